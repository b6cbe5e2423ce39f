// Sliding window: keep the most recent `budget` tokens (the baseline every KV-cache paper beats).
#include "policies/recency.h"

namespace kvsim {
namespace {

class SlidingWindow : public Policy {
public:
    explicit SlidingWindow(int capacity) : ring_(capacity) { ring_.push(0); }

    void on_decode_step(int32_t pos, std::span<const float>) override { ring_.push(pos); }
    bool reads_attention() const override { return false; }

    void evict(int budget, std::vector<int32_t>& victims) override {
        while (ring_.size() > static_cast<std::size_t>(budget)) victims.push_back(ring_.pop_oldest());
    }

    std::size_t bytes_per_slot() const override { return sizeof(int32_t); }

private:
    PositionRing ring_;
};

}  // namespace

PolicyDescriptor sliding_window_descriptor() {
    return {"sliding_window", "Beltagy et al. 2020, Longformer (local attention window)", {},
            [](const ParamValues&, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                return std::make_unique<SlidingWindow>(ctx.capacity);
            },
            nullptr};
}

}  // namespace kvsim
