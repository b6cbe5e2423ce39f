// This machine's fp32 fused-multiply-add peak, measured rather than looked up: on each of
// `threads` OS threads at once, twelve independent chains of 16-wide vector FMAs (enough to hide
// the FMA latency on two pipes).
#pragma once
#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace kvsim::bench {

// GFLOP/s, one FMA counted as 2 flops: the best of three trials.
inline double measure_fp32_peak_gflops(int threads) {
    typedef float v16 __attribute__((vector_size(64)));
    constexpr int kChains = 12;
    constexpr long kIterations = 20'000'000;
    auto chains = [](float* result) {
        v16 acc[kChains], x, y;
        for (int i = 0; i < 16; ++i) {
            x[i] = 1.0f + 1e-7f * i;
            y[i] = 0.999999f;
        }
        for (auto& c : acc) c = x;
        for (long it = 0; it < kIterations; ++it)
            for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * y + x;
        float sum = 0;
        for (auto& c : acc) sum += c[0];
        *result = sum;  // keeps the chains alive
    };
    double best = 0;
    for (int trial = 0; trial < 3; ++trial) {
        std::vector<float> results(threads);
        std::vector<std::thread> workers;
        const auto start = std::chrono::steady_clock::now();
        for (int t = 0; t < threads; ++t) workers.emplace_back(chains, &results[t]);
        for (auto& w : workers) w.join();
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        best = std::max(best, 2.0 * 16 * kChains * kIterations * threads / seconds / 1e9);
    }
    return best;
}

}  // namespace kvsim::bench
