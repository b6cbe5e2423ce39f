// The seven eviction policies on decode-4096: the published figures of the attention-free
// policies, the findings the reference publishes about the others, and the harness contract.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <cstring>
#include <limits>

#include "helpers.h"
#include "policies/pyramidkv.h"
#include "policies/snapkv.h"
#include "policies/scored_eviction.h"
#include "base/errors.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {
const std::vector<int> kBudgets = {256, 512, 1024};

// The reference for SlotArray::erase: the entries at `slots` (ascending) erased one by one, last first.
template <class T>
void erase_slots(std::vector<T>& column, std::span<const std::size_t> slots) {
    for (auto slot = slots.rbegin(); slot != slots.rend(); ++slot)
        column.erase(column.begin() + static_cast<std::ptrdiff_t>(*slot));
}

const std::vector<Row>& all_policies() {
    static const std::vector<Row> rows = policybook_rows(
        {entry("sliding_window"), entry("streaming_llm"), entry("h2o"), entry("scissorhands"), entry("tova"),
         entry("snapkv"), entry("pyramidkv")},
        kBudgets);
    return rows;
}
}  // namespace

TEST_CASE("sliding window and StreamingLLM reproduce the published figures to 6 decimals") {
    struct Published {
        const char* label;
        int budget;
        double mass, recall;
    };
    // policybook-kvcache.md section 5 (the reference harness's published table).
    const Published published[] = {
        {"sliding_window", 256, 0.596637, 0.742171}, {"sliding_window", 512, 0.655518, 0.774107},
        {"sliding_window", 1024, 0.754149, 0.833734}, {"streaming_llm", 256, 0.736691, 0.859419},
        {"streaming_llm", 512, 0.786153, 0.883480},  {"streaming_llm", 1024, 0.866203, 0.927572},
    };
    for (const Published& p : published) {
        const Row& row = find_row(all_policies(), p.label, p.budget);
        INFO(std::string(p.label) << " @" << p.budget);
        CHECK(row.retained_mass == p.mass);
        CHECK(row.recall == p.recall);
    }
}

TEST_CASE("every policy makes 4096 - budget eviction calls") {
    for (const Row& row : all_policies()) {
        INFO(row.label << " @" << row.budget);
        CHECK(row.eviction_calls == 4096 - row.budget);
    }
}

TEST_CASE("published findings on the attention-reading policies") {
    const auto& rows = all_policies();
    auto mass = [&](const char* p, int b) { return find_row(rows, p, b).retained_mass; };
    auto recall = [&](const char* p, int b) { return find_row(rows, p, b).recall; };
    const char* names[] = {"sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "snapkv", "pyramidkv"};
    auto leader = [&](auto metric, int b) {
        std::string best;
        double best_value = -1;
        for (const char* n : names)
            if (metric(n, b) > best_value) {
                best_value = metric(n, b);
                best = n;
            }
        return best;
    };
    // At 256 the metrics agree: SnapKV leads both (tied with PyramidKV, identical on one layer).
    CHECK(leader(mass, 256) == "snapkv");
    CHECK(leader(recall, 256) == "snapkv");
    // At 512 TOVA leads mass and H2O leads recall; at 1024 SnapKV leads mass and H2O ties Scissorhands on recall.
    CHECK(leader(mass, 512) == "tova");
    CHECK(leader(recall, 512) == "h2o");
    CHECK(leader(mass, 1024) == "snapkv");
    CHECK(recall("h2o", 1024) == recall("scissorhands", 1024));
    CHECK(recall("h2o", 1024) >= recall("snapkv", 1024));
    // A recent window of 32 inside a 64-wide local band makes H2O trail StreamingLLM.
    for (int b : kBudgets) CHECK(mass("h2o", b) < mass("streaming_llm", b));
    // H2O and Scissorhands stay within 0.01: heavy hitters persist a whole 512-step epoch.
    for (int b : kBudgets) CHECK(std::abs(mass("h2o", b) - mass("scissorhands", b)) < 0.01);
    // One layer: PyramidKV's share is the whole budget, so it is SnapKV.
    for (int b : kBudgets) {
        CHECK(mass("pyramidkv", b) == mass("snapkv", b));
        CHECK(recall("pyramidkv", b) == recall("snapkv", b));
    }
}

TEST_CASE("H2O with a recent window as wide as the local band beats StreamingLLM on both metrics") {
    const auto rows = policybook_rows({entry("h2o", {{"recent_window", 64}}), entry("streaming_llm")}, kBudgets);
    for (int b : kBudgets) {
        INFO("budget " << b);
        CHECK(find_row(rows, "h2o(recent_window=64)", b).retained_mass > find_row(rows, "streaming_llm", b).retained_mass);
        CHECK(find_row(rows, "h2o(recent_window=64)", b).recall > find_row(rows, "streaming_llm", b).recall);
    }
}

TEST_CASE("SnapKV: the observation window does not matter on this trace, pooling is the whole difference from TOVA") {
    const auto rows = policybook_rows({entry("snapkv", {{"obs_window", 1}}), entry("snapkv", {{"obs_window", 4}}),
                                       entry("snapkv"), entry("snapkv", {{"obs_window", 64}}),
                                       entry("snapkv", {{"pool_kernel", 1}}), entry("tova")},
                                      kBudgets);
    for (int b : kBudgets) {
        INFO("budget " << b);
        const Row& base = find_row(rows, "snapkv", b);
        for (const char* label : {"snapkv(obs_window=1)", "snapkv(obs_window=4)", "snapkv(obs_window=64)"}) {
            CHECK(find_row(rows, label, b).retained_mass == base.retained_mass);
            CHECK(find_row(rows, label, b).recall == base.recall);
        }
        CHECK(find_row(rows, "snapkv(pool_kernel=1)", b).retained_mass == find_row(rows, "tova", b).retained_mass);
        CHECK(find_row(rows, "snapkv(pool_kernel=1)", b).recall == find_row(rows, "tova", b).recall);
    }
    // Pooling helps at 256 and 1024 and hurts at 512 (retained mass).
    CHECK(find_row(rows, "snapkv", 256).retained_mass > find_row(rows, "tova", 256).retained_mass);
    CHECK(find_row(rows, "snapkv", 512).retained_mass < find_row(rows, "tova", 512).retained_mass);
    CHECK(find_row(rows, "snapkv", 1024).retained_mass > find_row(rows, "tova", 1024).retained_mass);
}

TEST_CASE("bookkeeping bytes per slot: a 4-byte position plus each policy's own state") {
    // The reference's C port reports 4, 4, 9, 13, 13 and 81: it also keeps a one-byte selection
    // flag per slot, which kvsim replaces by a list of the (usually one) chosen slots.
    const auto& rows = all_policies();
    CHECK(find_row(rows, "sliding_window", 512).bytes_per_slot == 4);
    CHECK(find_row(rows, "streaming_llm", 512).bytes_per_slot == 4);
    CHECK(find_row(rows, "scissorhands", 512).bytes_per_slot == 8);  // int32 votes
    CHECK(find_row(rows, "h2o", 512).bytes_per_slot == 12);          // f64 accumulated attention
    CHECK(find_row(rows, "tova", 512).bytes_per_slot == 12);         // f64 last attention
    // SnapKV: a 16-step f32 window, its f64 sum and the f64 pooled score: 4+64+8+8.
    CHECK(find_row(rows, "snapkv", 512).bytes_per_slot == 84);
}

TEST_CASE("pyramid budget: the reference's worked example and its mean") {
    CHECK(pyramid_budget(512, 0, 32, 4) == 819);
    CHECK(pyramid_budget(512, 31, 32, 4) == 204);
    CHECK(pyramid_budget(512, 0, 1, 4) == 512);
    int64_t total = 0;
    for (int layer = 0; layer < 32; ++layer) total += pyramid_budget(512, layer, 32, 4);
    CHECK(total <= 512 * 32);
    CHECK(total > 512 * 32 - 32);  // floors lose less than one token per layer
}

TEST_CASE("first_equal finds what std::find finds: ties, NaN, -0 and every length around a vector") {
    std::vector<double> doubles;
    std::vector<float> floats;
    std::vector<int32_t> ints;
    for (int n = 0; n <= 40; ++n) {
        doubles.resize(n);
        floats.resize(n);
        ints.resize(n);
        for (int i = 0; i < n; ++i) {
            const int v = (i * 7 + n) % 5;
            doubles[i] = v == 4 ? std::numeric_limits<double>::quiet_NaN() : v == 3 ? -0.0 : v;
            floats[i] = static_cast<float>(doubles[i]);
            ints[i] = v;
        }
        for (double wanted : {0.0, -0.0, 1.0, 2.0, 7.0, std::numeric_limits<double>::quiet_NaN()}) {
            CAPTURE(n);
            CAPTURE(wanted);
            CHECK(first_equal(doubles.data(), doubles.size(), wanted) ==
                  static_cast<std::size_t>(std::find(doubles.begin(), doubles.end(), wanted) - doubles.begin()));
            const float f = static_cast<float>(wanted);
            CHECK(first_equal(floats.data(), floats.size(), f) ==
                  static_cast<std::size_t>(std::find(floats.begin(), floats.end(), f) - floats.begin()));
        }
        for (int32_t wanted : {0, 1, 2, 4, 9})
            CHECK(first_equal(ints.data(), ints.size(), wanted) ==
                  static_cast<std::size_t>(std::find(ints.begin(), ints.end(), wanted) - ints.begin()));
    }
}

TEST_CASE("SlotArray keeps what a vector with erase_slots keeps: either side moved, its start moved back") {
    // Random admissions and evictions (single slots anywhere, and batches) on a SlotArray and on a
    // vector side by side; a small reserve makes the start move back to the front, and grow, often.
    // Capacity 0: no reserve at all (the first admission finds no storage).
    std::mt19937 rng(9);
    for (std::size_t capacity : {0u, 1u, 3u, 8u, 50u}) {
        SlotArray<int32_t> slots;
        if (capacity > 0) slots.reserve(capacity);
        std::vector<int32_t> expected;
        int32_t next = 0;
        for (int step = 0; step < 3000; ++step) {
            slots.push_back(next);
            expected.push_back(next++);
            std::vector<std::size_t> victims;
            if (expected.size() > std::max<std::size_t>(capacity, 20) || rng() % 3 == 0) {
                const std::size_t count = rng() % 4 == 0 ? 1 + rng() % expected.size() : 1;
                for (std::size_t i = 0; i < expected.size(); ++i)
                    if (victims.size() < count && rng() % expected.size() < count) victims.push_back(i);
            }
            slots.erase(victims);
            erase_slots(expected, victims);
            REQUIRE(slots.size() == expected.size());
            REQUIRE(std::equal(slots.begin(), slots.end(), expected.begin()));
        }
    }
}

TEST_CASE("lowest_score is the least score, or NaN where there is one: every length, NaN anywhere") {
    // Against a plain loop, for lengths around the four-vector steps and NaN in every place:
    // a NaN in one chain, or in the tail, must not be lost.
    std::mt19937 rng(5);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    for (std::size_t n = 1; n <= 80; ++n) {
        std::vector<double> x(n);
        for (int trial = 0; trial < 4; ++trial) {
            for (double& v : x) v = trial == 3 ? inf : u(rng);
            double expected = x[0];
            for (double v : x) expected = std::min(expected, v);
            CAPTURE(n);
            CHECK(lowest_score(x.data(), n) == expected);
        }
        x.assign(n, 0.0);
        x[n - 1] = -0.0;
        CHECK(lowest_score(x.data(), n) == 0.0);  // either zero: == does not tell them apart
        for (std::size_t at = 0; at < n; ++at) {
            for (double& v : x) v = u(rng);
            x[at] = nan;
            CAPTURE(n);
            CAPTURE(at);
            CHECK(std::isnan(lowest_score(x.data(), n)));
        }
    }
    const std::vector<int32_t> votes = {4, 2, 9, 2, 7};
    CHECK(lowest_score(votes.data(), votes.size()) == 2);
}

namespace {
// Scores set by the test; observe/admit keep one score per slot.
template <class Score>
class FixedScores : public ScoredEviction<Score> {
public:
    FixedScores(int capacity, int recent_window) : ScoredEviction<Score>(capacity, recent_window) { score_.push_back(0); }
    std::vector<Score> score_;

protected:
    void observe(std::span<const float>) override {}
    void admit() override { score_.push_back(0); }
    std::span<const Score> scores() override { return score_; }
    void drop_state(std::span<const std::size_t> evicted) override { erase_slots(score_, evicted); }
    std::size_t state_bytes_per_slot() const override { return sizeof(Score); }
};

// The reference's rule, literally: `needed` times, the first evictable slot lowest in the
// eviction order among those not yet taken; never a kNotEvictable one.
template <class Score>
std::vector<std::size_t> lowest_one_at_a_time(const std::vector<Score>& score, std::size_t evictable_end,
                                              std::size_t needed) {
    std::vector<std::size_t> taken;
    for (std::size_t round = 0; round < needed; ++round) {
        std::size_t best = evictable_end;
        Score best_score = kNotEvictable<Score>;
        for (std::size_t i = 0; i < evictable_end; ++i)
            if (evicted_before(score[i], best_score) && std::find(taken.begin(), taken.end(), i) == taken.end()) {
                best = i;
                best_score = score[i];
            }
        if (best == evictable_end) break;
        taken.push_back(best);
    }
    std::sort(taken.begin(), taken.end());
    return taken;
}

template <class Score>
void check_many_victims(Score nan_or_zero) {
    uint64_t state = 12345;
    auto next = [&] { return (state = state * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
    for (int trial = 0; trial < 300; ++trial) {
        const int size = 1 + static_cast<int>(next() % 60), window = static_cast<int>(next() % 5);
        FixedScores<Score> policy(size + 1, window);
        for (int p = 1; p < size; ++p) policy.on_decode_step(p, {});
        for (auto& s : policy.score_) {  // few distinct values: many ties
            const int v = static_cast<int>(next() % 9);
            s = v == 0 ? nan_or_zero : v == 1 ? kNotEvictable<Score> : v == 2 ? static_cast<Score>(-0.0) : static_cast<Score>(v % 4);
        }
        const std::vector<Score> scores = policy.score_;
        const int keep = static_cast<int>(next() % static_cast<uint64_t>(size));
        const std::size_t evictable_end = static_cast<std::size_t>(size - std::min(window, size));
        const std::vector<std::size_t> expected =
            lowest_one_at_a_time(scores, evictable_end, static_cast<std::size_t>(size - keep));
        std::vector<int32_t> victims;
        policy.evict_to(keep, victims);
        CAPTURE(trial);
        std::string dump;
        for (Score x : scores) dump += std::to_string(x) + " ";
        CAPTURE(dump);
        CAPTURE(window);
        CAPTURE(keep);
        REQUIRE(victims.size() == expected.size());
        for (std::size_t i = 0; i < victims.size(); ++i) CHECK(victims[i] == static_cast<int32_t>(expected[i]));
    }
}
}  // namespace

TEST_CASE("evicting many slots at once takes what taking the lowest one at a time takes: ties, NaN, -0, protected") {
    check_many_victims<double>(std::numeric_limits<double>::quiet_NaN());
    check_many_victims<int32_t>(0);
}

namespace {
// SnapKV's scores as the reference computes them, every step from scratch: the window's columns
// summed per slot in ring order, then max-pooled over neighbouring slots.
struct PlainSnapKV {
    int radius;
    std::vector<std::vector<float>> window;
    int write = 0;
    PlainSnapKV(int obs_window, int pool_kernel) : radius((pool_kernel - 1) / 2), window(obs_window, std::vector<float>(1, 0.0f)) {}
    void step(std::span<const float> attn) {
        for (std::size_t i = 0; i < attn.size(); ++i) window[write][i] = attn[i];
        write = (write + 1) % static_cast<int>(window.size());
        for (auto& c : window) c.push_back(0.0f);
    }
    void erase(std::span<const std::size_t> slots) {
        for (auto& c : window) erase_slots(c, slots);
    }
    std::vector<double> scores() const {
        const std::size_t n = window[0].size();
        std::vector<double> sums(n), pooled(n);
        for (std::size_t i = 0; i < n; ++i) {
            double s = 0.0 + static_cast<double>(window[0][i]);
            for (std::size_t k = 1; k < window.size(); ++k) s += window[k][i];
            sums[i] = s;
        }
        for (std::size_t i = 0; i < n; ++i) {
            double best = sums[i];
            for (int d = 1; d <= radius; ++d) {
                if (i >= static_cast<std::size_t>(d)) best = std::max(best, sums[i - d]);
                if (i + d < n) best = std::max(best, sums[i + d]);
            }
            pooled[i] = best;
        }
        return pooled;
    }
};
}  // namespace

TEST_CASE("SnapKV's running window sums give the bits of summing every window in ring order, whatever the weights") {
    // Weights that sum exactly in any order (+0, and from 2^-25 to below 2 for a window of 16)
    // mixed with ones that do not: tiny, denormal, -0, 2 and above, so that slots go in and out of
    // the running sums as their windows turn over. A running sum kept where it is not exact
    // changes the scores' bits within a few steps.
    // With recent slots favoured, the victims are old slots as well as new ones, so that a batch
    // of victims falls among (and past) those evicted before it. With summable weights only, no
    // slot's window is ever summed in ring order: the running sums alone make the scores, step
    // after step.
    for (int mode : {0, 1, 2})
    for (int obs_window : {1, 3, 16, 40}) {
        const bool favour_recent = mode > 0, summable_only = mode == 2;
        uint64_t state = 99 + static_cast<uint64_t>(obs_window);
        auto next = [&] { return (state = state * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
        auto weight = [&]() -> float {
            const uint64_t kind = next() % 100;
            const float unit = static_cast<float>(next() % 1000000) / 1000000.0f;
            if (summable_only) return 0.001f + unit * 0.01f;
            if (kind < 70) return unit * 0.01f;            // mostly summable
            if (kind < 80) return unit * 1e-9f;             // below 2^-25
            if (kind < 85) return 0.0f;
            if (kind < 88) return -0.0f;
            if (kind < 90) return unit * 1e-40f;            // denormal
            if (kind < 93) return 2.0f + unit;              // 2 and above
            return unit;                                    // up to 1
        };
        const int budget = 24, capacity = 200;
        SnapKV policy(capacity, 2, obs_window, 5);
        PlainSnapKV plain(obs_window, 5);
        std::vector<float> attn;
        std::vector<int32_t> victims;
        std::vector<int32_t> held = {0};
        HeldScores out;
        for (int32_t t = 1; t < 150; ++t) {
            attn.resize(held.size());
            for (std::size_t i = 0; i < attn.size(); ++i)
                attn[i] = weight() * (favour_recent ? static_cast<float>(i + 1) / static_cast<float>(attn.size()) : 1.0f);
            policy.on_decode_step(t, attn);
            plain.step(attn);
            held.push_back(t);
            // Every tenth step several slots go at once.
            const bool several = t % 10 == 0;
            if (held.size() > static_cast<std::size_t>(budget) || several) {
                victims.clear();
                if (several)
                    policy.evict_to(budget - 6, victims);
                else
                    policy.evict(budget, victims);
                std::vector<std::size_t> slots;
                for (int32_t v : victims)
                    slots.push_back(static_cast<std::size_t>(std::lower_bound(held.begin(), held.end(), v) - held.begin()));
                plain.erase(slots);
                erase_slots(held, slots);
            }
            REQUIRE(policy.held_scores(out));
            const std::vector<double> expected = plain.scores();
            REQUIRE(out.score.size() == expected.size());
            for (std::size_t i = 0; i < expected.size(); ++i) {
                CAPTURE(mode);
                CAPTURE(obs_window);
                CAPTURE(t);
                CAPTURE(i);
                uint64_t got_bits, want_bits;
                std::memcpy(&got_bits, &out.score[i], 8);
                std::memcpy(&want_bits, &expected[i], 8);
                CHECK(got_bits == want_bits);
            }
        }
    }
}
