// `kvsim run` and `kvsim sweep`: a config in, a table on the terminal and CSV/JSON files out.
#pragma once
#include <functional>
#include <memory>
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

// A configuration cell (a table row at a budget) as its records state it: plain data that a
// partial results file carries, so that merging needs neither the config nor the trace.
struct CellInfo {
    std::string policy, label;
    ParamValues params;
    bool keeps_everything = false;
    double compression = 0;
    int budget = 0;
    std::string budget_label;
    std::vector<int> layer_budgets;
};
CellInfo cell_info(const ReplayCombo& combo);

// What a sweep's records are built from besides its measurements.
struct ResultFrame {
    std::string trace;  // the trace's description
    std::vector<std::string> metrics;
    std::string note;
    bool per_layer = false, per_sequence = false;
    int num_layers = 0, num_kv_heads = 0, group_size = 1;
    std::vector<int64_t> sequence_lengths;
    std::vector<std::string> sequence_names;
    std::vector<int> sequence_index;  // a per-sequence record's `sequence`: its index in the trace file
    std::vector<CellInfo> cells;      // in table order
};

// One work unit's measurements (see sim/shard_plan.h): per (sequence, KV head), s * kv_heads + kv.
struct UnitResult {
    std::size_t policy_bytes_per_slot = 0;
    std::vector<StreamMetrics> streams;
};

// The records of a sweep from every unit's measurements, indexed as enumerate_work numbers them.
// One machine's run and a merge of shards both come here, so their files agree byte for byte.
ExperimentResult build_result(const ResultFrame& frame, const std::vector<UnitResult>& units);

// The config's grid with --set axes added; an axis for the same parameter replaces the config's.
std::vector<GridAxis> merge_grid(const std::vector<GridAxis>& config_grid, const std::vector<GridAxis>& extra_axes);

// The budget a record states: none for a policy that keeps every token, and none for a ratio
// column pooled over sequences (sequence_length 0), whose budgets differ; else the tokens per
// (layer, KV head), a profile's mean.
std::optional<int> record_budget(const CellInfo& cell, int64_t sequence_length);
std::optional<int> record_budget(const ReplayCombo& combo, int64_t sequence_length);

// Opens the config's trace (generated in-process for a synthetic one).
std::unique_ptr<AttentionSource> open_source(const TraceRef& trace);

// A config's sweep, expanded and checked against its trace, ready to replay any of its work units.
class Experiment {
public:
    // extra_axes (from --set) replace config axes of the same parameter.
    Experiment(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes);
    ~Experiment();
    const ResultFrame& frame() const { return frame_; }
    std::size_t unit_count() const { return frame_.cells.size() * static_cast<std::size_t>(frame_.num_layers); }

    // Replays the listed units (enumerate_work's indices), a layer at a time; after each layer,
    // `layer_done` gets that layer's units and their results.
    using LayerDone = std::function<void(const std::vector<std::size_t>& units, std::vector<UnitResult>& results)>;
    void run_units(const std::vector<std::size_t>& units, bool show_progress, const LayerDone& layer_done);

private:
    std::vector<ReplayCombo> combos_;
    std::unique_ptr<AttentionSource> source_;
    ReplayOptions options_;
    ResultFrame frame_;
};

// Runs the config's sweep in this process.
ExperimentResult run_experiment(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes,
                                bool show_progress);

// Writes results.csv and results.json (and `more_files`, name and contents, beside them) into dir,
// created if missing: one commit, under the folder's lock (base/output_folder.h).
void write_outputs(const ExperimentResult& result, const std::string& dir,
                   const std::vector<std::pair<std::string, std::string>>& more_files = {});

}  // namespace kvsim
