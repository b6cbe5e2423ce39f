#include "sim/heavy_hitters.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <climits>
#include <functional>

namespace kvsim {
namespace {

// Weights are ranked by an integer key: IEEE 754 totalOrder (-NaN < -Inf < ... < -0 < +0 < ... <
// +Inf < +NaN). Integer comparisons form a strict weak order on any bits, so the heap and the
// counts below stay consistent on NaN, Inf, negative or denormal input (float comparisons do not:
// a NaN threshold once let the tie fill read past its list). For finite weights >= +0, the
// attention a trace holds, the key is the float's bit pattern, which orders and ties exactly as
// the floats do: results on valid input are unchanged.
inline int32_t rank_key(float x) {
    int32_t bits;
    std::memcpy(&bits, &x, 4);
    return bits ^ ((bits >> 31) & INT32_MAX);  // negative floats order in reverse; branch-free
}

// Whether any of row[0..16) may have a key above (or, or_equal, at) floor_key. A float with the sign
// bit clear has its bits as its key, and one with it set has a negative key and negative bits, so
// for floor_key >= 0 comparing the raw bits as integers (which vectorises, where NaN rules keep
// float comparisons from it) is exact; a negative floor only costs a scan.
inline bool block_may_pass(const float* row, int32_t floor_key, bool or_equal) {
    if (floor_key < 0) return true;
    const int32_t floor_bits = or_equal ? floor_key - 1 : floor_key;  // x >= f <=> x > f - 1 (no wrap: f >= 0)
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
    const std::size_t want = k > 0 ? std::min<std::size_t>(static_cast<std::size_t>(k), n) : 0;
    if (want == 0) return;
    // The k-th largest key (with multiplicity) by a min-heap of the k largest seen so far:
    // most weights fail the first comparison, so this is about one comparison per weight.
    int32_t heap[256];
    std::vector<int32_t> big_heap;
    int32_t* h = heap;
    if (want > 256) {
        big_heap.resize(want);
        h = big_heap.data();
    }
    // Scanned from the newest position back: attention is heaviest on recent tokens, so the heap's
    // floor rises at once and few older weights get past it. The threshold is the same either way.
    std::transform(row.end() - static_cast<std::ptrdiff_t>(want), row.end(), h, rank_key);
    std::make_heap(h, h + want, std::greater<int32_t>());
    auto offer = [&](float x) {
        const int32_t key = rank_key(x);
        if (key > h[0]) {
            std::pop_heap(h, h + want, std::greater<int32_t>());
            h[want - 1] = key;
            std::push_heap(h, h + want, std::greater<int32_t>());
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
    // above it all count; ties fill the remaining slots in ascending position order. Fewer than
    // `want` keys lie above the k-th largest and at least `want` at or above it, so the ties
    // always cover what is missing.
    const int32_t threshold = h[0];
    const std::size_t first_out = out.size();
    thread_local std::vector<int32_t> ties;
    ties.clear();
    auto take = [&](std::size_t j) {
        const int32_t key = rank_key(row[j]);
        if (key > threshold)
            out.push_back(static_cast<int32_t>(j));
        else if (key == threshold)
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
