// Fuzzes kvsim's trace validation, not HDF5's parser: the bytes decide a trace's root attributes
// (kind, shape numbers, sequence lengths, strings, and whether each is missing or mistyped), its
// datasets (shape, element type, layout, how much of them is written) and their float contents
// (valid softmax rows or Q/K/V, raw bits, NaN/Inf/huge values at chosen places); the harness
// writes that file with the HDF5 C API, opens it with TraceReader and replays a few policies at
// small budgets over it. Bad input may only ever be an InputError: anything else escaping (a
// PolicyError on a trace the reader accepted, bad_alloc, a crash, a sanitizer report) is a bug.
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/errors.h"
#include "base/size_limits.h"
#include "fuzz_bytes.h"
#include "sim/attention_source.h"
#include "sim/qkv_attention.h"
#include "sim/replay.h"
#include "sim/sweep.h"
#include "sim/trace_store.h"

namespace {

using kvsim::fuzz::Bytes;
using kvsim::fuzz::Rng;

const std::string& scratch_file() {
    static const std::string path = "/tmp/kvsim-fuzz-trace-" + std::to_string(::getpid()) + ".h5";
    return path;
}

// Every write is bounded, so one input stays fast however large a shape it claims.
constexpr hsize_t kMaxWrittenFloats = 1 << 15;

hid_t float16_type() {
    const hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(t, 15, 10, 5, 0, 10);
    H5Tset_size(t, 2);
    H5Tset_ebias(t, 15);
    return t;
}

// How an attribute is written: 0 as the format says, else missing, mistyped, or several values.
void put_string(hid_t obj, const char* name, const std::string& value, uint8_t mode) {
    switch (mode % 8) {
        case 1: return;  // missing
        case 2: {        // an integer instead
            const hid_t space = H5Screate(H5S_SCALAR);
            const hid_t a = H5Acreate2(obj, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
            const int64_t v = 1;
            if (a >= 0) H5Awrite(a, H5T_NATIVE_INT64, &v), H5Aclose(a);
            H5Sclose(space);
            return;
        }
        case 3: {  // a variable-length string
            const hid_t type = H5Tcopy(H5T_C_S1);
            H5Tset_size(type, H5T_VARIABLE);
            const hid_t space = H5Screate(H5S_SCALAR);
            const hid_t a = H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
            const char* p = value.c_str();
            if (a >= 0) H5Awrite(a, type, &p), H5Aclose(a);
            H5Sclose(space);
            H5Tclose(type);
            return;
        }
        default: break;
    }
    // Fixed-length, null-padded; mode 4: an array of 3 strings; mode 5: a long string.
    const std::string text = mode % 8 == 5 ? value + std::string(3000, 'x') : value;
    const hsize_t n = mode % 8 == 4 ? 3 : 1;
    const hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, std::max<size_t>(1, text.size()));
    H5Tset_strpad(type, H5T_STR_NULLPAD);
    const hid_t space = n == 1 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr);
    const hid_t a = H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
    std::string buffer;
    for (hsize_t i = 0; i < n; ++i) buffer += text.empty() ? std::string(1, '\0') : text;
    if (a >= 0) H5Awrite(a, type, buffer.data()), H5Aclose(a);
    H5Sclose(space);
    H5Tclose(type);
}

void put_int(hid_t obj, const char* name, int64_t value, uint8_t mode) {
    switch (mode % 8) {
        case 1: return;
        case 2: put_string(obj, name, std::to_string(value), 0); return;
        case 3: {  // a float
            const hid_t space = H5Screate(H5S_SCALAR);
            const hid_t a = H5Acreate2(obj, name, H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT);
            const double v = static_cast<double>(value);
            if (a >= 0) H5Awrite(a, H5T_NATIVE_DOUBLE, &v), H5Aclose(a);
            H5Sclose(space);
            return;
        }
        default: break;
    }
    // mode 4: two values; mode 5: unsigned 64-bit; mode 6: 8-bit
    const hsize_t n = mode % 8 == 4 ? 2 : 1;
    const hid_t file_type = mode % 8 == 5 ? H5T_STD_U64LE : mode % 8 == 6 ? H5T_STD_I8LE : H5T_STD_I64LE;
    const hid_t space = n == 1 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr);
    const hid_t a = H5Acreate2(obj, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT);
    const int64_t values[2] = {value, value};
    if (a >= 0) H5Awrite(a, H5T_NATIVE_INT64, values), H5Aclose(a);
    H5Sclose(space);
}

hid_t make_group(hid_t file, const std::string& path) {
    if (H5Lexists(file, path.c_str(), H5P_DEFAULT) > 0) return H5Gopen2(file, path.c_str(), H5P_DEFAULT);
    const hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    const hid_t g = H5Gcreate2(file, path.c_str(), lcpl, H5P_DEFAULT, H5P_DEFAULT);
    H5Pclose(lcpl);
    return g;
}

// The floats of one dataset: valid contents (softmax rows without their own weight, or Q/K/V of
// moderate size), raw bits, or valid contents with special values at chosen indices.
std::vector<float> contents(Bytes& in, bool attention, hsize_t n) {
    std::vector<float> values(n);
    const uint8_t mode = in.u8();
    Rng rng(in.u32());
    if (mode % 4 == 1) {
        for (float& x : values) x = in.empty() ? rng.uniform() : in.raw_float();
        return values;
    }
    if (attention) {
        // Row t of the packed layout has t weights; each row sums to at most 1.
        hsize_t at = 0;
        for (int64_t t = 1; at < n; ++t) {
            const hsize_t len = std::min<hsize_t>(static_cast<hsize_t>(t), n - at);
            double sum = 0;
            for (hsize_t j = 0; j < len; ++j) sum += (values[at + j] = rng.uniform() + 1e-3f);
            const double mass = 0.5 + 0.5 * rng.uniform();  // the rest is the token's own weight
            for (hsize_t j = 0; j < len; ++j) values[at + j] = static_cast<float>(values[at + j] / sum * mass);
            at += len;
        }
    } else {
        // Q/K/V scaled by 10^e: large enough, q.k overflows float32 while both stay finite.
        const uint8_t e = in.u8();
        const float scale = e == 0 ? 1.0f : std::pow(10.0f, static_cast<float>(e % 40));
        for (float& x : values) x = (rng.uniform() * 4.0f - 2.0f) * scale;
    }
    if (mode % 4 >= 2) {
        const int injections = 1 + in.u8() % 4;
        for (int i = 0; i < injections && n > 0; ++i) {
            const hsize_t at = in.u32() % n;
            values[at] = in.special();
        }
    }
    return values;
}

// One dataset as the bytes decide: the expected shape or a wrong one, float32/float16/float64 or
// integers, chunked/contiguous/compact, every chunk written or only some or none.
void put_dataset(hid_t file, Bytes& in, const std::string& path, std::vector<hsize_t> shape, bool attention) {
    const uint8_t mode = in.u8();
    if (mode % 16 == 1) return;                    // missing
    if (mode % 16 == 2) shape.back() += 1;         // wrong shape
    if (mode % 16 == 3) shape.push_back(1);        // wrong rank
    if (mode % 16 == 4) shape[0] = in.count(1, 64);  // any first extent
    const uint8_t type_choice = in.u8();
    hid_t half = -1;
    hid_t file_type = H5T_IEEE_F32LE;
    if (type_choice % 5 == 1) file_type = half = float16_type();
    if (type_choice % 5 == 2) file_type = H5T_IEEE_F64LE;
    if (type_choice % 5 == 3) file_type = H5T_STD_I32LE;
    // Elements per row (every extent after the first) and in all, both saturated at 2^59: the
    // largest extent a trace's attributes allow (HDF5 1.10 itself crashes writing chunks of
    // datasets near 2^62, and that is not the code under test).
    constexpr hsize_t kHuge = hsize_t{1} << 59;
    auto times = [&](hsize_t a, hsize_t b) { return b != 0 && a > kHuge / b ? kHuge : a * b; };
    hsize_t per_row = 1;
    for (hsize_t& d : shape) d = std::min(d, kHuge);
    for (size_t i = 1; i < shape.size(); ++i) per_row = times(per_row, shape[i]);
    const hsize_t total = times(shape[0], per_row);
    const uint8_t layout = in.u8();
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    std::vector<hsize_t> chunk(shape.size());
    const bool chunked = layout % 4 == 0 || layout % 4 == 3 || total > kMaxWrittenFloats;
    if (chunked) {
        // The writer's chunking by default; else chunks whose extents the bytes pick.
        for (size_t i = 0; i < shape.size(); ++i) {
            const uint8_t c = layout % 4 == 3 ? in.u8() : 0;
            const hsize_t want = c == 0 ? (i == 0 ? 256 : shape[i]) : c;
            chunk[i] = std::max<hsize_t>(1, std::min<hsize_t>(std::min<hsize_t>(want, shape[i]), 1 << 12));
        }
        // Chunks of at most 64 Ki elements keep each input fast (the reader's own chunk limit is
        // the memory limit, tested with its unit tests).
        auto elements = [&] { hsize_t n = 1; for (hsize_t c : chunk) n *= c; return n; };
        while (elements() > (hsize_t{1} << 16)) *std::max_element(chunk.begin(), chunk.end()) /= 2;
        // And at most ~64 chunks written: HDF5 spends a zlib state (256 KiB) and an index entry on
        // each, which at thousands of chunks made an input take seconds under the sanitizers.
        auto written_chunks = [&] {
            hsize_t n = 1;
            const hsize_t rows = std::min<hsize_t>(shape[0], kMaxWrittenFloats / std::max<hsize_t>(per_row, 1));
            for (size_t i = 0; i < shape.size(); ++i)
                n = times(n, ((i == 0 ? rows : shape[i]) + chunk[i] - 1) / chunk[i]);
            return n;
        };
        for (size_t i = shape.size(); written_chunks() > 64 && i-- > 0;)
            while (written_chunks() > 64 && chunk[i] < std::min<hsize_t>(shape[i], 1 << 16) &&
                   elements() <= (hsize_t{1} << 16))
                chunk[i] = std::min<hsize_t>(chunk[i] * 2, shape[i]);
        H5Pset_chunk(dcpl, static_cast<int>(shape.size()), chunk.data());
        if (layout & 4) H5Pset_deflate(dcpl, 1);
    } else if (layout % 4 == 2 && total * 8 < 30000) {
        H5Pset_layout(dcpl, H5D_COMPACT);
    }
    const hid_t space = H5Screate_simple(static_cast<int>(shape.size()), shape.data(), nullptr);
    const std::string parent = path.substr(0, path.rfind('/'));
    const hid_t group = make_group(file, parent);
    const hid_t dataset =
        group >= 0 ? H5Dcreate2(file, path.c_str(), file_type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT) : -1;
    if (dataset >= 0) {
        // How much is written: all (if it fits the bound), none, or a prefix of the first extent.
        const uint8_t amount = in.u8();
        hsize_t rows = shape[0];
        if (amount % 4 == 1) rows = 0;
        if (amount % 4 == 2) rows = std::min<hsize_t>(rows, 1 + amount / 4);
        rows = std::min<hsize_t>(rows, kMaxWrittenFloats / std::max<hsize_t>(per_row, 1));
        if (rows > 0 && per_row > 0 && per_row <= kMaxWrittenFloats) {
            std::vector<hsize_t> start(shape.size(), 0), count = shape;
            count[0] = rows;
            std::vector<float> values = contents(in, attention, rows * per_row);
            const hid_t file_space = H5Dget_space(dataset);
            H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
            const hid_t mem_space = H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr);
            if (file_type == H5T_STD_I32LE) {
                std::vector<int32_t> ints(values.size());
                for (size_t i = 0; i < values.size(); ++i) ints[i] = static_cast<int32_t>(i);
                H5Dwrite(dataset, H5T_NATIVE_INT32, mem_space, file_space, H5P_DEFAULT, ints.data());
            } else {
                H5Dwrite(dataset, H5T_NATIVE_FLOAT, mem_space, file_space, H5P_DEFAULT, values.data());
            }
            H5Sclose(mem_space);
            H5Sclose(file_space);
        }
        H5Dclose(dataset);
    }
    if (group >= 0) H5Gclose(group);
    H5Sclose(space);
    H5Pclose(dcpl);
    if (half >= 0) H5Tclose(half);
}

// Writes the trace the bytes describe; returns false when HDF5 cannot even create the file.
bool write_trace(Bytes& in) {
    // A strong close degree: H5Fclose closes whatever this writer left open, so no input leaves an
    // open file (and its metadata cache) behind.
    const hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG);
    const hid_t file = H5Fcreate(scratch_file().c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    H5Pclose(fapl);
    if (file < 0) return false;
    const uint8_t kind_choice = in.u8();
    const bool qkv = kind_choice % 2 == 1;
    const std::string kind = kind_choice % 16 == 15 ? "keys" : qkv ? "qkv" : "attention";
    const uint8_t format_mode = in.u8();
    put_string(file, "format", format_mode % 16 == 9 ? "kvsim-trace2" : "kvsim-trace", format_mode);
    // Every read is its own statement: argument order is unspecified, and an input must decode
    // alike under clang (the fuzzer) and gcc (meson test's replay of the regressions).
    const int64_t version = 1 + (in.u8() % 32 == 31);
    put_int(file, "format_version", version, in.u8());
    put_string(file, "kind", kind, in.u8());
    put_string(file, "model_name", "fuzz", in.u8());
    const int64_t layers = in.count(1, 2);
    const int64_t kv_heads = in.count(1, 2);
    // A multiple of the KV heads, unless a count probes a limit (then the product saturates).
    const int64_t group = in.count(1, 2);
    int64_t query_heads;
    if (__builtin_mul_overflow(group, kv_heads, &query_heads)) query_heads = INT64_MAX;
    const int64_t head_dim = in.count(qkv ? 1 : 0, 6);
    put_int(file, "num_layers", layers, in.u8());
    put_int(file, "num_query_heads", query_heads, in.u8());
    put_int(file, "num_kv_heads", kv_heads, in.u8());
    put_int(file, "head_dim", head_dim, in.u8());
    for (const char* name : {"source_kind", "source_generator", "source_model_file", "source_model_sha256",
                             "source_text_sha256", "kvsim_version"})
        put_string(file, name, "fuzz", in.u8());
    const int64_t seed = in.u32();
    put_int(file, "source_seed", seed, in.u8());
    const int64_t sequences = in.count(1, 2);
    put_int(file, "num_sequences", sequences, in.u8());
    const hid_t sequences_group = make_group(file, "/sequences");
    if (sequences_group >= 0) H5Gclose(sequences_group);

    // The datasets of at most 2 sequences, 2 layers and 2 heads are written: enough for every
    // check, and a count above that probes what is missing.
    for (int64_t s = 0; s < std::min<int64_t>(sequences, 2); ++s) {
        char group_name[32];
        std::snprintf(group_name, sizeof group_name, "/sequences/%06d", static_cast<int>(s));
        const hid_t group = make_group(file, group_name);
        if (group < 0) continue;
        const int64_t length = in.count(2, 40);
        put_string(group, "name", "s" + std::to_string(s), in.u8());
        put_int(group, "length", length, in.u8());
        H5Gclose(group);
        const hsize_t t = static_cast<hsize_t>(std::max<int64_t>(length, 1));
        for (int64_t layer = 0; layer < std::min<int64_t>(layers, 2); ++layer) {
            char layer_name[32];
            std::snprintf(layer_name, sizeof layer_name, "layer_%03d", static_cast<int>(layer));
            if (!qkv) {
                // t (t - 1) / 2 weights, saturated: a huge length claims a huge extent.
                const hsize_t floats = t > (hsize_t{1} << 31) ? hsize_t{1} << 61 : t * (t - 1) / 2;
                for (int64_t h = 0; h < std::min<int64_t>(query_heads, 2); ++h) {
                    char head_name[32];
                    std::snprintf(head_name, sizeof head_name, "head_%03d", static_cast<int>(h));
                    put_dataset(file, in, std::string(group_name) + "/attention/" + layer_name + "/" + head_name,
                                {std::max<hsize_t>(floats, 1)}, true);
                }
            } else {
                const hsize_t d = static_cast<hsize_t>(std::max<int64_t>(head_dim, 1));
                const std::string base = std::string(group_name) + "/qkv/" + layer_name + "/";
                put_dataset(file, in, base + "q", {t, static_cast<hsize_t>(std::max<int64_t>(query_heads, 1)), d}, false);
                put_dataset(file, in, base + "k", {t, static_cast<hsize_t>(std::max<int64_t>(kv_heads, 1)), d}, false);
                put_dataset(file, in, base + "v", {t, static_cast<hsize_t>(std::max<int64_t>(kv_heads, 1)), d}, false);
            }
        }
        if (in.u8() % 4 == 1) put_dataset(file, in, std::string(group_name) + "/tokens", {t}, false);
    }
    H5Fclose(file);
    return true;
}

// Two policies at a small budget, over at most 40 steps, in blocks of a size the bytes pick.
void replay_trace(Bytes& in) {
    const std::unique_ptr<kvsim::AttentionSource> source = kvsim::open_trace_source(scratch_file(), 40);
    const bool qkv = dynamic_cast<kvsim::QkvSource*>(source.get()) != nullptr;
    auto entry = [](const std::string& name, std::map<std::string, double> params = {}) {
        kvsim::PolicyEntry e;  // the other fields keep their defaults
        e.name = name;
        e.params = std::move(params);
        e.where = "fuzz: " + name;
        return e;
    };
    std::vector<kvsim::PolicyEntry> policies = {
        entry("sliding_window"), entry("streaming_llm", {{"sinks", 1}}), entry("h2o", {{"recent_window", 1}}),
        entry("tova"), entry("snapkv", {{"recent_window", 1}, {"obs_window", 2}, {"pool_kernel", 3}}),
        entry("scissorhands", {{"recent_window", 1}}), entry("pyramidkv", {{"recent_window", 1}}),
        entry("stratigraphic", {{"sinks", 1}, {"recent", 2}})};
    if (qkv) {
        policies.push_back(entry("int4", {{"key_group", 2}, {"value_group", 2}}));
        policies.push_back(entry("streaming_attention", {{"sinks", 1}, {"recent", 2}}));
        kvsim::PolicyEntry quantized = entry("h2o", {{"recent_window", 0}});
        quantized.quantized = true;
        quantized.quantize = {{"bits", 8}, {"key_group", 2}, {"value_group", 2}};
        quantized.where = "fuzz: h2o+int8";
        policies.push_back(quantized);
    }
    // Two of them per input, at one budget: each input stays quick, and the bytes pick which.
    const uint8_t pick = in.u8();
    std::vector<kvsim::PolicyEntry> chosen = {policies[pick % policies.size()],
                                              policies[(pick / 16 + 1 + pick % policies.size()) % policies.size()]};
    if (chosen[0].where == chosen[1].where) chosen.pop_back();
    const auto combos = kvsim::expand_sweep(chosen, {}, std::vector<int>{in.u8() % 2 ? 5 : 2});
    kvsim::ReplayOptions options;
    const uint8_t k = in.u8();
    options.heavy_hitter_k = k >= 250 ? (1 << 30) : 1 + k % 8;  // a huge k must not size a buffer
    options.block_floats = 1 + in.u8() * 16;
    const uint8_t view = in.u8();
    options.harness.view = view % 2 ? kvsim::AttentionView::renormalized : kvsim::AttentionView::raw;
    options.harness.reduce = static_cast<kvsim::GroupReduce>(view / 2 % 3);
    if (qkv) {
        options.output_error = view & 8;
        options.memory = view & 16;
    }
    (void)kvsim::replay(*source, combos, options);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    // Input that claims gigabytes must be refused by the memory checks, not allocated.
    static const bool initialized = [] {
        kvsim::set_memory_limit_bytes(uint64_t{256} << 20);
        H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
        // HDF5 keeps freed blocks on its own free lists: every input would end with more mallocs
        // than frees, and libFuzzer would run a leak check (a scan of the whole heap) after each.
        H5set_free_list_limits(0, 0, 0, 0, 0, 0);
        return true;
    }();
    (void)initialized;
    Bytes in(data, size);
    if (!write_trace(in)) return 0;
    try {
        kvsim::TraceReader reader(scratch_file());
        (void)reader.dataset_sizes();
        for (size_t s = 0; s < reader.sequences().size(); ++s) (void)reader.read_tokens(static_cast<int>(s));
        replay_trace(in);
    } catch (const kvsim::InputError& e) {
        // KVSIM_FUZZ_VERBOSE=1 shows what each input was refused for (to check seeds by hand).
        if (std::getenv("KVSIM_FUZZ_VERBOSE")) std::fprintf(stderr, "refused: %s\n", e.what());
        std::remove(scratch_file().c_str());
        H5garbage_collect();
        return 0;
    }
    if (std::getenv("KVSIM_FUZZ_VERBOSE")) std::fprintf(stderr, "replayed\n");
    std::remove(scratch_file().c_str());
    H5garbage_collect();
    return 0;
}
