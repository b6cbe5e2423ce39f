// A ranking kept between steps as two arrays, keys and slots, meant to ascend as pairs (the key,
// then the slot): where it does not any more. A policy that ranks tokens by a score that changes a
// little each step (stratigraphic's cumulative attention) renews the keys and finishes the order
// with an insertion sort, which moves only the tokens marked here. The keys are the scores
// themselves, encoded so that plain integer order is the ranking's, and the score is renewed in
// its key where the token lies in the ranking.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvsim {

// An importance as an unsigned number in the order selections need (NaN lowest, then ascending;
// -0 and +0 one key, as they compare equal): selections then compare plain integers, where a
// comparison of doubles that minds NaN branched through every step of nth_element.
inline uint64_t ascending_key(double x) {
    // Written without branches (x + 0.0 turns -0 into +0): the loop over a head's tokens vectorises.
    const uint64_t bits = std::bit_cast<uint64_t>(x + 0.0);
    constexpr uint64_t kSign = uint64_t{1} << 63;
    const uint64_t key = bits & kSign ? ~bits : bits | kSign;  // -inf's key is 0x000f..., above NaN's
    return x == x ? key : 0;
}

// The importance an ascending key was made from (a NaN for a NaN's key, and +0 for -0's: the
// importance is a sum that starts at +0, so it is never -0). Without branches, as ascending_key.
inline double from_ascending_key(uint64_t key) {
    constexpr uint64_t kSign = uint64_t{1} << 63;
    const double x = std::bit_cast<double>(key & kSign ? key & ~kSign : ~key);
    return key == 0 ? std::numeric_limits<double>::quiet_NaN() : x;
}

// The step's weights added to the tokens' cumulative attention where it is kept, as ranking keys
// (~ascending_key of it), each weight found by its token's slot: key[k] = ~ascending_key(
// from_ascending_key(~key[k]) + weight[slot[k]]) for k < n. Both conversions are one map, an
// involution on the bits (sign set: kept; clear: every other bit flipped), NaN aside.
inline void add_weights_to_keys(uint64_t* key, const uint32_t* slot, const float* weight, std::size_t n) {
    std::size_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    // Eight at a time: the weights found by slot, as the scalar loop's, and every NaN made and
    // kept as it would (its key all ones, whatever its payload; all ones read back is a NaN). The
    // eight weights are eight scalar loads, not a gather instruction: on the Xeon (model 167) a
    // call over 4,000 keys took 1.9-2.1 us against 3.2-3.3 us with _mm256_i32gather_ps.
    const __m512i sign = _mm512_set1_epi64(static_cast<long long>(uint64_t{1} << 63));
    const __m512i rest = _mm512_set1_epi64(static_cast<long long>(~(uint64_t{1} << 63)));
    const __m512i all_ones = _mm512_set1_epi64(-1);
    const auto flip = [&](__m512i b) {
        return _mm512_mask_mov_epi64(_mm512_andnot_si512(b, rest), _mm512_test_epi64_mask(b, sign), b);
    };
    for (; k + 8 <= n; k += 8) {
        const __m512i stored = _mm512_loadu_si512(key + k);
        const uint32_t* at = slot + k;
        const __m512d w = _mm512_cvtps_pd(_mm256_setr_ps(weight[at[0]], weight[at[1]], weight[at[2]], weight[at[3]],
                                                         weight[at[4]], weight[at[5]], weight[at[6]], weight[at[7]]));
        const __m512d x = _mm512_castsi512_pd(flip(stored));  // a NaN's key, all ones, stays a NaN
        const __m512d y = _mm512_add_pd(_mm512_add_pd(x, w), _mm512_setzero_pd());  // -0 as +0, as ascending_key
        const __m512i renewed = _mm512_mask_mov_epi64(flip(_mm512_castpd_si512(y)), _mm512_cmp_pd_mask(y, y, _CMP_UNORD_Q),
                                                      all_ones);
        _mm512_storeu_si512(key + k, renewed);
    }
#endif
    for (; k < n; ++k) key[k] = ~ascending_key(from_ascending_key(~key[k]) + static_cast<double>(weight[slot[k]]));
}

// Whether pair (a_key, a_slot) comes before pair (b_key, b_slot) in the ranking's order.
inline bool pair_before(uint64_t a_key, uint32_t a_slot, uint64_t b_key, uint32_t b_slot) {
    return a_key < b_key || (a_key == b_key && a_slot < b_slot);
}

// Every j in [1, n) where the ranking descends (pair j before pair j - 1), as bits: bit j % 64 of
// word j / 64; bit 0 is never set. `words` holds (n + 63) / 64. Slots are below 2^31.
// From 3% to a quarter of the tokens move a step (measured in the runtime's benchmark, the tier fit
// and random weights), at places no branch predicts: one pass marks them all, eight pairs (four
// with AVX2) compared at once and no branch on what they hold, so that the insertion sort walks
// the bits instead of restarting a search after every move.
inline void mark_descents(const uint64_t* key, const uint32_t* slot, std::size_t n, uint64_t* words) {
    const std::size_t word_count = (n + 63) / 64;
    for (std::size_t w = 0; w < word_count; ++w) words[w] = 0;
    auto descends = [&](std::size_t j) { return pair_before(key[j], slot[j], key[j - 1], slot[j - 1]); };
    std::size_t j = 1;
    // Up to the first multiple of eight, one at a time: the vector loops then fill whole bytes.
    for (; j < n && j < 8; ++j) words[0] |= uint64_t{descends(j)} << j;
#if defined(__AVX512F__)
    for (; j + 8 <= n; j += 8) {
        const __m512i here = _mm512_loadu_si512(key + j), before = _mm512_loadu_si512(key + j - 1);
        const __m512i slot_here = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(slot + j)));
        const __m512i slot_before = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(slot + j - 1)));
        const __mmask8 descent = _mm512_cmplt_epu64_mask(here, before) |
                                 (_mm512_cmpeq_epu64_mask(here, before) & _mm512_cmplt_epu64_mask(slot_here, slot_before));
        words[j / 64] |= uint64_t{descent} << (j % 64);
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
        const auto mask = static_cast<unsigned>(_mm256_movemask_pd(_mm256_castsi256_pd(descent)));
        words[j / 64] |= uint64_t{mask} << (j % 64);
    }
#endif
    for (; j < n; ++j) words[j / 64] |= uint64_t{descends(j)} << (j % 64);
}

}  // namespace kvsim
