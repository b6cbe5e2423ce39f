// Real storage for one side (keys or values) of one (layer, KV head) tiered cache: rows of
// head_dim numbers at FP16 (half bits), INT8 (one level a byte) or INT4 (two levels a byte), the
// quantised tiers with one fp16 scale per group of channels beside the data, per token (the
// arrangement token-level tiering uses, cache_math/quantize.h). Every number goes through
// cache_math/numerics.h, so a row reads back bit for bit what the simulator's tier arrays hold.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cache_math/numerics.h"

namespace kvsim::runtime {

// One tier's rows where they lie (host or device memory), read channel by channel: how the CUDA
// kernel reads the cache, and on the host the check that its layout is TierStore's.
struct TierView {
    int tier = 0, head_dim = 0, row_bytes = 0, groups = 1, group_channels = 1;
    const uint16_t* half = nullptr;   // FP16: head_dim half bits a row
    const uint8_t* levels = nullptr;  // INT8 / INT4: row_bytes a row
    const uint16_t* scales = nullptr; // groups fp16 scales a row

    KVSIM_HD float element(int slot, int c) const {
        if (tier == 0) return half_bits_to_float(half[static_cast<std::size_t>(slot) * head_dim + c]);
        const float scale = half_bits_to_float(scales[static_cast<std::size_t>(slot) * groups + c / group_channels]);
        const uint8_t* row = levels + static_cast<std::size_t>(slot) * row_bytes;
        const int level = tier == 1 ? static_cast<int8_t>(row[c]) : int4_level(row, c);
        return dequantize_level(static_cast<float>(level), scale);
    }
    // Bytes of one row in each array, for copies.
    std::size_t half_row_bytes() const { return tier == 0 ? static_cast<std::size_t>(head_dim) * 2 : 0; }
    std::size_t level_row_bytes() const { return tier == 0 ? 0 : static_cast<std::size_t>(row_bytes); }
    std::size_t scale_row_bytes() const { return tier == 0 ? 0 : static_cast<std::size_t>(groups) * 2; }
};

class TierStore {
public:
    // `rows` slots of `head_dim` values; `group`: channels sharing one scale (quantised tiers).
    // group 0 at a quantised tier: levels only, each channel's scale kept outside the store (KIVI
    // keys: one scale per channel for a group of positions) and passed to the two calls below.
    void plan(int tier, int rows, int head_dim, int group);
    void write_with_channel_scales(int row, const float* x, const float* channel_scales);
    void read_with_channel_scales(int row, const float* channel_scales, float* out) const;

    // Stores a row at this tier: FP16 keeps fp16(x); INT8/INT4 quantise fp16(x) per group.
    void write(int row, const float* x);
    // The row as attention reads it, dequantised (head_dim floats).
    void read(int row, float* out) const;
    // Asks the CPU to start loading a row that will be read soon: a tier's rows lie at scattered
    // slots, which the hardware prefetcher cannot guess.
    void prefetch(int row) const {
        const std::size_t r = static_cast<std::size_t>(row);
        const char* data = tier_ == 0 ? reinterpret_cast<const char*>(half_.data() + r * head_dim_)
                                      : reinterpret_cast<const char*>(levels_.data() + r * row_bytes_);
        const std::size_t bytes = tier_ == 0 ? static_cast<std::size_t>(head_dim_) * 2 : static_cast<std::size_t>(row_bytes_);
        for (std::size_t at = 0; at < bytes; at += 64) __builtin_prefetch(data + at);
        if (tier_ != 0 && !scales_.empty()) __builtin_prefetch(scales_.data() + r * groups_);
    }

    int tier() const { return tier_; }
    TierView view() const {
        return TierView{tier_, head_dim_, row_bytes_, groups_, group_, half_.data(), levels_.data(), scales_.data()};
    }
    // The raw layout, for a device copy (runtime/cuda_attention.cu): row r's FP16 bits at
    // half()[r * head_dim], its levels at levels()[r * row_bytes()], its scales at
    // scales()[r * groups()], a scale per `group_channels()` channels.
    const uint16_t* half() const { return half_.data(); }
    const uint8_t* levels() const { return levels_.data(); }
    const uint16_t* scales() const { return scales_.data(); }
    int row_bytes() const { return row_bytes_; }
    int groups() const { return groups_; }
    int group_channels() const { return group_; }
    std::size_t rows() const { return tier_ == 0 ? half_.size() / std::max(head_dim_, 1) : levels_.size() / std::max(row_bytes_, 1); }
    std::size_t reserved_bytes() const;

private:
    void store_level(uint8_t* row, int i, int level) const;
    static constexpr int kMaxUnpacked = 512;  // head sizes up to this unpack INT4 rows in one go
    int tier_ = 0, head_dim_ = 0, group_ = 1, groups_ = 1, row_bytes_ = 0;
    std::vector<uint16_t> half_;   // FP16: head_dim half bits a row
    std::vector<uint8_t> levels_;  // INT8: head_dim bytes a row; INT4: ceil(head_dim / 2)
    std::vector<uint16_t> scales_; // quantised tiers: `groups_` fp16 scales a row
};

}  // namespace kvsim::runtime
