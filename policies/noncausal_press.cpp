// Compactor's query-agnostic scores: Chari & Van Durme 2025, "Compactor: Calibrated
// Query-Agnostic KV Cache Compression with Approximate Leverage Scores", as NVIDIA kvpress's
// NonCausalAttnPress applies it to a prompt. The prompt is cut into chunks of chunk_size (the last
// padded with zero queries and keys); inside each chunk every query attends to every key, causal
// or not, by a softmax of the raw dot products (not scaled by sqrt(head_dim)), padded keys and
// padded queries' rows held at (almost) zero logits as kvpress holds them; a position's score is
// the attention its key collects, averaged over the group's query heads, times its value's norm,
// then averaged over a window of 3 (zero padding counted). kvpress then z-scores every head's
// scores together, which orders no head's positions differently, so that step is left out.
#include <algorithm>
#include <cmath>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class NonCausalPress : public PromptPress {
public:
    NonCausalPress(int capacity, int chunk) : PromptPress(capacity), chunk_(chunk) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        const int64_t n = p.length, c = chunk_;
        const int64_t padded = (n + c - 1) / c * c;
        const int d = p.head_dim;
        // kvpress masks the last chunk only when the prompt was padded.
        const bool masked = padded > n;
        std::vector<double> collected(static_cast<std::size_t>(n), 0.0);
        std::vector<float> logits(static_cast<std::size_t>(c));
        for (int g = 0; g < p.group(); ++g) {
            const int head = p.kv_head * p.group() + g;
            for (int64_t start = 0; start < padded; start += c) {
                const bool last = start + c == padded;
                for (int64_t i = start; i < start + c; ++i) {
                    const bool pad_query = i >= n;
                    float peak = -INFINITY;
                    for (int64_t j = start; j < start + c; ++j) {
                        float dot = 0.0f;
                        if (j < n && !pad_query) {
                            const float *q = p.query(i, head), *k = p.key(j, p.kv_head);
                            for (int x = 0; x < d; ++x) dot += q[x] * k[x];
                        }
                        if (last && masked && j >= n) dot = -1e-9f;  // padded keys, in every row
                        logits[j - start] = dot;
                        peak = std::max(peak, dot);
                    }
                    float total = 0.0f;
                    for (float& l : logits) total += (l = std::exp(l - peak));
                    for (int64_t j = start; j < std::min(start + c, n); ++j) collected[j] += logits[j - start] / total;
                }
            }
        }
        std::vector<double> weighted(static_cast<std::size_t>(n));
        for (int64_t j = 0; j < n; ++j) {
            const float* v = p.value(j, p.kv_head);
            double norm = 0;
            for (int x = 0; x < d; ++x) norm += static_cast<double>(v[x]) * v[x];
            weighted[j] = collected[j] / p.group() * std::sqrt(norm);
        }
        for (int64_t j = 0; j < n; ++j)
            scores[j] = ((j > 0 ? weighted[j - 1] : 0.0) + weighted[j] + (j + 1 < n ? weighted[j + 1] : 0.0)) / 3;
    }

private:
    int chunk_;
};

}  // namespace

PolicyDescriptor noncausal_press_descriptor() {
    return prompt_press_descriptor(
        "noncausal_press", "Chari & Van Durme 2025, Compactor (non-causal chunked attention), as kvpress's "
                           "NonCausalAttnPress compresses a prompt",
        {{"chunk_size", 256, true, 1, "positions attending to each other, non-causally, at once"}},
        [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
            return std::make_unique<NonCausalPress>(ctx.capacity, param_int(p, "chunk_size"));
        });
}

}  // namespace kvsim
