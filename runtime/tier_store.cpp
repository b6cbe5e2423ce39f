#include "runtime/tier_store.h"

#include <algorithm>
#include <cmath>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvsim::runtime {

namespace {
constexpr int kMaxUnpacked = 512;  // head sizes up to this unpack INT4 rows in one go
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
        store_level(out, i, static_cast<int>(quant_level(round_to_fp16(x[i]), channel_scales[i], qmax)));
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
    if (tier_ == 0) {
        uint16_t* out = half_.data() + row * head_dim_;
        for (int i = 0; i < head_dim_; ++i) out[i] = float_to_half_bits(round_to_fp16(x[i]));
        return;
    }
    const int qmax = quant_levels(tier_ == 1 ? 8 : 4);
    uint8_t* out = levels_.data() + row * row_bytes_;
    uint16_t* scales = scales_.data() + row * groups_;
    if (tier_ == 2) std::fill(out, out + row_bytes_, uint8_t{0});
    for (int g = 0; g < groups_; ++g) {
        const int first = g * group_, end = std::min(head_dim_, first + group_);
        float max_abs = 0.0f;
        for (int i = first; i < end; ++i) max_abs = std::max(max_abs, std::abs(round_to_fp16(x[i])));
        const float scale = group_scale(max_abs, qmax);
        scales[g] = float_to_half_bits(scale);  // exact: the scale is already an fp16 value
        for (int i = first; i < end; ++i) {
            store_level(out, i, static_cast<int>(quant_level(round_to_fp16(x[i]), scale, qmax)));
        }
    }
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
           (row_of_slot_.size() + slot_of_row_.size()) * sizeof(int32_t);
}

}  // namespace kvsim::runtime
