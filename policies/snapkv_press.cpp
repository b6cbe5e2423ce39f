// SnapKV: Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", as
// NVIDIA kvpress's SnapKVPress applies it to a prompt. For each query head of the KV head's group:
//   1. the causal softmax attention of the prompt's last window_size queries (its observation
//      window), on the keys before the window;
//   2. averaged over those queries;
//   3. smoothed by an average pool of kernel_size over positions (zero padding counted);
// then averaged over the group's query heads; the window itself always stays (scored above all).
// Unlike kvsim's decode-time `snapkv` (a rolling window, max pooling over held neighbours), this
// scores once, over the prompt.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class SnapKvPress : public PromptPress {
public:
    SnapKvPress(int capacity, int window, int kernel) : PromptPress(capacity), window_(window), kernel_(kernel) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        const int64_t n = p.length, w = window_, before = n - w;
        if (before < 1)
            throw std::logic_error("a prompt of " + std::to_string(n) + " tokens is not longer than window_size " +
                                   std::to_string(w) + " (kvpress refuses it too)");
        const int radius = kernel_ / 2;
        std::vector<float> row(static_cast<std::size_t>(n));
        std::vector<double> observed(static_cast<std::size_t>(before));
        std::fill(scores.begin(), scores.end(), 0.0);
        for (int g = 0; g < p.group(); ++g) {
            const int head = p.kv_head * p.group() + g;
            std::fill(observed.begin(), observed.end(), 0.0);
            for (int64_t t = before; t < n; ++t) {
                prompt_attention_row(p, head, t, row.data());
                for (int64_t j = 0; j < before; ++j) observed[j] += row[j];
            }
            for (double& x : observed) x /= static_cast<double>(w);
            for (int64_t j = 0; j < before; ++j) {  // average pool, zero padding counted
                double sum = 0;
                for (int64_t o = j - radius; o <= j + radius; ++o)
                    if (o >= 0 && o < before) sum += observed[o];
                scores[j] += sum / kernel_;
            }
        }
        double top = 0;
        for (int64_t j = 0; j < before; ++j) top = std::max(top, scores[j] /= p.group());
        for (int64_t j = before; j < n; ++j) scores[j] = top + 1;  // the window is kept
    }

private:
    int window_, kernel_;
};

}  // namespace

PolicyDescriptor snapkv_press_descriptor() {
    return prompt_press_descriptor(
        "snapkv_press", "Li et al. 2024, SnapKV (NeurIPS), as kvpress's SnapKVPress compresses a prompt",
        {{"window_size", 64, true, 1, "the prompt's last queries whose attention scores the rest (always kept)"},
         {"kernel_size", 5, true, 1, "width of the average pooling over neighbouring positions", true}},
        [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
            return std::make_unique<SnapKvPress>(ctx.capacity, param_int(p, "window_size"), param_int(p, "kernel_size"));
        });
}

}  // namespace kvsim
