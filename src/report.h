// Results as a paper-style table (policy rows, budget columns), CSV and JSON records.
#pragma once
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "policies/policy.h"
#include "sim/experiment_spec.h"

namespace kvsim {

struct ResultRecord {
    std::string policy;  // registry name
    std::string label;   // table row: name plus the parameters the user set
    ParamValues params;  // every parameter, defaults included
    int budget = 0;                  // tokens per (layer, KV head); a profile's mean
    std::string budget_label;        // table column: "256" or a profile's name
    std::vector<int> layer_budgets;  // a profile's per-layer budgets
    int layer = -1;      // -1: over all layers
    int64_t steps = 0;
    double retained_mass = 0;
    double heavy_hitter_recall = 0;
    int64_t eviction_calls = 0;
    std::size_t policy_bytes_per_slot = 0;
    double output_rel_error = NAN;   // Q/K/V traces: mean relative L2 error of the attention output
    double output_cosine = NAN;      // ... and its mean cosine similarity with the full cache's
    double bytes_per_token = NAN;    // bytes held per token of context per (layer, KV head), K and V
    double compression_ratio = NAN;  // a full fp16 cache's bytes over these
    double ppl = NAN;        // kvsim eval: perplexity with the policy in the loop
    double delta_ppl = NAN;  // kvsim eval: ppl minus the full cache's
};

// round6 as the reference harness defines it: floor(x * 1e6 + 0.5) / 1e6.
double round6(double x);

// One table per metric; rows and columns in first-seen order. Whole-trace records only.
std::string format_table(const std::vector<ResultRecord>& records, const std::vector<std::string>& metrics,
                         const std::string& title);
// One row per configuration (policy at a budget), one column per metric, rows ordered by the
// bytes their caches hold per token: configurations compared at equal memory, not equal tokens.
std::string format_comparison(const std::vector<ResultRecord>& records, const std::vector<std::string>& metrics,
                              const std::string& title);
std::string format_csv(const std::vector<ResultRecord>& records);
// A number in 17 significant digits, which read back exactly; "null" where it is not finite.
std::string exact_number(double x);

std::string format_json(const std::vector<ResultRecord>& records, const std::string& trace);
// JSON text (compact for indent -1) with invalid UTF-8 replaced and non-finite numbers as null.
std::string to_json_text(const nlohmann::ordered_json& value, int indent = -1);

}  // namespace kvsim
