// Fuzzes the readers of the low-rank policies' files: the bases (`kvsim trace bases`, a search's
// bases.json or bases.h5, JSON or HDF5 told apart by the signature) and the fitted ranks (a search's
// ranks-*.json), each input read as both, at the shape of the seeds (3 layers, 2 KV heads, head
// size 16). Bad input may only ever be an InputError;
// anything else escaping, a crash or a sanitizer report is a bug the fuzzer reports.
// An input the bases reader would read as HDF5 (by the same signature test) is not read as bases:
// this harness fuzzes kvsim's readers, not HDF5's parser (as fuzz_trace.cpp), and raw bytes found
// that parser unsafe on crafted files (Debian 12's libhdf5 1.10.8, 2026-12-06: a heap-buffer
// overflow in H5MM_strdup under H5Aexists, an 8 GiB allocation sized from a local heap, a leak on
// an error path). docs/lowrank.md says so to users. kvsim's checks of an HDF5 bases file are
// fuzzed by fuzz_bases_hdf5.cpp, which writes valid files and changes them through the HDF5 API.
#include <cstdint>
#include <cstdio>
#include <string>

#include "base/hdf5_file.h"
#include "cache_math/lowrank.h"
#include "fuzz_files.h"

namespace {

using kvsim::fuzz::expect_only_input_errors;

const std::string& scratch_file() {
    static const std::string path = kvsim::fuzz::scratch_path("lowrank.json");
    return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (!kvsim::fuzz::write_input(scratch_file(), data, size)) return 0;
    if (!kvsim::has_hdf5_signature(scratch_file())) expect_only_input_errors([] {
        const auto bases = kvsim::read_kv_bases(scratch_file());
        // What the policies do with a file they accept: group heads by its distances, project.
        for (int layer = 0; layer < bases->num_layers; ++layer)
            (void)kvsim::group_heads_of_layer(bases->num_kv_heads, 1, &bases->head_distance.at(layer));
    });
    expect_only_input_errors([] { (void)kvsim::load_fitted_ranks(scratch_file(), 3, 2, 16); });
    std::remove(scratch_file().c_str());
    return 0;
}
