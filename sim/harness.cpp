#include "sim/harness.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "cache_math/streaming_heads.h"
#include "cache_math/tier_gather.h"
#include "base/errors.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvsim {

namespace {

// The first `heads` rows' weights on the kept positions, each summed in double in position order
// into retained[h] and copied to gathered[h * held + slot]. Several heads go together: each
// head's sum still adds in the same order, to the same double, but their chains of additions
// overlap instead of each addition waiting on the one before.
template <int heads>
int sum_in_order(std::span<const float* const> rows, std::span<const int32_t> kept, float* gathered,
                 double* retained) {
    const std::size_t held = kept.size();
    const float* row[heads];
    for (int h = 0; h < heads; ++h) row[h] = rows[h];
    double sum[heads] = {};
    if (gathered)
        for (std::size_t j = 0; j < held; ++j)
            for (int h = 0; h < heads; ++h) sum[h] += (gathered[h * held + j] = row[h][kept[j]]);
    else
        for (std::size_t j = 0; j < held; ++j)
            for (int h = 0; h < heads; ++h) sum[h] += row[h][kept[j]];
    for (int h = 0; h < heads; ++h) retained[h] = sum[h];
    return heads;
}

// Where four heads' sums are exact in any order (sum_four_heads_exactly): every weight +0 or in
// [2^-29, 2), told by the least of (bits - 1) over the weights, where +0 wraps to the top and
// passes, and the largest bits, where a negative, NaN or too large weight is at least 2.0f's.
bool exact_sum_range(uint32_t least_bits_minus_one, uint32_t largest_bits) {
    constexpr uint32_t smallest_bits = 0x31000000u;  // 2^-29 as a float
    constexpr uint32_t two_bits = 0x40000000u;        // 2.0f
    return least_bits_minus_one >= smallest_bits - 1 && largest_bits < two_bits;
}

// The least (bits - 1) and the largest bits over weights, which exact_sum_range reads: taken
// weight by weight, or folded in from a vector loop's lanes.
struct WeightBits {
    uint32_t least = UINT32_MAX, largest = 0;
    void add(float w) { fold(std::bit_cast<uint32_t>(w) - 1, std::bit_cast<uint32_t>(w)); }
    void fold(uint32_t lane_least, uint32_t lane_largest) {
        least = std::min(least, lane_least);
        largest = std::max(largest, lane_largest);
    }
    bool exact_in_any_order() const { return exact_sum_range(least, largest); }
};

#if defined(__AVX2__)
// Four heads' sums as sum_in_order<4> gives them, with the additions in two chains (even and
// odd slots) instead of one, so each addition need not wait on the one before. Any order gives
// the same bits when every addition is exact: when each weight is +0 or in [2^-29, 2) (its last
// bit is then at least 2^-52) and each total is below 2 (every partial sum of weights >= 0 is
// then below 2, where a double's last bit is 2^-52). Returns false where that is not shown, and
// the sums are then redone in order; on the Llama-1B-shaped synthetic trace that was 1 call in
// 10 million. The gathered weights are written either way, where `copy` asks for them.
// `bounded`: the caller has shown every weight of the rows +0 or in [2^-29, 2) (the replay does,
// once a step for all its harnesses), so only the totals are checked here.
template <bool by_position, bool copy, bool bounded = false>
bool sum_four_heads_exactly(std::span<const float* const> rows, const float* interleaved, std::span<const int32_t> kept,
                            float* gathered, double* retained) {
    const std::size_t held = kept.size();
    const float *row0 = rows[0], *row1 = rows[1], *row2 = rows[2], *row3 = rows[3];
    float *out0 = nullptr, *out1 = nullptr, *out2 = nullptr, *out3 = nullptr;
    if constexpr (copy)  // without a copy, gathered is null, and null + held would be undefined
        out0 = gathered, out1 = gathered + held, out2 = gathered + 2 * held, out3 = gathered + 3 * held;
    __m256d even = _mm256_setzero_pd(), odd = _mm256_setzero_pd();
    // Over all weights, as unsigned: the least of (bits - 1), where +0 wraps to the top and passes,
    // and the largest bits, where a negative, NaN or too large weight is at least 2.0f's.
    __m128i least = _mm_set1_epi32(-1), largest = _mm_setzero_si128();
    const __m128i one = _mm_set1_epi32(1);
    auto add = [&](std::size_t j, __m256d& sum) {
        const int32_t p = kept[j];
        __m128 w;
        if constexpr (by_position) {  // one load of the four heads' weights
            w = _mm_loadu_ps(interleaved + 4 * static_cast<std::size_t>(p));
            if constexpr (copy) {
                out0[j] = _mm_cvtss_f32(w);
                out1[j] = _mm_cvtss_f32(_mm_shuffle_ps(w, w, 1));
                out2[j] = _mm_cvtss_f32(_mm_movehl_ps(w, w));
                out3[j] = _mm_cvtss_f32(_mm_shuffle_ps(w, w, 3));
            }
        } else {
            const float a = row0[p], b = row1[p], c = row2[p], d = row3[p];
            if constexpr (copy) {
                out0[j] = a;
                out1[j] = b;
                out2[j] = c;
                out3[j] = d;
            }
            w = _mm_setr_ps(a, b, c, d);
        }
        if constexpr (!bounded) {
            const __m128i bits = _mm_castps_si128(w);
            least = _mm_min_epu32(least, _mm_sub_epi32(bits, one));
            largest = _mm_max_epu32(largest, bits);
        }
        sum = _mm256_add_pd(sum, _mm256_cvtps_pd(w));
    };
    std::size_t j = 0;
#if defined(__AVX512F__)
    if constexpr (by_position) {
        // Four slots' sixteen weights to a vector: checked and summed sixteen (eight) at a time,
        // and one permutation groups them by head for the copies. Lanes h, h + 4, h + 8, h + 12
        // are head h's; they are folded into the four-lane totals after the loop.
        __m512i least16 = _mm512_set1_epi32(-1), largest16 = _mm512_setzero_si512();
        __m512d sum_low = _mm512_setzero_pd(), sum_high = _mm512_setzero_pd();
        const __m512i one16 = _mm512_set1_epi32(1);
        const __m512i by_head = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        auto at = [&](std::size_t slot) { return _mm_loadu_ps(interleaved + 4 * static_cast<std::size_t>(kept[slot])); };
        // Slots j..j+3's weights, checked and summed. Four consecutive positions (kept ascends,
        // so the fourth is the first plus 3) are one load: a recent window, or a sliding window's
        // whole cache.
        auto load_four = [&](std::size_t j, __m512d& low, __m512d& high) {
            __m512 w;
            if (kept[j + 3] == kept[j] + 3) {
                w = _mm512_loadu_ps(interleaved + 4 * static_cast<std::size_t>(kept[j]));
            } else {
                w = _mm512_castps128_ps512(at(j));
                w = _mm512_insertf32x4(w, at(j + 1), 1);
                w = _mm512_insertf32x4(w, at(j + 2), 2);
                w = _mm512_insertf32x4(w, at(j + 3), 3);
            }
            if constexpr (!bounded) {
                const __m512i bits = _mm512_castps_si512(w);
                least16 = _mm512_min_epu32(least16, _mm512_sub_epi32(bits, one16));
                largest16 = _mm512_max_epu32(largest16, bits);
            }
            low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(w)));
            high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xFF, _mm512_castps_pd(w), 1))));
            return w;
        };
        if constexpr (copy) {
            // Sixteen slots at a time: each four grouped by head, then the four groups' 128-bit
            // lanes transposed, so that each head's sixteen weights are one store.
            __m512d low2 = _mm512_setzero_pd(), high2 = _mm512_setzero_pd();  // a second chain
            for (; j + 16 <= held; j += 16) {
                const __m512 g0 = _mm512_permutexvar_ps(by_head, load_four(j, sum_low, sum_high));
                const __m512 g1 = _mm512_permutexvar_ps(by_head, load_four(j + 4, low2, high2));
                const __m512 g2 = _mm512_permutexvar_ps(by_head, load_four(j + 8, sum_low, sum_high));
                const __m512 g3 = _mm512_permutexvar_ps(by_head, load_four(j + 12, low2, high2));
                const __m512 heads01_of_01 = _mm512_shuffle_f32x4(g0, g1, 0x44), heads23_of_01 = _mm512_shuffle_f32x4(g0, g1, 0xEE);
                const __m512 heads01_of_23 = _mm512_shuffle_f32x4(g2, g3, 0x44), heads23_of_23 = _mm512_shuffle_f32x4(g2, g3, 0xEE);
                _mm512_storeu_ps(out0 + j, _mm512_shuffle_f32x4(heads01_of_01, heads01_of_23, 0x88));
                _mm512_storeu_ps(out1 + j, _mm512_shuffle_f32x4(heads01_of_01, heads01_of_23, 0xDD));
                _mm512_storeu_ps(out2 + j, _mm512_shuffle_f32x4(heads23_of_01, heads23_of_23, 0x88));
                _mm512_storeu_ps(out3 + j, _mm512_shuffle_f32x4(heads23_of_01, heads23_of_23, 0xDD));
            }
            sum_low = _mm512_add_pd(sum_low, low2);
            sum_high = _mm512_add_pd(sum_high, high2);
        }
        for (; j + 4 <= held; j += 4) {
            const __m512 w = load_four(j, sum_low, sum_high);
            if constexpr (copy) {
                const __m512 grouped = _mm512_permutexvar_ps(by_head, w);
                _mm_storeu_ps(out0 + j, _mm512_castps512_ps128(grouped));
                _mm_storeu_ps(out1 + j, _mm512_extractf32x4_ps(grouped, 1));
                _mm_storeu_ps(out2 + j, _mm512_extractf32x4_ps(grouped, 2));
                _mm_storeu_ps(out3 + j, _mm512_extractf32x4_ps(grouped, 3));
            }
        }
        const __m256i least8 = _mm256_min_epu32(_mm512_maskz_extracti64x4_epi64(0xFF, least16, 0), _mm512_maskz_extracti64x4_epi64(0xFF, least16, 1));
        const __m256i largest8 = _mm256_max_epu32(_mm512_maskz_extracti64x4_epi64(0xFF, largest16, 0), _mm512_maskz_extracti64x4_epi64(0xFF, largest16, 1));
        least = _mm_min_epu32(least, _mm_min_epu32(_mm256_castsi256_si128(least8), _mm256_extracti128_si256(least8, 1)));
        largest = _mm_max_epu32(largest, _mm_max_epu32(_mm256_castsi256_si128(largest8), _mm256_extracti128_si256(largest8, 1)));
        const __m512d both = _mm512_add_pd(sum_low, sum_high);
        even = _mm256_add_pd(even, _mm256_add_pd(_mm512_maskz_extractf64x4_pd(0xFF, both, 0), _mm512_maskz_extractf64x4_pd(0xFF, both, 1)));
    }
#else
    if constexpr (by_position) {
        // Without AVX-512, four slots at a time: their four heads' weights transposed (a 4 x 4
        // block) into one vector store per head, instead of a scalar store per weight.
        for (; j + 4 <= held; j += 4) {
            __m128 w[4];
            for (int s = 0; s < 4; ++s) {
                w[s] = _mm_loadu_ps(interleaved + 4 * static_cast<std::size_t>(kept[j + s]));
                if constexpr (!bounded) {
                    const __m128i bits = _mm_castps_si128(w[s]);
                    least = _mm_min_epu32(least, _mm_sub_epi32(bits, one));
                    largest = _mm_max_epu32(largest, bits);
                }
            }
            even = _mm256_add_pd(even, _mm256_cvtps_pd(w[0]));
            odd = _mm256_add_pd(odd, _mm256_cvtps_pd(w[1]));
            even = _mm256_add_pd(even, _mm256_cvtps_pd(w[2]));
            odd = _mm256_add_pd(odd, _mm256_cvtps_pd(w[3]));
            if constexpr (copy) {
                _MM_TRANSPOSE4_PS(w[0], w[1], w[2], w[3]);
                _mm_storeu_ps(out0 + j, w[0]);
                _mm_storeu_ps(out1 + j, w[1]);
                _mm_storeu_ps(out2 + j, w[2]);
                _mm_storeu_ps(out3 + j, w[3]);
            }
        }
    }
#endif
    for (; j + 2 <= held; j += 2) {
        add(j, even);
        add(j + 1, odd);
    }
    if (j < held) add(j, even);
    alignas(16) uint32_t low[4], high[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(low), least);
    _mm_store_si128(reinterpret_cast<__m128i*>(high), largest);
    alignas(32) double total[4];
    _mm256_store_pd(total, _mm256_add_pd(even, odd));
    for (int h = 0; h < 4; ++h)
        if (!exact_sum_range(low[h], high[h]) || !(total[h] < 2.0)) return false;
    for (int h = 0; h < 4; ++h) retained[h] = total[h];
    return true;
}

// The same, copying the weights out only where `gathered` is given.
template <bool by_position, bool bounded = false>
bool sum_four_heads(std::span<const float* const> rows, const float* interleaved, std::span<const int32_t> kept,
                    float* gathered, double* retained) {
    return gathered ? sum_four_heads_exactly<by_position, true, bounded>(rows, interleaved, kept, gathered, retained)
                    : sum_four_heads_exactly<by_position, false, bounded>(rows, interleaved, kept, nullptr, retained);
}
#endif

#if defined(__AVX2__)
// One head's sum as sum_in_order<1> gives it. Its kept weights are copied out first (to
// `gathered`, or a scratch buffer), eight loads to a vector store with no chain between them
// (AVX2's gather was no faster on Zen 3), and the copies are then summed in four chains of four
// doubles instead of one chain of additions, each waiting on the one before. As for four heads
// (sum_four_heads_exactly), any order gives the in-order sum's bits where every weight is +0 or
// in [2^-29, 2) and the total is below 2; returns false where that is not shown, and the weights
// are then summed in order. The copies are written either way.
bool sum_one_head_exactly(const float* row, std::span<const int32_t> kept, float* gathered, double* retained) {
    const std::size_t held = kept.size();
    thread_local std::vector<float> scratch;
    float* w = gathered;
    if (!w) {
        if (scratch.size() < held) scratch.resize(held);
        w = scratch.data();
    }
    std::size_t g = 0;
    const int32_t* p = kept.data();
    for (; g + 8 <= held; g += 8)
        _mm256_storeu_ps(w + g, _mm256_setr_ps(row[p[g]], row[p[g + 1]], row[p[g + 2]], row[p[g + 3]], row[p[g + 4]],
                                               row[p[g + 5]], row[p[g + 6]], row[p[g + 7]]));
    for (; g < held; ++g) w[g] = row[p[g]];
    __m256d sum[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    __m256i least8 = _mm256_set1_epi32(-1), largest8 = _mm256_setzero_si256();
    const __m256i one = _mm256_set1_epi32(1);
    std::size_t j = 0;
    for (; j + 16 <= held; j += 16) {
        const __m256 a = _mm256_loadu_ps(w + j), b = _mm256_loadu_ps(w + j + 8);
        for (const __m256 v : {a, b}) {
            const __m256i bits = _mm256_castps_si256(v);
            least8 = _mm256_min_epu32(least8, _mm256_sub_epi32(bits, one));
            largest8 = _mm256_max_epu32(largest8, bits);
        }
        sum[0] = _mm256_add_pd(sum[0], _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
        sum[1] = _mm256_add_pd(sum[1], _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
        sum[2] = _mm256_add_pd(sum[2], _mm256_cvtps_pd(_mm256_castps256_ps128(b)));
        sum[3] = _mm256_add_pd(sum[3], _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)));
    }
    alignas(32) uint32_t low[8], high[8];
    alignas(32) double lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(low), least8);
    _mm256_store_si256(reinterpret_cast<__m256i*>(high), largest8);
    _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(sum[0], sum[1]), _mm256_add_pd(sum[2], sum[3])));
    WeightBits range;
    for (int l = 0; l < 8; ++l) range.fold(low[l], high[l]);
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; j < held; ++j) {
        range.add(w[j]);
        total += w[j];
    }
    if (!range.exact_in_any_order() || !(total < 2.0)) return false;
    *retained = total;
    return true;
}
#endif

}  // namespace

void sum_kept_weights(std::span<const float* const> rows, std::span<const int32_t> kept, float* gathered,
                      double* retained, const float* interleaved, bool bounded) {
    const std::size_t held = kept.size();
    bool exactness_tried = false;  // once shown not to hold, the same weights are summed in order
#if defined(__AVX2__)
    if (interleaved && rows.size() == 4) {
        if (bounded ? sum_four_heads<true, true>(rows, interleaved, kept, gathered, retained)
                    : sum_four_heads<true>(rows, interleaved, kept, gathered, retained))
            return;
        exactness_tried = true;
    }
#else
    (void)interleaved;
    (void)bounded;
    (void)exactness_tried;
#endif
    for (std::size_t h = 0; h < rows.size();) {
        const std::size_t left = rows.size() - h;
        const auto group = rows.subspan(h);
        float* copy = gathered ? gathered + h * held : nullptr;
#if defined(__AVX2__)
        if (left >= 4 && !exactness_tried && sum_four_heads<false>(group, nullptr, kept, copy, retained + h)) {
            h += 4;
            continue;
        }
        if (left < 4 && !exactness_tried && sum_one_head_exactly(group[0], kept, copy, retained + h)) {
            h += 1;
            continue;
        }
#endif
        if (left >= 4)
            h += sum_in_order<4>(group, kept, copy, retained + h);
        else if (left >= 2)
            h += sum_in_order<2>(group, kept, copy, retained + h);
        else
            h += sum_in_order<1>(group, kept, copy, retained + h);
    }
}

bool interleave_rows(std::span<const float* const> rows, int64_t t, float* out) {
    const float *a = rows[0], *b = rows[1], *c = rows[2], *d = rows[3];
    // As sum_four_heads_exactly checks them (exact_sum_range).
    WeightBits range;
    int64_t p = 0;
#if defined(__AVX2__)
    __m128i least4 = _mm_set1_epi32(-1), largest4 = _mm_setzero_si128();
    const __m128i one = _mm_set1_epi32(1);
    for (; p + 4 <= t; p += 4) {  // a 4 x 4 transpose per four positions
        __m128 ra = _mm_loadu_ps(a + p), rb = _mm_loadu_ps(b + p), rc = _mm_loadu_ps(c + p), rd = _mm_loadu_ps(d + p);
        for (const __m128 r : {ra, rb, rc, rd}) {
            const __m128i bits = _mm_castps_si128(r);
            least4 = _mm_min_epu32(least4, _mm_sub_epi32(bits, one));
            largest4 = _mm_max_epu32(largest4, bits);
        }
        _MM_TRANSPOSE4_PS(ra, rb, rc, rd);
        _mm_storeu_ps(out + 4 * p, ra);
        _mm_storeu_ps(out + 4 * p + 4, rb);
        _mm_storeu_ps(out + 4 * p + 8, rc);
        _mm_storeu_ps(out + 4 * p + 12, rd);
    }
    alignas(16) uint32_t low[4], high[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(low), least4);
    _mm_store_si128(reinterpret_cast<__m128i*>(high), largest4);
    for (int l = 0; l < 4; ++l) range.fold(low[l], high[l]);
#endif
    for (; p < t; ++p) {
        const float w[4] = {a[p], b[p], c[p], d[p]};
        for (int h = 0; h < 4; ++h) {
            out[4 * p + h] = w[h];
            range.add(w[h]);
        }
    }
    return range.exact_in_any_order();
}

Harness::Harness(std::unique_ptr<Policy> policy, int budget, int64_t sequence_length, const HarnessOptions& options,
                 std::string label, std::string where)
    : policy_(std::move(policy)), budget_(budget), options_(options), label_(std::move(label)),
      where_(std::move(where)), sequence_length_(sequence_length), kept_bits_((sequence_length + 63) / 64, 0) {
    tiered_ = policy_->tier_format() != nullptr;
    if (tiered_) {
        key_tier_.assign(sequence_length, 0);
        value_tier_.assign(sequence_length, 0);
    }
    if (policy_->reads_prompt() && (options.prefill_tokens < 2 || options.prefill_tokens >= sequence_length))
        throw InputError("policy " + label_ + where_ + " compresses a prompt once, at its end, but the prompt here is " +
                         std::to_string(options.prefill_tokens) + " of " + std::to_string(sequence_length) +
                         " tokens: give it a prompt of at least 2 tokens that leaves a continuation (prefill_tokens, "
                         "or search.prompt)");
    kept_.reserve(std::min<int64_t>(std::max(budget, options.prefill_tokens), sequence_length) + 1);
    kept_.push_back(0);
    set_kept(0, true);
    if (tiered_) policy_->assign_tiers(0, kept_, key_tier_, value_tier_);  // position 0 as step 0 left it
}

HarnessOptions named_harness_options(const std::string& attention_view, const std::string& group_reduce,
                                     bool values_known, int prefill_tokens, const std::string& config) {
    if (attention_view == "cached" && !values_known)
        throw InputError(config + ": attention_view: cached computes attention from the keys the cache holds, but the "
                                  "trace records attention only (it needs a Q/K/V trace)");
    HarnessOptions options;
    const std::string view = attention_view.empty() ? (values_known ? "renormalized" : "raw") : attention_view;
    options.view = view == "raw" ? AttentionView::raw : view == "cached" ? AttentionView::cached : AttentionView::renormalized;
    options.reduce = group_reduce == "max" ? GroupReduce::max : group_reduce == "sum" ? GroupReduce::sum : GroupReduce::mean;
    options.prefill_tokens = prefill_tokens;
    return options;
}

void combine_group_rows(std::span<const float* const> rows, int64_t t, GroupReduce reduce, float* out) {
    std::copy(rows[0], rows[0] + t, out);
    for (std::size_t h = 1; h < rows.size(); ++h) {
        const float* row = rows[h];
        if (reduce == GroupReduce::max)
            for (int64_t j = 0; j < t; ++j) out[j] = std::max(out[j], row[j]);
        else
            for (int64_t j = 0; j < t; ++j) out[j] += row[j];
    }
    if (reduce == GroupReduce::mean)
        for (int64_t j = 0; j < t; ++j) out[j] /= static_cast<float>(rows.size());
}

void Harness::set_values(const CacheValues& values) {
    values_ = values;
    if (!tiered_) {  // an untiered policy reads every position at fp16
        key_tier_.assign(sequence_length_, 0);
        value_tier_.assign(sequence_length_, 0);
    }
    for (int tier = 0; tier < 3; ++tier) {
        const int key_dim = values.key_dim > 0 ? values.key_dim : values.head_dim;
        const int value_dim = values.value_dim > 0 ? values.value_dim : values.head_dim;
        key_bytes_[tier] = values.byte_share * key_bytes(static_cast<Tier>(tier), key_dim, policy_->tier_format());
        value_bytes_[tier] = values.byte_share * value_bytes(static_cast<Tier>(tier), value_dim, policy_->tier_format());
    }
}

// A streaming head's state takes every token up to t (each once); it folds what leaves its window.
void Harness::feed_linear_state(int32_t t) {
    StreamingHeadState* state = policy_->linear_state();
    if (!state) return;
    const std::size_t d = static_cast<std::size_t>(values_.head_dim), stride = values_.num_kv_heads * d;
    for (; state_next_ <= t; ++state_next_) {
        const std::size_t at = state_next_ * stride + static_cast<std::size_t>(values_.kv_head) * d;
        state->admit(state_next_, values_.arrays->k[0] + at, values_.arrays->v[0] + at);
    }
}

// The cache's attention output for each query head of the group (into last_outputs_, where
// `with_outputs`), and with the cached view each head's weights on the attended positions (into
// cached_weights_).
void Harness::attend_cached(const GroupStep& s, bool with_outputs) {
    if (const CachedValueSums* sums = attend_cached_weights(s, with_outputs)) cached_attention_values(*sums);
    attended_step_ = with_outputs ? s.t : -1;
}

// attend_cached's weights; returns the value sums still to make (null for a streaming head, whose
// state made its outputs).
const CachedValueSums* Harness::attend_cached_weights(const GroupStep& s, bool with_outputs) {
    const int32_t t = s.t;
    const int d = values_.head_dim;
    StreamingHeadState* state = policy_->linear_state();
    feed_linear_state(t);
    attended_.assign(kept_.begin(), kept_.end());
    attended_.push_back(t);
    key_tier_[t] = value_tier_[t] = 0;
    const bool want_weights = options_.view == AttentionView::cached;
    // The replay's shared scores of a tier serve where they were computed from this cache's keys
    // at that tier.
    std::array<bool, 3> shared{};
    for (int tier = 0; tier < 3; ++tier)
        shared[tier] = !s.tier_scores[tier].empty() && s.tier_scores_keys[tier] == values_.arrays->k[tier];
    last_outputs_.resize(s.queries.size() * d);
    cached_weights_.assign(want_weights ? s.queries.size() * attended_.size() : 0, 0.0f);
    if (state) {  // a streaming head shows its policy no weights: it keeps by position
        if (with_outputs) state->output(s.queries, last_outputs_.data());
        return nullptr;
    }
    group_queries_.resize(s.queries.size());
    for (std::size_t h = 0; h < s.queries.size(); ++h) {
        CachedQuery& head = group_queries_[h];
        head.q = s.queries[h];
        head.out = with_outputs ? last_outputs_.data() + h * d : nullptr;
        head.weights = want_weights ? cached_weights_.data() + h * attended_.size() : nullptr;
        for (int tier = 0; tier < 3; ++tier) head.shared_scores[tier] = shared[tier] ? s.tier_scores[tier][h] : nullptr;
    }
    if (group_queries_.size() > kMaxCachedGroup) {  // in parts, each made whole (a multi-query model's group)
        cached_attention_outputs(group_queries_, attended_, key_tier_, value_tier_, *values_.arrays, values_.kv_head,
                                 values_.num_kv_heads, d, scratch_);
        return nullptr;
    }
    pending_values_ = cached_attention_weights(group_queries_, attended_, key_tier_, value_tier_, *values_.arrays,
                                               values_.kv_head, values_.num_kv_heads, d, scratch_);
    return &pending_values_;
}

const CachedValueSums* Harness::weights_for_shared_values(const GroupStep& s) {
    // Where observe would make this step's outputs in measure_values (not the cached view's
    // earlier call), and has not yet.
    if (options_.view == AttentionView::cached || !output_measured(s.t) || attended_step_ == s.t) return nullptr;
    if (holds_the_full_cache(s)) {
        // The same arithmetic over the same rows in the same order as the full cache's output: its
        // bits, copied rather than made again (a large budget's cache early in a sequence).
        const std::size_t d = static_cast<std::size_t>(values_.head_dim);
        last_outputs_.resize(s.queries.size() * d);
        for (std::size_t h = 0; h < s.queries.size(); ++h)
            std::copy(s.full_output[h], s.full_output[h] + d, last_outputs_.data() + h * d);
        attended_step_ = s.t;
        return nullptr;
    }
    const CachedValueSums* sums = attend_cached_weights(s, true);
    if (!sums) attended_step_ = s.t;  // made whole already (a streaming head's state, a group in parts)
    return sums;
}

// Whether the cache holds every position before s.t, all at fp16, of the very arrays the full
// cache's outputs were made from: then its output is theirs.
bool Harness::holds_the_full_cache(const GroupStep& s) const {
    const TierArrays* full = s.full_output_arrays;
    if (!full || policy_->linear_state() || kept_.size() != static_cast<std::size_t>(s.t) ||
        s.full_output.size() != s.queries.size() || !values_.arrays || values_.arrays->k[0] != full->k[0] ||
        values_.arrays->v[0] != full->v[0])
        return false;
    if (tiered_)
        for (int32_t p : kept_)
            if (key_tier_[p] != 0 || value_tier_[p] != 0) return false;
    return true;
}

// Whether this step's output error is measured (the sample's steps, or every decode step).
bool Harness::output_measured(int32_t t) const {
    if (!values_.output_error || t < options_.prefill_tokens) return false;
    return !values_.sample.steps || values_.sample.steps[t];
}

bool tier_bytes_are_whole(double start, const double key_bytes[3], const double value_bytes[3]) {
    bool whole = start >= 0 && start <= 0x1p52 && start == std::trunc(start);
    for (int tier = 0; tier < 3; ++tier)
        for (const double b : {key_bytes[tier], value_bytes[tier]})
            whole = whole && b >= 0 && b <= 0x1p20 && b == std::trunc(b);
    return whole;
}

double tier_bytes_of_counts(double start, const HeldTierCounts& c, const double key_bytes[3], const double value_bytes[3]) {
    return start + static_cast<double>(c.held - c.key_int8 - c.key_int4) * key_bytes[0] +
           static_cast<double>(c.key_int8) * key_bytes[1] + static_cast<double>(c.key_int4) * key_bytes[2] +
           static_cast<double>(c.held - c.value_int8 - c.value_int4) * value_bytes[0] +
           static_cast<double>(c.value_int8) * value_bytes[1] + static_cast<double>(c.value_int4) * value_bytes[2];
}

double held_tier_bytes(double start, std::span<const int32_t> kept, const uint8_t* key_tier,
                       const uint8_t* value_tier, const double key_bytes[3], const double value_bytes[3]) {
    if (!tier_bytes_are_whole(start, key_bytes, value_bytes)) {
        double bytes = start;
        for (int32_t p : kept) bytes += key_bytes[key_tier[p]] + value_bytes[value_tier[p]];
        return bytes;
    }
    // Tiers are 0, 1 or 2: the INT4 count is the sum of tier / 2, the INT8 count what the sum of
    // tiers leaves. Sixteen positions a gather with AVX-512 (cache_math/tier_gather.h).
    int64_t key_sum = 0, key_int4 = 0, value_sum = 0, value_int4 = 0;
    unsigned top = 0;
    std::size_t j = 0;
#if defined(__AVX512F__)
    {
        const TierGather keys(key_tier), values(value_tier);
        // 32-bit sums: every total is at most twice the held count, which this bounds to 2^30.
        __m512i ks = _mm512_setzero_si512(), k4 = ks, vs = ks, v4 = ks, most = ks;
        const std::size_t vector_end = kept.size() < (std::size_t{1} << 30) ? kept.size() : 0;
        for (; j + 16 <= vector_end; j += 16) {
            const __m512i p = _mm512_loadu_si512(kept.data() + j);
            const __m512i k = keys.at(p), v = values.at(p);
            ks = _mm512_add_epi32(ks, k), k4 = _mm512_add_epi32(k4, _mm512_srli_epi32(k, 1));
            vs = _mm512_add_epi32(vs, v), v4 = _mm512_add_epi32(v4, _mm512_srli_epi32(v, 1));
            most = _mm512_max_epu32(most, _mm512_max_epu32(k, v));
        }
        key_sum = _mm512_reduce_add_epi32(ks), key_int4 = _mm512_reduce_add_epi32(k4);
        value_sum = _mm512_reduce_add_epi32(vs), value_int4 = _mm512_reduce_add_epi32(v4);
        top = static_cast<unsigned>(_mm512_reduce_max_epu32(most));
    }
#endif
    for (; j < kept.size(); ++j) {
        const unsigned k = key_tier[kept[j]], v = value_tier[kept[j]];
        key_sum += k, key_int4 += k >> 1, value_sum += v, value_int4 += v >> 1;
        top = std::max(top, std::max(k, v));
    }
    if (top > 2) throw std::logic_error("a held position's tier is " + std::to_string(top) + ", not 0, 1 or 2");
    const HeldTierCounts counts{static_cast<int64_t>(kept.size()), key_sum - 2 * key_int4, key_int4,
                                value_sum - 2 * value_int4, value_int4};
    return tier_bytes_of_counts(start, counts, key_bytes, value_bytes);
}

// Output error and memory of the cache as the model reads it at this step: what the policy held
// after the last eviction, plus the current token at fp16.
void Harness::measure_values(const GroupStep& s) {
    const int32_t t = s.t;
    const int d = values_.head_dim;
    StreamingHeadState* state = policy_->linear_state();
    const bool sampling = values_.output_error && values_.sample.steps;
    const bool output_error = output_measured(t);  // a measured step: t is past the prefill
    if (output_error && attended_step_ != t) attend_cached(s, true);
    feed_linear_state(t);  // for the memory alone; a no-op once attend_cached fed it
    if (values_.memory) {
        const double token_bytes = key_bytes_[0] + value_bytes_[0];
        double bytes = token_bytes;  // the current token
        if (state) {
            bytes = state->bytes();  // its exact tokens at fp16 and the linear state
        } else if (!tiered_ && token_bytes == std::trunc(token_bytes)) {
            // Every token at fp16 and whole bytes a token: the product is the sum below, exactly.
            bytes += static_cast<double>(kept_.size()) * token_bytes;
        } else if (std::array<int64_t, 3> per_tier; policy_->held_per_tier(per_tier) &&
                   tier_bytes_are_whole(bytes, key_bytes_, value_bytes_)) {
            // The policy counts its tiers as they change: the same bits as the pass below.
            if (per_tier[0] + per_tier[1] + per_tier[2] != static_cast<int64_t>(kept_.size()))
                fail(t, "counts " + std::to_string(per_tier[0] + per_tier[1] + per_tier[2]) + " positions by tier, but holds " +
                            std::to_string(kept_.size()));
            bytes = tier_bytes_of_counts(bytes, {static_cast<int64_t>(kept_.size()), per_tier[1], per_tier[2], per_tier[1], per_tier[2]},
                                         key_bytes_, value_bytes_);
        } else {
            bytes = held_tier_bytes(bytes, kept_, key_tier_.data(), value_tier_.data(), key_bytes_, value_bytes_);
        }
        if (options_.bookkeeping) bytes += static_cast<double>(policy_->bytes_per_slot()) * (kept_.size() + 1);
        bytes += values_.fixed_bytes;  // held at every step: amortised over the context
        metrics_.cache_bytes += bytes;
        metrics_.fp16_bytes += 4.0 * d * (t + 1);
        metrics_.context_tokens += t + 1;
    }
    if (output_error) {
        double step_error = 0, step_cosine = 0;
        for (std::size_t h = 0; h < s.queries.size(); ++h) {
            const float* cached = last_outputs_.data() + h * d;
            const float* full = s.full_output[h];
            double diff = 0, norm_full = 0, norm_out = 0, dot = 0;
            for (int i = 0; i < d; ++i) {
                diff += double(cached[i] - full[i]) * (cached[i] - full[i]);
                norm_full += double(full[i]) * full[i];
                norm_out += double(cached[i]) * cached[i];
                dot += double(cached[i]) * full[i];
            }
            const double error = norm_full > 0 ? std::sqrt(diff / norm_full) : std::sqrt(diff);
            const double cosine = (norm_full > 0 && norm_out > 0) ? dot / std::sqrt(norm_full * norm_out) : 1.0;
            if (sampling) {
                step_error += error;
                step_cosine += cosine;
                continue;
            }
            metrics_.output_rel_error += error;
            metrics_.output_cosine += cosine;
            ++metrics_.output_steps;
        }
        if (sampling) {
            if (!sample_sums_) sample_sums_.emplace(values_.sample.population, values_.sample.strata);
            sample_sums_->add(step_error, step_cosine);
        }
    }
    if (sampling) {
        ++population_steps_;
        if (t == values_.sample.last_step) finish_sample(static_cast<int64_t>(s.queries.size()));
    }
}

// The sample's estimates of the stream's every-step sums and the variance of the error's
// (StratifiedSum). A step's query heads are one draw, not several, so the variance counts what
// they share.
void Harness::finish_sample(int64_t group) {
    if (!sample_sums_ || !sample_sums_->complete() || population_steps_ != values_.sample.population)
        throw std::logic_error("harness " + label_ + where_ + ": a stratified sample of " +
                               std::to_string(values_.sample.strata) + " of " + std::to_string(values_.sample.population) +
                               " steps ended after " + std::to_string(population_steps_) + " steps, " +
                               (sample_sums_ && sample_sums_->complete() ? "every stratum" : "strata missing"));
    metrics_.output_rel_error += sample_sums_->total();
    metrics_.output_cosine += sample_sums_->second_total();
    metrics_.output_steps += population_steps_ * group;
    metrics_.output_error_variance += sample_sums_->variance();
    sample_sums_.reset();
    population_steps_ = 0;
}

void Harness::fail(int32_t t, const std::string& what) const {
    throw PolicyError("policy " + label_ + " at step " + std::to_string(t) + where_ + ": " + what);
}

void Harness::set_prompt(const PromptView& prompt) {
    prompt_ = prompt;
    prompt_.length = options_.prefill_tokens;
}

void Harness::step(const GroupStep& s) {
    observe(s);
    if (policy_->reads_prompt()) {
        // A prefill-time compressor scores the whole prompt once, at its end, and compresses it;
        // every token after the prompt is appended.
        if (s.t + 1 == options_.prefill_tokens) {
            if (!prompt_.keys) throw std::logic_error("a prompt press replayed without its prompt");
            try {
                policy_->score_prompt(prompt_);
            } catch (const std::logic_error& e) {
                fail(s.t, e.what());
            }
            evict(s.t, budget_, false);
        }
    } else if (s.t + 1 >= options_.prefill_tokens &&
               (kept_.size() > static_cast<std::size_t>(budget_) || policy_->sizes_itself())) {
        // During a prefill the cache grows freely; after its last token it is compressed once.
        evict(s.t, budget_, false);
    }
    assign_tiers(s.t);
}

void Harness::evict_to(int32_t t, int keep) {
    if (t + 1 >= options_.prefill_tokens && kept_.size() > static_cast<std::size_t>(std::max(keep, 0)))
        evict(t, keep, true);
    assign_tiers(t);
}

void Harness::assign_tiers(int32_t t) {
    if (tiered_) {
        key_tier_[t] = value_tier_[t] = 0;
        policy_->assign_tiers(t, kept_, key_tier_, value_tier_);
    }
}

void Harness::observe(const GroupStep& s) {
    const int32_t t = s.t;
    const std::size_t held = kept_.size(), group = s.rows.size();
    // Decode steps are measured; prompt steps (a prefill) only feed the policy.
    const bool measured = t >= options_.prefill_tokens;

    // The cached view shows the policy the attention of the cache as held: computed first.
    const bool cached_view = options_.view == AttentionView::cached;
    if (cached_view) {
        if (!values_.arrays || s.queries.size() != group)
            throw std::logic_error("the cached attention view needs the trace's values and queries");
        attend_cached(s, !values_.outputs_when_measured || output_measured(t));
    }
    // Retained mass per query head: the full-cache weight on kept positions, before eviction.
    // The renormalized view needs the same weights again, so they are gathered once, unless the
    // policy keeps by position alone and is shown no weights.
    const bool shown = policy_->reads_attention();
    const bool renormalized = options_.view == AttentionView::renormalized;
    retained_.resize(group);
    gathered_.resize(renormalized && shown ? group * held : 0);
    // A lone head's combined row is its own row (the replay passes the same pointer), so the
    // weights the policy is shown are the ones summed: copied out once, by the sum.
    const bool shown_as_summed = shown && !cached_view && !renormalized && group == 1 && s.combined == s.rows[0];
    attn_.resize(shown ? held : 0);
    float* const copy = shown_as_summed ? attn_.data() : gathered_.empty() ? nullptr : gathered_.data();
    // The cached view shows the policy its own cache's weights (attend_cached): the full rows'
    // kept sums serve the metrics and the other views alone.
    if (options_.attention_metrics || (shown && !cached_view))
        sum_kept_weights(s.rows, kept_, copy, retained_.data(), s.interleaved, s.interleaved_bounded);
    if (measured) {
        for (std::size_t h = 0; h < group && options_.attention_metrics; ++h) {
            // The current token is always in the cache: where its own weight is known, it counts.
            metrics_.retained_mass += retained_[h] + (s.own_weight.empty() ? 0.0 : s.own_weight[h]);
            int64_t hits = 0;
            if (s.heavy_bits.empty()) {
                for (int32_t p : s.heavy[h]) hits += is_kept(p);
            } else {
                const uint64_t* heavy = s.heavy_bits[h];
                for (std::size_t w = 0, words = (static_cast<std::size_t>(t) + 63) / 64; w < words; ++w)
                    hits += std::popcount(kept_bits_[w] & heavy[w]);
            }
            metrics_.heavy_hitter_hits += hits;
            metrics_.heavy_hitter_possible += static_cast<int64_t>(s.heavy[h].size());
        }
        metrics_.steps += static_cast<int64_t>(group);
        if (values_.output_error || values_.memory) measure_values(s);
    }

    // What the policy sees, index-aligned with kept_.
    if (!shown || shown_as_summed) {
        // A policy that keeps by position is given nothing to read; a lone head's were copied.
    } else if (cached_view) {
        // Each head's weights on the held positions (the current token is last), averaged over
        // the group in head order: the runtime's arithmetic (runtime/head_cache.cpp).
        std::fill(attn_.begin(), attn_.end(), 0.0f);
        if (!cached_weights_.empty()) {
            const std::size_t n = held + 1;
            for (std::size_t h = 0; h < group; ++h)
                for (std::size_t j = 0; j < held; ++j) attn_[j] += cached_weights_[h * n + j];
            for (std::size_t j = 0; j < held; ++j) attn_[j] /= static_cast<float>(group);
        }
    } else if (!renormalized) {
        // The full softmax restricted to the positions held, not renormalised.
        for (std::size_t j = 0; j < held; ++j) attn_[j] = s.combined[kept_[j]];
    } else {
        // The softmax over held positions and the current token: each head's raw weights divided
        // by what that head keeps, then combined across the group.
        scale_.resize(group);
        float* sc = scale_.data();
        bool wide = false;
        for (std::size_t h = 0; h < group; ++h) {
            const double total = retained_[h] + s.self_weight[h];  // kept positions and the token itself
            const double inverse = total > 0 ? 1.0 / total : 0.0;
            // A head whose kept and own weights underflow (all its attention on evicted tokens) has
            // a scale past float's range: an infinite weight would pin a slot as unevictable, so
            // such a step is scaled in double instead.
            wide |= !(inverse <= std::numeric_limits<float>::max());
            sc[h] = static_cast<float>(inverse);
        }
        float* attn = attn_.data();
        const float* first = gathered_.data();
        auto scaled = [&](std::size_t h, std::size_t j) {
            const double total = retained_[h] + s.self_weight[h];
            return total > 0 ? static_cast<float>(gathered_[h * held + j] / total) : 0.0f;
        };
        bool divided = false;  // the mean's division done
        if (wide) {
            for (std::size_t j = 0; j < held; ++j) attn[j] = scaled(0, j);
            for (std::size_t h = 1; h < group; ++h)
                for (std::size_t j = 0; j < held; ++j)
                    attn[j] = options_.reduce == GroupReduce::max ? std::max(attn[j], scaled(h, j)) : attn[j] + scaled(h, j);
        } else if (group == 4 && options_.reduce != GroupReduce::max) {
            // The loops below (and the mean's division) for four heads as one pass: each weight
            // gets the same operations in the same order, read and written once.
            const float *w1 = first + held, *w2 = first + 2 * held, *w3 = first + 3 * held;
            const float s0 = sc[0], s1 = sc[1], s2 = sc[2], s3 = sc[3];
            const bool mean = options_.reduce == GroupReduce::mean;
            for (std::size_t j = 0; j < held; ++j) {
                float a = first[j] * s0;
                a += w1[j] * s1;
                a += w2[j] * s2;
                a += w3[j] * s3;
                attn[j] = mean ? a / 4.0f : a;
            }
            divided = true;
        } else {
            for (std::size_t j = 0; j < held; ++j) attn[j] = first[j] * sc[0];
            for (std::size_t h = 1; h < group; ++h) {
                const float* w = gathered_.data() + h * held;
                if (options_.reduce == GroupReduce::max)
                    for (std::size_t j = 0; j < held; ++j) attn[j] = std::max(attn[j], w[j] * sc[h]);
                else
                    for (std::size_t j = 0; j < held; ++j) attn[j] += w[j] * sc[h];
            }
        }
        if (options_.reduce == GroupReduce::mean && !divided)
            for (std::size_t j = 0; j < held; ++j) attn[j] /= static_cast<float>(group);
    }

    try {
        policy_->on_decode_step(t, attn_);
    } catch (const std::logic_error& e) {
        fail(t, e.what());
    }
    kept_.push_back(t);
    set_kept(t, true);
}

// `exact`: down to `budget` by Policy::evict_to (a budget chosen for this step), else Policy::evict.
void Harness::evict(int32_t t, int budget, bool exact) {
    victims_.clear();
    try {
        if (exact)
            policy_->evict_to(budget, victims_);
        else
            policy_->evict(budget, victims_);
    } catch (const std::logic_error& e) {
        fail(t, e.what());
    }
    // A self-sizing policy is asked every step; a call counts when it evicted something.
    if (!victims_.empty() || kept_.size() > static_cast<std::size_t>(budget)) ++metrics_.eviction_calls;
    victim_slots_.clear();
    for (int32_t v : victims_) {
        if (v < 0 || v > t || !is_kept(v)) fail(t, "evicted position " + std::to_string(v) + " which it does not hold");
        set_kept(v, false);
        victim_slots_.push_back(static_cast<std::size_t>(std::lower_bound(kept_.begin(), kept_.end(), v) - kept_.begin()));
    }
    std::sort(victim_slots_.begin(), victim_slots_.end());
    kept_.erase(victim_slots_);
    if (kept_.size() > static_cast<std::size_t>(budget))
        fail(t, "left " + std::to_string(kept_.size()) + " positions cached, over the budget of " +
                    std::to_string(budget));
}

}  // namespace kvsim
