// Ada-KV (policies/adakv.cpp): cross-head allocation, its floor, and its replay in step.
#include <doctest/doctest.h>
#include <tbb/global_control.h>

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
