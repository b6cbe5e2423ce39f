// Shared by the unit tests: replay the policybook trace through a list of policies.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "policies/mixed.h"
#include "sim/replay.h"
#include "sim/sweep.h"
#include "src/report.h"

namespace kvsim::test {

struct Row {
    std::string label;
    int budget;
    double retained_mass;
    double recall;
    int64_t eviction_calls;
    std::size_t bytes_per_slot;
};

inline std::vector<Row> replay_rows(AttentionSource& source, const std::vector<PolicyEntry>& policies,
                                    const std::vector<int>& budgets, const std::vector<GridAxis>& grid = {}) {
    const auto combos = expand_sweep(policies, grid, budgets);
    const auto results = replay(source, combos, ReplayOptions{});
    std::vector<Row> rows;
    for (std::size_t i = 0; i < combos.size(); ++i) {
        const StreamMetrics& m = results[i].total;
        rows.push_back({combos[i].label, combos[i].budget, round6(m.retained_mass / m.steps),
                        round6(static_cast<double>(m.heavy_hitter_hits) / m.heavy_hitter_possible), m.eviction_calls,
                        results[i].policy_bytes_per_slot});
    }
    return rows;
}

inline std::vector<Row> policybook_rows(const std::vector<PolicyEntry>& policies, const std::vector<int>& budgets,
                                        int64_t max_steps = 0) {
    auto source = make_policybook_source(PolicybookTraceSpec{}, max_steps);
    return replay_rows(*source, policies, budgets);
}

inline const Row& find_row(const std::vector<Row>& rows, const std::string& label, int budget) {
    for (const Row& r : rows)
        if (r.label == label && r.budget == budget) return r;
    throw std::runtime_error("no row " + label + " @" + std::to_string(budget));
}

inline PolicyEntry entry(const std::string& name, std::map<std::string, double> params = {}) {
    PolicyEntry e;  // the other fields keep their defaults
    e.name = name;
    e.params = std::move(params);
    e.where = "test: " + name;
    return e;
}

// The frame of the tests' mixed plans: H2O (recent window 8) for evicting heads, stratigraphic
// (recent 16) for tier heads, streaming heads with 4 sinks and 16 recent; the caller fills each
// head's method and level.
inline MixedPlan mixed_plan_frame(int num_layers, int num_kv_heads) {
    MixedPlan plan;
    plan.num_layers = num_layers, plan.num_kv_heads = num_kv_heads;
    plan.evict_policy = "h2o";
    plan.evict_params = resolve_params(*find_policy("h2o"), {{"recent_window", 8}}, "test");
    plan.tier_params = resolve_params(*find_policy("stratigraphic"), {{"recent", 16}}, "test");
    plan.sinks = 4, plan.recent = 16;
    return plan;
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

inline std::string temp_dir() {
    const std::string dir = KVSIM_TEST_TMP;
    std::filesystem::create_directories(dir);
    return dir;
}

}  // namespace kvsim::test
