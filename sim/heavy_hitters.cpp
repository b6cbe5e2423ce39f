#include "sim/heavy_hitters.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <functional>

namespace kvsim {
namespace {

// Whether any of row[0..16) may exceed (or, or_equal, reach) `floor`. Attention weights are never
// negative, so for floor >= 0 their bit patterns order as integers do, and integer comparisons
// vectorise where float ones (NaN rules) do not. A negative floor, or a NaN, only costs a scan.
inline bool block_may_pass(const float* row, float floor, bool or_equal) {
    if (!(floor >= 0.0f)) return true;
    int32_t floor_bits;
    std::memcpy(&floor_bits, &floor, 4);
    if (or_equal) --floor_bits;  // x >= f  <=>  x > f - 1 for integers (floor_bits >= 0 here)
#if defined(__AVX512F__)
    const __m512i block = _mm512_loadu_si512(row);
    return _mm512_cmpgt_epi32_mask(block, _mm512_set1_epi32(floor_bits)) != 0;
#elif defined(__AVX2__)
    const __m256i f = _mm256_set1_epi32(floor_bits);
    const __m256i lo = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), f);
    const __m256i hi = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8)), f);
    return !_mm256_testz_si256(_mm256_or_si256(lo, hi), _mm256_or_si256(lo, hi));
#else
    int32_t bits[16];
    std::memcpy(bits, row, sizeof bits);
    int any = 0;
    for (int l = 0; l < 16; ++l) any |= bits[l] > floor_bits;
    return any != 0;
#endif
}

}  // namespace

void top_k_positions(std::span<const float> row, int k, std::vector<int32_t>& out) {
    const std::size_t n = row.size();
    const std::size_t want = std::min<std::size_t>(static_cast<std::size_t>(k), n);
    if (want == 0) return;
    // The k-th largest weight (with multiplicity) by a min-heap of the k largest seen so far:
    // most weights fail the first comparison, so this is about one comparison per weight.
    float heap[256];
    std::vector<float> big_heap;
    float* h = heap;
    if (want > 256) {
        big_heap.resize(want);
        h = big_heap.data();
    }
    // Scanned from the newest position back: attention is heaviest on recent tokens, so the heap's
    // floor rises at once and few older weights get past it. The threshold is the same either way.
    std::copy(row.end() - static_cast<std::ptrdiff_t>(want), row.end(), h);
    std::make_heap(h, h + want, std::greater<float>());
    auto offer = [&](float x) {
        if (x > h[0]) {
            std::pop_heap(h, h + want, std::greater<float>());
            h[want - 1] = x;
            std::push_heap(h, h + want, std::greater<float>());
        }
    };
    // Blocks of 16 are tested with one vectorised comparison: once the heap holds large weights,
    // almost every block is skipped whole.
    std::size_t end = n - want;  // positions [0, end) remain
    for (; end >= 16; end -= 16)
        if (block_may_pass(row.data() + end - 16, h[0], false))
            for (int l = 15; l >= 0; --l) offer(row[end - 16 + l]);
    while (end > 0) offer(row[--end]);
    // One more pass, again skipping blocks with nothing at or above the threshold: positions
    // above it all count; ties fill the remaining slots in ascending position order.
    const float threshold = h[0];
    const std::size_t first_out = out.size();
    thread_local std::vector<int32_t> ties;
    ties.clear();
    auto take = [&](std::size_t j) {
        if (row[j] > threshold)
            out.push_back(static_cast<int32_t>(j));
        else if (row[j] == threshold)
            ties.push_back(static_cast<int32_t>(j));
    };
    std::size_t j = 0;
    for (; j + 16 <= n; j += 16)
        if (block_may_pass(row.data() + j, threshold, true))
            for (int l = 0; l < 16; ++l) take(j + l);
    for (; j < n; ++j) take(j);
    const std::size_t ties_needed = want - (out.size() - first_out);
    out.insert(out.end(), ties.begin(), ties.begin() + static_cast<std::ptrdiff_t>(ties_needed));
}

}  // namespace kvsim
