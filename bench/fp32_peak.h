// This machine's fp32 fused-multiply-add peak, measured rather than looked up: independent
// chains of vector FMAs (enough to hide latency) on every core at once.
#pragma once
#include <tbb/parallel_for.h>

#include <chrono>

namespace kvsim::bench {

// Returns GFLOP/s (one FMA = 2 flops), median-free: the best of a few short trials.
inline double measure_fp32_peak_gflops(int threads) {
    typedef float v16 __attribute__((vector_size(64)));
    constexpr int kChains = 12;
    constexpr long kIterations = 20'000'000;
    double best = 0;
    for (int trial = 0; trial < 3; ++trial) {
        const auto start = std::chrono::steady_clock::now();
        float sink = 0;
        tbb::parallel_for(0, threads, [&](int) {
            v16 acc[kChains];
            const v16 a = {} , b = {};
            v16 x, y;
            for (int i = 0; i < 16; ++i) {
                x[i] = 1.0f + 1e-7f * i;
                y[i] = 0.999999f;
            }
            (void)a, (void)b;
            for (auto& c : acc) c = x;
            for (long it = 0; it < kIterations / 16; ++it)
                for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * y + x;
            float s = 0;
            for (auto& c : acc) s += c[0];
            sink += s;  // keeps the loop alive; races on this value do not matter
        });
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const double flops = 2.0 * 16 * kChains * (kIterations / 16) * threads;
        if (sink != 12345) best = std::max(best, flops / seconds / 1e9);
    }
    return best;
}

}  // namespace kvsim::bench
