#include "sim/replay.h"

#include <tbb/parallel_for.h>

#include <algorithm>

#include "sim/heavy_hitters.h"
#include "sim/precision.h"
#include "sim/qkv_attention.h"
#include "src/errors.h"

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
    std::vector<float> full_output;                      // [query head][row][d]: the full cache's output
    std::vector<int32_t> every_position;                 // 0, 1, 2, ...: the full cache's positions
    std::vector<uint8_t> all_fp16;

    // Value-level metrics need the values: only a Q/K/V source has them.
    QkvSource* qkv = dynamic_cast<QkvSource*>(&source);
    const bool values_needed = options.output_error || options.memory;
    if (values_needed && !qkv)
        throw InputError(source.description() +
                         ": output error and memory metrics need a Q/K/V trace (this one records attention only)");
    const int head_dim = qkv ? qkv->qkv_shape().head_dim : 0;

    for (std::size_t s = 0; s < shape.sequence_lengths.size(); ++s) {
        const int64_t length = shape.sequence_lengths[s];
        const int64_t last = shape.last_steps[s];
        for (int layer = 0; layer < shape.num_layers; ++layer) {
            // One harness per (KV head, combination), index kv_head * num_combos + combo.
            std::vector<Harness> harnesses;
            harnesses.reserve(kv_heads * num_combos);
            for (int kv = 0; kv < kv_heads; ++kv)
                for (const ReplayCombo& c : combos) {
                    const int budget = c.budget_for(layer, length);
                    if (c.compression > 0 && c.policy->check_budget) {
                        const std::string problem = c.policy->check_budget(c.params, budget);
                        if (!problem.empty())
                            throw InputError(c.label + " at budget " + c.budget_label + ": sequence " +
                                             shape.sequence_names[s] + " (" + std::to_string(length) +
                                             " tokens) gets " + std::to_string(budget) + " tokens, and " + problem);
                    }
                    const int capacity = static_cast<int>(std::min<int64_t>(std::max(budget, prefill), length)) + 1;
                    const PolicyContext ctx{budget, capacity, layer, shape.num_layers, kv, kv_heads, head_dim};
                    const std::string where = " (sequence " + shape.sequence_names[s] + ", layer " +
                                              std::to_string(layer) + ", KV head " + std::to_string(kv) + ")";
                    harnesses.emplace_back(c.make(ctx), budget, length, options.harness, c.label, where);
                }

            // The tiers each distinct precision format serves for this layer, built once and shared.
            std::vector<std::unique_ptr<TierArrays>> tier_arrays;
            const QkvLayer* layer_values = nullptr;
            const TierArrays* fp16_arrays = nullptr;
            if (values_needed) {
                layer_values = &qkv->layer_data(static_cast<int>(s), layer);
                auto arrays_for = [&](const TierFormat* format) -> const TierArrays* {
                    for (const auto& a : tier_arrays)
                        if ((format == nullptr) == (a->k[1] == nullptr) && (!format || a->format == *format))
                            return a.get();
                    auto arrays = std::make_unique<TierArrays>();
                    arrays->k[0] = layer_values->k.data();
                    arrays->v[0] = layer_values->v.data();
                    if (format) {
                        arrays->format = *format;
                        build_tier_arrays(*layer_values, kv_heads, head_dim, *arrays);
                    }
                    tier_arrays.push_back(std::move(arrays));
                    return tier_arrays.back().get();
                };
                fp16_arrays = arrays_for(nullptr);
                for (std::size_t job = 0; job < harnesses.size(); ++job) {
                    const TierArrays* arrays = arrays_for(harnesses[job].policy().tier_format());
                    harnesses[job].set_values({arrays, static_cast<int>(job / num_combos), kv_heads, head_dim,
                                               options.output_error, options.memory});
                }
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
                if (options.output_error) {
                    // The full cache's output at full precision, once per (query head, step), by the
                    // same arithmetic as a policy's cached output: the full cache errs by exactly 0.
                    full_output.resize(static_cast<std::size_t>(query_heads) * rows * head_dim);
                    if (every_position.size() < static_cast<std::size_t>(length)) {
                        every_position.resize(length);
                        for (int64_t p = 0; p < length; ++p) every_position[p] = static_cast<int32_t>(p);
                        all_fp16.assign(length, 0);
                    }
                    tbb::parallel_for(int64_t{0}, query_heads * rows, [&](int64_t job) {
                        const int head = static_cast<int>(job / rows);
                        const int64_t t = first + job % rows;
                        thread_local Eigen::ArrayXf scratch;
                        cached_attention_output(layer_values->q.data() + (t * query_heads + head) * head_dim,
                                                {every_position.data(), static_cast<std::size_t>(t + 1)}, all_fp16,
                                                all_fp16, *fp16_arrays, head / group, kv_heads, head_dim, scratch,
                                                full_output.data() + job * head_dim);
                    });
                }
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
                    const float* queries_of_group[64];
                    const float* full_of_group[64];
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
                        if (options.output_error) {
                            for (int h = 0; h < group; ++h) {
                                const int head = kv * group + h;
                                queries_of_group[h] = layer_values->q.data() + (t * query_heads + head) * head_dim;
                                full_of_group[h] = full_output.data() + (head * rows + i) * head_dim;
                            }
                            step.queries = {queries_of_group, static_cast<std::size_t>(group)};
                            step.full_output = {full_of_group, static_cast<std::size_t>(group)};
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
