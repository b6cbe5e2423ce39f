// SnapKV: Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation".
// Score = attention summed over an observation window of recent steps, max-pooled over
// neighbouring cached tokens so that phrases survive together. PyramidKV reuses it per layer.
#pragma once
#include "policies/scored_eviction.h"

namespace kvsim {

class SnapKV : public ScoredEviction<double> {
public:
    SnapKV(int capacity, int recent_window, int obs_window, int pool_kernel);

protected:
    void observe(std::span<const float> attn) override;
    void admit() override;
    std::span<const double> scores() override;
    void drop_state(std::span<const std::size_t> evicted) override;
    std::size_t state_bytes_per_slot() const override;

private:
    double ring_order_sum(std::size_t slot) const;
    int pool_radius_;
    // window_[k][slot]: the attention of the k-th entry of a ring of the last obs_window steps,
    // stored column by column so that the per-slot sums vectorise across slots.
    std::vector<SlotArray<float>> window_;
    int write_index_ = 0;  // one ring index shared by all slots
    // Each slot's window sum, kept up to date step by step where that is exact (see summable):
    // running_[slot] is the sum in any order, so the in-order sum too, where unsummable_[slot]
    // (the slot's window entries that are not summable) is 0. The count is the simulator's
    // proof of exactness, not state the policy needs, so bytes_per_slot leaves it out.
    SlotArray<double> running_;
    SlotArray<int32_t> unsummable_;
    int64_t unsummable_total_ = 0;  // the sum of unsummable_: 0 allows observe's short loop
    uint32_t smallest_summable_bits_;
    std::vector<double> window_sum_;
    std::vector<double> pooled_;
};

// What SnapKV's observation window takes (PyramidKV's too).
ParamMemory snapkv_memory(const ParamValues& params, const PolicyContext& ctx);

}  // namespace kvsim
