// Ada-KV (policies/adakv.cpp): cross-head allocation, its floor, and its replay in step.
#include <doctest/doctest.h>
#include <tbb/global_control.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include "helpers.h"
#include "base/errors.h"
#include "policies/adakv.h"
#include "sim/synthetic_qkv.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

// Two H2O heads (recent window 2, share 16 each) fed 64 steps: head 0's attention concentrated on
// positions 0-3, head 1's spread evenly; then Ada-KV allocates the layer's 32 slots.
struct TwoHeads {
    std::vector<std::unique_ptr<Policy>> heads;
    std::vector<int> keep;

    explicit TwoHeads(double floor) {
        const PolicyDescriptor& h2o = *find_policy("h2o");
        const ParamValues params = resolve_params(h2o, {{"recent_window", 2}}, "test");
        for (int kv = 0; kv < 2; ++kv) heads.push_back(h2o.make(params, PolicyContext{16, 65, 0, 1, kv, 2, 0}));
        std::vector<float> row;
        for (int32_t t = 1; t <= 64; ++t) {
            for (int kv = 0; kv < 2; ++kv) {
                row.assign(static_cast<std::size_t>(t), 0.0f);
                for (int32_t p = 0; p < t; ++p)
                    row[p] = kv == 0 ? (p < 4 ? 0.24f : 0.04f / t) : 1.0f / static_cast<float>(t);
                HeldScores held;
                heads[kv]->held_scores(held);
                // The policy sees the weights on what it holds, index-aligned.
                std::vector<float> attn;
                for (int32_t p : held.position) attn.push_back(row[p]);
                heads[kv]->on_decode_step(t, attn);
            }
            std::vector<Policy*> pointers = {heads[0].get(), heads[1].get()};
            const std::vector<int> shares = {16, 16};
            AdaKvAllocator(AdaKvRule{floor}).allocate(pointers, shares, keep);
            std::vector<int32_t> victims;
            for (int kv = 0; kv < 2; ++kv) heads[kv]->evict_to(keep[kv], victims);
        }
    }
    int held(int kv) {
        HeldScores held;
        heads[kv]->held_scores(held);
        return static_cast<int>(held.position.size());
    }
};

struct Measured {
    std::vector<double> values;
    bool operator==(const Measured&) const = default;
};

// Every metric of every combination, in total and per (layer, KV head).
Measured replay_qkv(const std::vector<PolicyEntry>& policies, const std::vector<int>& budgets, int threads = 2) {
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
    auto source = make_synthetic_qkv_source(synthetic_qkv_trace("tiny-256", "test"), 0);
    ReplayOptions options;
    options.output_error = options.memory = true;
    options.harness.view = AttentionView::renormalized;
    Measured m;
    for (const ComboResult& r : replay(*source, expand_sweep(policies, {}, budgets), options)) {
        std::vector<StreamMetrics> all = r.by_head;
        all.push_back(r.total);
        for (const StreamMetrics& s : all)
            m.values.insert(m.values.end(), {s.retained_mass, double(s.heavy_hitter_hits), double(s.eviction_calls),
                                             s.output_rel_error, s.output_cosine, s.cache_bytes, double(s.context_tokens)});
    }
    return m;
}

PolicyEntry ada(const std::string& name, std::map<std::string, double> params, double floor) {
    PolicyEntry e = entry(name, std::move(params));
    e.adakv = true;
    e.adakv_params = {{"floor", floor}};
    e.adakv_where = "test: adakv";
    return e;
}

// A head that reports fixed scores: the allocator's input made by hand.
class FixedScores : public Policy {
public:
    explicit FixedScores(HeldScores held) : held_(std::move(held)) {}
    void on_decode_step(int32_t, std::span<const float>) override {}
    void evict(int, std::vector<int32_t>&) override {}
    std::size_t bytes_per_slot() const override { return 0; }
    void assign_tiers(int32_t, std::span<const int32_t>, std::span<uint8_t>, std::span<uint8_t>) override {}
    bool held_scores(HeldScores& out) override {
        out = held_;
        return true;
    }

private:
    HeldScores held_;
};

// What each head keeps by the rules (policies/adakv.cpp), from one full sort per step of the
// rules: protected first, then each head's best up to floor x share, then the layer's best.
std::vector<int> reference_keep(const std::vector<HeldScores>& heads, const std::vector<int>& shares, double floor) {
    struct Token {
        double score;
        int32_t position;
        int head;
    };
    // Kept first: the higher score, a NaN last; ties to the higher position, then the higher head.
    const auto kept_before = [](const Token& a, const Token& b) {
        const bool a_nan = std::isnan(a.score), b_nan = std::isnan(b.score);
        if (a_nan != b_nan) return b_nan;
        if (!a_nan && a.score != b.score) return a.score > b.score;
        return a.position != b.position ? a.position > b.position : a.head > b.head;
    };
    std::vector<int> keep(heads.size(), 0);
    int64_t total = 0, held = 0;
    for (std::size_t h = 0; h < heads.size(); ++h) total += shares[h], held += static_cast<int64_t>(heads[h].position.size());
    if (held <= total) {
        for (std::size_t h = 0; h < heads.size(); ++h) keep[h] = static_cast<int>(heads[h].position.size());
        return keep;
    }
    std::vector<Token> pool;
    int64_t given = 0;
    for (std::size_t h = 0; h < heads.size(); ++h) {
        std::vector<Token> own;
        int protected_count = 0;
        for (std::size_t i = 0; i < heads[h].position.size(); ++i) {
            if (heads[h].protect[i])
                ++protected_count;
            else
                own.push_back({heads[h].score[i], heads[h].position[i], static_cast<int>(h)});
        }
        std::sort(own.begin(), own.end(), kept_before);
        const int floor_tokens = static_cast<int>(std::floor(floor * shares[h]));
        const int guaranteed = std::clamp(floor_tokens - protected_count, 0, static_cast<int>(own.size()));
        keep[h] = protected_count + guaranteed;
        given += keep[h];
        pool.insert(pool.end(), own.begin() + guaranteed, own.end());
    }
    std::sort(pool.begin(), pool.end(), kept_before);
    const int64_t rest = std::clamp<int64_t>(total - given, 0, static_cast<int64_t>(pool.size()));
    for (int64_t i = 0; i < rest; ++i) ++keep[pool[i].head];
    return keep;
}

}  // namespace

TEST_CASE("adakv: a diffuse head gets more slots than a concentrated one, within the layer's total") {
    TwoHeads two(0.2);
    CHECK(two.keep[0] + two.keep[1] == 32);       // the layer's total: the sum of the uniform shares
    CHECK(two.held(0) + two.held(1) == 32);       // and the heads evicted down to it
    CHECK(two.keep[1] > two.keep[0]);             // the diffuse head gets more
    CHECK(two.keep[0] >= 3);                      // each keeps at least floor x share = 3.2 -> 3
    CHECK(two.keep[1] >= 3);
    CHECK(two.held(0) < 16);
    CHECK(two.held(1) > 16);
}

TEST_CASE("adakv: floor 1 keeps every head at its uniform share") {
    TwoHeads two(1.0);
    CHECK(two.keep == std::vector<int>{16, 16});
    CHECK(two.held(0) == 16);
    CHECK(two.held(1) == 16);
}

TEST_CASE("adakv: floor 0 still keeps each head's protected recent window") {
    TwoHeads two(0.0);
    CHECK(two.keep[0] + two.keep[1] == 32);
    CHECK(two.keep[0] >= 2);
    CHECK(two.keep[1] >= 2);
}

TEST_CASE("adakv with floor 1 reproduces the wrapped policy at uniform budgets exactly") {
    for (const auto& policy : std::vector<std::pair<std::string, std::map<std::string, double>>>{
             {"h2o", {{"recent_window", 4}}}, {"tova", {}}, {"scissorhands", {{"recent_window", 4}}},
             {"snapkv", {{"recent_window", 4}, {"obs_window", 4}, {"pool_kernel", 3}}}}) {
        const auto& name = policy.first;  // not a structured binding: clang 14 cannot capture one
        const auto& params = policy.second;
        CAPTURE(name);
        CHECK(replay_qkv({ada(name, params, 1.0)}, {12, 40}) == replay_qkv({entry(name, params)}, {12, 40}));
    }
    // Not a vacuous check: at floor 0.2 the heads' budgets move and the results differ.
    CHECK(!(replay_qkv({ada("h2o", {{"recent_window", 4}}, 0.2)}, {12}) == replay_qkv({entry("h2o", {{"recent_window", 4}})}, {12})));
}

TEST_CASE("adakv: results do not depend on the number of threads, and every head is measured") {
    const std::vector<PolicyEntry> policies = {ada("h2o", {{"recent_window", 4}}, 0.2), entry("h2o", {{"recent_window", 4}}),
                                               ada("snapkv", {{"recent_window", 4}}, 0.5)};
    const Measured one = replay_qkv(policies, {12, 40}, 1);
    CHECK(one == replay_qkv(policies, {12, 40}, 2));
    CHECK(one == replay_qkv(policies, {12, 40}, 4));
    // The same bytes as uniform: per layer the heads hold the sum of their shares.
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 2);
    auto source = make_synthetic_qkv_source(synthetic_qkv_trace("tiny-256", "test"), 0);
    ReplayOptions options;
    options.memory = true;
    const auto results = replay(*source, expand_sweep({ada("h2o", {{"recent_window", 4}}, 0.2), entry("h2o", {{"recent_window", 4}})}, {}, std::vector<int>{12}), options);
    CHECK(results[0].total.context_tokens == results[1].total.context_tokens);
    CHECK(results[0].total.cache_bytes == doctest::Approx(results[1].total.cache_bytes).epsilon(0.002));
    for (const StreamMetrics& head : results[0].by_head) CHECK(head.steps > 0);
}

TEST_CASE("adakv config mistakes name the key") {
    auto message = [](PolicyEntry e) {
        try {
            expand_sweep({e}, {}, std::vector<int>{16});
        } catch (const InputError& error) {
            return std::string(error.what());
        }
        return std::string();
    };
    CHECK(contains(message(ada("h2o", {}, 1.5)), "test: adakv.floor: must be between 0 and 1, got 1.5"));
    CHECK(contains(message(ada("h2o", {}, -0.1)), "test: adakv.floor: must be >= 0"));
    CHECK(contains(message(ada("sliding_window", {}, 0.2)), "adakv selects by a scored eviction policy's scores"));
    CHECK(contains(message(ada("nonesuch", {}, 0.2)), "unknown policy 'nonesuch'"));
    CHECK(contains(message(entry("adakv")), "write {evict: h2o, adakv: {floor: 0.2}}"));
}

TEST_CASE("adakv: each head's count is the rules' by a full sort, with ties, NaN and signed zeros") {
    // Scores from a few values so that ties are common within and across heads; NaN, -0 and +0
    // among them (NaN is kept last, -0 and +0 tie), infinities, a subnormal and numbers of every
    // sign and size (the allocator compares them as integer keys); some tokens protected.
    std::mt19937 rng(7);
    const double values[] = {std::nan(""), -0.0, 0.0, 0.25, 0.5, 0.5, 1.0, -1.0, 3.0, -INFINITY, INFINITY,
                             4.9e-324, -4.9e-324, -1e300, 1e300, -2.5, -0.25};
    int cases = 0, scores_shared_by_heads = 0;
    for (int round = 0; round < 400; ++round) {
        const int head_count = 1 + static_cast<int>(rng() % 8);
        std::vector<HeldScores> scores(static_cast<std::size_t>(head_count));
        std::vector<std::unique_ptr<Policy>> heads;
        std::vector<Policy*> pointers;
        std::vector<int> shares;
        for (HeldScores& held : scores) {
            const int count = static_cast<int>(rng() % 40);
            int32_t position = 0;
            for (int i = 0; i < count; ++i) {
                position += 1 + static_cast<int32_t>(rng() % 3);  // ascending, some heads sharing positions
                held.position.push_back(position);
                held.score.push_back(values[rng() % std::size(values)]);
                held.protect.push_back(rng() % 6 == 0);
            }
            heads.push_back(std::make_unique<FixedScores>(held));
            pointers.push_back(heads.back().get());
            shares.push_back(static_cast<int>(rng() % 24));
        }
        const double floor = (rng() % 5) / 4.0;
        std::vector<int> keep;
        AdaKvAllocator(AdaKvRule{floor}).allocate(pointers, shares, keep);
        const std::vector<int> expected = reference_keep(scores, shares, floor);
        INFO("round " << round << ", " << head_count << " heads, floor " << floor);
        CHECK(keep == expected);
        ++cases;
        // Not vacuous: different heads hold equal scores, which only the order's ties separate.
        std::map<double, std::set<int>> heads_of_score;
        for (int h = 0; h < head_count; ++h)
            for (double v : scores[h].score)
                if (v == v) heads_of_score[v].insert(h);
        for (const auto& [v, hs] : heads_of_score) scores_shared_by_heads += hs.size() > 1;
    }
    CHECK(cases == 400);
    CHECK(scores_shared_by_heads > 400);
}
