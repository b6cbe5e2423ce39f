// The tiers of sixteen held positions at once, with AVX-512. A tier array holds a byte per
// position and the held positions are scattered, so each tier is read as the byte of the aligned
// 32-bit word that holds it: the word is read whole, so nothing past the array's own words is.
#pragma once
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kvsim {

class TierGather {
public:
    explicit TierGather(const uint8_t* tiers)
        : misalign_(static_cast<int>(reinterpret_cast<uintptr_t>(tiers) & 3)),
          words_(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(tiers) & ~uintptr_t{3})) {}

    // tiers[positions[i]] in lane i (positions at least 0).
    __m512i at(__m512i positions) const {
        const __m512i p = _mm512_add_epi32(positions, _mm512_set1_epi32(misalign_));
        const __m512i word = _mm512_i32gather_epi32(_mm512_srli_epi32(p, 2), words_, 4);
        const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(p, _mm512_set1_epi32(3)), 3);
        return _mm512_and_si512(_mm512_srlv_epi32(word, shift), _mm512_set1_epi32(0xff));
    }

private:
    int misalign_;
    const void* words_;
};

}  // namespace kvsim
#endif
