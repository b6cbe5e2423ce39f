// Fuzzes `kvsim report`'s readers: each input as a results folder's results.json, search.json and
// profile.json in turn, read and turned into figures (the .dat data and .gp scripts) without
// running gnuplot. Bad input may only ever be an InputError; anything else escaping, a crash or a
// sanitizer report is a bug the fuzzer reports.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "src/report_plots.h"
#include "fuzz_files.h"

namespace {

const std::string& scratch_folder() {
    static const std::string path = [] {
        const std::string folder = kvsim::fuzz::scratch_path("report");
        std::filesystem::create_directories(folder);
        return folder;
    }();
    return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    for (const char* name : {"results.json", "search.json", "profile.json"}) {
        const std::string path = scratch_folder() + "/" + name;
        if (!kvsim::fuzz::write_input(path, data, size)) return 0;
        kvsim::fuzz::expect_only_input_errors([] { (void)kvsim::check_report_inputs(scratch_folder()); });
        std::remove(path.c_str());
    }
    return 0;
}
