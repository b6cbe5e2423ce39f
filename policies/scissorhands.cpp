// Scissorhands: Liu et al. 2023, "Scissorhands: Exploiting the Persistence of Importance
// Hypothesis for LLM KV Cache Compression at Test Time" (NeurIPS). Score = how many steps gave
// the token more than a uniform share of attention.
#include "policies/scored_eviction.h"

namespace kvsim {
namespace {

class Scissorhands : public ScoredEviction<int32_t> {
public:
    Scissorhands(int capacity, int recent_window) : ScoredEviction(capacity, recent_window) { votes_.push_back(0); }

protected:
    void observe(std::span<const float> attn) override {
        if (attn.empty()) return;
        const double uniform_share = 1.0 / static_cast<double>(attn.size());
        for (std::size_t i = 0; i < attn.size(); ++i) votes_[i] += static_cast<double>(attn[i]) > uniform_share;
    }
    void admit() override { votes_.push_back(0); }
    std::span<const int32_t> scores() override { return votes_; }
    void drop_state(std::span<const std::size_t> evicted) override { votes_.erase(evicted); }
    std::size_t state_bytes_per_slot() const override { return sizeof(int32_t); }

private:
    SlotArray<int32_t> votes_;
};

}  // namespace

PolicyDescriptor scissorhands_descriptor() {
    PolicyDescriptor d{"scissorhands", "Liu et al. 2023, Scissorhands: Persistence of Importance for KV Cache Compression (NeurIPS)",
            {{"recent_window", 32, true, 0, "most recent tokens never evicted"}},
            [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                return std::make_unique<Scissorhands>(ctx.capacity, param_int(p, "recent_window"));
            },
            check_recent_window_fits};
    d.scored = true;
    return d;
}

}  // namespace kvsim
