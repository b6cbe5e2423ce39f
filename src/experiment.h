// `kvsim run` and `kvsim sweep`: a config in, a table on the terminal and CSV/JSON files out.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "sim/attention_source.h"
#include "sim/replay.h"
#include "src/config.h"
#include "src/report.h"

namespace kvsim {

struct ExperimentResult {
    std::string trace;  // what was replayed
    std::vector<ResultRecord> records;
    std::vector<std::string> metrics;  // the tables printed: the config's, or its defaults (table_metrics)
    std::string note;                  // a line for the user about the defaults chosen, or empty
    int64_t policy_steps = 0;  // decode steps replayed, summed over every combination and KV-head stream
    double seconds = 0;        // wall time of the replay
};

// The config's grid with --set axes added; an axis for the same parameter replaces the config's.
std::vector<GridAxis> merge_grid(const std::vector<GridAxis>& config_grid, const std::vector<GridAxis>& extra_axes);

// The budget a record states: none for a policy that keeps every token, and none for a ratio
// column pooled over sequences (sequence_length 0), whose budgets differ; else the tokens per
// (layer, KV head), a profile's mean.
std::optional<int> record_budget(const ReplayCombo& combo, int64_t sequence_length);

// Opens the config's trace (generated in-process for a synthetic one).
std::unique_ptr<AttentionSource> open_source(const TraceRef& trace);

// Runs the config's sweep; extra_axes (from --set) replace config axes of the same parameter.
ExperimentResult run_experiment(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes,
                                bool show_progress);

// Writes results.csv and results.json into dir (created if missing), each atomically.
void write_outputs(const ExperimentResult& result, const std::string& dir);

}  // namespace kvsim
