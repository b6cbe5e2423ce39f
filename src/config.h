// The declarative experiment config (YAML), parsed and checked up front: every mistake is one
// InputError naming the file, the line and the key.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "base/yaml_file.h"
#include "search/search_spec.h"
#include "sim/experiment_spec.h"

namespace kvsim {

struct TraceRef {
    std::string path;       // a trace file, resolved against the config file's folder; or
    std::string synthetic;  // a generator ("policybook" or "qkv") and
    std::string name;       // its trace name ("decode-4096", "llama-1b-4096")
    int64_t max_steps = 0;  // 0: every step
    std::vector<int> sequences;  // a trace file's sequences to replay (indices); empty: all
    std::string where;
};

inline const std::vector<std::string>& known_metrics() {
    static const std::vector<std::string> metrics = {"retained_mass", "heavy_hitter_recall", "eviction_calls",
                                                     "policy_bytes_per_slot", "ppl", "delta_ppl",
                                                     "output_rel_error", "output_cosine", "bytes_per_token",
                                                     "compression_ratio"};
    return metrics;
}

struct ExperimentConfig {
    std::string file;
    TraceRef trace;
    std::vector<int> budgets;
    std::vector<double> compression_budgets;          // budgets: ["2x"]: sized per sequence to that ratio
    std::vector<BudgetColumn> layer_budget_profiles;  // from layer_budgets:
    std::string attention_view;  // "raw", "renormalized", or "" for the trace kind's default
    std::string group_reduce = "mean";
    int prefill_tokens = 0;
    std::vector<PolicyEntry> policies;
    std::vector<std::string> metrics;  // tables printed; empty: table_metrics() chooses them
    int heavy_hitter_k = 32;
    std::vector<GridAxis> grid;
    std::string output_dir;  // relative to the current directory; default results/<config name>
    std::string output_format = "table";
    std::string output_layout = "matrix";  // matrix: policy rows x budget columns; comparison: by memory
    bool per_layer = false;
    bool per_sequence = false;  // records per sequence besides the pooled ones
    std::optional<SearchSpec> search;  // the `search:` section, for kvsim search
};

ExperimentConfig load_config(const std::string& path);

// Whether a policy entry changes the values its cache holds (quantised or tiered K and V, a
// streaming head's linear state), not only which tokens: retained mass and recall cannot see
// what such a policy loses.
bool changes_values(const PolicyEntry& entry);

// The metrics whose tables are printed: the config's, or where it names none, what fits its
// policies. With a policy that changes values and a trace (or model) that holds them, output
// error and compression ratio; otherwise retained mass and heavy-hitter recall.
std::vector<std::string> table_metrics(const ExperimentConfig& config, bool values_known);

// Every budget column of a config: its scalar budgets, then its per-layer profiles.
std::vector<BudgetColumn> budget_columns(const ExperimentConfig& config);

// Reads a per-layer budget profile file (YAML with `layer_budgets: [..]`, optional `name:`).
BudgetColumn load_budget_profile(const std::string& path);

// "--budgets 64,128,256"
std::vector<int> parse_budget_list(const std::string& text, const std::string& where);
// "--set h2o.recent_window=16,32,64"
GridAxis parse_grid_flag(const std::string& text, const std::string& where);

}  // namespace kvsim
