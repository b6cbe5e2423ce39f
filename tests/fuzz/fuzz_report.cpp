// Fuzzes `kvsim report`'s readers: each input as a results folder's results.json, search.json and
// profile.json in turn, read and turned into figures (the .dat data and .gp scripts) without
// running gnuplot. Bad input may only ever be an InputError; anything else escaping, a crash or a
// sanitizer report is a bug the fuzzer reports.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "base/errors.h"
#include "src/report_plots.h"

namespace {

const std::string& scratch_folder() {
    static const std::string path = [] {
        const std::string folder = "/tmp/kvsim-fuzz-report-" + std::to_string(::getpid());
        std::filesystem::create_directories(folder);
        return folder;
    }();
    return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    for (const char* name : {"results.json", "search.json", "profile.json"}) {
        const std::string path = scratch_folder() + "/" + name;
        FILE* f = std::fopen(path.c_str(), "wb");
        if (!f) return 0;
        std::fwrite(data, 1, size, f);
        std::fclose(f);
        try {
            (void)kvsim::check_report_inputs(scratch_folder());
        } catch (const kvsim::InputError&) {
        }
        std::remove(path.c_str());
    }
    return 0;
}
