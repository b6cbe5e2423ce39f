// SnapKV: Li et al. 2024 (NeurIPS); the algorithm is described in snapkv.h.
#include "policies/snapkv.h"

namespace kvsim {

SnapKV::SnapKV(int capacity, int recent_window, int obs_window, int pool_kernel)
    : ScoredEviction(capacity, recent_window), pool_radius_((pool_kernel - 1) / 2), window_(obs_window) {
    for (auto& column : window_) {
        column.reserve(capacity);
        column.push_back(0.0f);
    }
}

void SnapKV::observe(std::span<const float> attn) {
    std::vector<float>& column = window_[write_index_];
    for (std::size_t i = 0; i < attn.size(); ++i) column[i] = attn[i];
    write_index_ = (write_index_ + 1) % static_cast<int>(window_.size());
}

// A new token has seen no steps: score 0 until the next one, protected only by the recent window.
void SnapKV::admit() {
    for (auto& column : window_) column.push_back(0.0f);
}

std::span<const double> SnapKV::scores() {
    const std::size_t n = size();
    // Sum in ring-index order (not chronological), as the reference does: bit-exact scores. The
    // first column starts the sums (0.0 + x, the same double as adding x to a cleared sum, -0
    // included), with no clearing pass every step.
    window_sum_.resize(n);
    const std::vector<float>& first = window_[0];
    for (std::size_t i = 0; i < n; ++i) window_sum_[i] = 0.0 + static_cast<double>(first[i]);
    for (std::size_t k = 1; k < window_.size(); ++k) {
        const std::vector<float>& column = window_[k];
        for (std::size_t i = 0; i < n; ++i) window_sum_[i] += column[i];
    }
    // Max-pool over neighbouring cached tokens (adjacent kept entries, not adjacent positions):
    // widen the window one neighbour at a time on each side, whole arrays at once.
    using Array = Eigen::Map<Eigen::ArrayXd>;
    pooled_ = window_sum_;
    Array pooled(pooled_.data(), static_cast<Eigen::Index>(n));
    const Array sums(window_sum_.data(), static_cast<Eigen::Index>(n));
    for (Eigen::Index d = 1; d <= pool_radius_ && d < static_cast<Eigen::Index>(n); ++d) {
        const Eigen::Index m = static_cast<Eigen::Index>(n) - d;
        pooled.head(m) = pooled.head(m).max(sums.tail(m));
        pooled.tail(m) = pooled.tail(m).max(sums.head(m));
    }
    return pooled_;
}

void SnapKV::drop_state(std::span<const std::size_t> evicted) {
    for (auto& column : window_) erase_slots(column, evicted);
}

std::size_t SnapKV::state_bytes_per_slot() const {
    return window_.size() * sizeof(float) + sizeof(double) /*window_sum_*/ + sizeof(double) /*pooled_*/;
}


ParamMemory snapkv_memory(const ParamValues& p, const PolicyContext& ctx) {
    // One column of floats per step of the window, each reserved for every slot the stream may hold.
    const uint64_t steps = static_cast<uint64_t>(p.at("obs_window"));
    const uint64_t slots = static_cast<uint64_t>(std::max(ctx.capacity, 1));
    return {steps * (slots * sizeof(float) + sizeof(std::vector<float>)), "obs_window",
            std::to_string(steps) + " steps of attention x " + std::to_string(slots) + " cached tokens"};
}

PolicyDescriptor snapkv_descriptor() {
    PolicyDescriptor d{"snapkv", "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation (NeurIPS)",
            {{"recent_window", 32, true, 0, "most recent tokens never evicted"},
             {"obs_window", 16, true, 1, "steps of attention summed into the score"},
             {"pool_kernel", 7, true, 1, "width of the max-pooling over neighbouring cached tokens", true}},
            [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                return std::make_unique<SnapKV>(ctx.capacity, param_int(p, "recent_window"),
                                                param_int(p, "obs_window"), param_int(p, "pool_kernel"));
            },
            check_recent_window_fits, false, snapkv_memory};
    d.scored = true;
    return d;
}

}  // namespace kvsim
