// kvsim search on a Llama-3.2-1B-shaped synthetic Q/K/V trace (16 layers, 32 query heads, 8 KV
// heads, head size 128): three sequences, two fitted and one held out; H2O's per-layer and
// per-head budgets at 2x and 4x. Reports the search's time, and the share of it that recomputing
// attention from Q and K takes (each pass computes every layer's attention once and shares it
// among all budgets and heads; the search makes two passes, fitting and held out).
//   build/bench/bench_search [tokens per sequence, default 1024] [grid points, default 16]
//                            [share of decode steps whose output error is measured, default 1: every step]
#include <sys/resource.h>
#include <tbb/info.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "search/allocation.h"
#include "search/search.h"
#include "sim/qkv_attention.h"
#include "sim/replay.h"
#include "sim/synthetic_qkv.h"
#include "sim/trace_store.h"
#include "bench/arguments.h"

using namespace kvsim;
using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

int main(int argc, char** argv) {
    const int64_t tokens = kvsim::bench::integer_argument<int64_t>(argc, argv, 1, 1024, 2, 1 << 20, "tokens per sequence");
    const int grid_points = kvsim::bench::integer_argument(argc, argv, 2, 16, 1, 4096, "grid budgets");
    const double sample_steps = kvsim::bench::real_argument(argc, argv, 3, 1.0, 0.0, 1.0, "sampled share of steps");
    SyntheticQkvSpec spec = synthetic_qkv_trace("llama-1b-4096", "bench");
    spec.tokens = tokens;
    const std::string dir = std::filesystem::temp_directory_path() / "kvsim-bench-search";
    std::filesystem::create_directories(dir);
    const std::string trace = dir + "/llama-1b-3x" + std::to_string(tokens) + ".h5";

    // Three sequences of the generator with different seeds, float16 as capture would store them.
    auto start = Clock::now();
    write_synthetic_qkv_trace(spec, trace, TensorDtype::float16, 3);
    std::printf("trace: 3 sequences x %lld tokens, %d layers, %d/%d heads, head size %d; written in %.1f s\n",
                static_cast<long long>(tokens), spec.num_layers, spec.num_query_heads, spec.num_kv_heads, spec.head_dim,
                seconds_since(start));

    // The attention recomputation alone: one pass over every sequence and layer.
    start = Clock::now();
    {
        auto source = open_trace_source(trace, 0);
        auto* qkv = dynamic_cast<QkvSource*>(source.get());
        AttentionBlock block;
        const int64_t floats = source->block_floats(ReplayOptions{}.block_floats) / spec.num_query_heads;
        for (int s = 0; s < 3; ++s)
            for (int layer = 0; layer < spec.num_layers; ++layer) {
                for (int64_t first = 1; first < tokens;) {
                    const int64_t end = attention_block_end(first, tokens - 1, floats);
                    qkv->read_block(s, layer, first, end, block);
                    first = end;
                }
            }
    }
    const double attention_seconds = seconds_since(start);  // reading the layers included

    SearchSpec search;
    search.where = "bench: search";
    search.policy.name = "h2o";
    search.policy.params = {{"recent_window", 32}};
    search.policy.where = "bench: search.policy";
    search.heldout = {2};
    search.split_where = "bench: search.split";
    search.targets = {{2.0, 0, "2x", "bench: target 2x"}, {4.0, 0, "4x", "bench: target 4x"}};
    search.grid_where = "bench: grid";
    search.sample_steps = sample_steps;
    search.sample_where = "bench: search.sample";
    const std::vector<int> dense = budget_grid(33, static_cast<int>(tokens - 1), spec.num_layers);
    for (int i = 0; i < grid_points; ++i)  // an even pick from the dense grid
        search.grid.push_back(dense[static_cast<std::size_t>(std::llround(i * (dense.size() - 1.0) / (grid_points - 1)))]);
    SearchRun run;
    run.config_file = dir + "/bench.yaml";
    std::ofstream(run.config_file) << "# bench_search\n";
    run.trace_path = trace;
    start = Clock::now();
    const SearchOutcome outcome = run_search(search, run);
    const double search_seconds = seconds_since(start);
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);

    std::printf("%s", format_search_table(outcome).c_str());
    std::printf("\nsearch: %d grid budgets x %d layers x %d KV heads, %d threads, output error on %g of the steps: "
                "%.1f s; peak memory %.0f MB\n",
                grid_points, spec.num_layers, spec.num_kv_heads, tbb::info::default_concurrency(), sample_steps,
                search_seconds, usage.ru_maxrss / 1024.0);
    // The search passes over 2 fitting sequences once and the held-out one once: one attention
    // computation per sequence and layer in all, shared by every budget and head.
    std::printf("attention recomputed from Q and K, one pass over the 3 sequences: %.1f s = %.0f%% of the search\n",
                attention_seconds, 100.0 * attention_seconds / search_seconds);
    std::filesystem::remove_all(dir);
    return 0;
}
