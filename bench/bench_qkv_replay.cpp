// Replay of a synthetic Q/K/V trace shaped like Llama-3.2-1B (16 layers, 32 query heads, 8 KV
// heads, head size 128, 4096 tokens), all seven policies at budgets 256, 512 and 1024.
// Reports the attention recomputation's GFLOP/s against this machine's measured fp32 FMA peak,
// the whole replay's policy-steps per second, and peak memory (which must not grow with layers).
//   build/bench/bench_qkv_replay [layers] [block floats]
#include <sys/resource.h>
#include <tbb/info.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "fp32_peak.h"
#include "sim/qkv_attention.h"
#include "sim/replay.h"
#include "sim/sweep.h"
#include "sim/synthetic_qkv.h"
#include "bench/arguments.h"

using namespace kvsim;
using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

int main(int argc, char** argv) {
    SyntheticQkvSpec spec = synthetic_qkv_trace("llama-1b-4096", "bench");
    spec.num_layers = kvsim::bench::integer_argument(argc, argv, 1, spec.num_layers, 1, 256, "layers");
    const int64_t wanted_block_floats = kvsim::bench::integer_argument<int64_t>(
        argc, argv, 2, ReplayOptions{}.block_floats, 1, int64_t{1} << 40, "block floats");
    const int threads = tbb::info::default_concurrency();
    const double peak = bench::measure_fp32_peak_gflops(threads);
    std::printf("machine: %d threads, measured fp32 FMA peak %.1f GFLOP/s\n", threads, peak);

    // 1. Attention recomputation alone, on one layer, in the engine's block size.
    const QkvShape shape{spec.num_query_heads, spec.num_kv_heads, spec.head_dim};
    auto start = Clock::now();
    QkvLayer layer = generate_synthetic_qkv_layer(spec, 0);
    const double generate_seconds = seconds_since(start);
    AttentionBlock block;
    auto source = make_synthetic_qkv_source(spec, 0);
    const int64_t block_floats =
        source->block_floats(wanted_block_floats) / spec.num_query_heads;
    double flops = 0;
    start = Clock::now();
    KeysByFeature keys;
    keys_by_feature(layer, shape, keys);  // once per layer, as a replay does
    for (int64_t first = 1; first < spec.tokens;) {
        const int64_t end = attention_block_end(first, spec.tokens - 1, block_floats);
        attention_from_qkv(layer, keys, shape, first, end, block);
        flops += attention_flops(shape, first, end);
        first = end;
    }
    const double attention_seconds = seconds_since(start);
    const double layer_mb = (layer.q.size() + layer.k.size() + layer.v.size()) * 4 / 1e6;
    std::printf("one layer: generate Q/K/V %.2f s; attention for 4095 steps x 32 heads %.2f s = %.1f GFLOP/s "
                "(%.0f%% of peak; score products only, softmax not counted)\n",
                generate_seconds, attention_seconds, flops / attention_seconds / 1e9,
                100.0 * flops / attention_seconds / 1e9 / peak);

    layer = QkvLayer{};  // free the bench's own copy: the replay's peak memory is what is measured

    // 2. The whole replay.
    std::vector<PolicyEntry> policies;
    for (const char* name : {"sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "snapkv", "pyramidkv"})
    {
        PolicyEntry entry;
        entry.name = name;
        entry.where = "bench";
        policies.push_back(entry);
    }
    const auto combos = expand_sweep(policies, {}, {256, 512, 1024});
    start = Clock::now();
    replay(*source, combos, ReplayOptions{});
    const double replay_seconds = seconds_since(start);
    const double harness_steps = static_cast<double>(combos.size()) * spec.num_layers * spec.num_kv_heads * 4095;
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    std::printf("replay: %d layers x %d KV heads x %zu combinations x 4095 steps = %.3g policy-steps in %.1f s "
                "(%.0f per second, each over %d query heads)\n",
                spec.num_layers, spec.num_kv_heads, combos.size(), harness_steps, replay_seconds,
                harness_steps / replay_seconds, spec.num_query_heads / spec.num_kv_heads);
    std::printf("peak resident memory: %.0f MB (one layer's Q/K/V is %.0f MB)\n", usage.ru_maxrss / 1024.0, layer_mb);
    return 0;
}
