// A mixed cache (policies/mixed.h): each (layer, KV head) runs its own method, and must hold and err
// exactly as that method's own policy does at that head, which is what lets `fit: mixed` add the
// heads' errors and bytes.
#include <doctest/doctest.h>

#include <fstream>

#include "helpers.h"
#include "policies/mixed.h"
#include "sim/synthetic_qkv.h"

using namespace kvsim;
using namespace kvsim::test;

TEST_CASE("mixed: every head holds and errs exactly as its own method's policy there") {
    auto source = make_synthetic_qkv_source(synthetic_qkv_trace("tiny-256", "test"), 0);
    const int L = source->shape().num_layers, K = source->shape().num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    REQUIRE(units >= 4);
    MixedPlan plan = mixed_plan_frame(L, K);
    std::vector<int> budgets;  // the eviction heads' budgets, and 64 for every other head
    for (std::size_t u = 0; u < units; ++u) {
        const auto m = static_cast<HeadMethod>(u % kHeadMethods);
        plan.method.push_back(m);
        plan.budgets.push_back(m == HeadMethod::evict ? 24 + 8 * static_cast<int>(u) : 0);
        budgets.push_back(m == HeadMethod::evict ? plan.budgets.back() : 64);
        plan.fp16.push_back(m == HeadMethod::tiers ? 0.1 : 0);
        plan.int8.push_back(m == HeadMethod::tiers ? 0.3 : 0);
        plan.int4.push_back(m == HeadMethod::tiers ? 0.2 : 0);
        plan.lambda.push_back(m == HeadMethod::streaming ? 0.5 : 0);
        plan.stateless.push_back(0);
    }
    const std::string path = temp_dir() + "/mixed-plan.json";
    std::ofstream(path) << nlohmann::ordered_json{{"mixed", mixed_plan_json(plan)}}.dump();
    // The plan reads back as written.
    const MixedPlan read = load_mixed_plan(path, L, K);
    CHECK(read.method == plan.method);
    CHECK(read.budgets == plan.budgets);
    CHECK(read.fp16 == plan.fp16);
    CHECK(read.lambda == plan.lambda);

    PolicyEntry mixed = entry("mixed");
    mixed.files = {{"profile", path}};
    PolicyEntry h2o = entry("h2o", {{"recent_window", 8}});
    std::vector<int> layer_budgets(static_cast<std::size_t>(L), 64);
    h2o.profile_budgets = {profile_budget_column("plan", "test", layer_budgets, budgets)};
    const std::vector<PolicyEntry> policies = {
        mixed, h2o,
        entry("stratigraphic", {{"recent", 16}, {"surface", 0.1}, {"slope", 0}, {"int8_share", 0.3}, {"int4_share", 0.2}}),
        entry("streaming_attention", {{"sinks", 4}, {"recent", 16}, {"lambda", 0.5}}), entry("full")};
    ReplayOptions options;
    options.output_error = options.memory = true;
    const std::vector<ComboResult> r = replay(*source, expand_sweep(policies, {}, std::vector<int>{64}), options);
    REQUIRE(r.size() == 5);
    for (std::size_t u = 0; u < units; ++u) {
        const StreamMetrics& own = r[1 + u % kHeadMethods].by_head[u];  // h2o, stratigraphic, streaming, full
        const StreamMetrics& head = r[0].by_head[u];
        INFO("head " << u << " (" << head_method_name(plan.method[u]) << ")");
        CHECK(head.output_rel_error == own.output_rel_error);
        CHECK(head.cache_bytes == own.cache_bytes);
        CHECK(head.retained_mass == own.retained_mass);
        CHECK(head.context_tokens == own.context_tokens);
    }
    CHECK(r[0].by_head[0].output_rel_error > 0);  // the evicting head lost something to compare
}

TEST_CASE("mixed: a plan names the file and the key of what is wrong") {
    const std::string path = temp_dir() + "/mixed-bad.json";
    std::ofstream(path) << R"({"mixed": {"method": [["evict", "full"]],
        "evict": {"policy": "h2o", "params": {"recent_window": 8}, "budgets": [[0, 0]]}}})";
    try {
        (void)load_mixed_plan(path, 1, 2);
        FAIL("a budget of 0 for an evicting head was taken");
    } catch (const InputError& e) {
        CHECK(contains(e.what(), path + ": mixed.evict.budgets[0][0]: an evicting head needs a budget of at least 1"));
    }
    std::ofstream(path) << R"({"mixed": {"method": [["full", "tiers"]]}})";
    try {
        (void)load_mixed_plan(path, 1, 2);
        FAIL("a tier head without tiers was taken");
    } catch (const InputError& e) {
        CHECK(contains(e.what(), path + ": mixed.tiers: missing"));
    }
}
