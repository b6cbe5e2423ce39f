// The stratigraphic tiered cache, driven directly through the Policy interface by a small harness
// loop of its own: seeded attention with heavy tokens, every step evicting and reporting tiers.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "policies/policy.h"
#include "policies/ranking.h"

namespace kvsim {
PolicyDescriptor stratigraphic_descriptor();
}

using namespace kvsim;

namespace {

constexpr int kSteps = 2000;
constexpr int kSinks = 4;
constexpr int kRecent = 64;
constexpr int kHugeBudget = 1 << 30;
constexpr int kNotHeld = -1;

// The zone shares as exact hundredths, so the test's floor(share * (t + 1)) has no rounding:
// FP16 = 30 * (0.4 + 0.6 * l / (L - 1)) hundredths, INT8 30, INT4 25.
struct Shares {
    int64_t fp16, int8, int4;  // hundredths
    int64_t count(int64_t hundredths, int32_t t) const { return hundredths * (int64_t{t} + 1) / 100; }
};
constexpr Shares kLayer0Of4{12, 30, 25};
constexpr Shares kLayer3Of4{30, 30, 25};

// One step as the test harness saw it. Tiers and importance are indexed by position.
struct StepView {
    int32_t t;
    const std::vector<int32_t>& before;  // held after admitting t, before eviction (ascending)
    const std::vector<int32_t>& held;    // after eviction
    const std::vector<int32_t>& victims;
    const std::vector<int>& previous_tier;  // kNotHeld for t itself and positions not held
    const std::vector<int>& tier;
    const std::vector<double>& importance;  // cumulative attention, summed as the policy sums it
};

const PolicyDescriptor& descriptor() {
    static const PolicyDescriptor d = stratigraphic_descriptor();
    return d;
}

ParamValues params_with(const std::map<std::string, double>& given) {
    return resolve_params(descriptor(), given, "test");
}

std::unique_ptr<Policy> make_policy(const std::map<std::string, double>& given, int layer, int num_layers) {
    const ParamValues p = params_with(given);
    REQUIRE(descriptor().check_budget(p, kHugeBudget) == "");
    return descriptor().make(p, PolicyContext{kHugeBudget, kSteps + 1, layer, num_layers});
}

// Smooth attention is continuous noise (ties never happen); coarse attention takes a few values in
// 1/64ths, summed exactly, so many tokens tie on importance and the tie-breaks decide. Upheaval is
// smooth, but every 97th step pours attention (unnormalised, up to 20 a token) on the newest tokens,
// in proportion to their position cubed: the importance order turns over, where steps otherwise
// move a few tokens in it.
enum class Attention { smooth, coarse, upheaval };

// Attention of step t over the held positions: noise, a sink at 0, a sparse set of heavy hitters,
// late bloomers that turn heavy long after they arrive (so some sink before they matter), and a
// local band. Smooth rows are normalised to 1 like a softmax row.
std::vector<float> attention(int32_t t, const std::vector<int32_t>& held, std::mt19937& rng, Attention kind) {
    std::uniform_real_distribution<float> noise(0.0f, 1.0f);
    std::vector<float> attn(held.size());
    const bool upheaval = kind == Attention::upheaval && t % 97 == 0;
    float total = 0;
    for (std::size_t j = 0; j < held.size(); ++j) {
        const int32_t pos = held[j];
        float weight = kind == Attention::coarse ? static_cast<float>(rng() % 3) : noise(rng);
        if (upheaval) weight = 20.0f * std::pow(static_cast<float>(pos) / static_cast<float>(t), 3.0f);
        if (pos == 0) weight *= 50;
        if (pos % 29 == 3) weight *= 15;
        if (pos % 41 == 7 && t > pos + 300) weight *= 30;
        if (pos > t - 16) weight *= 4;
        attn[j] = weight;
        total += weight;
    }
    if (!upheaval)
        for (float& a : attn) a = kind == Attention::coarse ? a / 64 : a / total;
    return attn;
}

// Runs kSteps steps; checks the harness contract itself (victims ascending and held, tiers in
// range and equal for keys and values, evicted never held again) and hands each step to `check`.
// The harness budget of step t, given how many it holds after admitting t.
using BudgetAt = std::function<int(int32_t t, std::size_t held)>;
BudgetAt budget_of(int budget) {
    return [budget](int32_t, std::size_t) { return budget; };
}

void replay(Policy& policy, uint32_t seed, const std::function<void(const StepView&)>& check,
            const BudgetAt& budget_at = budget_of(kHugeBudget), Attention kind = Attention::smooth) {
    std::mt19937 rng(seed);
    std::vector<int32_t> held = {0};
    std::vector<double> importance(kSteps, 0.0);
    std::vector<int> tier(kSteps, kNotHeld);
    std::vector<bool> evicted(kSteps, false);
    tier[0] = 0;
    std::vector<uint8_t> key_tier(kSteps), value_tier(kSteps);
    for (int32_t t = 1; t < kSteps; ++t) {
        const std::vector<float> attn = attention(t, held, rng, kind);
        policy.on_decode_step(t, attn);
        for (std::size_t j = 0; j < held.size(); ++j) importance[held[j]] += attn[j];
        held.push_back(t);
        const std::vector<int32_t> before = held;

        std::vector<int32_t> victims;
        policy.evict(budget_at(t, held.size()), victims);
        // Failures stop the run; passing steps add no assertions (there are millions of them).
        if (!std::is_sorted(victims.begin(), victims.end()) ||
            std::adjacent_find(victims.begin(), victims.end()) != victims.end())
            FAIL("step " << t << ": victims not strictly ascending");
        for (int32_t v : victims) {
            if (!std::binary_search(held.begin(), held.end(), v)) FAIL("step " << t << ": victim " << v << " not held");
            evicted[v] = true;
        }
        std::erase_if(held, [&](int32_t pos) { return evicted[pos]; });

        // The arrays keep what the policy reported before (Policy::assign_tiers); t enters at FP16.
        key_tier[t] = value_tier[t] = 0;
        policy.assign_tiers(t, held, key_tier, value_tier);
        const std::vector<int> previous_tier = [&] {
            std::vector<int> prev(kSteps, kNotHeld);
            for (int32_t pos : before)
                if (pos != t) prev[pos] = tier[pos];
            return prev;
        }();
        std::fill(tier.begin(), tier.end(), kNotHeld);
        for (int32_t pos : held) {
            if (key_tier[pos] > 2 || key_tier[pos] != value_tier[pos])
                FAIL("step " << t << " position " << pos << ": key tier " << int{key_tier[pos]} << ", value tier "
                              << int{value_tier[pos]});
            tier[pos] = key_tier[pos];
        }
        // The counts the memory metric reads in place of a pass over the held tiers.
        std::array<int64_t, 3> counted{-1, -1, -1}, reported{};
        if (!policy.held_per_tier(counted)) FAIL("step " << t << ": no tier counts");
        for (int32_t pos : held) ++reported[tier[pos]];
        if (counted != reported)
            FAIL("step " << t << ": counts " << counted[0] << "/" << counted[1] << "/" << counted[2] << " by tier, "
                         << reported[0] << "/" << reported[1] << "/" << reported[2] << " reported");
        check(StepView{t, before, held, victims, previous_tier, tier, importance});
    }
}

struct AnchorRule {
    double percentile = 99;
    int64_t max_percent = 5;  // of held tokens
};

// Anchors among `held`, computed independently of the policy by a full sort: importance at or
// above the percentile (linear between order statistics), at most max_percent of held (rounded
// down), the more important and then the lower position first.
std::set<int32_t> anchors_of(const std::vector<int32_t>& held, const std::vector<double>& importance,
                             const AnchorRule& rule = {}) {
    const std::size_t n = held.size();
    const std::size_t max_anchors = n * rule.max_percent / 100;
    if (max_anchors == 0) return {};
    std::vector<double> values;
    for (int32_t pos : held) values.push_back(importance[pos]);
    std::sort(values.begin(), values.end());
    const double rank = rule.percentile / 100.0 * static_cast<double>(n - 1);
    const std::size_t below = static_cast<std::size_t>(rank);
    const double above = below + 1 < n ? values[below + 1] : values[below];
    const double threshold = values[below] + (rank - below) * (above - values[below]);
    std::vector<int32_t> candidates;
    for (int32_t pos : held)
        if (importance[pos] >= threshold) candidates.push_back(pos);
    std::sort(candidates.begin(), candidates.end(), [&](int32_t a, int32_t b) {
        return importance[a] != importance[b] ? importance[a] > importance[b] : a < b;
    });
    if (candidates.size() > max_anchors) candidates.resize(max_anchors);
    return {candidates.begin(), candidates.end()};
}

bool sink_or_recent(int32_t pos, int32_t t) { return pos < kSinks || pos > t - kRecent; }

// The positions held before eviction that no rule protects (sinks, the recent window, anchors),
// the most important first (the lower position on ties), by a full sort.
std::vector<int32_t> unprotected_by_importance(const StepView& s, const AnchorRule& rule = {}) {
    const std::set<int32_t> anchors = anchors_of(s.before, s.importance, rule);
    std::vector<int32_t> unprotected;
    for (int32_t pos : s.before)
        if (!sink_or_recent(pos, s.t) && !anchors.count(pos)) unprotected.push_back(pos);
    std::sort(unprotected.begin(), unprotected.end(), [&](int32_t a, int32_t b) {
        return s.importance[a] != s.importance[b] ? s.importance[a] > s.importance[b] : a < b;
    });
    return unprotected;
}

// The `count` least important of them, ascending: what a budget trims first.
std::vector<int32_t> least_important_unprotected(const StepView& s, std::size_t count) {
    const std::vector<int32_t> unprotected = unprotected_by_importance(s);
    std::vector<int32_t> least(unprotected.end() - static_cast<std::ptrdiff_t>(count), unprotected.end());
    std::sort(least.begin(), least.end());
    return least;
}

// The zone (0 fp16, 1 int8, 2 int4, 3 evicted) of every position held before eviction, by the
// rules, with the tokens unprotected ranked by a full sort.
struct Zones {
    std::map<int32_t, int> zone;
    int64_t protected_count;
};

Zones reference_zones(const StepView& s, const Shares& shares, const AnchorRule& rule) {
    const std::vector<int32_t> unprotected = unprotected_by_importance(s, rule);
    std::map<int32_t, int> zone;
    for (int32_t pos : s.before) zone[pos] = 0;  // FP16, the protected zone; the unprotected get theirs below
    const int64_t protected_count = static_cast<int64_t>(s.before.size() - unprotected.size());
    const int64_t fp16_left = std::max<int64_t>(shares.count(shares.fp16, s.t) - protected_count, 0);
    const int64_t int8_end = fp16_left + shares.count(shares.int8, s.t);
    const int64_t int4_end = int8_end + shares.count(shares.int4, s.t);
    for (int64_t rank = 0; rank < static_cast<int64_t>(unprotected.size()); ++rank)
        zone[unprotected[rank]] = rank < fp16_left ? 0 : rank < int8_end ? 1 : rank < int4_end ? 2 : 3;
    return {zone, protected_count};
}

int count_tier(const StepView& s, int wanted) {
    return static_cast<int>(
        std::count_if(s.held.begin(), s.held.end(), [&](int32_t pos) { return s.tier[pos] == wanted; }));
}

// Collects the first violation of a rule over a run, so one failing rule reports once.
struct Violations {
    std::string first;
    int count = 0;
    void add(const std::string& what) {
        if (count++ == 0) first = what;
    }
};

// A rule holds when nothing violated it; where something did, the message names the rule and
// the first violation.
void check_none(const std::string& rule, const Violations& v) {
    INFO(rule << ": " << v.first);
    CHECK(v.count == 0);
}

std::string at(int32_t t, int32_t pos) { return "step " + std::to_string(t) + " position " + std::to_string(pos); }

// The properties every run must keep, whatever its parameters.
void check_invariants(const StepView& s, Violations& sinking, Violations& protected_fp16, std::vector<bool>& gone) {
    for (int32_t pos : s.held) {
        if (gone[pos]) sinking.add(at(s.t, pos) + ": held again after eviction");
        if (s.previous_tier[pos] != kNotHeld && s.tier[pos] < s.previous_tier[pos])
            sinking.add(at(s.t, pos) + ": rose from tier " + std::to_string(s.previous_tier[pos]) + " to " +
                        std::to_string(s.tier[pos]));
        if (pos == s.t && s.tier[pos] != 0) sinking.add(at(s.t, pos) + ": the new token did not enter at FP16");
        if (sink_or_recent(pos, s.t) && s.tier[pos] != 0)
            protected_fp16.add(at(s.t, pos) + ": a sink or recent token at tier " + std::to_string(s.tier[pos]));
    }
    for (int32_t pos : s.before)
        if (sink_or_recent(pos, s.t) && !std::binary_search(s.held.begin(), s.held.end(), pos))
            protected_fp16.add(at(s.t, pos) + ": a sink or recent token evicted");
    for (int32_t v : s.victims) gone[v] = true;
}

struct LayerRun {
    Violations sinking, protected_fp16, anchors, zones, counts;
    int anchors_seen = 0, anchors_at_fp16 = 0, anchors_sunk_before = 0;
    int steps_checked = 0, steps_zones_full = 0, steps_fp16_below_share = 0;
    int64_t fp16_token_steps = 0;  // FP16 tokens summed over the steps after warm-up
    int final_fp16 = 0, final_held = 0;
    std::vector<std::vector<int>> tier_history;  // the held tiers of every step, for comparing runs
};

struct Setup {
    int layer, num_layers;
    Shares shares;  // what the layer's shares come to
    std::map<std::string, double> params = {};
    AnchorRule anchors = {};  // what params say about anchors
    Attention attention = Attention::smooth;
    uint32_t seed = 11;
};

// A whole run at rezone_every = 1, checking every step against the rules.
LayerRun run_layer(const Setup& setup) {
    auto policy = make_policy(setup.params, setup.layer, setup.num_layers);
    const Shares& shares = setup.shares;
    LayerRun run;
    std::vector<bool> gone(kSteps, false);
    replay(*policy, setup.seed, [&](const StepView& s) {
        check_invariants(s, run.sinking, run.protected_fp16, gone);

        // Anchors sit in the FP16 zone: FP16 unless they had already sunk, which they cannot undo.
        for (int32_t pos : anchors_of(s.before, s.importance, setup.anchors)) {
            ++run.anchors_seen;
            const int expected = std::max(s.previous_tier[pos], 0);
            if (expected == 0) ++run.anchors_at_fp16;
            if (expected > 0) ++run.anchors_sunk_before;
            if (s.tier[pos] != expected)
                run.anchors.add(at(s.t, pos) + ": an anchor at tier " + std::to_string(s.tier[pos]) + ", expected " +
                                std::to_string(expected));
        }

        // Every tier is max(previous tier, zone), and exactly the "evicted" zone goes.
        const auto [zone, protected_count] = reference_zones(s, shares, setup.anchors);
        std::vector<int32_t> expected_victims;
        for (int32_t pos : s.before) {
            const int z = zone.at(pos);
            if (z == 3) {
                expected_victims.push_back(pos);
                continue;
            }
            const int expected = std::max(s.previous_tier[pos], z);
            if (s.tier[pos] != expected)
                run.zones.add(at(s.t, pos) + ": tier " + std::to_string(s.tier[pos]) + ", zone " + std::to_string(z) +
                              ", previous " + std::to_string(s.previous_tier[pos]));
        }
        if (expected_victims != s.victims)
            run.zones.add("step " + std::to_string(s.t) + ": " + std::to_string(s.victims.size()) +
                          " victims, expected " + std::to_string(expected_victims.size()));

        // The zone sizes once warmed up. Tiers only sink, so the tokens in a zone or finer bound
        // those at its tier or finer, and the tokens in a zone or coarser those at its tier or
        // coarser. The FP16 tier can stay well below the FP16 share: sunk tokens fill that zone.
        const int64_t fp16 = shares.count(shares.fp16, s.t), int8 = shares.count(shares.int8, s.t),
                      int4 = shares.count(shares.int4, s.t);
        if (s.t >= 400) {
            ++run.steps_checked;
            const int64_t fp16_zone = std::max(protected_count, fp16);  // protected overflow widens it
            const int64_t at_fp16 = count_tier(s, 0), at_int8 = count_tier(s, 1), at_int4 = count_tier(s, 2);
            const int64_t held = static_cast<int64_t>(s.held.size());
            const std::string step = "step " + std::to_string(s.t) + ": ";
            // Evicted tokens never return, so the zones may have room to spare (a new anchor widens
            // the FP16 zone); when anything was evicted they are exactly full.
            const int64_t zones_hold = fp16_zone + int8 + int4;
            if (held > zones_hold || (!s.victims.empty() && held != zones_hold))
                run.counts.add(step + std::to_string(held) + " held, zones hold " + std::to_string(zones_hold) +
                               (s.victims.empty() ? "" : " after evicting"));
            if (!s.victims.empty()) ++run.steps_zones_full;
            if (at_fp16 > fp16_zone) run.counts.add(step + "more FP16 tokens than the FP16 zone");
            if (at_fp16 + at_int8 > fp16_zone + int8) run.counts.add(step + "more FP16+INT8 tokens than their zones");
            if (at_int4 < int4) run.counts.add(step + "fewer INT4 tokens than the INT4 zone");
            if (at_int8 + at_int4 < int8 + int4) run.counts.add(step + "fewer INT8+INT4 tokens than their zones");
            if (at_fp16 < fp16) ++run.steps_fp16_below_share;
            run.fp16_token_steps += at_fp16;
        }

        std::vector<int> tiers;
        for (int32_t pos : s.held) tiers.push_back(pos * 4 + s.tier[pos]);
        run.tier_history.push_back(std::move(tiers));
        run.final_fp16 = count_tier(s, 0);
        run.final_held = static_cast<int>(s.held.size());
    }, budget_of(kHugeBudget), setup.attention);
    return run;
}

const LayerRun& layer0() {
    static const LayerRun run = run_layer({0, 4, kLayer0Of4});
    return run;
}
const LayerRun& layer3() {
    static const LayerRun run = run_layer({3, 4, kLayer3Of4});
    return run;
}

void check_run(const LayerRun& run) {
    check_none("sinking", run.sinking);
    check_none("protected", run.protected_fp16);
    check_none("anchors", run.anchors);
    check_none("zones", run.zones);
    check_none("counts", run.counts);
}

}  // namespace

TEST_CASE("stratigraphic: tokens only sink, sinks/recent/anchors stay FP16, zones follow the shares (layer 0 of 4)") {
    const LayerRun& run = layer0();
    check_run(run);
    // Not vacuous: anchors exist and many are at FP16, and the zones are exactly full at every
    // step that evicts (about a third of the steps after warm-up at a 67% total share).
    CHECK(run.anchors_seen > 1000);
    CHECK(run.anchors_at_fp16 > 1000);
    CHECK(run.steps_checked == kSteps - 400);
    CHECK(run.steps_zones_full > 300);
}

TEST_CASE("stratigraphic: the same rules hold at the deepest layer (layer 3 of 4)") {
    const LayerRun& run = layer3();
    check_run(run);
    CHECK(run.anchors_seen > 1000);
    CHECK(run.steps_zones_full > 100);
    // Tokens turn into anchors after they sank: their zone is FP16, their tier stays.
    CHECK(run.anchors_sunk_before > 0);
}

TEST_CASE("stratigraphic: deeper layers keep more FP16") {
    // Layer 0 gets 0.3 * 0.4 = 12% of the tokens seen as its FP16 zone, layer 3 the full 30%.
    // Sunk tokens fill much of either zone (cumulative importance favours old tokens, which
    // sank when they left the recent window), so the FP16 tier stays well below the share;
    // still the deeper layer holds more at FP16 and more in all.
    CHECK(layer3().fp16_token_steps > layer0().fp16_token_steps);
    CHECK(layer3().final_fp16 > layer0().final_fp16);
    CHECK(layer3().final_held > layer0().final_held);
    // 67% and 85% of the 2000 tokens seen, give or take the protected overflow.
    CHECK(layer0().final_held == doctest::Approx(0.67 * kSteps).epsilon(0.02));
    CHECK(layer3().final_held == doctest::Approx(0.85 * kSteps).epsilon(0.02));
}

TEST_CASE("stratigraphic: one layer gets the whole surface share, like the deepest of several") {
    const LayerRun only = run_layer({0, 1, kLayer3Of4});
    check_run(only);
    CHECK(only.tier_history == layer3().tier_history);
}

TEST_CASE("stratigraphic: ties on importance go to the lower position (coarse attention, layer 1 of 4)") {
    // 0.3 * (0.4 + 0.6 / 3) = 18% FP16; importance in 1/64ths, so tokens of an age tie often.
    const LayerRun run = run_layer({1, 4, {18, 30, 25}, {}, {}, Attention::coarse});
    check_run(run);
    CHECK(run.anchors_seen > 1000);
    CHECK(run.steps_zones_full > 300);
}

TEST_CASE("stratigraphic: the zones hold when attention turns the importance order over (layer 2 of 4)") {
    // The policy keeps last step's order and mends it; a step that reverses it takes the other way.
    const LayerRun run = run_layer({2, 4, {24, 30, 25}, {}, {}, Attention::upheaval});
    check_run(run);
    CHECK(run.steps_zones_full > 300);
}

TEST_CASE("stratigraphic: the anchor cap binds at a low percentile (layer 2 of 4)") {
    // The 80th percentile admits ~20% of held tokens; the cap keeps the 5% most important.
    const LayerRun run = run_layer({2, 4, {24, 30, 25}, {{"anchor_percentile", 80}}, {80, 5}});
    check_run(run);
    // 5% of held summed over the run is ~79000 anchor-steps; the uncapped 20% would be four times that.
    CHECK(run.anchors_seen > 70000);
    CHECK(run.anchors_seen < 90000);
}

TEST_CASE("stratigraphic: rezone_every = 8 moves tiers only on multiples of 8") {
    auto policy = make_policy({{"rezone_every", 8}}, 1, 4);
    Violations sinking, protected_fp16, between;
    std::vector<bool> gone(kSteps, false);
    int rezonings_that_moved = 0;
    replay(*policy, 23, [&](const StepView& s) {
        check_invariants(s, sinking, protected_fp16, gone);
        bool moved = !s.victims.empty();
        for (int32_t pos : s.held)
            if (pos != s.t && s.tier[pos] != s.previous_tier[pos]) moved = true;
        if (s.t % 8 != 0 && moved) between.add("step " + std::to_string(s.t) + ": tiers or residency changed");
        if (s.t % 8 == 0 && moved) ++rezonings_that_moved;
    });
    check_none("sinking", sinking);
    check_none("protected", protected_fp16);
    check_none("between re-zonings", between);
    CHECK(rezonings_that_moved > 200);  // nearly every one of the 249 after warm-up
}

TEST_CASE("stratigraphic: a tight harness budget evicts the least important unprotected tokens") {
    // Budget 300 is far below the zones' share: between re-zonings (every 8) the budget alone
    // decides, taking the least important unprotected tokens; sinks and the recent window stay.
    constexpr int kBudget = 300;
    auto policy = make_policy({{"rezone_every", 8}}, 0, 4);
    Violations sinking, protected_fp16, budget;
    std::vector<bool> gone(kSteps, false);
    int trims_checked = 0;
    replay(
        *policy, 5,
        [&](const StepView& s) {
            check_invariants(s, sinking, protected_fp16, gone);
            const std::string step = "step " + std::to_string(s.t) + ": ";
            if (s.held.size() > kBudget) budget.add(step + std::to_string(s.held.size()) + " held");
            if (s.t % 8 == 0 || s.before.size() <= kBudget) return;
            if (least_important_unprotected(s, s.before.size() - kBudget) != s.victims)
                budget.add(step + "not the least important unprotected tokens");
            ++trims_checked;
        },
        budget_of(kBudget));
    check_none("sinking", sinking);
    check_none("protected", protected_fp16);
    check_none("budget", budget);
    CHECK(trims_checked > 1000);
}

TEST_CASE("stratigraphic: a budget below the zones trims in the same step as a re-zoning evicts") {
    // Every 32nd step from 400 on the budget drops 3 below what is held: the re-zoning evicts what
    // the zones leave out, and the trim the least important unprotected tokens still held, so
    // together they are the 3 least important unprotected (the zones evict from the least). In
    // between, the zones (67% of the tokens seen, growing by 0.67 a step) catch up with the cuts.
    constexpr std::size_t kCut = 3;
    const auto cut_step = [](int32_t t) { return t >= 400 && t % 32 == 0; };
    auto policy = make_policy({}, 0, 4);
    Violations sinking, protected_fp16, budget;
    std::vector<bool> gone(kSteps, false);
    int cuts_checked = 0, cuts_after_zones_evicted = 0;
    replay(
        *policy, 17,
        [&](const StepView& s) {
            check_invariants(s, sinking, protected_fp16, gone);
            if (!cut_step(s.t)) return;
            const std::string step = "step " + std::to_string(s.t) + ": ";
            const std::map<int32_t, int> zone = reference_zones(s, kLayer0Of4, {}).zone;
            if (std::any_of(zone.begin(), zone.end(), [](const auto& z) { return z.second == 3; }))
                ++cuts_after_zones_evicted;
            if (least_important_unprotected(s, kCut) != s.victims)
                budget.add(step + std::to_string(s.victims.size()) + " victims, not the " + std::to_string(kCut) +
                           " least important unprotected tokens");
            ++cuts_checked;
        },
        [&](int32_t t, std::size_t held) { return cut_step(t) ? static_cast<int>(held - kCut) : kHugeBudget; });
    check_none("sinking", sinking);
    check_none("protected", protected_fp16);
    check_none("budget", budget);
    CHECK(cuts_checked == 50);
    CHECK(cuts_after_zones_evicted > 10);  // not vacuous: 14 of the 50 (the zones evict in a third of all steps)
}

TEST_CASE("stratigraphic: parameter checks, bookkeeping bytes and tier format") {
    const auto check = [](const std::map<std::string, double>& given) {
        return descriptor().check_budget(params_with(given), 256);
    };
    CHECK(check({}) == "");
    CHECK(check({{"int8_share", 0.5}}) == "shares sum to 1.05 > 1 (surface + int8_share + int4_share)");
    CHECK(check({{"int8_share", 0.45}}) == "");  // exactly 1 is fine
    CHECK(check({{"slope", 1.5}}) != "");
    CHECK(check({{"slope", 1}}) == "");
    CHECK(check({{"anchor_percentile", 101}}) != "");
    CHECK_THROWS(params_with({{"sinks", 2.5}}));
    CHECK_THROWS(params_with({{"rezone_every", 0}}));
    CHECK_THROWS(params_with({{"surface", -0.1}}));

    auto policy = make_policy({}, 0, 4);
    CHECK(policy->bytes_per_slot() == 13);
    CHECK(policy->sizes_itself());
    const TierFormat* format = policy->tier_format();
    REQUIRE(format != nullptr);
    CHECK(format->per_token_keys);
    CHECK(format->int4_from_int8);
    CHECK(format->value_group == 128);
    CHECK(make_policy({{"value_group", 64}}, 0, 4)->tier_format()->value_group == 64);
}

TEST_CASE("ranking: every descent of (key, slot) pairs marked, eight, four and one at a time") {
    // Every length up to 150 (three words of bits), so each element is met by each path the build
    // holds (the first seven one at a time, AVX-512's eights, AVX2's fours, the scalar tail); keys
    // from a small range, so ties are common and the slots decide; slots distinct. The words are
    // filled with ones first: marking must clear what it does not set.
    std::mt19937 rng(23);
    int descents_found = 0;
    for (int trial = 0; trial < 600; ++trial) {
        const std::size_t n = 1 + rng() % 150;
        std::vector<uint64_t> key(n);
        std::vector<uint32_t> slot(n);
        for (std::size_t i = 0; i < n; ++i) slot[i] = static_cast<uint32_t>(i);
        std::shuffle(slot.begin(), slot.end(), rng);
        // Keys near the top of the range too: an unsigned order a signed compare would get wrong.
        const uint64_t base = trial % 2 ? (uint64_t{1} << 63) - 2 : 5;
        for (auto& k : key) k = base + rng() % 4;
        std::vector<std::size_t> order(n);
        std::iota(order.begin(), order.end(), std::size_t{0});
        if (trial % 3 == 0) {  // sorted but for a few swaps: descents far apart
            std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
                return key[a] != key[b] ? key[a] < key[b] : slot[a] < slot[b];
            });
            for (int swaps = 0; swaps < 2 && n > 1; ++swaps) std::swap(order[rng() % n], order[rng() % n]);
        }
        std::vector<uint64_t> k(n);
        std::vector<uint32_t> s(n);
        for (std::size_t i = 0; i < n; ++i) k[i] = key[order[i]], s[i] = slot[order[i]];
        const std::size_t words = (n + 63) / 64;
        std::vector<uint64_t> marked(words + 1, ~uint64_t{0});  // one word past the end: left alone
        mark_descents(k.data(), s.data(), n, marked.data());
        INFO("trial " << trial << ", n " << n);
        REQUIRE(marked[words] == ~uint64_t{0});
        for (std::size_t j = 0; j < 64 * words; ++j) {
            const bool expected = j >= 1 && j < n && (k[j] < k[j - 1] || (k[j] == k[j - 1] && s[j] < s[j - 1]));
            INFO("position " << j);
            REQUIRE(((marked[j / 64] >> (j % 64)) & 1) == uint64_t{expected});
            descents_found += expected ? 1 : 0;
        }
    }
    CHECK(descents_found > 5000);
}

TEST_CASE("ranking: weights added to the scores in their keys, eight at a time as one at a time") {
    // add_weights_to_keys against its definition written out for each key, bit for bit: every
    // length up to 41 (the vector loop's eights and the scalar tail), scores and weights that
    // include +0, -0, infinities, NaNs (with payloads), subnormals, negatives and sums that round.
    std::mt19937 rng(29);
    const double special_scores[] = {0.0, -0.0, INFINITY, -INFINITY, std::nan("7"), 5e-320, -3.5, 1e300, 0.1};
    const float special_weights[] = {0.0f, -0.0f, INFINITY, -INFINITY, std::nanf("3"), 1e-45f, -0.25f, 3e38f};
    std::uniform_real_distribution<double> uniform(0.0, 2.0);
    int nans = 0, changed = 0;
    for (int trial = 0; trial < 400; ++trial) {
        const std::size_t n = static_cast<std::size_t>(trial % 42);
        std::vector<uint64_t> key(n);
        std::vector<uint32_t> slot(n);
        std::vector<float> weight(n + 3);
        for (std::size_t i = 0; i < n; ++i) {
            const double score = rng() % 4 == 0 ? special_scores[rng() % 9] : uniform(rng);
            key[i] = ~ascending_key(score);
            slot[i] = static_cast<uint32_t>(i + rng() % 4);  // any slot within the weights
        }
        for (float& w : weight)
            w = rng() % 4 == 0 ? special_weights[rng() % 8] : static_cast<float>(uniform(rng) * 1e-3);
        std::vector<uint64_t> expected(n);
        for (std::size_t i = 0; i < n; ++i)
            expected[i] = ~ascending_key(from_ascending_key(~key[i]) + static_cast<double>(weight[slot[i]]));
        std::vector<uint64_t> got = key;
        add_weights_to_keys(got.data(), slot.data(), weight.data(), n);
        INFO("trial " << trial << ", n " << n);
        for (std::size_t i = 0; i < n; ++i) {
            INFO("key " << i);
            REQUIRE(got[i] == expected[i]);
            nans += expected[i] == ~uint64_t{0} ? 1 : 0;
            changed += expected[i] != key[i] ? 1 : 0;
        }
    }
    CHECK(nans > 100);      // not vacuous: NaNs met and made
    CHECK(changed > 4000);  // and most keys moved
}

TEST_CASE("stratigraphic: fewer weights than held tokens leave the rest as a weight of zero would") {
    // Policy::on_decode_step may be given weights for the first held slots only. The importance is
    // a sum from +0, so adding +0 leaves it as it was: a policy given zeros for the rest must keep,
    // sink and evict exactly as one given the short list (the short list alone, so a read past it
    // is a read past its vector).
    const ParamValues p = params_with({});
    auto short_fed = descriptor().make(p, PolicyContext{400, 1001, 1, 4});
    auto zero_fed = descriptor().make(p, PolicyContext{400, 1001, 1, 4});
    std::mt19937 rng(31);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    std::vector<int32_t> held{0};
    int shortened = 0;
    for (int32_t t = 1; t <= 1000; ++t) {
        const std::size_t n = held.size(), given = n > 5 && t % 3 ? n - 1 - rng() % 5 : n;
        std::vector<float> padded(n, 0.0f);
        for (std::size_t i = 0; i < given; ++i) padded[i] = uniform(rng) * (held[i] % 7 == 0 ? 3.0f : 0.1f);
        const std::vector<float> shorter(padded.begin(), padded.begin() + static_cast<std::ptrdiff_t>(given));
        shortened += given < n ? 1 : 0;
        short_fed->on_decode_step(t, shorter);
        zero_fed->on_decode_step(t, padded);
        std::vector<int32_t> victims_short, victims_zero;
        short_fed->evict(400, victims_short);
        zero_fed->evict(400, victims_zero);
        REQUIRE(victims_short == victims_zero);
        held.push_back(t);
        std::vector<int32_t> kept;
        std::set_difference(held.begin(), held.end(), victims_short.begin(), victims_short.end(), std::back_inserter(kept));
        held = kept;
        std::vector<uint8_t> key_short(1001, 0), value_short(1001, 0), key_zero(1001, 0), value_zero(1001, 0);
        short_fed->assign_tiers(t, held, key_short, value_short);
        zero_fed->assign_tiers(t, held, key_zero, value_zero);
        REQUIRE(key_short == key_zero);
        REQUIRE(value_short == value_zero);
    }
    CHECK(shortened > 500);
    CHECK(held.size() < 1000);  // not vacuous: tokens were evicted
}
