// Key norm: Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
// Compression" (EMNLP), as NVIDIA kvpress's KnormPress applies it to a prompt: a position's score
// is minus the L2 norm of its key, so the keys of smallest norm stay. No position is protected.
#include <cmath>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class KnormPress : public PromptPress {
public:
    explicit KnormPress(int capacity) : PromptPress(capacity) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        for (int64_t j = 0; j < p.length; ++j) {
            const float* k = p.key(j, p.kv_head);
            double squares = 0;
            for (int i = 0; i < p.head_dim; ++i) squares += static_cast<double>(k[i]) * k[i];
            scores[j] = -std::sqrt(squares);
        }
    }
};

}  // namespace

PolicyDescriptor knorm_press_descriptor() {
    return prompt_press_descriptor("knorm_press",
                                   "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache "
                                   "Compression (EMNLP), as kvpress's KnormPress compresses a prompt",
                                   {}, [](const ParamValues&, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                                       return std::make_unique<KnormPress>(ctx.capacity);
                                   });
}

}  // namespace kvsim
