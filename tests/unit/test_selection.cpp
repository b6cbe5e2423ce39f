// The selection code behind the metrics and the evictions is total: on any floats (NaN, +-Inf,
// negative, -0, denormal) it picks positions in range, as the documented order says, and on valid
// weights exactly as before.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "helpers.h"
#include "policies/policy.h"
#include "sim/harness.h"
#include "sim/heavy_hitters.h"
#include "base/errors.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kDenormal = std::numeric_limits<float>::denorm_min();

// top_k_positions' order: IEEE 754 totalOrder (-NaN lowest, +NaN highest); ties to the lower position.
std::vector<int32_t> reference_top_k(const std::vector<float>& row, int k) {
    auto rank = [](float x) -> int64_t {
        int32_t bits;
        std::memcpy(&bits, &x, 4);
        return bits >= 0 ? bits : bits ^ INT32_MAX;
    };
    std::vector<int32_t> order(row.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return rank(row[a]) > rank(row[b]); });
    order.resize(std::min<std::size_t>(k, row.size()));
    std::sort(order.begin(), order.end());
    return order;
}

std::vector<int32_t> top_k(const std::vector<float>& row, int k) {
    std::vector<int32_t> out;
    top_k_positions(row, k, out);
    std::sort(out.begin(), out.end());
    return out;
}

std::unique_ptr<Policy> make_policy(const std::string& name, std::map<std::string, double> given, int budget,
                                    int capacity) {
    const PolicyDescriptor* d = find_policy(name);
    REQUIRE(d != nullptr);
    return d->make(resolve_params(*d, given, "test"), PolicyContext{budget, capacity, 0, 1, 0, 1, 0});
}

// Drives a policy through the harness over rows that are all `value` except where `pattern`
// says; returns the error, or "" when every step kept the contract.
std::string replay_rows(const std::string& policy, std::map<std::string, double> params, int budget,
                        const std::vector<float>& pattern, AttentionView view) {
    const int steps = 80;
    if (find_policy(policy)->keeps_everything) budget = steps;  // as the replay sizes them
    HarnessOptions options;
    options.view = view;
    Harness harness(make_policy(policy, params, budget, budget + 1), budget, steps, options, policy, "");
    std::vector<float> row(steps);
    std::vector<int32_t> heavy;
    for (int t = 1; t < steps; ++t) {
        for (int j = 0; j < t; ++j) row[j] = pattern[(j * 7 + t) % pattern.size()];
        heavy.clear();
        top_k_positions({row.data(), static_cast<std::size_t>(t)}, 8, heavy);
        const float* rows[1] = {row.data()};
        const std::span<const int32_t> heavies[1] = {heavy};
        const float self[1] = {pattern[t % pattern.size()]};
        GroupStep step;
        step.t = t;
        step.rows = rows;
        step.heavy = heavies;
        step.self_weight = self;
        step.combined = row.data();
        try {
            harness.step(step);
        } catch (const PolicyError& e) {
            return e.what();
        }
        const auto& kept = harness.kept();
        if (!std::is_sorted(kept.begin(), kept.end()) || kept.size() > static_cast<std::size_t>(budget) ||
            kept.front() < 0 || kept.back() > t)
            return policy + ": bad cache at step " + std::to_string(t);
    }
    return "";
}

}  // namespace

TEST_CASE("top_k_positions is total: NaN, infinities, negatives, -0 and denormals give k positions in range") {
    const std::vector<std::vector<float>> rows = {
        std::vector<float>(40, kNaN),                                    // all NaN: the threshold itself is NaN
        std::vector<float>(40, -0.0f),                                   // -0: its bits are negative as integers
        {0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f,
         0.0f, -0.0f, 0.0f, -0.0f},
        {0.1f, kNaN, 0.3f, kInf, -kInf, 0.2f, kNaN, 0.2f, -0.5f, kDenormal, 0.0f, 0.9f, kNaN, 0.4f, 3e38f, -3e38f,
         0.2f, kNaN, 0.05f},
        {-1.0f, -2.0f, -3.0f, -0.5f, -4.0f, -0.25f, -8.0f, -1e-30f, -kDenormal, -kInf, -1.0f, -2.0f, -3.0f,
         -0.5f, -4.0f, -0.25f, -8.0f, -1e-30f, -kDenormal, -kInf},
    };
    for (std::size_t r = 0; r < rows.size(); ++r)
        for (int k : {1, 2, 3, 5, 8, 16, 17, 40, 300}) {
            INFO("row " << r << ", k " << k);
            const std::vector<int32_t> got = top_k(rows[r], k);
            CHECK(got == reference_top_k(rows[r], k));
        }
    // Random bit patterns, long enough for the vectorised blocks, heap sizes either side of 256.
    std::mt19937 rng(7);
    for (int trial = 0; trial < 200; ++trial) {
        std::vector<float> row(1 + rng() % 700);
        for (float& x : row) {
            const uint32_t bits = rng();
            std::memcpy(&x, &bits, 4);
        }
        const int k = 1 + static_cast<int>(rng() % 300);
        INFO("trial " << trial);
        CHECK(top_k(row, k) == reference_top_k(row, k));
    }
}

TEST_CASE("top_k_positions with a hint carried from row to row: the same positions in the same order") {
    // Rows of one head in sequence, as the replay calls it: weights from a few levels (many ties),
    // some rows flatter or peakier than the last (the hint then too high or too low), a few
    // invalid ones; each must match the unhinted call exactly and the brute-force reference.
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    const float levels[] = {0.0f, 1e-6f, 0.001f, 0.01f, 0.01f, 0.02f, 0.05f, 0.1f, 0.3f};
    for (int k : {1, 4, 32, 100, 300}) {
        int32_t hint = kNoTopKHint;
        std::vector<float> row;
        for (int t = 1; t < 1500; t += 1 + static_cast<int>(rng() % 5)) {
            row.resize(t);
            const float scale = u(rng) < 0.1f ? 0.01f + u(rng) : 1.0f;  // now and then a flatter row
            for (float& x : row) x = levels[rng() % std::size(levels)] * (u(rng) < 0.5f ? 1.0f : scale);
            if (u(rng) < 0.03f) row[rng() % t] = u(rng) < 0.5f ? kNaN : -1.0f;
            if (u(rng) < 0.05f) hint = static_cast<int32_t>(rng());  // any hint, even a wild one
            std::vector<int32_t> hinted, plain;
            top_k_positions(row, k, hinted, hint);
            top_k_positions(row, k, plain);
            INFO("k " << k << ", t " << t);
            REQUIRE(hinted == plain);
            std::sort(hinted.begin(), hinted.end());
            REQUIRE(hinted == reference_top_k(row, k));
        }
    }
}

TEST_CASE("top_k_positions on valid weights keeps the reference tie rule") {
    // Non-negative finite weights: the bit order is the float order, so the rule is unchanged.
    std::vector<float> row(100, 0.01f);
    row[3] = row[50] = row[97] = 0.2f;
    CHECK(top_k(row, 5) == std::vector<int32_t>{0, 1, 3, 50, 97});  // ties go to the lowest positions
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int trial = 0; trial < 50; ++trial) {
        std::vector<float> w(1 + rng() % 2000);
        for (float& x : w) x = u(rng) < 0.3f ? 0.0f : u(rng) * u(rng);
        const int k = 1 + static_cast<int>(rng() % 64);
        CHECK(top_k(w, k) == reference_top_k(w, k));
    }
}

TEST_CASE("scored eviction picks a held slot whatever the scores: NaN ranks lowest, +Inf stays") {
    // TOVA: no protected window, so every held slot is a candidate; all scores NaN but the new one.
    auto tova = make_policy("tova", {}, 2, 4);
    const std::vector<float> nan_row(8, kNaN);
    tova->on_decode_step(1, std::span<const float>(nan_row).first(1));
    tova->on_decode_step(2, std::span<const float>(nan_row).first(2));
    std::vector<int32_t> victims;
    tova->evict(2, victims);
    CHECK(victims == std::vector<int32_t>{0});  // the first NaN slot, never one past the end

    // Every held slot NaN but the unobserved new one (+Inf): a vectorised minimum over such scores
    // may come out as the +Inf, which alone would mean "nothing evictable"; a NaN slot must go.
    const std::vector<float> nans(64, kNaN);
    for (int held = 1; held <= 40; ++held) {
        auto policy = make_policy("tova", {}, held, held + 1);
        for (int32_t pos = 1; pos <= held; ++pos) policy->on_decode_step(pos, std::span<const float>(nans).first(pos));
        victims.clear();
        policy->evict(held, victims);  // held NaN slots and the new one: one must go
        INFO("held " << held);
        CHECK(victims.size() == 1);
        CHECK((!victims.empty() && victims.front() == 0));
    }

    // H2O with a NaN among numbers, one victim and several.
    auto h2o = make_policy("h2o", {{"recent_window", 1}}, 3, 8);
    const std::vector<float> row = {0.5f, kNaN, 0.1f, kNaN, 0.3f, 0.2f, 0.4f};
    for (int32_t pos = 1; pos <= 6; ++pos) h2o->on_decode_step(pos, std::span<const float>(row).first(pos));
    victims.clear();
    h2o->evict(3, victims);  // 7 held, 1 protected: the two NaN slots first, then the lowest number
    CHECK(victims == std::vector<int32_t>{1, 2, 3, 5});
    h2o->on_decode_step(7, std::span<const float>(row).first(3));
    victims.clear();
    h2o->evict(3, victims);
    CHECK(victims.size() == 1);
}

TEST_CASE("every policy keeps the harness contract on rows of NaN, infinities and negatives") {
    const std::vector<std::vector<float>> patterns = {
        {kNaN}, {kInf}, {-kInf}, {-0.25f, 0.5f}, {kNaN, 0.1f, kInf, -0.0f, kDenormal, 3e38f, -3e38f},
        {kDenormal}, {-0.0f, 0.0f}};
    for (const PolicyDescriptor& d : policy_registry()) {
        // A policy that needs a trace's keys and values (or a file) to run is not driven by rows alone.
        if (d.check_context &&
            !d.check_context(resolve_params(d, {}, "test"), PolicyContext{6, 7, 0, 1, 0, 1, 0}).second.empty())
            continue;
        if (d.prompt_press) continue;  // reads the prompt's Q/K/V, not rows: test_prompt_press.cpp
        for (const auto& pattern : patterns)
            for (AttentionView view : {AttentionView::raw, AttentionView::renormalized}) {
                std::map<std::string, double> params;
                for (const ParamSpec& s : d.params)
                    if (s.name == "recent_window" || s.name == "recent") params[s.name] = 2;
                const std::string error = replay_rows(d.name, params, 6, pattern, view);
                INFO(d.name << " pattern " << &pattern - &patterns[0]);
                // A score of +Inf is the mark of a slot that may not go (TOVA's unobserved token), so
                // a policy fed +Inf may be unable to evict: the harness says so as a PolicyError.
                // Never anything else, and nothing at all without +Inf.
                if (std::find(pattern.begin(), pattern.end(), kInf) != pattern.end())
                    CHECK((error.empty() || error.find("over the budget") != std::string::npos));
                else
                    CHECK(error == "");
            }
    }
}

TEST_CASE("the renormalized view stays finite when a head's kept and own weights underflow") {
    // All of the head's attention on positions the policy evicted (a sharp softmax from Q and K, as
    // eval on random bytes gives): its kept weights and its own weight are denormal and 1 / their
    // sum is past float's range. Every policy must still see finite weights: an infinite score
    // (H2O's sum, TOVA's last weight) could never be evicted and the cache would outgrow its budget.
    const int steps = 40, budget = 4;
    for (const PolicyDescriptor& d : policy_registry()) {
        if (d.keeps_everything || d.prompt_press) continue;  // a prompt press reads no rows
        std::map<std::string, double> params;
        for (const ParamSpec& s : d.params)
            if (s.name == "recent_window" || s.name == "recent") params[s.name] = 1;
        HarnessOptions options;
        options.view = AttentionView::renormalized;
        Harness harness(make_policy(d.name, params, budget, budget + 1), budget, steps, options, d.name, "");
        std::vector<float> row(steps);
        INFO(d.name);
        for (int t = 1; t < steps; ++t) {
            std::fill(row.begin(), row.end(), 1e-44f);
            const float* rows[1] = {row.data()};
            const std::span<const int32_t> heavies[1] = {};
            const float self[1] = {1e-44f};
            GroupStep step;
            step.t = t;
            step.rows = rows;
            step.heavy = heavies;
            step.self_weight = self;
            REQUIRE_NOTHROW(harness.step(step));
        }
        CHECK(harness.kept().size() <= static_cast<std::size_t>(budget));
    }
}
