// Fuzzes the reader of partial results files: a sweep's or a search's shard (what `kvsim merge`
// reads) and the checkpoint `--resume` reads back, the same files. Bad input may only ever be an
// InputError; anything else escaping, a crash or a sanitizer report is a bug the fuzzer reports.
#include <cstdint>
#include <cstdio>
#include <string>

#include "src/shards.h"
#include "fuzz_files.h"

namespace {

const std::string& scratch_file() {
    static const std::string path = kvsim::fuzz::scratch_path("partial.json");
    return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (!kvsim::fuzz::write_input(scratch_file(), data, size)) return 0;
    kvsim::fuzz::expect_only_input_errors([] { kvsim::check_partial_file(scratch_file()); });
    std::remove(scratch_file().c_str());
    return 0;
}
