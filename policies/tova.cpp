// TOVA: Oren et al. 2024, "Transformers are Multi-State RNNs" (Token Omission Via Attention).
// Score = the attention the token received at the latest step; no protected window.
#include "policies/scored_eviction.h"

namespace kvsim {
namespace {

class Tova : public ScoredEviction<double> {
public:
    explicit Tova(int capacity) : ScoredEviction(capacity, /*recent_window=*/0) { last_attention_.push_back(kUnobserved); }

protected:
    void observe(std::span<const float> attn) override {
        for (std::size_t i = 0; i < attn.size(); ++i) last_attention_[i] = attn[i];
    }
    // A token nobody has attended to yet cannot be judged, so it survives its first eviction.
    void admit() override { last_attention_.push_back(kUnobserved); }
    std::span<const double> scores() override { return last_attention_; }
    void drop_state(std::span<const std::size_t> evicted) override { last_attention_.erase(evicted); }
    std::size_t state_bytes_per_slot() const override { return sizeof(double); }

private:
    static constexpr double kUnobserved = kNotEvictable<double>;
    SlotArray<double> last_attention_;
};

}  // namespace

PolicyDescriptor tova_descriptor() {
    PolicyDescriptor d{"tova", "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA)", {},
            [](const ParamValues&, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                return std::make_unique<Tova>(ctx.capacity);
            },
            nullptr};
    d.scored = true;
    return d;
}

}  // namespace kvsim
