// This machine's fp32 fused-multiply-add peak, measured rather than looked up: on each of
// `threads` OS threads at once, twelve independent chains of vector FMAs (enough to hide the FMA
// latency on two pipes), as wide as the build's vectors: 16 floats with AVX-512, else 8 (twelve
// 16-wide chains take 24 of AVX2's 16 registers and spill). The chains start apart, so that no
// compiler folds them into one.
#pragma once
#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace kvsim::bench {

// GFLOP/s, one FMA counted as 2 flops: the best of three trials.
inline double measure_fp32_peak_gflops(int threads) {
#if defined(__AVX512F__)
    constexpr int kLanes = 16;
#else
    constexpr int kLanes = 8;
#endif
    typedef float vec __attribute__((vector_size(4 * kLanes)));
    constexpr int kChains = 12;
    constexpr long kIterations = 40'000'000;
    auto chains = [](float* result) {
        vec acc[kChains], x, y;
        for (int i = 0; i < kLanes; ++i) {
            x[i] = 1.0f + 1e-7f * i;
            y[i] = 0.999999f;
        }
        for (int c = 0; c < kChains; ++c) acc[c] = x + 1e-3f * static_cast<float>(c);
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
        best = std::max(best, 2.0 * kLanes * kChains * kIterations * threads / seconds / 1e9);
    }
    return best;
}

}  // namespace kvsim::bench
