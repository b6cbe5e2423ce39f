// The prefill-time compression shared by kvpress's presses; see prompt_press.h.
#include "policies/prompt_press.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvsim {

int kvpress_kept_tokens(int64_t prompt_length, double ratio) {
    if (ratio == 0) return static_cast<int>(prompt_length);
    const double kept = static_cast<double>(prompt_length) * (1.0 - ratio);
    return static_cast<int>(std::max(0.0, std::trunc(kept)));
}

void prompt_attention_row(const PromptView& prompt, int head, int64_t t, float* out) {
    const int d = prompt.head_dim;
    const int kv = head / prompt.group();
    const float* q = prompt.query(t, head);
    const float scale = static_cast<float>(std::sqrt(static_cast<double>(d)));
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j <= t; ++j) {
        const float* k = prompt.key(j, kv);
        float dot = 0.0f;
        for (int i = 0; i < d; ++i) dot += q[i] * k[i];
        out[j] = dot / scale;
        peak = std::max(peak, out[j]);
    }
    float total = 0.0f;
    for (int64_t j = 0; j <= t; ++j) total += (out[j] = std::exp(out[j] - peak));
    for (int64_t j = 0; j <= t; ++j) out[j] /= total;
}

PromptPress::PromptPress(int capacity) : ScoredEviction(capacity, /*recent_window=*/0) {
    scores_.reserve(static_cast<std::size_t>(std::max(capacity, 1)));
    scores_.push_back(0.0);
}

void PromptPress::score_prompt(const PromptView& prompt) {
    if (static_cast<int64_t>(size()) != prompt.length)
        throw std::logic_error("holds " + std::to_string(size()) + " positions at the end of a prompt of " +
                               std::to_string(prompt.length));
    computed_.assign(static_cast<std::size_t>(prompt.length), 0.0);
    score(prompt, computed_);
    for (std::size_t i = 0; i < computed_.size(); ++i) scores_[i] = computed_[i];
}

PolicyDescriptor prompt_press_descriptor(std::string name, std::string paper, std::vector<ParamSpec> params,
                                         std::function<std::unique_ptr<Policy>(const ParamValues&, const PolicyContext&)> make) {
    PolicyDescriptor d{std::move(name), std::move(paper), std::move(params), std::move(make), nullptr};
    // Not `scored` for Ada-KV: a press selects once, per head, from the prompt, not step by step.
    d.prompt_press = true;
    return d;
}

}  // namespace kvsim
