#include "src/experiment.h"

#include <chrono>
#include <filesystem>

#include "sim/replay.h"
#include "sim/sweep.h"
#include "src/atomic_file.h"
#include "src/errors.h"
#include "src/progress.h"

namespace kvsim {

std::unique_ptr<AttentionSource> open_source(const TraceRef& trace) {
    if (!trace.synthetic.empty())
        return make_policybook_source(policybook_trace(trace.name, trace.where + ".name"), trace.max_steps);
    return open_attention_trace(trace.path, trace.max_steps);
}

ExperimentResult run_experiment(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes,
                                bool show_progress) {
    std::vector<GridAxis> grid;
    for (const GridAxis& axis : config.grid) {
        bool replaced = false;
        for (const GridAxis& extra : extra_axes) replaced |= extra.policy == axis.policy && extra.param == axis.param;
        if (!replaced) grid.push_back(axis);
    }
    grid.insert(grid.end(), extra_axes.begin(), extra_axes.end());
    const std::vector<ReplayCombo> combos = expand_sweep(config.policies, grid, config.budgets);

    std::unique_ptr<AttentionSource> source = open_source(config.trace);
    ReplayOptions options;
    options.heavy_hitter_k = config.heavy_hitter_k;
    ProgressBar bar(show_progress);
    options.progress = [&bar](double fraction) { bar.update(fraction); };

    const auto start = std::chrono::steady_clock::now();
    const std::vector<ComboResult> results = replay(*source, combos, options);
    bar.finish();

    ExperimentResult out;
    out.trace = source->description();
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    auto record = [&](const ReplayCombo& c, const ComboResult& r, const StreamMetrics& m, int layer) {
        ResultRecord rec;
        rec.policy = c.policy->name;
        rec.label = c.label;
        rec.params = c.params;
        rec.budget = c.budget;
        rec.layer = layer;
        rec.steps = m.steps;
        rec.retained_mass = m.steps ? m.retained_mass / m.steps : 0.0;
        rec.heavy_hitter_recall =
            m.heavy_hitter_possible ? static_cast<double>(m.heavy_hitter_hits) / m.heavy_hitter_possible : 0.0;
        rec.eviction_calls = m.eviction_calls;
        rec.policy_bytes_per_slot = r.policy_bytes_per_slot;
        out.records.push_back(rec);
    };
    for (std::size_t i = 0; i < combos.size(); ++i) {
        record(combos[i], results[i], results[i].total, -1);
        out.policy_steps += results[i].total.steps;
    }
    if (config.per_layer)
        for (std::size_t i = 0; i < combos.size(); ++i)
            for (std::size_t layer = 0; layer < results[i].by_layer.size(); ++layer)
                record(combos[i], results[i], results[i].by_layer[layer], static_cast<int>(layer));
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
