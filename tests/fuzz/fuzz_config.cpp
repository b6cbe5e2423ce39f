// Fuzzes the YAML loaders (experiment config with its search section, per-layer budget profile,
// streaming-head profile), the profile.json reader and the flag parsers. Bad input may only ever be an InputError; anything else escaping (a YAML
// exception, bad_alloc, a crash, a sanitizer report) is a bug the fuzzer reports.
#include <cstdint>
#include <cstdio>
#include <string>

#include "base/size_limits.h"
#include "cache_math/streaming_heads.h"
#include "search/profile.h"
#include "src/config.h"
#include "fuzz_files.h"

namespace {

using kvsim::fuzz::expect_only_input_errors;

const std::string& scratch_file() {
    static const std::string path = kvsim::fuzz::scratch_path("config.yaml");
    return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string text(reinterpret_cast<const char*>(data), size);
    if (!kvsim::fuzz::write_input(scratch_file(), data, size)) return 0;
    expect_only_input_errors([] {
        const kvsim::ExperimentConfig config = kvsim::load_config(scratch_file());
        (void)kvsim::budget_columns(config);
    });
    expect_only_input_errors([] { (void)kvsim::load_budget_profile(scratch_file()); });
    expect_only_input_errors([] {
        const kvsim::Profile profile = kvsim::load_profile(scratch_file());
        if (!profile.layer_budgets.empty()) (void)kvsim::profile_column(profile, "fuzz");
    });
    expect_only_input_errors([] { (void)kvsim::load_streaming_profile(scratch_file(), 3, 2, 0.99); });
    expect_only_input_errors([] { (void)kvsim::load_duo_attention_pattern(scratch_file(), 3, 2, 0.99); });
    expect_only_input_errors([&] { (void)kvsim::parse_budget_list(text, "--budgets"); });
    expect_only_input_errors([&] { (void)kvsim::parse_grid_flag(text, "--set"); });
    expect_only_input_errors([&] { (void)kvsim::parse_byte_size(text, "--max-memory"); });
    std::remove(scratch_file().c_str());
    return 0;
}
