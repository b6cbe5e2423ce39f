// StreamingLLM: Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"
// (ICLR). Keep the first `sinks` tokens forever and a sliding window of the most recent ones.
#include <algorithm>

#include "policies/recency.h"

namespace kvsim {
namespace {

class StreamingLlm : public Policy {
public:
    StreamingLlm(int capacity, int sinks)
        // Sinks may outnumber the positions a short sequence hands it: the window then stays empty.
        : sinks_(sinks), sinks_held_(sinks > 0 ? 1 : 0), recent_(static_cast<std::size_t>(std::max(capacity - sinks, 1))) {
        if (sinks == 0) recent_.push(0);
    }

    void on_decode_step(int32_t pos, std::span<const float>) override {
        if (pos < sinks_)
            ++sinks_held_;
        else
            recent_.push(pos);
    }
    bool reads_attention() const override { return false; }

    void evict(int budget, std::vector<int32_t>& victims) override {
        while (sinks_held_ + recent_.size() > static_cast<std::size_t>(budget) && recent_.size() > 0)
            victims.push_back(recent_.pop_oldest());
    }

    // Sinks are positions 0..sinks-1, so a count stands for them; the window stores positions.
    std::size_t bytes_per_slot() const override { return sizeof(int32_t); }

private:
    int sinks_;
    std::size_t sinks_held_;
    PositionRing recent_;
};

}  // namespace

PolicyDescriptor streaming_llm_descriptor() {
    return {"streaming_llm", "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks (ICLR)",
            {{"sinks", 4, true, 0, "initial tokens kept forever"}},
            [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                return std::make_unique<StreamingLlm>(ctx.capacity, param_int(p, "sinks"));
            },
            [](const ParamValues& p, int budget) -> std::string {
                if (param_int(p, "sinks") >= budget)
                    return "sinks = " + std::to_string(param_int(p, "sinks")) + " must be less than the budget " +
                           std::to_string(budget);
                return {};
            }};
}

}  // namespace kvsim
