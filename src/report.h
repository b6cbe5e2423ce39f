// Results as a paper-style table (policy rows, budget columns), CSV and JSON records.
#pragma once
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "policies/policy.h"
#include "sim/experiment_spec.h"
#include "sim/harness.h"

namespace kvsim {

struct ResultRecord {
    std::string policy;  // registry name
    std::string label;   // table row: name plus the parameters the user set
    ParamValues params;  // every parameter, defaults included
    // Tokens per (layer, KV head); a profile's mean. None for a policy that keeps every token (full,
    // int8, int4, stratigraphic, streaming_attention), or for a compression-ratio column over
    // several sequences, whose budgets differ.
    std::optional<int> budget;
    std::string budget_label;        // table column: "256" or a profile's name
    std::vector<int> layer_budgets;  // a profile's per-layer budgets
    int layer = -1;      // -1: over all layers
    int sequence = -1;   // -1: over all sequences; else its index in the trace (or text)
    std::string sequence_name;
    int64_t steps = 0;
    double retained_mass = 0;
    double heavy_hitter_recall = 0;
    int64_t eviction_calls = 0;
    std::size_t policy_bytes_per_slot = 0;
    double output_rel_error = NAN;   // Q/K/V traces: mean relative L2 error of the attention output
    double output_cosine = NAN;      // ... and its mean cosine similarity with the full cache's
    double bytes_per_token = NAN;    // bytes held per token of context per (layer, KV head), K and V
    double compression_ratio = NAN;  // a full fp16 cache's bytes over these
    double ppl = NAN;        // kvsim eval: perplexity with the policy in the loop (exp(nll); infinite
                             // where that overflows a double)
    double delta_ppl = NAN;  // kvsim eval: ppl minus the full cache's
    double nll = NAN;        // kvsim eval: mean negative log-likelihood per predicted token (nats)
};

// round6 as the reference harness defines it: floor(x * 1e6 + 0.5) / 1e6.
double round6(double x);

// Fills a record's measured figures from summed metrics. Fractions (retained mass, recall) are
// clamped to [0, 1] and mean cosine to [-1, 1] at the end: a softmax row summed in floats can
// exceed 1 by rounding (the full cache's mass came out 1.0000000029), and a figure outside its
// range would read as a bug.
void set_measured(ResultRecord& record, const StreamMetrics& metrics);

// One table per metric; rows and columns in first-seen order. Whole-trace records only, then
// the per-sequence tables where there are per-sequence records.
std::string format_table(const std::vector<ResultRecord>& records, const std::vector<std::string>& metrics,
                         const std::string& title);
// One row per configuration (policy at a budget), one column per metric, rows ordered by the
// bytes their caches hold per token: configurations compared at equal memory, not equal tokens.
// Per-sequence tables follow as in format_table.
std::string format_comparison(const std::vector<ResultRecord>& records, const std::vector<std::string>& metrics,
                              const std::string& title);
// Per metric, one row per configuration and one column per sequence; empty without
// per-sequence records.
std::string format_sequence_tables(const std::vector<ResultRecord>& records, const std::vector<std::string>& metrics);
std::string format_csv(const std::vector<ResultRecord>& records);
// A number in 17 significant digits, which read back exactly; "null" where it is not finite.
std::string exact_number(double x);

std::string format_json(const std::vector<ResultRecord>& records, const std::string& trace);
// JSON text (compact for indent -1) with invalid UTF-8 replaced and non-finite numbers as null.
std::string to_json_text(const nlohmann::ordered_json& value, int indent = -1);

}  // namespace kvsim
