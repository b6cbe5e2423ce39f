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

// Evicts a held position picked by a hash of the step: kept sets full of holes.
class EvictsScattered : public Policy {
public:
    void on_decode_step(int32_t t, std::span<const float>) override {
        held_.push_back(t);
        step_ = t;
    }
    void evict(int budget, std::vector<int32_t>& victims) override {
        while (held_.size() > static_cast<std::size_t>(budget)) {
            const std::size_t slot = (static_cast<std::size_t>(step_) * 2654435761u) % held_.size();
            victims.push_back(held_[slot]);
            held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(slot));
        }
    }
    std::size_t bytes_per_slot() const override { return 0; }

private:
    std::vector<int32_t> held_{0};
    int32_t step_ = 0;
};

}  // namespace

TEST_CASE("heavy-hitter recall counts the same hits from the positions' list and from their bits") {
    // The replay hands each step's heavy hitters as bits too (GroupStep::heavy_bits); a harness
    // then counts its hits a 64-position word at a time, across word boundaries (t up to 299).
    constexpr int group = 4, steps = 300, k = 16;
    Harness by_list(std::make_unique<EvictsScattered>(), 40, steps, HarnessOptions{}, "list", "");
    Harness by_bits(std::make_unique<EvictsScattered>(), 40, steps, HarnessOptions{}, "bits", "");
    uint64_t state = 12345;
    auto random = [&] { return static_cast<float>((state = state * 6364136223846793005u + 1442695040888963407u) >> 40); };
    std::vector<std::vector<float>> rows(group, std::vector<float>(steps));
    std::vector<float> combined(steps);
    for (int32_t t = 1; t < steps; ++t) {
        for (auto& row : rows)
            for (int32_t p = 0; p < t; ++p) row[p] = random();
        std::vector<std::vector<int32_t>> heavy(group);
        std::vector<std::vector<uint64_t>> bits(group, std::vector<uint64_t>((t + 63) / 64, 0));
        std::span<const int32_t> heavy_spans[group];
        const float* row_pointers[group];
        const uint64_t* bit_pointers[group];
        for (int h = 0; h < group; ++h) {
            top_k_positions({rows[h].data(), static_cast<std::size_t>(t)}, k, heavy[h]);
            for (int32_t p : heavy[h]) bits[h][p / 64] |= uint64_t{1} << (p % 64);
            heavy_spans[h] = heavy[h];
            row_pointers[h] = rows[h].data();
            bit_pointers[h] = bits[h].data();
        }
        GroupStep step;
        step.t = t;
        step.rows = row_pointers;
        step.heavy = heavy_spans;
        step.combined = combined.data();
        by_list.step(step);
        step.heavy_bits = bit_pointers;
        by_bits.step(step);
    }
    const StreamMetrics &list = by_list.metrics(), &bits = by_bits.metrics();
    CHECK(bits.heavy_hitter_possible == list.heavy_hitter_possible);
    CHECK(bits.heavy_hitter_hits == list.heavy_hitter_hits);
    // Neither none nor all: the kept set and the heavy hitters overlap in part.
    CHECK(list.heavy_hitter_hits > list.heavy_hitter_possible / 20);
    CHECK(list.heavy_hitter_hits < list.heavy_hitter_possible / 2);
}

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

namespace {

// Keeps the newest positions, as sliding_window does, and records the weights it is shown.
class RecordsWhatItIsShown : public Policy {
public:
    explicit RecordsWhatItIsShown(std::vector<std::vector<float>>& shown) : shown_(shown) {}
    void on_decode_step(int32_t pos, std::span<const float> attn) override {
        shown_.emplace_back(attn.begin(), attn.end());
        held_.push_back(pos);
    }
    void evict(int budget, std::vector<int32_t>& victims) override {
        while (static_cast<int>(held_.size()) > budget) {
            victims.push_back(held_.front());
            held_.erase(held_.begin());
        }
    }
    std::size_t bytes_per_slot() const override { return 0; }

private:
    std::vector<std::vector<float>>& shown_;
    std::vector<int32_t> held_ = {0};
};

}  // namespace

TEST_CASE("the renormalized view changes what a policy is shown, never how retained mass is measured") {
    // Two query heads, a budget of 3 over 12 steps; row h at step t weighs position p by p + 1 + h.
    constexpr int kSteps = 12, kBudget = 3, kGroup = 2;
    std::vector<std::vector<std::vector<float>>> rows(kSteps, std::vector<std::vector<float>>(kGroup));
    for (int t = 1; t < kSteps; ++t)
        for (int h = 0; h < kGroup; ++h) {
            double total = 0;
            for (int p = 0; p <= t; ++p) total += p + 1 + h;
            for (int p = 0; p <= t; ++p) rows[t][h].push_back(static_cast<float>((p + 1 + h) / total));
        }
    auto run = [&](AttentionView view, std::vector<std::vector<float>>& shown) {
        HarnessOptions options;
        options.view = view;
        Harness harness(std::make_unique<RecordsWhatItIsShown>(shown), kBudget, kSteps, options, "recorder", "");
        for (int t = 1; t < kSteps; ++t) {
            const float* group_rows[kGroup] = {rows[t][0].data(), rows[t][1].data()};
            const float self[kGroup] = {rows[t][0][t], rows[t][1][t]};
            std::vector<int32_t> top[kGroup];
            std::span<const int32_t> heavy[kGroup];
            for (int h = 0; h < kGroup; ++h) {
                top_k_positions({group_rows[h], static_cast<std::size_t>(t)}, 2, top[h]);
                heavy[h] = top[h];
            }
            std::vector<float> combined(t);
            combine_group_rows(group_rows, t, GroupReduce::mean, combined.data());
            GroupStep step;
            step.t = t;
            step.rows = group_rows;
            step.self_weight = self;
            step.own_weight = self;
            step.heavy = heavy;
            step.combined = combined.data();
            harness.step(step);
        }
        return harness.metrics();
    };
    std::vector<std::vector<float>> raw_shown, renormalized_shown;
    const StreamMetrics raw = run(AttentionView::raw, raw_shown);
    const StreamMetrics renormalized = run(AttentionView::renormalized, renormalized_shown);

    // Mass is the full softmax's weight on the positions held before eviction (the newest
    // kBudget) plus the token itself, in both views: well under 1 a step, not 1 as a softmax over
    // the kept positions alone would make it.
    double expected = 0;
    for (int t = 1; t < kSteps; ++t)
        for (int h = 0; h < kGroup; ++h) {
            double kept = 0;
            for (int p = std::max(0, t - kBudget); p < t; ++p) kept += rows[t][h][p];
            expected += kept + rows[t][h][t];
        }
    CHECK(raw.retained_mass == renormalized.retained_mass);
    CHECK(raw.retained_mass == doctest::Approx(expected).epsilon(1e-6));
    CHECK(raw.retained_mass / raw.steps < 0.9);
    CHECK(raw.heavy_hitter_hits == renormalized.heavy_hitter_hits);
    CHECK(raw.steps == renormalized.steps);

    // What the policy is shown differs: raw, the group's mean full-softmax weights on what it holds;
    // renormalized, each head's weights divided by its kept mass plus its own weight, then averaged.
    REQUIRE(raw_shown.size() == renormalized_shown.size());
    const int t = kSteps - 1;
    const std::vector<float>& last_raw = raw_shown.back();
    const std::vector<float>& last_renormalized = renormalized_shown.back();
    REQUIRE(last_raw.size() == static_cast<std::size_t>(kBudget));
    double shares = 0;
    for (int h = 0; h < kGroup; ++h) {
        double kept = 0;
        for (int p = t - kBudget; p < t; ++p) kept += rows[t][h][p];
        shares += rows[t][h][t] / (kept + rows[t][h][t]) / kGroup;
    }
    double raw_sum = 0, renormalized_sum = 0;
    for (int j = 0; j < kBudget; ++j) {
        const int p = t - kBudget + j;
        CHECK(last_raw[j] == doctest::Approx((rows[t][0][p] + rows[t][1][p]) / 2).epsilon(1e-6));
        raw_sum += last_raw[j];
        renormalized_sum += last_renormalized[j];
    }
    CHECK(renormalized_sum + shares == doctest::Approx(1.0).epsilon(1e-6));  // a softmax over kept + itself
    CHECK(raw_sum < 0.8);
}
