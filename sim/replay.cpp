#include "sim/replay.h"

#include <tbb/parallel_for.h>

#include <algorithm>

#include "sim/heavy_hitters.h"

namespace kvsim {

std::vector<ComboResult> replay(AttentionSource& source, const std::vector<ReplayCombo>& combos,
                                const ReplayOptions& options) {
    const AttentionShape& shape = source.shape();
    const int heads = shape.num_heads;
    const std::size_t num_combos = combos.size();
    const int k = options.heavy_hitter_k;

    std::vector<ComboResult> results(num_combos);
    for (auto& r : results) r.by_layer.resize(shape.num_layers);

    int64_t total_steps = 0, steps_done = 0;
    for (int64_t last : shape.last_steps) total_steps += last * shape.num_layers;

    std::vector<std::vector<float>> rows(heads);          // this block's rows, per head
    std::vector<std::vector<int32_t>> heavy(heads);       // k slots per row, per head
    std::vector<std::vector<int32_t>> heavy_count(heads);  // positions used per row

    for (std::size_t s = 0; s < shape.sequence_lengths.size(); ++s) {
        const int64_t length = shape.sequence_lengths[s];
        const int64_t last = shape.last_steps[s];
        for (int layer = 0; layer < shape.num_layers; ++layer) {
            // One harness per (head, combination), index head * num_combos + combo.
            std::vector<Harness> harnesses;
            harnesses.reserve(heads * num_combos);
            for (int head = 0; head < heads; ++head)
                for (const ReplayCombo& c : combos) {
                    const PolicyContext ctx{c.budget, layer, shape.num_layers};
                    const std::string where = " (sequence " + shape.sequence_names[s] + ", layer " +
                                              std::to_string(layer) + ", head " + std::to_string(head) + ")";
                    harnesses.emplace_back(c.policy->make(c.params, ctx), c.budget, length, c.label, where);
                }

            for (int64_t first = 1; first <= last;) {
                const int64_t end = attention_block_end(first, last, std::max<int64_t>(1, options.block_floats / heads));
                const int64_t block_rows = end - first;
                for (int head = 0; head < heads; ++head) {
                    source.read_rows(static_cast<int>(s), layer, head, first, end, rows[head]);
                    heavy[head].resize(block_rows * k);
                    heavy_count[head].resize(block_rows);
                }
                // Shared per-step work: each row's heavy hitters, once for all combinations.
                tbb::parallel_for(int64_t{0}, heads * block_rows, [&](int64_t job) {
                    const int head = static_cast<int>(job / block_rows);
                    const int64_t i = job % block_rows, t = first + i;
                    std::span<const float> row(rows[head].data() + attention_row_offset(t) - attention_row_offset(first),
                                               static_cast<std::size_t>(t));
                    thread_local std::vector<int32_t> top;
                    top.clear();
                    top_k_positions(row, k, top);
                    std::copy(top.begin(), top.end(), heavy[head].begin() + i * k);
                    heavy_count[head][i] = static_cast<int32_t>(top.size());
                });
                tbb::parallel_for(std::size_t{0}, harnesses.size(), [&](std::size_t job) {
                    const int head = static_cast<int>(job / num_combos);
                    Harness& harness = harnesses[job];
                    const float* row = rows[head].data();
                    for (int64_t i = 0; i < block_rows; ++i) {
                        const int64_t t = first + i;
                        harness.step(static_cast<int32_t>(t), {row, static_cast<std::size_t>(t)},
                                     {heavy[head].data() + i * k, static_cast<std::size_t>(heavy_count[head][i])});
                        row += t;
                    }
                });
                steps_done += block_rows;
                first = end;
                if (options.progress) options.progress(static_cast<double>(steps_done) / total_steps);
            }

            for (int head = 0; head < heads; ++head)
                for (std::size_t c = 0; c < num_combos; ++c) {
                    const Harness& harness = harnesses[head * num_combos + c];
                    results[c].by_layer[layer].add(harness.metrics());
                    results[c].total.add(harness.metrics());
                    results[c].policy_bytes_per_slot = harness.policy().bytes_per_slot();
                }
        }
    }
    return results;
}

}  // namespace kvsim
