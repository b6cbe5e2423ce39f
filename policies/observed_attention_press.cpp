// H2O: Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
// Language Models", as NVIDIA kvpress's ObservedAttentionPress applies it to a prompt: a
// position's score is the attention the prompt's queries pay it (itself included), divided by
// how many queries see it (the causal mask hides it from earlier ones), averaged over the KV
// head's group of query heads. No position is protected.
#include <algorithm>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class ObservedAttentionPress : public PromptPress {
public:
    explicit ObservedAttentionPress(int capacity) : PromptPress(capacity) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        const int64_t n = p.length;
        std::vector<float> row(static_cast<std::size_t>(n));
        std::vector<double> sum(static_cast<std::size_t>(n));
        std::fill(scores.begin(), scores.end(), 0.0);
        for (int g = 0; g < p.group(); ++g) {
            std::fill(sum.begin(), sum.end(), 0.0);
            for (int64_t t = 0; t < n; ++t) {
                prompt_attention_row(p, p.kv_head * p.group() + g, t, row.data());
                for (int64_t j = 0; j <= t; ++j) sum[j] += row[j];
            }
            for (int64_t j = 0; j < n; ++j) scores[j] += sum[j] / static_cast<double>(n - j);
        }
        for (double& x : scores) x /= p.group();
    }
};

}  // namespace

PolicyDescriptor observed_attention_press_descriptor() {
    return prompt_press_descriptor("observed_attention_press",
                                   "Zhang et al. 2023, H2O (NeurIPS), as kvpress's ObservedAttentionPress compresses a "
                                   "prompt",
                                   {}, [](const ParamValues&, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                                       return std::make_unique<ObservedAttentionPress>(ctx.capacity);
                                   });
}

}  // namespace kvsim
