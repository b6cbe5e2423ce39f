#include "cache_math/softmax_exp.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>

// Eigen 3.4.0's pexp_float for eight floats (AVX2 with FMA), step by step. AVX-512 builds and any
// other Eigen keep Eigen's own expressions: the tests compare these bits with Eigen's.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && EIGEN_VERSION_AT_LEAST(3, 4, 0) && \
    !EIGEN_VERSION_AT_LEAST(3, 4, 1)
#define KVSIM_FAST_SOFTMAX_EXP 1
#include <immintrin.h>
#endif

namespace kvsim {

#if defined(KVSIM_FAST_SOFTMAX_EXP)
namespace {

// exp of eight floats: Eigen 3.4.0's pexp_float line for line, in Eigen's own packet operations
// (their operand orders decide which input a min or max returns for NaN), but for the ldexp.
inline Eigen::internal::Packet8f exp8(const Eigen::internal::Packet8f& input) {
    using namespace Eigen::internal;
    using P = Packet8f;
    const P x = pmax(pmin(input, pset1<P>(88.723f)), pset1<P>(-88.723f));
    const P m = pfloor(pmadd(x, pset1<P>(1.44269504088896341f), pset1<P>(0.5f)));
    P r = pmadd(m, pset1<P>(-0.693359375f), x);
    r = pmadd(m, pset1<P>(2.12194440e-4f), r);
    const P r2 = pmul(r, r), r3 = pmul(r2, r);
    P y = pmadd(pset1<P>(1.9875691500E-4f), r, pset1<P>(1.3981999507E-3f));
    P y1 = pmadd(pset1<P>(4.1665795894E-2f), r, pset1<P>(1.6666665459E-1f));
    const P y2 = padd(r, pset1<P>(1.0f));
    y = pmadd(y, r, pset1<P>(8.3334519073E-3f));
    y1 = pmadd(y1, r, pset1<P>(5.0000001201E-1f));
    y = pmadd(y, r3, y1);
    y = pmadd(y, r2, y2);
    // y is in [0.7, 1.42]. Eigen's ldexp multiplies by 2^b three times and then by 2^(m - 3b),
    // b = floor(m / 4). For m in [-125, 0] every factor and every partial product is a normal
    // float, so each multiply by a power of two is exact: one multiply by 2^m is the same number.
    const __m256 outside = _mm256_or_ps(_mm256_cmp_ps(m, _mm256_set1_ps(-125.0f), _CMP_LT_OQ),
                                        _mm256_cmp_ps(m, _mm256_setzero_ps(), _CMP_GT_OQ));
    P scaled;
    if (_mm256_movemask_ps(outside) == 0) {
        const __m256i biased = _mm256_add_epi32(_mm256_cvttps_epi32(m), _mm256_set1_epi32(127));
        scaled = pmul(y, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
    } else {
        scaled = pldexp(y, m);  // NaN, or an exponent outside [-125, 0]
    }
    return pmax(scaled, input);
}

// Eigen's assignment and reduction take x[0, start) and x[end, n) one by one and the 32-byte
// aligned packets between; the reduction adds the packets in two alternating sums.
template <bool with_sum>
float exp_pass(float* x, int64_t n, float peak) {
    const int64_t misalignment = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(x) & 31);
    const int64_t start = std::min<int64_t>(n, ((32 - misalignment) & 31) / int64_t{sizeof(float)});
    const int64_t end = start + (n - start) / 8 * 8, end_of_pairs = start + (n - start) / 16 * 16;
    for (int64_t i = 0; i < start; ++i) x[i] = std::exp(x[i] - peak);
    for (int64_t i = end; i < n; ++i) x[i] = std::exp(x[i] - peak);
    using Eigen::internal::padd;
    const __m256 p = _mm256_set1_ps(peak);
    auto packet = [&](int64_t i) {
        const __m256 e = exp8(Eigen::internal::psub(_mm256_load_ps(x + i), p));
        _mm256_store_ps(x + i, e);
        return e;
    };
    if (end == start) {  // no whole packet: Eigen's sum is one chain from the first value
        if constexpr (!with_sum) return 0.0f;
        float total = x[0];
        for (int64_t i = 1; i < n; ++i) total += x[i];
        return total;
    }
    __m256 sum0 = packet(start);
    if (end - start > 8) {
        __m256 sum1 = packet(start + 8);
        for (int64_t i = start + 16; i < end_of_pairs; i += 16) {
            const __m256 a = packet(i), b = packet(i + 8);
            sum0 = padd(sum0, a);
            sum1 = padd(sum1, b);
        }
        sum0 = padd(sum0, sum1);
        if (end > end_of_pairs) sum0 = padd(sum0, packet(end_of_pairs));
    }
    if constexpr (!with_sum) return 0.0f;
    float total = Eigen::internal::predux(sum0);
    for (int64_t i = 0; i < start; ++i) total += x[i];
    for (int64_t i = end; i < n; ++i) total += x[i];
    return total;
}

}  // namespace

float exp_minus_peak_and_sum(float* x, int64_t n, float peak) { return exp_pass<true>(x, n, peak); }
void exp_minus_peak(float* x, int64_t n, float peak) { exp_pass<false>(x, n, peak); }
bool fast_softmax_exp() { return true; }

#else

float exp_minus_peak_and_sum(float* x, int64_t n, float peak) {
    Eigen::Map<Eigen::ArrayXf> row(x, n);
    row = (row - peak).exp();
    return row.sum();
}
void exp_minus_peak(float* x, int64_t n, float peak) {
    Eigen::Map<Eigen::ArrayXf> row(x, n);
    row = (row - peak).exp();
}
bool fast_softmax_exp() { return false; }

#endif

}  // namespace kvsim
