// A ranking kept between steps as two arrays, keys and slots, meant to ascend as pairs (the key,
// then the slot): where it does not any more. A policy that ranks tokens by a score that changes a
// little each step (stratigraphic's cumulative attention) renews the keys and finishes the order
// with an insertion sort, which moves only the tokens found here.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvsim {

// The first j >= from (from >= 1) where the ranking descends: pair j before pair j - 1; n if none.
// Slots are below 2^31. From 3% to a quarter of the tokens move a step (measured in the runtime's
// benchmark, the tier fit and random weights), at places no branch predicts, so the search
// compares eight pairs (four with AVX2) at once and branches once for them.
inline std::size_t first_descent(const uint64_t* key, const uint32_t* slot, std::size_t from, std::size_t n) {
    std::size_t j = from;
#if defined(__AVX512F__)
    for (; j + 8 <= n; j += 8) {
        const __m512i here = _mm512_loadu_si512(key + j), before = _mm512_loadu_si512(key + j - 1);
        __mmask8 descent = _mm512_cmplt_epu64_mask(here, before);
        if (const __mmask8 tied = _mm512_cmpeq_epu64_mask(here, before)) {
            const __m512i slot_here = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(slot + j)));
            const __m512i slot_before =
                _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(slot + j - 1)));
            descent |= tied & _mm512_cmplt_epu64_mask(slot_here, slot_before);
        }
        if (descent) return j + static_cast<std::size_t>(std::countr_zero(static_cast<unsigned>(descent)));
    }
#endif
#if defined(__AVX2__)
    // (With AVX-512 too: a tail of four to seven.) AVX2 compares signed 64-bit lanes: flipping the
    // top bit orders unsigned keys as signed ones.
    const __m256i flip = _mm256_set1_epi64x(static_cast<long long>(uint64_t{1} << 63));
    for (; j + 4 <= n; j += 4) {
        const __m256i here = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + j)), flip);
        const __m256i before = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + j - 1)), flip);
        // Slots are below 2^31: signed compares order them.
        const __m256i slot_here = _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(slot + j)));
        const __m256i slot_before = _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(slot + j - 1)));
        const __m256i descent = _mm256_or_si256(
            _mm256_cmpgt_epi64(before, here),
            _mm256_and_si256(_mm256_cmpeq_epi64(here, before), _mm256_cmpgt_epi64(slot_before, slot_here)));
        if (const int mask = _mm256_movemask_pd(_mm256_castsi256_pd(descent)))
            return j + static_cast<std::size_t>(std::countr_zero(static_cast<unsigned>(mask)));
    }
#endif
    for (; j < n; ++j)
        if (key[j] < key[j - 1] || (key[j] == key[j - 1] && slot[j] < slot[j - 1])) return j;
    return n;
}

}  // namespace kvsim
