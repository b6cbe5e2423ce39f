// Fuzzes kvsim's checks of an HDF5 bases file (cache_math/lowrank.h's read_kv_bases), not HDF5's
// parser: raw bytes found that parser unsafe on crafted files (fuzz_lowrank_files.cpp says how), so
// here the bytes decide a valid file's shape (layers, KV heads, head size, pre- or post-RoPE keys,
// joint bases or not), kvsim writes it, and then the bytes change it through the HDF5 C API: root
// attributes removed, mistyped, out of range or made arrays; datasets removed, replaced by ones of
// another shape or element type, chunked and left unwritten, or given NaN, infinite, huge or
// negative numbers at chosen places. The reader then opens it and the policies' use of a file it
// accepts (grouping heads by distance) runs. Bad input may only ever be an InputError: anything
// else escaping, a crash or a sanitizer report is a bug.
#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "cache_math/lowrank.h"
#include "fuzz_bytes.h"
#include "base/errors.h"
#include "fuzz_files.h"

namespace {

using kvsim::fuzz::Bytes;

const std::string& scratch_file() {
    static const std::string path = kvsim::fuzz::scratch_path("bases_hdf5.h5");
    return path;
}

// A valid basis of n-vectors: orthonormal (the identity, signs from the generator), energies
// descending. The generator, not the input, fills the numbers: the input's bytes go to the shape
// and to the changes.
kvsim::PcaBasis basis(int n, kvsim::fuzz::Rng& rng) {
    kvsim::PcaBasis b;
    b.vectors = Eigen::MatrixXd::Zero(n, n);
    for (int j = 0; j < n; ++j) b.vectors(j, j) = rng.next() % 2 ? -1.0 : 1.0;
    b.energy.resize(n);
    for (int j = 0; j < n; ++j) b.energy[j] = static_cast<double>(n - j);
    b.mean = Eigen::VectorXd::Constant(n, 0.25 * static_cast<double>(rng.next() % 5));
    return b;
}

kvsim::KvBases valid_bases(Bytes& in) {
    kvsim::KvBases bases;
    bases.num_layers = 1 + in.u8() % 3;
    bases.num_kv_heads = 1 + in.u8() % 3;
    bases.head_dim = 2 * (1 + in.u8() % 3);
    const int L = bases.num_layers, K = bases.num_kv_heads, d = bases.head_dim;
    kvsim::fuzz::Rng rng(in.u8());
    if (in.u8() % 2) {
        bases.keys = "pre_rope";
        bases.rope.pairing = in.u8() % 2 ? kvsim::RopePairing::halves : kvsim::RopePairing::adjacent;
        for (int i = 0; i < d / 2; ++i) bases.rope.frequencies.push_back(1.0 / (1.0 + i));
    }
    for (int u = 0; u < L * K; ++u) bases.key.push_back(basis(d, rng)), bases.value.push_back(basis(d, rng));
    if (in.u8() % 2 == 0)
        for (int l = 0; l < L; ++l) bases.joint_key.push_back(basis(K * d, rng)), bases.joint_value.push_back(basis(K * d, rng));
    for (int l = 0; l < L; ++l) {
        Eigen::MatrixXd m = Eigen::MatrixXd::Constant(K, K, 1.0 + l);
        m.diagonal().setZero();
        bases.head_distance.push_back(m);
    }
    bases.fitted_sequences = {0, 1};
    return bases;
}

const char* const kAttributes[] = {"format", "version", "num_layers", "num_kv_heads", "head_dim",
                                   "keys",   "rope_pairing", "rope_frequencies", "fitted_sequences"};
const char* const kDatasets[] = {"/heads/key_energy",   "/heads/key_mean",   "/heads/key_vectors",
                                 "/heads/value_energy", "/heads/value_mean", "/heads/value_vectors",
                                 "/joint/key_energy",   "/joint/key_mean",   "/joint/key_vectors",
                                 "/joint/value_energy", "/joint/value_mean", "/joint/value_vectors",
                                 "/head_distance"};

// An attribute rewritten as the input chooses: 64-bit or 8-bit integers, doubles or a string, a
// scalar or an array of up to four (or left out).
void write_attribute(hid_t root, const char* name, Bytes& in) {
    if (H5Aexists(root, name) > 0) H5Adelete(root, name);
    const int kind = in.u8() % 4;
    const hsize_t count = static_cast<hsize_t>(in.count(1, 4));
    if (count < 1 || count > 64) return;  // left out: a missing attribute
    const hid_t space = count == 1 && in.u8() % 2 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &count, nullptr);
    if (kind == 0 || kind == 1) {  // integers, probing the limits
        std::vector<int64_t> v(count);
        for (auto& x : v) x = in.count(-2, 8);
        const hid_t a = H5Acreate2(root, name, kind == 0 ? H5T_STD_I64LE : H5T_STD_U8LE, space, H5P_DEFAULT, H5P_DEFAULT);
        if (a >= 0) H5Awrite(a, H5T_NATIVE_INT64, v.data()), H5Aclose(a);
    } else if (kind == 2) {  // doubles, special ones among them
        std::vector<double> v(count);
        for (auto& x : v) x = in.u8() % 2 ? static_cast<double>(in.special()) : static_cast<double>(in.count(-1, 4));
        const hid_t a = H5Acreate2(root, name, H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT);
        if (a >= 0) H5Awrite(a, H5T_NATIVE_DOUBLE, v.data()), H5Aclose(a);
    } else {  // a fixed-length string: a word the reader knows, or bytes
        static const char* const kWords[] = {"kvsim-kv-bases", "post_rope", "pre_rope", "adjacent", "halves", "", "x"};
        std::string s = kWords[in.u8() % std::size(kWords)];
        if (in.u8() % 4 == 0) s.push_back(static_cast<char>(in.u8()));
        const std::size_t width = std::max<std::size_t>(s.size(), 1);  // HDF5 has no empty fixed-length string
        const hid_t type = H5Tcopy(H5T_C_S1);
        H5Tset_size(type, width);
        const hid_t a = H5Acreate2(root, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
        std::vector<char> text(width * count, '\0');
        for (hsize_t i = 0; i < count; ++i) std::copy(s.begin(), s.end(), text.begin() + static_cast<std::ptrdiff_t>(i * width));
        if (a >= 0) H5Awrite(a, type, text.data()), H5Aclose(a);
        H5Tclose(type);
    }
    H5Sclose(space);
}

// A dataset replaced: another shape (1 to 4 dimensions), element type, layout, or contents.
void replace_dataset(hid_t file, const char* name, Bytes& in) {
    if (H5Lexists(file, name, H5P_DEFAULT) > 0) H5Ldelete(file, name, H5P_DEFAULT);
    if (in.u8() % 4 == 0) return;  // left out
    const int rank = 1 + in.u8() % 4;
    std::vector<hsize_t> shape(rank);
    hsize_t elements = 1;
    for (auto& d : shape) {
        d = static_cast<hsize_t>(in.count(0, 7));
        if (d > (hsize_t{1} << 40)) d = 3;  // HDF5 refuses what a file cannot hold; the reader's checks are the point
        elements = d == 0 || elements > (hsize_t{1} << 40) / std::max<hsize_t>(d, 1) ? 0 : elements * d;
    }
    static const hid_t kTypes[] = {H5T_IEEE_F64LE, H5T_IEEE_F32LE, H5T_STD_I32LE, H5T_IEEE_F64BE};
    const hid_t type = kTypes[in.u8() % std::size(kTypes)];
    const hid_t space = H5Screate_simple(rank, shape.data(), nullptr);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    const bool chunked = in.u8() % 3 == 0 && elements > 0;
    if (chunked) {
        std::vector<hsize_t> chunk(shape);
        for (auto& c : chunk) c = std::max<hsize_t>(1, std::min<hsize_t>(c, 4));
        H5Pset_chunk(dcpl, rank, chunk.data());
    }
    // The groups the name needs (a replaced /joint dataset in a file without joint bases).
    const hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    const hid_t dataset = H5Dcreate2(file, name, type, space, lcpl, dcpl, H5P_DEFAULT);
    // Written in full, or not at all (a chunked dataset then has no data stored).
    if (dataset >= 0 && elements > 0 && elements <= 4096 && !(chunked && in.u8() % 2)) {
        std::vector<double> v(elements);
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = i % 5 == 0 ? static_cast<double>(in.special()) : (i % 3 == 0 ? 1.0 : 0.0);
        H5Dwrite(dataset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    }
    if (dataset >= 0) H5Dclose(dataset);
    H5Pclose(lcpl);
    H5Pclose(dcpl);
    H5Sclose(space);
}

// One number of a dataset overwritten in place: the shape stays, the value breaks a rule.
void poke_dataset(hid_t file, const char* name, Bytes& in) {
    if (H5Lexists(file, name, H5P_DEFAULT) <= 0) return;
    const hid_t dataset = H5Dopen2(file, name, H5P_DEFAULT);
    if (dataset < 0) return;
    const hid_t space = H5Dget_space(dataset);
    const hssize_t elements = H5Sget_simple_extent_npoints(space);
    if (elements > 0 && elements <= 4096) {  // a replaced dataset may claim any size; read only small ones
        std::vector<double> v(static_cast<std::size_t>(elements));
        if (H5Dread(dataset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) >= 0) {
            static const double kBreaks[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                                             -1.0, 1e300, -1e-3, 0.0, 2.0, 1e39};
            const std::size_t at = in.u32() % v.size();
            v[at] = kBreaks[in.u8() % std::size(kBreaks)];
            H5Dwrite(dataset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
        }
    }
    H5Sclose(space);
    H5Dclose(dataset);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // the harness's own HDF5 calls may fail quietly
    Bytes in(data, size);
    const std::string& path = scratch_file();
    kvsim::write_kv_bases(path, valid_bases(in));
    const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    if (file < 0) return 0;
    for (int change = 0; change < 8 && !in.empty(); ++change) {
        const uint8_t what = in.u8();
        switch (what % 5) {
            case 0: break;  // none
            case 1: {
                const char* name = kAttributes[in.u8() % std::size(kAttributes)];
                if (H5Aexists(file, name) > 0) H5Adelete(file, name);
                break;
            }
            case 2: write_attribute(file, kAttributes[in.u8() % std::size(kAttributes)], in); break;
            case 3: replace_dataset(file, kDatasets[in.u8() % std::size(kDatasets)], in); break;
            case 4: poke_dataset(file, kDatasets[in.u8() % std::size(kDatasets)], in); break;
        }
    }
    H5Fclose(file);
    // KVSIM_FUZZ_VERBOSE=1 says what became of each input (to check that the seeds reach past the
    // first check); KVSIM_FUZZ_KEEP=1 leaves the file written for it in /tmp.
    static const bool verbose = std::getenv("KVSIM_FUZZ_VERBOSE") != nullptr;
    try {
        const auto bases = kvsim::read_kv_bases(path);
        for (int layer = 0; layer < bases->num_layers; ++layer)
            (void)kvsim::group_heads_of_layer(bases->num_kv_heads, 1, &bases->head_distance.at(layer));
        if (verbose) std::fprintf(stderr, "accepted\n");
    } catch (const kvsim::InputError& e) {
        if (verbose) std::fprintf(stderr, "refused: %s\n", e.what());
    }
    if (!std::getenv("KVSIM_FUZZ_KEEP")) std::remove(path.c_str());
    return 0;
}
