#include "src/experiment.h"

#include "search/profile.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>

#include "sim/qkv_attention.h"
#include "sim/replay.h"
#include "sim/synthetic_qkv.h"
#include "sim/shard_plan.h"
#include "sim/sweep.h"
#include "base/errors.h"
#include "base/output_folder.h"
#include "src/progress.h"

namespace kvsim {

std::unique_ptr<AttentionSource> open_source(const TraceRef& trace) {
    if (trace.synthetic == "policybook")
        return make_policybook_source(policybook_trace(trace.name, trace.where + ".name"), trace.max_steps);
    if (trace.synthetic == "qkv")
        return make_synthetic_qkv_source(synthetic_qkv_trace(trace.name, trace.where + ".name"), trace.max_steps);
    return open_trace_source(trace.path, trace.max_steps, trace.sequences);
}

HarnessOptions harness_options(const ExperimentConfig& config, const AttentionSource& source) {
    const bool qkv = dynamic_cast<const QkvSource*>(&source) != nullptr;
    return named_harness_options(config.attention_view, config.group_reduce, qkv, config.prefill_tokens, config.file);
}

// Checks the config against the trace's shape: profiles need one budget per layer.
void check_against_trace(const ExperimentConfig& config, const AttentionSource& source) {
    const AttentionShape& shape = source.shape();
    for (const BudgetColumn& column : config.layer_budget_profiles)
        if (static_cast<int>(column.layer_budgets.size()) != shape.num_layers)
            throw InputError(column.where + ": " + std::to_string(column.layer_budgets.size()) +
                             " per-layer budgets, but trace " + source.description() + " has " +
                             std::to_string(shape.num_layers) + " layers");
    for (const PolicyEntry& entry : config.policies) {
        if (entry.profile_shape.num_layers == 0) continue;
        ModelShape actual{source.description(), shape.num_layers, shape.num_query_heads, shape.num_kv_heads,
                          entry.profile_shape.head_dim};  // an attention-only trace records no head size
        if (const auto* qkv = dynamic_cast<const QkvSource*>(&source)) actual.head_dim = qkv->qkv_shape().head_dim;
        check_profile_shape(entry.profile_shape, entry.where, actual, "trace " + source.description());
    }
    if (shape.group_size() > 64)
        throw InputError(source.description() + ": " + std::to_string(shape.group_size()) +
                         " query heads per KV head; kvsim handles at most 64");
    for (std::size_t s = 0; s < shape.sequence_lengths.size(); ++s)
        if (config.prefill_tokens >= shape.sequence_lengths[s])
            throw InputError(config.file + ": prefill_tokens = " + std::to_string(config.prefill_tokens) +
                             " leaves no decode step in sequence " + shape.sequence_names[s] + " (" +
                             std::to_string(shape.sequence_lengths[s]) + " tokens)");
}

CellInfo cell_info(const ReplayCombo& combo) {
    return CellInfo{combo.policy->name, combo.label,          combo.params,       combo.policy->keeps_everything,
                    combo.compression,  combo.budget,         combo.budget_label, combo.layer_budgets};
}

std::optional<int> record_budget(const CellInfo& cell, int64_t sequence_length) {
    if (cell.keeps_everything) return std::nullopt;
    if (cell.compression == 0) return cell.budget;
    if (sequence_length > 0) return budget_for_compression(cell.compression, sequence_length);
    return std::nullopt;
}

std::optional<int> record_budget(const ReplayCombo& combo, int64_t sequence_length) {
    return record_budget(cell_info(combo), sequence_length);
}

std::vector<GridAxis> merge_grid(const std::vector<GridAxis>& config_grid, const std::vector<GridAxis>& extra_axes) {
    std::vector<GridAxis> grid;
    for (const GridAxis& axis : config_grid) {
        bool replaced = false;
        for (const GridAxis& extra : extra_axes) replaced |= extra.policy == axis.policy && extra.param == axis.param;
        if (!replaced) grid.push_back(axis);
    }
    grid.insert(grid.end(), extra_axes.begin(), extra_axes.end());
    return grid;
}

Experiment::Experiment(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes) {
    if (config.trace.path.empty() && config.trace.synthetic.empty())
        throw InputError(config.file + ": missing key 'trace' (kvsim run replays a trace)");
    for (const std::string& metric : config.metrics)
        if (metric == "ppl" || metric == "delta_ppl")
            throw InputError(config.file + ": metrics: " + metric + " needs the model in the loop: use kvsim eval");
    const std::vector<GridAxis> grid = merge_grid(config.grid, extra_axes);
    combos_ = expand_sweep(config.policies, grid, budget_columns(config));

    source_ = open_source(config.trace);
    check_against_trace(config, *source_);
    options_.heavy_hitter_k = config.heavy_hitter_k;
    options_.harness = harness_options(config, *source_);
    const bool values_known = dynamic_cast<const QkvSource*>(source_.get()) != nullptr;
    frame_.metrics = table_metrics(config, values_known);
    if (config.metrics.empty() && !values_known &&
        std::any_of(config.policies.begin(), config.policies.end(), changes_values))
        frame_.note = source_->description() +
                      " records attention only, so output error cannot be measured: retained mass and recall are "
                      "shown, and they count a quantised, tiered or streamed token as kept (name metrics: to choose)";
    for (const std::string& m : frame_.metrics) {
        options_.output_error |= m == "output_rel_error" || m == "output_cosine";
        options_.memory |= m == "bytes_per_token" || m == "compression_ratio";
    }

    const AttentionShape& shape = source_->shape();
    frame_.trace = source_->description();
    frame_.per_layer = config.per_layer;
    frame_.per_sequence = config.per_sequence;
    frame_.num_layers = shape.num_layers;
    frame_.num_kv_heads = shape.num_kv_heads;
    frame_.group_size = shape.group_size();
    frame_.sequence_lengths = shape.sequence_lengths;
    frame_.sequence_names = shape.sequence_names;
    for (std::size_t s = 0; s < shape.sequence_lengths.size(); ++s)
        frame_.sequence_index.push_back(config.trace.sequences.empty() ? static_cast<int>(s) : config.trace.sequences[s]);
    for (const ReplayCombo& c : combos_) frame_.cells.push_back(cell_info(c));
}

Experiment::~Experiment() = default;

void Experiment::run_units(const std::vector<std::size_t>& units, bool show_progress, const LayerDone& layer_done) {
    const std::vector<WorkUnit> all = enumerate_work(combos_.size(), frame_.num_layers);
    // The units by layer, in enumeration order: one lockstep replay per layer.
    std::map<int, std::vector<std::size_t>> by_layer;
    for (std::size_t u : units) by_layer[all.at(u).layer].push_back(u);
    ProgressBar bar(show_progress);
    std::size_t layers_done = 0;
    const std::size_t sequences = frame_.sequence_lengths.size();
    const auto kv_heads = static_cast<std::size_t>(frame_.num_kv_heads);
    for (auto it = by_layer.begin(); it != by_layer.end(); ++it) {
        const auto& [layer, layer_units] = *it;
        std::vector<ReplayCombo> combos;
        for (std::size_t u : layer_units) combos.push_back(combos_[all[u].cell]);
        ReplayOptions options = options_;
        options.layers = {layer};
        // The next layer's Q/K/V loads while this one replays (nothing here reads the trace between).
        if (std::next(it) != by_layer.end()) options.next_layer = std::next(it)->first;
        options.progress = [&, layers = by_layer.size()](double fraction) {
            bar.update((static_cast<double>(layers_done) + fraction) / static_cast<double>(layers));
        };
        const std::vector<ComboResult> results = replay(*source_, combos, options);
        std::vector<UnitResult> unit_results(layer_units.size());
        for (std::size_t i = 0; i < layer_units.size(); ++i) {
            unit_results[i].policy_bytes_per_slot = results[i].policy_bytes_per_slot;
            for (std::size_t s = 0; s < sequences; ++s)
                for (std::size_t kv = 0; kv < kv_heads; ++kv)
                    unit_results[i].streams.push_back(
                        results[i].by_stream[(s * frame_.num_layers + layer) * kv_heads + kv]);
        }
        ++layers_done;
        layer_done(layer_units, unit_results);
    }
    bar.finish();
}

ExperimentResult build_result(const ResultFrame& frame, const std::vector<UnitResult>& units) {
    const std::vector<WorkUnit> all = enumerate_work(frame.cells.size(), frame.num_layers);
    if (units.size() != all.size()) throw std::logic_error("build_result: units missing");
    const std::size_t sequences = frame.sequence_lengths.size();
    const auto kv_heads = static_cast<std::size_t>(frame.num_kv_heads);
    std::vector<ComboResult> results(frame.cells.size());
    for (auto& r : results) r.by_stream.resize(sequences * frame.num_layers * kv_heads);
    for (std::size_t u = 0; u < all.size(); ++u) {
        ComboResult& r = results[all[u].cell];
        if (units[u].streams.size() != sequences * kv_heads) throw std::logic_error("build_result: streams missing");
        for (std::size_t s = 0; s < sequences; ++s)
            for (std::size_t kv = 0; kv < kv_heads; ++kv)
                r.by_stream[(s * frame.num_layers + all[u].layer) * kv_heads + kv] = units[u].streams[s * kv_heads + kv];
        // A policy's bookkeeping per slot, as its last stream (the last layer's) reports it.
        if (all[u].layer == frame.num_layers - 1) r.policy_bytes_per_slot = units[u].policy_bytes_per_slot;
    }
    for (auto& r : results) sum_streams(r, sequences, frame.num_layers, frame.num_kv_heads);

    ExperimentResult out;
    out.trace = frame.trace;
    out.metrics = frame.metrics;
    out.note = frame.note;
    // sequence -1: over every sequence; else the replay's sequence s.
    auto record = [&](const CellInfo& c, const ComboResult& r, const StreamMetrics& m, int layer, int sequence) {
        ResultRecord rec;
        rec.policy = c.policy;
        rec.label = c.label;
        rec.params = c.params;
        rec.budget = record_budget(c, sequence >= 0 ? frame.sequence_lengths[sequence] : 0);
        rec.budget_label = c.budget_label;
        rec.layer_budgets = c.layer_budgets;
        rec.layer = layer;
        if (sequence >= 0) {
            rec.sequence = frame.sequence_index[sequence];
            rec.sequence_name = frame.sequence_names[sequence];
        }
        set_measured(rec, m);
        rec.policy_bytes_per_slot = r.policy_bytes_per_slot;
        out.records.push_back(rec);
    };
    const std::vector<CellInfo>& cells = frame.cells;
    for (std::size_t i = 0; i < cells.size(); ++i) {
        record(cells[i], results[i], results[i].total, -1, -1);
        out.policy_steps += results[i].total.steps / frame.group_size;  // one per KV head
    }
    if (frame.per_layer)
        for (std::size_t i = 0; i < cells.size(); ++i)
            for (std::size_t layer = 0; layer < results[i].by_layer.size(); ++layer)
                record(cells[i], results[i], results[i].by_layer[layer], static_cast<int>(layer), -1);
    if (frame.per_sequence)
        for (std::size_t i = 0; i < cells.size(); ++i)
            for (std::size_t s = 0; s < results[i].by_sequence.size(); ++s)
                record(cells[i], results[i], results[i].by_sequence[s], -1, static_cast<int>(s));
    return out;
}

ExperimentResult run_experiment(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes,
                                bool show_progress) {
    Experiment experiment(config, extra_axes);
    std::vector<std::size_t> every(experiment.unit_count());
    for (std::size_t u = 0; u < every.size(); ++u) every[u] = u;
    std::vector<UnitResult> units(every.size());
    const auto start = std::chrono::steady_clock::now();
    experiment.run_units(every, show_progress, [&](const std::vector<std::size_t>& done, std::vector<UnitResult>& results) {
        for (std::size_t i = 0; i < done.size(); ++i) units[done[i]] = std::move(results[i]);
    });
    ExperimentResult out = build_result(experiment.frame(), units);
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return out;
}

void write_outputs(const ExperimentResult& result, const std::string& dir,
                   const std::vector<std::pair<std::string, std::string>>& more_files) {
    // Every file is complete under a temporary name before any takes its real name, and they take
    // them together (base/output_folder.h).
    FolderCommit commit(dir);
    commit.add("results.csv", format_csv(result.records));
    commit.add("results.json", format_json(result.records, result.trace));
    for (const auto& [name, contents] : more_files) commit.add(name, contents);
    commit.commit();
}

}  // namespace kvsim
