// KeyDiff: Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
// LLM Inference in Resource-Constrained Environments", as NVIDIA kvpress's KeyDiffPress applies it
// to a prompt (in one block): the anchor is the mean of the KV head's unit-normalised keys, and a
// position's score is minus its key's cosine similarity to the anchor, so the most distinctive
// keys stay. No position is protected.
#include <algorithm>
#include <cmath>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class KeyDiffPress : public PromptPress {
public:
    explicit KeyDiffPress(int capacity) : PromptPress(capacity) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        const int d = p.head_dim;
        auto norm = [d](const float* x) {
            double s = 0;
            for (int i = 0; i < d; ++i) s += static_cast<double>(x[i]) * x[i];
            return std::sqrt(s);
        };
        std::vector<double> anchor(static_cast<std::size_t>(d), 0.0);
        for (int64_t j = 0; j < p.length; ++j) {
            const float* k = p.key(j, p.kv_head);
            const double scale = std::max(norm(k), 1e-12);  // F.normalize's floor
            for (int i = 0; i < d; ++i) anchor[i] += k[i] / scale;
        }
        double anchor_norm = 0;
        for (double& a : anchor) {
            a /= static_cast<double>(p.length);
            anchor_norm += a * a;
        }
        anchor_norm = std::sqrt(anchor_norm);
        for (int64_t j = 0; j < p.length; ++j) {
            const float* k = p.key(j, p.kv_head);
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += k[i] * anchor[i];
            scores[j] = -dot / std::max(norm(k) * anchor_norm, 1e-8);  // F.cosine_similarity's floor
        }
    }
};

}  // namespace

PolicyDescriptor keydiff_press_descriptor() {
    return prompt_press_descriptor("keydiff_press",
                                   "Park et al. 2025, KeyDiff: Key Similarity-Based KV Cache Eviction, as kvpress's "
                                   "KeyDiffPress compresses a prompt",
                                   {}, [](const ParamValues&, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                                       return std::make_unique<KeyDiffPress>(ctx.capacity);
                                   });
}

}  // namespace kvsim
