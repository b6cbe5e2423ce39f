// H2O: Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
// Large Language Models" (NeurIPS). Score = attention accumulated since the token arrived.
#include "policies/scored_eviction.h"

namespace kvsim {
namespace {

class H2O : public ScoredEviction<double> {
public:
    H2O(int capacity, int recent_window) : ScoredEviction(capacity, recent_window) { accumulated_.push_back(0.0); }

protected:
    void observe(std::span<const float> attn) override {
        for (std::size_t i = 0; i < attn.size(); ++i) accumulated_[i] += attn[i];
    }
    void admit() override { accumulated_.push_back(0.0); }
    std::span<const double> scores() override { return accumulated_; }
    void drop_state(std::span<const std::size_t> evicted) override { accumulated_.erase(evicted); }
    std::size_t state_bytes_per_slot() const override { return sizeof(double); }

private:
    SlotArray<double> accumulated_;
};

}  // namespace

PolicyDescriptor h2o_descriptor() {
    PolicyDescriptor d{"h2o", "Zhang et al. 2023, H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs (NeurIPS)",
            {{"recent_window", 32, true, 0, "most recent tokens never evicted"}},
            [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                return std::make_unique<H2O>(ctx.capacity, param_int(p, "recent_window"));
            },
            check_recent_window_fits};
    d.scored = true;
    return d;
}

}  // namespace kvsim
