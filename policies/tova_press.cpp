// TOVA: Oren et al. 2024, "Transformers are Multi-State RNNs" (Token Omission Via Attention), as
// NVIDIA kvpress's TOVAPress applies it to a prompt: a position's score is the attention the
// prompt's last query pays it, averaged over every query head of the layer, so that every KV head
// keeps the same positions; the last position always stays (scored above all).
#include <algorithm>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class TovaPress : public PromptPress {
public:
    explicit TovaPress(int capacity) : PromptPress(capacity) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        const int64_t n = p.length, last = n - 1;
        std::vector<float> row(static_cast<std::size_t>(n));
        std::fill(scores.begin(), scores.end(), 0.0);
        for (int head = 0; head < p.num_query_heads; ++head) {
            prompt_attention_row(p, head, last, row.data());
            for (int64_t j = 0; j < last; ++j) scores[j] += row[j];
        }
        double top = 0;
        for (int64_t j = 0; j < last; ++j) top = std::max(top, scores[j] /= p.num_query_heads);
        scores[last] = top + 1;
    }
};

}  // namespace

PolicyDescriptor tova_press_descriptor() {
    return prompt_press_descriptor("tova_press",
                                   "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA), as kvpress's TOVAPress "
                                   "compresses a prompt",
                                   {}, [](const ParamValues&, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                                       return std::make_unique<TovaPress>(ctx.capacity);
                                   });
}

}  // namespace kvsim
