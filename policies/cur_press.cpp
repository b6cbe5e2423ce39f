// CurDKV: Sengupta et al. 2025, "Value-Guided KV Compression for LLMs via Approximated CUR
// Decomposition", as NVIDIA kvpress's CURPress applies it to a prompt (its defaults: product of
// key and value leverage, local approximation, no random projection): each position's squared
// key norm and squared value norm, each normalised within its window of local_window_size
// positions (zero padding past the end), multiplied, normalised over the prompt; the first
// num_sinks positions score 1 (above every other, whose scores sum to 1).
#include <algorithm>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class CurPress : public PromptPress {
public:
    CurPress(int capacity, int sinks, int window) : PromptPress(capacity), sinks_(sinks), window_(window) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        const int64_t n = p.length;
        std::vector<double> k2(static_cast<std::size_t>(n)), v2(static_cast<std::size_t>(n));
        for (int64_t j = 0; j < n; ++j) {
            const float *k = p.key(j, p.kv_head), *v = p.value(j, p.kv_head);
            double ks = 0, vs = 0;
            for (int i = 0; i < p.head_dim; ++i) ks += static_cast<double>(k[i]) * k[i], vs += static_cast<double>(v[i]) * v[i];
            k2[j] = ks, v2[j] = vs;
        }
        for (int64_t start = 0; start < n; start += window_) {  // each local window sums to 1
            const int64_t end = std::min<int64_t>(n, start + window_);
            double ks = 0, vs = 0;
            for (int64_t j = start; j < end; ++j) ks += k2[j], vs += v2[j];
            for (int64_t j = start; j < end; ++j) k2[j] /= ks, v2[j] /= vs;
        }
        double total = 0;
        for (int64_t j = 0; j < n; ++j) total += (scores[j] = k2[j] * v2[j]);
        for (int64_t j = 0; j < n; ++j) scores[j] = j < sinks_ ? 1.0 : scores[j] / total;
    }

private:
    int sinks_, window_;
};

}  // namespace

PolicyDescriptor cur_press_descriptor() {
    return prompt_press_descriptor(
        "cur_press", "Sengupta et al. 2025, CurDKV: approximated CUR decomposition, as kvpress's CURPress compresses a prompt",
        {{"num_sinks", 4, true, 0, "first positions always kept"},
         {"local_window_size", 16, true, 1, "positions over which key and value leverage are normalised"}},
        [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
            return std::make_unique<CurPress>(ctx.capacity, param_int(p, "num_sinks"), param_int(p, "local_window_size"));
        });
}

}  // namespace kvsim
