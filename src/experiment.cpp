#include "src/experiment.h"

#include "search/profile.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "sim/qkv_attention.h"
#include "sim/replay.h"
#include "sim/synthetic_qkv.h"
#include "sim/sweep.h"
#include "base/atomic_file.h"
#include "base/errors.h"
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
    return named_harness_options(config.attention_view, config.group_reduce, qkv, config.prefill_tokens);
}

// Quantisation groups must fit the trace's head size.
void check_precision(const std::vector<ReplayCombo>& combos, const AttentionSource& source) {
    const auto* qkv = dynamic_cast<const QkvSource*>(&source);
    if (!qkv) return;
    const int head_dim = qkv->qkv_shape().head_dim;
    const AttentionShape& shape = source.shape();
    for (const ReplayCombo& c : combos) {
        // A probe instance, only to read its format: a budget every policy accepts.
        const int budget = std::max(c.budget, 4096);
        const std::unique_ptr<Policy> probe =
            c.make(PolicyContext{budget, budget + 1, 0, shape.num_layers, 0, shape.num_kv_heads, head_dim});
        if (const TierFormat* f = probe->tier_format())
            if (f->value_group < head_dim && head_dim % f->value_group != 0)
                throw InputError(c.label + ": value_group " + std::to_string(f->value_group) +
                                 " does not divide the head size " + std::to_string(head_dim) + " of " +
                                 source.description());
    }
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

std::optional<int> record_budget(const ReplayCombo& combo, int64_t sequence_length) {
    if (combo.policy->keeps_everything) return std::nullopt;
    if (combo.compression == 0) return combo.budget;
    if (sequence_length > 0) return budget_for_compression(combo.compression, sequence_length);
    return std::nullopt;
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

ExperimentResult run_experiment(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes,
                                bool show_progress) {
    if (config.trace.path.empty() && config.trace.synthetic.empty())
        throw InputError(config.file + ": missing key 'trace' (kvsim run replays a trace)");
    for (const std::string& metric : config.metrics)
        if (metric == "ppl" || metric == "delta_ppl")
            throw InputError(config.file + ": metrics: " + metric + " needs the model in the loop: use kvsim eval");
    const std::vector<GridAxis> grid = merge_grid(config.grid, extra_axes);
    const std::vector<ReplayCombo> combos = expand_sweep(config.policies, grid, budget_columns(config));

    std::unique_ptr<AttentionSource> source = open_source(config.trace);
    check_against_trace(config, *source);
    ReplayOptions options;
    options.heavy_hitter_k = config.heavy_hitter_k;
    options.harness = harness_options(config, *source);
    ExperimentResult out;
    const bool values_known = dynamic_cast<const QkvSource*>(source.get()) != nullptr;
    out.metrics = table_metrics(config, values_known);
    if (config.metrics.empty() && !values_known &&
        std::any_of(config.policies.begin(), config.policies.end(), changes_values))
        out.note = source->description() +
                   " records attention only, so output error cannot be measured: retained mass and recall are "
                   "shown, and they count a quantised, tiered or streamed token as kept (name metrics: to choose)";
    for (const std::string& m : out.metrics) {
        options.output_error |= m == "output_rel_error" || m == "output_cosine";
        options.memory |= m == "bytes_per_token" || m == "compression_ratio";
    }
    check_precision(combos, *source);
    ProgressBar bar(show_progress);
    options.progress = [&bar](double fraction) { bar.update(fraction); };

    const auto start = std::chrono::steady_clock::now();
    const std::vector<ComboResult> results = replay(*source, combos, options);
    bar.finish();

    out.trace = source->description();
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const AttentionShape& shape = source->shape();
    // sequence -1: over every sequence; else the replay's sequence s.
    auto record = [&](const ReplayCombo& c, const ComboResult& r, const StreamMetrics& m, int layer, int sequence) {
        ResultRecord rec;
        rec.policy = c.policy->name;
        rec.label = c.label;
        rec.params = c.params;
        rec.budget = record_budget(c, sequence >= 0 ? shape.sequence_lengths[sequence] : 0);
        rec.budget_label = c.budget_label;
        rec.layer_budgets = c.layer_budgets;
        rec.layer = layer;
        if (sequence >= 0) {
            rec.sequence = config.trace.sequences.empty() ? sequence : config.trace.sequences[sequence];
            rec.sequence_name = shape.sequence_names[sequence];
        }
        set_measured(rec, m);
        rec.policy_bytes_per_slot = r.policy_bytes_per_slot;
        out.records.push_back(rec);
    };
    for (std::size_t i = 0; i < combos.size(); ++i) {
        record(combos[i], results[i], results[i].total, -1, -1);
        out.policy_steps += results[i].total.steps / shape.group_size();  // one per KV head
    }
    if (config.per_layer)
        for (std::size_t i = 0; i < combos.size(); ++i)
            for (std::size_t layer = 0; layer < results[i].by_layer.size(); ++layer)
                record(combos[i], results[i], results[i].by_layer[layer], static_cast<int>(layer), -1);
    if (config.per_sequence)
        for (std::size_t i = 0; i < combos.size(); ++i)
            for (std::size_t s = 0; s < results[i].by_sequence.size(); ++s)
                record(combos[i], results[i], results[i].by_sequence[s], -1, static_cast<int>(s));
    return out;
}

void write_outputs(const ExperimentResult& result, const std::string& dir) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw InputError(dir + ": cannot create output folder (" + ec.message() + ")");
    // Both files are complete under temporary names before either takes its real name.
    AtomicFile csv(dir + "/results.csv"), json(dir + "/results.json");
    csv.write(format_csv(result.records));
    json.write(format_json(result.records, result.trace));
    csv.commit();
    json.commit();
}

}  // namespace kvsim
