// What the value-level metrics and quantised caches cost in the replay, as ratios to the same
// replay without them. Trace: synthetic small-1024 (4 layers, 8 query heads, 2 KV heads, head
// size 64, 1024 tokens), generated in-process.
//   build/bench/bench_precision [runs]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "src/experiment.h"
#include "bench/arguments.h"

using namespace kvsim;

namespace {

double median_seconds(const ExperimentConfig& config, int runs) {
    std::vector<double> seconds;
    for (int r = 0; r < runs; ++r) {
        const auto start = std::chrono::steady_clock::now();
        run_experiment(config, {}, false);
        seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(seconds.begin(), seconds.end());
    return seconds[seconds.size() / 2];
}

PolicyEntry policy(const std::string& name, std::map<std::string, double> params = {}) {
    return PolicyEntry{name, std::move(params), "bench"};
}

}  // namespace

int main(int argc, char** argv) {
    const int runs = kvsim::bench::integer_argument(argc, argv, 1, 5, 1, 1000, "runs");
    ExperimentConfig config;
    config.file = "bench";
    config.trace.synthetic = "qkv";
    config.trace.name = "small-1024";
    config.budgets = {128, 256};
    const std::vector<PolicyEntry> eviction = {policy("sliding_window"), policy("streaming_llm"), policy("h2o"),
                                               policy("scissorhands"),   policy("tova"),          policy("snapkv"),
                                               policy("pyramidkv")};
    config.policies = eviction;

    config.metrics = {"retained_mass", "heavy_hitter_recall"};
    const double base = median_seconds(config, runs);
    config.metrics = {"retained_mass", "heavy_hitter_recall", "bytes_per_token", "compression_ratio"};
    const double memory = median_seconds(config, runs);
    config.metrics = {"retained_mass", "heavy_hitter_recall", "output_rel_error", "output_cosine"};
    const double output = median_seconds(config, runs);

    // The same replay with every eviction policy's kept tokens quantised to int4 past 64 steps.
    config.policies.clear();
    for (PolicyEntry p : eviction) {
        p.quantized = true;
        p.quantize = {{"bits", 4}, {"older_than", 64}};
        config.policies.push_back(p);
    }
    const double quantised_output = median_seconds(config, runs);
    config.metrics = {"retained_mass", "heavy_hitter_recall"};
    const double quantised_plain = median_seconds(config, runs);

    std::printf("replay of small-1024, 7 eviction policies x 2 budgets, medians of %d runs\n", runs);
    std::printf("  attention metrics only (retained mass, recall):        %.3f s  1.00x\n", base);
    std::printf("  + memory (bytes per token, compression):               %.3f s  %.2fx\n", memory, memory / base);
    std::printf("  + output error (cached attention output vs full):      %.3f s  %.2fx\n", output, output / base);
    std::printf("  policies composed with int4 (older_than 64), no values: %.3f s  %.2fx\n", quantised_plain,
                quantised_plain / base);
    std::printf("  composed with int4 + output error (tiers built):       %.3f s  %.2fx\n", quantised_output,
                quantised_output / base);
    return 0;
}
