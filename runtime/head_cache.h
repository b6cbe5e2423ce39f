// One (layer, KV head) of the runtime's cache: the profile's policy instance (the same policy
// objects the simulator replays, so selection is written once), the positions it holds with
// their tiers, and their keys and values in real tiered storage (tier_store.h); or, for a
// streaming head, the decayed linear state of cache_math/streaming_heads.h with its exact tokens.
//
// A decode step at position t, as the simulator's harness orders it (sim/harness.cpp):
//   1. t's key and value enter at FP16;
//   2. attention of the group's query heads over the held positions and t: the output, and the
//      weights the policy is shown (each head's softmax over what is held, averaged over the group);
//   3. the policy observes those weights and admits t; it evicts down to its budget; tiers are
//      reassigned, and a token that sinks is requantised from what the cache holds.
#pragma once
#include <Eigen/Core>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "policies/policy.h"
#include "runtime/attention_kernels.h"
#include "runtime/device_pool.h"
#include "runtime/tier_store.h"

namespace kvsim::runtime {

struct HeadPlan {
    int layer = 0, kv_head = 0, num_layers = 1, num_kv_heads = 1;
    int group = 1;         // query heads per KV head
    int head_dim = 0;
    int budget = 0;        // tokens held after each step's eviction
    int max_context = 0;
    int prefill = 0;       // the most tokens one prefill call appends (held unevicted until its end)
    bool oracle = false;   // the two-pass attention that matches the simulator bit for bit
};

class HeadCache {
public:
    using PolicyMaker = std::function<std::unique_ptr<Policy>()>;
    HeadCache(const HeadPlan& plan, PolicyMaker make_policy);

    // A new sequence in two steps, so a runtime can build every head's policy (which may read its
    // profile again, and fail) before it changes any head.
    std::unique_ptr<Policy> fresh_policy() const;
    void reset(std::unique_ptr<Policy> fresh);
    // One decode step; q: the group's queries (group x head_dim), out: their outputs. Throws
    // std::logic_error when the policy breaks its contract.
    // With defer_eviction (a prefill's tokens but its last), t is admitted and nothing evicted.
    void decode(int32_t t, const float* q, const float* k, const float* v, float* out, bool defer_eviction = false);

    // The same step in three parts, for a backend that attends elsewhere (the CUDA device):
    // admit t's key and value at FP16 and return its slot; then either abandon that slot (the
    // attention failed: the head is as before the step), or complete the step from the group's
    // mean weight on each slot (a row of `capacity()` floats, by slot).
    int admit(int32_t t, const float* k, const float* v);
    void abandon(int slot);
    void complete_from_slot_weights(int32_t t, int slot, const float* slot_weights, bool defer_eviction);

    // A device mirror of this head's slots: every slot whose contents or tiers change is marked,
    // and take_dirty hands each marked slot once, with its code (device_pool.h's slot_code, or
    // kEmptyCode),
    // so the device receives only what changed. Not for streaming heads (they stay on the host).
    void mirror_to_device(bool on);
    void take_dirty(const std::function<void(int slot, uint8_t code)>& send);
    void mark_all_dirty();  // the device lost what it held: every slot is sent again
    bool streaming() const { return state_ != nullptr; }
    const TierFormat* tier_format() const { return format_; }  // null: every token at FP16
    bool per_channel_keys() const { return kivi_; }  // KIVI key groups: the CPU backends only
    int capacity() const { return capacity_; }
    // Every tier's rows where they lie, keys and values: what a device copy reads.
    void tier_views(TierView (&keys)[3], TierView (&values)[3]) const {
        for (int tier = 0; tier < 3; ++tier) keys[tier] = keys_[tier].view(), values[tier] = values_[tier].view();
    }

    const std::vector<int32_t>& held() const { return positions_; }
    uint8_t key_tier_of(std::size_t i) const { return key_tier_[positions_[i]]; }
    // Bytes while attending at the last step (held tokens at their tiers, the current token at
    // FP16, bookkeeping per slot, a streaming head's state), counted as the simulator counts them.
    double attending_bytes() const { return attending_bytes_; }
    std::size_t reserved_bytes() const;

    // Benchmarks only (bench/bench_runtime.cpp): hold positions 0..tokens-1 with the given rows
    // (tokens x head_dim each) at tier_of(position), without the policy; then one attention pass
    // over them (the last position as the current token, which must be FP16), by the serving path
    // or the oracle's.
    void bench_fill(int tokens, const float* k, const float* v, const std::function<uint8_t(int)>& tier_of);
    void bench_attend(const float* q, float* out, bool oracle = false);

private:
    void start();
    void complete(int32_t t, int slot, bool defer_eviction);
    void mark(int slot, uint8_t code);
    void add_group_key(int32_t t, const float* k);
    void read_key(int32_t p, uint8_t tier, int slot, float* out) const;
    const float* group_scales(uint8_t tier, int32_t p) const {
        return channel_scales_[tier].data() + static_cast<std::size_t>(p / key_group_) * plan_.head_dim;
    }
    void sink(std::size_t i, uint8_t key_tier, uint8_t value_tier);
    void release(int slot, int32_t p);
    void assign_tiers(int32_t t);
    void attend_two_pass(int slot, const float* q, float* out);
    void attend_from_storage(const float* q, float* out);
    TierRows key_rows(int tier) const;
    TierRows value_rows(int tier) const;
    [[noreturn]] void fail(int32_t t, const std::string& what) const;

    HeadPlan plan_;
    PolicyMaker make_policy_;
    std::unique_ptr<Policy> policy_;
    StreamingHeadState* state_ = nullptr;  // owned by the policy; null unless a streaming head
    const TierFormat* format_ = nullptr;
    int capacity_ = 0;                      // slots: budget + 1
    TierStore keys_[3], values_[3];        // per tier, room for `capacity_` slots, packed
    std::vector<int32_t> positions_;       // held, ascending
    std::vector<int> slot_of_;             // index-aligned with positions_
    std::vector<int32_t> position_of_slot_;
    std::vector<int> free_slots_;
    std::vector<uint8_t> key_tier_, value_tier_;  // by position, as the policy assigns them
    std::vector<uint8_t> new_key_tier_, new_value_tier_;  // what assign_tiers writes, checked
    std::vector<int32_t> victims_;
    std::vector<float> key_row_, value_row_, attn_;
    // The oracle's: one head's scores, and the group's weights (group x (held + 1)).
    Eigen::ArrayXf scores_;
    std::vector<float> weights_;
    // The serving path's: the group's scores, then weights, query head h at h * score_stride_
    // from row_weights_[score_offset_], in the order the key tiers' rows were read; where each
    // slot's lies; per head the peak score and 1 / the sum of the exponentials. Every head's row
    // starts on kSoftmaxRowAlignBytes: exp_minus_peak takes a row's unaligned head one by one
    // (Eigen's way), so an address that moved with the heap would move the output's bits with it.
    std::vector<float> row_weights_, row_means_;
    std::size_t score_stride_ = 0, score_offset_ = 0;
    std::vector<int32_t> index_of_slot_;
    std::vector<float> peaks_, inverse_sums_;
    std::vector<float> kernel_scratch_;
    double key_bytes_[3] = {}, value_bytes_[3] = {};
    bool kivi_ = false;                    // keys per channel, a scale per group of positions
    int key_group_ = 1;
    int completed_key_groups_ = 0;
    std::vector<float> group_keys_;        // the current position group's keys at FP16
    std::vector<float> channel_scales_[3]; // [tier 1, 2]: per position group, a scale per channel
    bool mirrored_ = false;
    std::vector<uint8_t> slot_code_, slot_dirty_;  // by slot, when mirrored
    std::vector<int> dirty_slots_;
    double attending_bytes_ = 0;
    std::vector<const float*> group_queries_;  // a streaming head's queries, by head (sized when planned)
};

}  // namespace kvsim::runtime
