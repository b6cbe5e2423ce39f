// Real storage for one side (keys or values) of one (layer, KV head) tiered cache: rows of
// head_dim numbers at FP16 (half bits), INT8 (one level a byte) or INT4 (two levels a byte), the
// quantised tiers with one fp16 scale per group of channels beside the data, per token (the
// arrangement token-level tiering uses, cache_math/quantize.h). Every number goes through
// cache_math/numerics.h, so a row reads back bit for bit what the simulator's tier arrays hold.
//
// A token is known by its slot (HeadCache's, stable while it is held); a tier keeps the rows of
// the slots it holds packed at its front, rows 0..rows()-1, so attention streams a tier's rows
// from contiguous memory (runtime/attention_kernels.h). A slot that leaves a tier hands its row
// to the tier's last row, which moves into it: rows stay packed, slots stay put.
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
    // A host TierStore's row of each slot (-1: not held); null where rows are by slot (the device
    // pool keeps slot s at row s).
    const int32_t* row_of_slot = nullptr;

    KVSIM_HD std::size_t row(int slot) const {
        return static_cast<std::size_t>(row_of_slot ? row_of_slot[slot] : slot);
    }
    KVSIM_HD float element(int slot, int c) const {
        const std::size_t r = row(slot);
        if (tier == 0) return half_bits_to_float(half[r * head_dim + c]);
        const float scale = half_bits_to_float(scales[r * groups + c / group_channels]);
        const uint8_t* levels_row = levels + r * row_bytes;
        const int level = tier == 1 ? static_cast<int8_t>(levels_row[c]) : int4_level(levels_row, c);
        return dequantize_level(static_cast<float>(level), scale);
    }
    // Bytes of one row in each array, for copies.
    std::size_t half_row_bytes() const { return tier == 0 ? static_cast<std::size_t>(head_dim) * 2 : 0; }
    std::size_t level_row_bytes() const { return tier == 0 ? 0 : static_cast<std::size_t>(row_bytes); }
    std::size_t scale_row_bytes() const { return tier == 0 ? 0 : static_cast<std::size_t>(groups) * 2; }
};

class TierStore {
public:
    // Room for `slots` slots of `head_dim` values; `group`: channels sharing one scale (quantised
    // tiers). group 0 at a quantised tier: levels only, each channel's scale kept outside the store
    // (KIVI keys: one scale per channel for a group of positions) and passed to the calls below.
    void plan(int tier, int slots, int head_dim, int group);

    // A slot joins the tier at its next row (write its contents next), or leaves it.
    void add(int slot);
    void remove(int slot);
    void clear();  // every slot leaves
    bool holds(int slot) const { return row_of_slot_[static_cast<std::size_t>(slot)] >= 0; }

    // Stores a held slot's row at this tier: FP16 keeps fp16(x); INT8/INT4 quantise fp16(x) per group.
    void write(int slot, const float* x);
    // The row as attention reads it, dequantised (head_dim floats).
    void read(int slot, float* out) const;
    void write_with_channel_scales(int slot, const float* x, const float* channel_scales);
    void read_with_channel_scales(int slot, const float* channel_scales, float* out) const;

    int tier() const { return tier_; }
    int rows() const { return count_; }  // held slots: rows 0..rows()-1
    const int32_t* slot_of_row() const { return slot_of_row_.data(); }
    TierView view() const {
        return TierView{tier_, head_dim_, row_bytes_, groups_, group_, half_.data(), levels_.data(), scales_.data(),
                        row_of_slot_.data()};
    }
    // The raw layout: row r's FP16 bits at half()[r * head_dim], its levels at
    // levels()[r * row_bytes()], its scales at scales()[r * groups()], a scale per
    // `group_channels()` channels.
    const uint16_t* half() const { return half_.data(); }
    const uint8_t* levels() const { return levels_.data(); }
    const uint16_t* scales() const { return scales_.data(); }
    int head_dim() const { return head_dim_; }
    int row_bytes() const { return row_bytes_; }
    int groups() const { return groups_; }
    int group_channels() const { return group_; }
    std::size_t reserved_bytes() const;

private:
    std::size_t row_of(int slot) const { return static_cast<std::size_t>(row_of_slot_[static_cast<std::size_t>(slot)]); }
    void store_level(uint8_t* row, int i, int level) const;
    int tier_ = 0, head_dim_ = 0, group_ = 1, groups_ = 1, row_bytes_ = 0, count_ = 0;
    std::vector<uint16_t> half_;   // FP16: head_dim half bits a row
    std::vector<uint8_t> levels_;  // INT8: head_dim bytes a row; INT4: ceil(head_dim / 2)
    std::vector<uint16_t> scales_; // quantised tiers: `groups_` fp16 scales a row
    std::vector<int32_t> row_of_slot_, slot_of_row_;
    std::vector<float> rounded_;         // write()'s scratch: a row at fp16
    std::vector<int32_t> level_scratch_; // and its levels
};

}  // namespace kvsim::runtime
