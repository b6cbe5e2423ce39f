#include "sim/replay.h"

#include <tbb/parallel_for.h>

#include <algorithm>

#include "sim/heavy_hitters.h"

namespace kvsim {
namespace {

// Reduces the rows of query heads [first_head, first_head + group) into one row of t weights.
void combine_rows(const AttentionBlock& block, int first_head, int group, GroupReduce reduce, int64_t t, float* out) {
    const float* first = block.row(first_head, t);
    std::copy(first, first + t, out);
    for (int h = 1; h < group; ++h) {
        const float* row = block.row(first_head + h, t);
        if (reduce == GroupReduce::max)
            for (int64_t j = 0; j < t; ++j) out[j] = std::max(out[j], row[j]);
        else
            for (int64_t j = 0; j < t; ++j) out[j] += row[j];
    }
    if (reduce == GroupReduce::mean)
        for (int64_t j = 0; j < t; ++j) out[j] /= static_cast<float>(group);
}

}  // namespace

std::vector<ComboResult> replay(AttentionSource& source, const std::vector<ReplayCombo>& combos,
                                const ReplayOptions& options) {
    const AttentionShape& shape = source.shape();
    const int query_heads = shape.num_query_heads, kv_heads = shape.num_kv_heads, group = shape.group_size();
    const std::size_t num_combos = combos.size();
    const int k = options.heavy_hitter_k;
    const bool raw_view = options.harness.view == AttentionView::raw;
    const int prefill = options.harness.prefill_tokens;

    std::vector<ComboResult> results(num_combos);
    for (auto& r : results) r.by_layer.resize(shape.num_layers);

    int64_t total_steps = 0, steps_done = 0;
    for (int64_t last : shape.last_steps) total_steps += last * shape.num_layers;

    AttentionBlock block;
    std::vector<int32_t> heavy;        // [query head][row][k]
    std::vector<int32_t> heavy_count;  // [query head][row]
    std::vector<std::vector<float>> combined(kv_heads);  // raw view with groups: reduced rows per KV head

    for (std::size_t s = 0; s < shape.sequence_lengths.size(); ++s) {
        const int64_t length = shape.sequence_lengths[s];
        const int64_t last = shape.last_steps[s];
        for (int layer = 0; layer < shape.num_layers; ++layer) {
            // One harness per (KV head, combination), index kv_head * num_combos + combo.
            std::vector<Harness> harnesses;
            harnesses.reserve(kv_heads * num_combos);
            for (int kv = 0; kv < kv_heads; ++kv)
                for (const ReplayCombo& c : combos) {
                    const int budget = c.budget_for(layer);
                    const PolicyContext ctx{budget, std::max(budget, prefill) + 1, layer, shape.num_layers};
                    const std::string where = " (sequence " + shape.sequence_names[s] + ", layer " +
                                              std::to_string(layer) + ", KV head " + std::to_string(kv) + ")";
                    harnesses.emplace_back(c.policy->make(c.params, ctx), budget, length, options.harness, c.label,
                                           where);
                }

            const int64_t block_floats = std::max<int64_t>(1, source.block_floats(options.block_floats) / query_heads);
            for (int64_t first = 1; first <= last;) {
                const int64_t end = attention_block_end(first, last, block_floats);
                const int64_t rows = end - first;
                source.read_block(static_cast<int>(s), layer, first, end, block);
                const bool recorded_self = !block.self_weight.empty();
                if (!raw_view && !recorded_self) self_weight_from_row_sums(block);

                // Shared per-step work, once for all combinations: every query head's heavy
                // hitters, and (raw view, grouped heads) every KV head's combined row.
                heavy.resize(static_cast<std::size_t>(query_heads) * rows * k);
                heavy_count.resize(static_cast<std::size_t>(query_heads) * rows);
                tbb::parallel_for(int64_t{0}, query_heads * rows, [&](int64_t job) {
                    const int head = static_cast<int>(job / rows);
                    const int64_t i = job % rows, t = first + i;
                    thread_local std::vector<int32_t> top;
                    top.clear();
                    top_k_positions({block.row(head, t), static_cast<std::size_t>(t)}, k, top);
                    std::copy(top.begin(), top.end(), heavy.begin() + job * k);
                    heavy_count[job] = static_cast<int32_t>(top.size());
                });
                if (raw_view && group > 1) {
                    const std::size_t packed = block.rows[0].size();
                    for (auto& c : combined) c.resize(packed);
                    tbb::parallel_for(int64_t{0}, kv_heads * rows, [&](int64_t job) {
                        const int kv = static_cast<int>(job / rows);
                        const int64_t t = first + job % rows;
                        combine_rows(block, kv * group, group, options.harness.reduce, t,
                                     combined[kv].data() + attention_row_offset(t) - attention_row_offset(first));
                    });
                }

                tbb::parallel_for(std::size_t{0}, harnesses.size(), [&](std::size_t job) {
                    const int kv = static_cast<int>(job / num_combos);
                    Harness& harness = harnesses[job];
                    const float* rows_of_group[64];
                    std::span<const int32_t> heavy_of_group[64];
                    float self_of_group[64];
                    for (int64_t i = 0; i < rows; ++i) {
                        const int64_t t = first + i;
                        for (int h = 0; h < group; ++h) {
                            const int head = kv * group + h;
                            rows_of_group[h] = block.row(head, t);
                            const int64_t job_row = head * rows + i;
                            heavy_of_group[h] = {heavy.data() + job_row * k, static_cast<std::size_t>(heavy_count[job_row])};
                            if (!raw_view || recorded_self) self_of_group[h] = block.self_weight[head][i];
                        }
                        GroupStep step;
                        step.t = static_cast<int32_t>(t);
                        step.rows = {rows_of_group, static_cast<std::size_t>(group)};
                        step.heavy = {heavy_of_group, static_cast<std::size_t>(group)};
                        if (!raw_view || recorded_self) {
                            const std::span<const float> self(self_of_group, static_cast<std::size_t>(group));
                            if (!raw_view) step.self_weight = self;
                            if (recorded_self) step.own_weight = self;
                        }
                        if (raw_view)
                            step.combined = group > 1 ? combined[kv].data() + attention_row_offset(t) -
                                                            attention_row_offset(first)
                                                      : rows_of_group[0];
                        harness.step(step);
                    }
                });
                steps_done += rows;
                first = end;
                if (options.progress) options.progress(static_cast<double>(steps_done) / total_steps);
            }

            for (int kv = 0; kv < kv_heads; ++kv)
                for (std::size_t c = 0; c < num_combos; ++c) {
                    const Harness& harness = harnesses[kv * num_combos + c];
                    results[c].by_layer[layer].add(harness.metrics());
                    results[c].total.add(harness.metrics());
                    results[c].policy_bytes_per_slot = harness.policy().bytes_per_slot();
                }
        }
    }
    return results;
}

}  // namespace kvsim
