// The harness contract, the shared heavy-hitter rule, and thread-count independence.
#include <doctest/doctest.h>
#include <tbb/global_control.h>

#include "helpers.h"
#include "sim/heavy_hitters.h"
#include "base/errors.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

// Policies that break the contract in one way each.
class EvictsStranger : public Policy {
public:
    void on_decode_step(int32_t, std::span<const float>) override {}
    void evict(int, std::vector<int32_t>& victims) override { victims.push_back(9999 % 50); }
    std::size_t bytes_per_slot() const override { return 0; }
};
class NeverEvicts : public Policy {
public:
    void on_decode_step(int32_t, std::span<const float>) override {}
    void evict(int, std::vector<int32_t>&) override {}
    std::size_t bytes_per_slot() const override { return 0; }
};

std::string run_until_error(std::unique_ptr<Policy> policy, int budget) {
    Harness harness(std::move(policy), budget, 64, HarnessOptions{}, "rogue(x=1)", " (sequence s, layer 0, head 0)");
    std::vector<float> row(64, 1.0f / 64);
    const float* rows[1] = {row.data()};
    const std::span<const int32_t> heavy[1] = {};
    try {
        for (int t = 1; t < 64; ++t) {
            GroupStep step;
            step.t = t;
            step.rows = rows;
            step.heavy = heavy;
            step.combined = row.data();
            harness.step(step);
        }
    } catch (const PolicyError& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST_CASE("a policy that evicts a position it does not hold is an error naming the policy and step") {
    // Step 60 is the first eviction (61 positions held) and 49 is still held; at step 61 it is not.
    const std::string error = run_until_error(std::make_unique<EvictsStranger>(), 60);
    CHECK(error == "policy rogue(x=1) at step 61 (sequence s, layer 0, head 0): evicted position 49 which it does not hold");
}

TEST_CASE("a policy that leaves the cache over budget is an error naming the policy and step") {
    const std::string error = run_until_error(std::make_unique<NeverEvicts>(), 8);
    CHECK(error.find("policy rogue(x=1) at step 8") == 0);
    CHECK(error.find("over the budget of 8") != std::string::npos);
}

TEST_CASE("heavy hitters: values above the k-th largest, then ties in ascending position order") {
    std::vector<int32_t> out;
    const std::vector<float> row = {0.1f, 0.3f, 0.2f, 0.3f, 0.2f, 0.2f, 0.05f};
    top_k_positions(row, 3, out);
    std::sort(out.begin(), out.end());
    CHECK(out == std::vector<int32_t>{1, 2, 3});  // 0.3, 0.3, then the first 0.2
    out.clear();
    top_k_positions(row, 4, out);
    std::sort(out.begin(), out.end());
    CHECK(out == std::vector<int32_t>{1, 2, 3, 4});
    out.clear();
    top_k_positions({row.data(), 2}, 32, out);  // k larger than the row: every position
    CHECK(out.size() == 2);
}

TEST_CASE("results do not depend on the number of threads or the block size") {
    const std::vector<PolicyEntry> policies = {entry("sliding_window"), entry("h2o"), entry("scissorhands"),
                                               entry("tova"), entry("snapkv"), entry("pyramidkv")};
    const auto combos = expand_sweep(policies, {}, {64, 300});
    auto run = [&](int threads, int64_t block_floats) {
        tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
        auto source = make_policybook_source(PolicybookTraceSpec{}, 1500);
        ReplayOptions options;
        options.block_floats = block_floats;
        std::vector<double> values;
        for (const ComboResult& r : replay(*source, combos, options)) {
            values.push_back(r.total.retained_mass);
            values.push_back(static_cast<double>(r.total.heavy_hitter_hits));
            values.push_back(static_cast<double>(r.total.eviction_calls));
        }
        return values;
    };
    const auto one = run(1, 1 << 21);
    CHECK(one == run(2, 1 << 21));
    CHECK(one == run(4, 1 << 21));
    CHECK(one == run(3, 5000));  // many small blocks
}

TEST_CASE("max_steps replays an exact prefix") {
    const auto rows = policybook_rows({entry("streaming_llm")}, {256}, 1000);
    CHECK(find_row(rows, "streaming_llm", 256).eviction_calls == 1000 - 256 + 1);
}
