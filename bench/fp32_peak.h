// This machine's fp32 fused-multiply-add peak, measured rather than looked up: on each of
// `threads` OS threads at once, independent chains of vector FMAs (explicit FMA instructions, as
// wide as the build's vectors: 16 floats with AVX-512, else 8), enough of them to cover the FMA's
// latency on two pipes without spilling a register (16 of AVX-512's 32; 12 of AVX2's 16). Written
// as FMA intrinsics, not `a * y + x`, so the figure does not rest on how the compiler contracts
// and schedules an expression: on a Zen 5 core the expression's form measured 58 GFLOP/s at -O2
// (its chains kept in memory) and 199 to 207 at the build's -O3, the intrinsics 201 to 210 at both.
#pragma once
#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace kvsim::bench {

// GFLOP/s, one FMA counted as 2 flops: the best of three trials.
inline double measure_fp32_peak_gflops(int threads) {
#if defined(__AVX512F__)
    constexpr int kLanes = 16, kChains = 16;
    using Vec = __m512;
    auto set1 = [](float x) { return _mm512_set1_ps(x); };
    auto fma = [](Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); };
    auto first = [](Vec a) { return _mm512_cvtss_f32(a); };
#elif defined(__AVX2__) && defined(__FMA__)
    constexpr int kLanes = 8, kChains = 12;
    using Vec = __m256;
    auto set1 = [](float x) { return _mm256_set1_ps(x); };
    auto fma = [](Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); };
    auto first = [](Vec a) { return _mm256_cvtss_f32(a); };
#else
    constexpr int kLanes = 1, kChains = 8;
    using Vec = float;
    auto set1 = [](float x) { return x; };
    auto fma = [](Vec a, Vec b, Vec c) { return __builtin_fmaf(a, b, c); };
    auto first = [](Vec a) { return a; };
#endif
    constexpr long kIterations = 40'000'000;
    auto chains = [&](float* result) {
        Vec acc[kChains];
        const Vec y = set1(0.999999f), x = set1(1e-7f);
        for (int c = 0; c < kChains; ++c) acc[c] = set1(1.0f + 1e-3f * static_cast<float>(c));
        for (long it = 0; it < kIterations; ++it)
#pragma GCC unroll 16
            for (int c = 0; c < kChains; ++c) acc[c] = fma(acc[c], y, x);
        float sum = 0;
        for (auto& c : acc) sum += first(c);
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
