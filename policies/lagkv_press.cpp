// LagKV: Liang et al. 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens
// Are Important", as NVIDIA kvpress's LagKVPress applies it to a prompt (no cross scoring). After
// n_sink sinks the prompt is cut into partitions of lag_size; each partition but the last is
// scored against the one after it: per channel, its keys (and values) are min-max scaled by the
// next partition's range, a token's spread is the standard deviation of its scaled channels, a
// softmax over the partition turns spreads into scores, keys' and values' are averaged, and the
// token's score is its rank within its partition over lag_size. Sinks and the last partition
// (with what is left over) score 1: kept. A prompt shorter than n_sink + 2 lag_size keeps its
// sinks and then its newest tokens. Ranks repeat from partition to partition, and which of a
// tied rank kvpress keeps is torch.topk's choice; the shared selection keeps the later ones.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "policies/prompt_press.h"

namespace kvsim {
namespace {

class LagKvPress : public PromptPress {
public:
    LagKvPress(int capacity, int sinks, int lag) : PromptPress(capacity), sinks_(sinks), lag_(lag) {}

protected:
    void score(const PromptView& p, std::vector<double>& scores) override {
        const int64_t n = p.length;
        if (n < sinks_ + 2 * static_cast<int64_t>(lag_)) {
            for (int64_t j = 0; j < n; ++j)
                scores[j] = j < sinks_ ? 1.0 : static_cast<double>(j - sinks_) / static_cast<double>(n - sinks_);
            return;
        }
        const int64_t partitions = (n - sinks_) / lag_;
        std::fill(scores.begin(), scores.end(), 1.0);
        std::vector<double> spread_k(static_cast<std::size_t>(lag_)), spread_v(static_cast<std::size_t>(lag_));
        for (int64_t part = 0; part + 1 < partitions; ++part) {
            const int64_t first = sinks_ + part * lag_;
            spread(p, first, /*values=*/false, spread_k);
            spread(p, first, /*values=*/true, spread_v);
            std::vector<double> combined(static_cast<std::size_t>(lag_));
            for (int i = 0; i < lag_; ++i) combined[i] = (spread_k[i] + spread_v[i]) / 2;
            std::vector<int> order(static_cast<std::size_t>(lag_));
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return combined[a] < combined[b]; });
            for (int rank = 0; rank < lag_; ++rank)
                scores[first + order[rank]] = static_cast<double>(rank) / lag_;
        }
    }

private:
    // Softmax over the partition of each token's standard deviation (unbiased) across channels,
    // its keys (or values) scaled by the next partition's per-channel minimum and maximum.
    void spread(const PromptView& p, int64_t first, bool values, std::vector<double>& out) const {
        const int d = p.head_dim;
        auto at = [&](int64_t pos) { return values ? p.value(pos, p.kv_head) : p.key(pos, p.kv_head); };
        std::vector<float> low(static_cast<std::size_t>(d), INFINITY), high(static_cast<std::size_t>(d), -INFINITY);
        for (int64_t j = first + lag_; j < first + 2 * lag_; ++j)
            for (int i = 0; i < d; ++i) low[i] = std::min(low[i], at(j)[i]), high[i] = std::max(high[i], at(j)[i]);
        double peak = -INFINITY;
        for (int t = 0; t < lag_; ++t) {
            const float* x = at(first + t);
            double mean = 0;
            std::vector<double> scaled(static_cast<std::size_t>(d));
            for (int i = 0; i < d; ++i) mean += (scaled[i] = (static_cast<double>(x[i]) - low[i]) / (high[i] - low[i]));
            mean /= d;
            double var = 0;
            for (double s : scaled) var += (s - mean) * (s - mean);
            out[t] = std::sqrt(var / (d - 1));
            peak = std::max(peak, out[t]);
        }
        double total = 0;
        for (double& s : out) total += (s = std::exp(s - peak));
        for (double& s : out) s /= total;
    }

    int sinks_, lag_;
};

}  // namespace

PolicyDescriptor lagkv_press_descriptor() {
    return prompt_press_descriptor(
        "lagkv_press", "Liang et al. 2025, LagKV: lag-relative information of the KV cache, as kvpress's LagKVPress "
                       "compresses a prompt",
        {{"n_sink", 4, true, 0, "first positions always kept"},
         {"lag_size", 128, true, 2, "positions of a partition, scored against the next"}},
        [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
            return std::make_unique<LagKvPress>(ctx.capacity, param_int(p, "n_sink"), param_int(p, "lag_size"));
        });
}

}  // namespace kvsim
