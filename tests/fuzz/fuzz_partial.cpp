// Fuzzes the reader of partial results files: a sweep's or a search's shard (what `kvsim merge`
// reads) and the checkpoint `--resume` reads back, the same files. Bad input may only ever be an
// InputError; anything else escaping, a crash or a sanitizer report is a bug the fuzzer reports.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "base/errors.h"
#include "src/shards.h"

namespace {

const std::string& scratch_file() {
    static const std::string path = "/tmp/kvsim-fuzz-partial-" + std::to_string(::getpid()) + ".json";
    return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    {
        FILE* f = std::fopen(scratch_file().c_str(), "wb");
        if (!f) return 0;
        std::fwrite(data, 1, size, f);
        std::fclose(f);
    }
    try {
        kvsim::check_partial_file(scratch_file());
    } catch (const kvsim::InputError&) {
    }
    std::remove(scratch_file().c_str());
    return 0;
}
