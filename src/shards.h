// A sweep beyond one process: shards of its work units (sim/shard_plan.h) that each write a
// partial results file, resumable checkpoints, the merge of partials into the files one machine
// writes, and a Slurm batch script that runs the shards as a job array.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "search/search.h"
#include "sim/shard_plan.h"
#include "src/config.h"
#include "src/experiment.h"
#include "src/model_text.h"

namespace kvsim {

// "partial-I-of-N.json": a shard's partial results in the output folder. A run without --shard is
// shard 0/1; its partial is its checkpoint, removed once results.csv and results.json are written.
std::string partial_file_name(const ShardSpec& shard);

struct ShardedRun {
    std::string command;  // "run" or "sweep", for the tables' title
    std::string config_path;
    std::vector<std::string> identity;  // the flags that change results (--budgets, --set), hashed with the config
    std::optional<ShardSpec> shard;     // none: the whole sweep, with results written at the end
    bool resume = false;                // keep the units a previous run of this shard checkpointed
    bool show_progress = false;
    std::string out_dir;
    std::string format, layout;  // how the merge prints the tables, as this run would
};

struct ShardedOutcome {
    std::optional<ExperimentResult> result;  // the whole sweep's (no --shard)
    std::size_t units = 0, units_resumed = 0, units_run = 0;
    std::string partial_path;  // with --shard
};

// Runs the units of run.shard (all of them without one) and checkpoints each layer's as it
// completes, atomically, into the partial file.
ShardedOutcome run_sharded(const ExperimentConfig& config, const std::vector<GridAxis>& axes, const ShardedRun& run);

struct MergeOutcome {
    ExperimentResult result;
    std::string title;  // the title a one-machine run prints over its tables
    std::string format, layout;  // as the shards were asked to print
    int shards = 0;
    std::size_t units = 0;
};

// The partial files `inputs` name: folders (every partial-*.json in each, sorted) or the files.
std::vector<std::string> partial_files(const std::vector<std::string>& inputs);

// The partials in `inputs` (folders holding partial-*-of-*.json, or the files) merged: InputError
// naming the file when they disagree on the kvsim version, config, trace or shard count, or naming
// the shards to rerun when a cell is missing.
MergeOutcome merge_partials(const std::vector<std::string>& inputs);

// A search beyond one process: each shard measures a share of the search's work units (the budget
// grid's, the tier fit's and the streaming fit's, SearchShardWork) into its partial file, checkpointed after every
// pass's layer; the merge sums them and runs the rest of the search (the fits, the held-out
// confirmation, the other fits, the model in the loop) as `kvsim search` does on one machine.
struct SearchShardRun {
    std::string config_path;  // as given: the merge reads the config again from it
    ModelInput confirm;       // --model, --text, ...: the merge confirms in the loop with them
    ShardSpec shard;
    bool resume = false;
    std::string out_dir;
};

struct SearchShardOutcome {
    std::size_t units = 0, units_resumed = 0, units_run = 0;
    std::string partial_path;
};

SearchShardOutcome run_search_shard(const SearchSpec& spec, const SearchRun& run, const SearchShardRun& shard_run);

// Whether the partial files are a search's (else a sweep's).
bool holds_search_partials(const std::vector<std::string>& files);

// Reads one partial file (a sweep's or a search's) and checks it as merge and --resume do, without
// merging: InputError naming the file and the field. The fuzzers' way in (tests/fuzz/fuzz_partial.cpp).
void check_partial_file(const std::string& path);

struct SearchMerge {
    ExperimentConfig config;  // read again from the file the shards name, checked against their hash
    ModelInput confirm;
    std::vector<SearchUnitResult> units;  // every unit's, for SearchRun::measured_units
    int shards = 0;
    std::size_t unit_count = 0;
};

// Checks the partials as merge_partials does, and that the config file and trace still hash as the
// shards found them: InputError naming the file otherwise, or the shards to rerun.
SearchMerge merge_search_partials(const std::vector<std::string>& files);

struct SlurmScript {
    std::string path;     // where the script goes
    int shards = 0;       // the job array's size
    int max_running = 0;  // at most this many shards at once (%M); 0: all
    std::string kvsim;    // the kvsim binary (absolute)
    std::string workdir;  // absolute: where the commands run
    std::vector<std::string> command_args;  // the command and its arguments, without --shard and --out
    std::string out_dir;
    std::string job_name;
    std::string outputs = "results.csv and results.json";  // what the merge writes, for the script's comment
};

// Writes the batch script (atomically, executable): a job array over the shards, each taking its
// shard from SLURM_ARRAY_TASK_ID and resuming its own checkpoint, and a merge job after them.
void write_slurm_script(const SlurmScript& script);

}  // namespace kvsim
