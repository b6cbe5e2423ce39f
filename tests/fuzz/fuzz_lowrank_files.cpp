// Fuzzes the readers of the low-rank policies' files: the bases (`kvsim trace bases`, a search's
// bases.json) and the fitted ranks (a search's ranks-*.json), each input read as both, at the shape
// of the seeds (3 layers, 2 KV heads, head size 16). Bad input may only ever be an InputError;
// anything else escaping, a crash or a sanitizer report is a bug the fuzzer reports.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "base/errors.h"
#include "cache_math/lowrank.h"

namespace {

const std::string& scratch_file() {
    static const std::string path = "/tmp/kvsim-fuzz-lowrank-" + std::to_string(::getpid()) + ".json";
    return path;
}

template <class F>
void expect_only_input_errors(F&& f) {
    try {
        f();
    } catch (const kvsim::InputError&) {
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    {
        FILE* f = std::fopen(scratch_file().c_str(), "wb");
        if (!f) return 0;
        std::fwrite(data, 1, size, f);
        std::fclose(f);
    }
    expect_only_input_errors([] {
        const auto bases = kvsim::read_kv_bases(scratch_file());
        // What the policies do with a file they accept: group heads by its distances, project.
        for (int layer = 0; layer < bases->num_layers; ++layer)
            (void)kvsim::group_heads_of_layer(bases->num_kv_heads, 1, &bases->head_distance.at(layer));
    });
    expect_only_input_errors([] { (void)kvsim::load_fitted_ranks(scratch_file(), 3, 2, 16); });
    std::remove(scratch_file().c_str());
    return 0;
}
