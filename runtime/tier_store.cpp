#include "runtime/tier_store.h"

#include <algorithm>
#include <cmath>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvsim::runtime {

namespace {
constexpr int kMaxUnpacked = 512;  // head sizes up to this unpack INT4 rows in one go

// A row is written every time a token enters the cache or sinks a tier (a few rows a step and
// head), so the writes below take eight numbers at a time where AVX2 and F16C are built in. Each
// gives numerics.h's bits: the CPU's conversion rounds to nearest even as float_to_half_bits
// does, and the quantiser's division, truncation and clamp are the same IEEE operations. The
// scalar loops finish each row, from its last whole eight or its first NaN on (the CPU keeps a
// NaN's payload in its half; numerics.h writes one canonical NaN).
#if defined(__AVX2__) && defined(__F16C__)
bool has_nan(__m256 v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }

// round_to_fp16's clamp, then the CPU's conversion to half bits.
__m128i clamped_half_bits(__m256 v) {
    const __m256 clamped = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-kFp16Max)), _mm256_set1_ps(kFp16Max));
    return _mm256_cvtps_ph(clamped, _MM_FROUND_TO_NEAREST_INT);
}
#endif

// out[i] = float_to_half_bits(round_to_fp16(x[i])).
void write_half_bits(const float* x, int n, uint16_t* out) {
    int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (has_nan(v)) break;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), clamped_half_bits(v));
    }
#endif
    for (; i < n; ++i) out[i] = float_to_half_bits(round_to_fp16(x[i]));
}

// out[i] = round_to_fp16(x[i]) (a NaN stays a NaN: the quantiser below maps every NaN alike).
void round_row_to_fp16(const float* x, int n, float* out) {
    int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (has_nan(v)) break;
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(clamped_half_bits(v)));
    }
#endif
    for (; i < n; ++i) out[i] = round_to_fp16(x[i]);
}

// The largest |x[i]|, a NaN passed over (as std::max(largest, |NaN|) keeps largest).
float largest_magnitude(const float* x, int n) {
    float largest = 0.0f;
    int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    if (n >= 8) {
        const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 lanes = _mm256_setzero_ps();
        // max_ps returns its second operand where either is NaN: the lanes, never the NaN.
        for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude_bits), lanes);
        alignas(32) float lane[8];
        _mm256_store_ps(lane, lanes);
        for (float m : lane) largest = std::max(largest, m);  // all >= +0 and none NaN: any order
    }
#endif
    for (; i < n; ++i) largest = std::max(largest, std::abs(x[i]));
    return largest;
}

// The integer a row keeps for quant_level's result: the level, or 0 for a NaN. No level stands for
// a NaN, so such a number reads back as 0 (the simulator's tier arrays keep the NaN); and a NaN
// cast to an integer is undefined behaviour.
int32_t stored_level(float level) { return level == level ? static_cast<int32_t>(level) : 0; }

// level[i] = stored_level(quant_level(x[i], scale, qmax)) (x already at fp16).
void quantise_levels(const float* x, int n, float scale, int qmax, int32_t* level) {
    int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    if (scale != 0.0f) {
        const __m256 divisor = _mm256_set1_ps(scale), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
        const __m256 sign_bit = _mm256_set1_ps(-0.0f);
        const __m256 top = _mm256_set1_ps(static_cast<float>(qmax)), bottom = _mm256_set1_ps(-static_cast<float>(qmax));
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), divisor);
            // round_half_away: trunc(v), one further from zero where |v - trunc(v)| >= 1/2 (never
            // for a NaN, which stays one).
            const __m256 whole = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign_bit, _mm256_sub_ps(v, whole)), half, _CMP_GE_OQ);
            const __m256 rounded = _mm256_blendv_ps(whole, _mm256_add_ps(whole, _mm256_or_ps(_mm256_and_ps(v, sign_bit), one)), away);
            // The clamp with the bound first: min_ps and max_ps pass a NaN second operand on, as
            // quant_level's comparisons do; then a NaN becomes 0, as stored_level makes it.
            const __m256 clamped = _mm256_max_ps(bottom, _mm256_min_ps(top, rounded));
            const __m256 numbers = _mm256_and_ps(clamped, _mm256_cmp_ps(clamped, clamped, _CMP_ORD_Q));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(level + i), _mm256_cvttps_epi32(numbers));
        }
    }
#endif
    for (; i < n; ++i) level[i] = stored_level(quant_level(x[i], scale, qmax));
}
}  // namespace

void TierStore::plan(int tier, int slots, int head_dim, int group) {
    tier_ = tier;
    head_dim_ = head_dim;
    const bool channel_scaled = tier != 0 && group == 0;
    group_ = channel_scaled ? 1 : std::min(group, head_dim);
    groups_ = channel_scaled ? 0 : (head_dim + group_ - 1) / group_;
    const std::size_t n = static_cast<std::size_t>(slots);
    if (tier == 0) {
        half_.assign(n * head_dim, 0);
    } else {
        row_bytes_ = tier == 1 ? head_dim : (head_dim + 1) / 2;
        levels_.assign(n * row_bytes_, 0);
        scales_.assign(n * groups_, 0);
    }
    row_of_slot_.assign(n, -1);
    slot_of_row_.assign(n, -1);
    rounded_.assign(tier == 0 ? 0 : head_dim, 0.0f);
    level_scratch_.assign(tier == 0 ? 0 : head_dim, 0);
    count_ = 0;
}

void TierStore::add(int slot) {
    row_of_slot_[static_cast<std::size_t>(slot)] = count_;
    slot_of_row_[static_cast<std::size_t>(count_)] = slot;
    ++count_;
}

void TierStore::remove(int slot) {
    const std::size_t row = row_of(slot), last = static_cast<std::size_t>(count_ - 1);
    if (row != last) {  // the last row moves into the hole
        const int moved = slot_of_row_[last];
        const std::size_t halves = tier_ == 0 ? static_cast<std::size_t>(head_dim_) : 0;
        const std::size_t bytes = tier_ == 0 ? 0 : static_cast<std::size_t>(row_bytes_);
        const std::size_t scales = tier_ == 0 ? 0 : static_cast<std::size_t>(groups_);
        std::copy_n(half_.data() + last * halves, halves, half_.data() + row * halves);
        std::copy_n(levels_.data() + last * bytes, bytes, levels_.data() + row * bytes);
        std::copy_n(scales_.data() + last * scales, scales, scales_.data() + row * scales);
        slot_of_row_[row] = moved;
        row_of_slot_[static_cast<std::size_t>(moved)] = static_cast<int32_t>(row);
    }
    slot_of_row_[last] = -1;
    row_of_slot_[static_cast<std::size_t>(slot)] = -1;
    --count_;
}

void TierStore::clear() {
    for (int r = 0; r < count_; ++r) row_of_slot_[static_cast<std::size_t>(slot_of_row_[r])] = -1, slot_of_row_[r] = -1;
    count_ = 0;
}

// Level i of a quantised row: a signed byte at INT8, a two's-complement nibble at INT4 (low nibble
// first; the row starts zeroed).
void TierStore::store_level(uint8_t* row, int i, int level) const {
    if (tier_ == 1) {
        row[i] = static_cast<uint8_t>(static_cast<int8_t>(level));
    } else {
        const uint8_t nibble = static_cast<uint8_t>(level) & 0x0fu;
        row[i / 2] |= static_cast<uint8_t>(i % 2 ? nibble << 4 : nibble);
    }
}

void TierStore::write_with_channel_scales(int slot, const float* x, const float* channel_scales) {
    const int qmax = quant_levels(tier_ == 1 ? 8 : 4);
    uint8_t* out = levels_.data() + row_of(slot) * row_bytes_;
    if (tier_ == 2) std::fill(out, out + row_bytes_, uint8_t{0});
    for (int i = 0; i < head_dim_; ++i) {
        store_level(out, i, stored_level(quant_level(round_to_fp16(x[i]), channel_scales[i], qmax)));
    }
}

void TierStore::read_with_channel_scales(int slot, const float* channel_scales, float* out) const {
    const uint8_t* in = levels_.data() + row_of(slot) * row_bytes_;
    for (int i = 0; i < head_dim_; ++i) {
        const int level = tier_ == 1 ? static_cast<int8_t>(in[i]) : int4_level(in, i);
        out[i] = dequantize_level(static_cast<float>(level), channel_scales[i]);
    }
}

void TierStore::write(int slot, const float* x) {
    const std::size_t row = row_of(slot);
    if (tier_ == 0) return write_half_bits(x, head_dim_, half_.data() + row * head_dim_);
    const int qmax = quant_levels(tier_ == 1 ? 8 : 4);
    float* rounded = rounded_.data();
    int32_t* level = level_scratch_.data();
    round_row_to_fp16(x, head_dim_, rounded);
    uint16_t* scales = scales_.data() + row * groups_;
    for (int g = 0; g < groups_; ++g) {
        const int first = g * group_, count = std::min(head_dim_, first + group_) - first;
        const float scale = group_scale(largest_magnitude(rounded + first, count), qmax);
        scales[g] = float_to_half_bits(scale);  // exact: the scale is already an fp16 value
        quantise_levels(rounded + first, count, scale, qmax, level + first);
    }
    uint8_t* out = levels_.data() + row * row_bytes_;
    if (tier_ == 1) {
        for (int i = 0; i < head_dim_; ++i) out[i] = static_cast<uint8_t>(static_cast<int8_t>(level[i]));
        return;
    }
    // Two's-complement nibbles, low first (store_level's layout), a byte at a time.
    for (int b = 0; b < head_dim_ / 2; ++b)
        out[b] = static_cast<uint8_t>((level[2 * b] & 0x0f) | (level[2 * b + 1] & 0x0f) << 4);
    if (head_dim_ % 2) out[head_dim_ / 2] = static_cast<uint8_t>(level[head_dim_ - 1] & 0x0f);
}

void TierStore::read(int slot, float* out) const {
    const std::size_t row = row_of(slot);
    if (tier_ == 0) {
        const uint16_t* in = half_.data() + row * head_dim_;
        int i = 0;
#if defined(__F16C__)
        // The CPU's own conversion, exact like half_bits_to_float (every half is a float).
        for (; i + 8 <= head_dim_; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#endif
        for (; i < head_dim_; ++i) out[i] = half_bits_to_float(in[i]);
        return;
    }
    const uint8_t* in = levels_.data() + row * row_bytes_;
    const uint16_t* scales = scales_.data() + row * groups_;
    const int8_t* levels = reinterpret_cast<const int8_t*>(in);
    int8_t unpacked[kMaxUnpacked];
    if (tier_ == 2 && head_dim_ <= kMaxUnpacked) {
        // Two's-complement nibbles, low first, unpacked a byte at a time into one level a byte (a
        // nibble shifted to the top of a signed byte and back keeps its sign): loops the compiler
        // vectorises, unlike a channel-by-channel nibble lookup.
        for (int b = 0; b < row_bytes_; ++b) {
            unpacked[2 * b] = static_cast<int8_t>(static_cast<int8_t>(static_cast<uint8_t>(in[b] << 4)) >> 4);
            unpacked[2 * b + 1] = static_cast<int8_t>(static_cast<int8_t>(in[b]) >> 4);
        }
        levels = unpacked;
    }
    for (int g = 0; g < groups_; ++g) {
        const float scale = half_bits_to_float(scales[g]);
        const int first = g * group_, end = std::min(head_dim_, first + group_);
        if (tier_ == 1 || levels == unpacked) {
            for (int i = first; i < end; ++i) out[i] = dequantize_level(static_cast<float>(levels[i]), scale);
        } else {
            for (int i = first; i < end; ++i) out[i] = dequantize_level(static_cast<float>(int4_level(in, i)), scale);
        }
    }
}

std::size_t TierStore::reserved_bytes() const {
    return half_.size() * sizeof(uint16_t) + levels_.size() + scales_.size() * sizeof(uint16_t) +
           (row_of_slot_.size() + slot_of_row_.size() + level_scratch_.size()) * sizeof(int32_t) +
           rounded_.size() * sizeof(float);
}

}  // namespace kvsim::runtime
