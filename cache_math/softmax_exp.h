#pragma once
// The softmax's exponentials with the bits of Eigen 3.4's array expressions, quicker.
//
// Every softmax in kvsim took `x = (x - peak).exp()` and then `x.sum()` from Eigen, and every
// result (replays, searches, the runtime's weights) carries those bits. Eigen's vectorized exp
// (Cephes' polynomial) ends with a general ldexp that multiplies by 2^m in four steps so that no
// exponent from -278 to 278 overflows. A softmax's exponents lie in [-125, 0] almost always, where
// one multiply by 2^m is exact and gives the same bits; this takes that path for every eight
// values whose exponents allow it, and Eigen's own ldexp otherwise. The sum is fused into the same
// pass, in the order of Eigen's reduction.

#include <cstddef>
#include <cstdint>

namespace kvsim {

// Where a row must start for its exponentials' bits not to depend on where the heap put it: Eigen
// takes a row's unaligned head one by one, and its packets are 32 bytes with AVX2 and 64 with
// AVX-512. A row starting on 64 bytes is aligned for every build's packets.
constexpr std::size_t kSoftmaxRowAlignBytes = 64;

// x[j] = exp(x[j] - peak) for j < n (n >= 1): the bits Eigen 3.4 gives for
// `Eigen::Map<Eigen::ArrayXf>(x, n) = (Eigen::Map<Eigen::ArrayXf>(x, n) - peak).exp()` at this address
// (where x is not 32-byte aligned, Eigen takes the first values with std::exp, one by one; so does
// this). Returns their sum with the bits of Eigen's `.sum()` over the same array.
float exp_minus_peak_and_sum(float* x, int64_t n, float peak);

// The same exponentials, without the sum.
void exp_minus_peak(float* x, int64_t n, float peak);

// Whether the fast path serves in this build (AVX2 with FMA, without AVX-512, Eigen 3.4.0);
// otherwise both functions are Eigen's expressions themselves.
bool fast_softmax_exp();

}  // namespace kvsim
