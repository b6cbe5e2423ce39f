// `kvsim run` and `kvsim sweep`: a config in, a table on the terminal and CSV/JSON files out.
#pragma once
#include <string>
#include <vector>

#include "sim/attention_source.h"
#include "src/config.h"
#include "src/report.h"

namespace kvsim {

struct ExperimentResult {
    std::string trace;  // what was replayed
    std::vector<ResultRecord> records;
    int64_t policy_steps = 0;  // decode steps replayed, summed over every combination and KV-head stream
    double seconds = 0;        // wall time of the replay
};

// The config's grid with --set axes added; an axis for the same parameter replaces the config's.
std::vector<GridAxis> merge_grid(const std::vector<GridAxis>& config_grid, const std::vector<GridAxis>& extra_axes);

// Opens the config's trace (generated in-process for a synthetic one).
std::unique_ptr<AttentionSource> open_source(const TraceRef& trace);

// Runs the config's sweep; extra_axes (from --set) replace config axes of the same parameter.
ExperimentResult run_experiment(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes,
                                bool show_progress);

// Writes results.csv and results.json into dir (created if missing), each atomically.
void write_outputs(const ExperimentResult& result, const std::string& dir);

}  // namespace kvsim
