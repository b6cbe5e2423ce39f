#include "sim/harness.h"

#include <algorithm>
#include <stdexcept>

#include "src/errors.h"

namespace kvsim {

Harness::Harness(std::unique_ptr<Policy> policy, int budget, int64_t sequence_length, const HarnessOptions& options,
                 std::string label, std::string where)
    : policy_(std::move(policy)), budget_(budget), options_(options), label_(std::move(label)),
      where_(std::move(where)), is_kept_(sequence_length, 0) {
    kept_.reserve(std::max(budget, options.prefill_tokens) + 1);
    kept_.push_back(0);
    is_kept_[0] = 1;
}

void Harness::fail(int32_t t, const std::string& what) const {
    throw PolicyError("policy " + label_ + " at step " + std::to_string(t) + where_ + ": " + what);
}

void Harness::step(const GroupStep& s) {
    const int32_t t = s.t;
    const std::size_t held = kept_.size(), group = s.rows.size();
    // Decode steps are measured; prompt steps (a prefill) only feed the policy.
    const bool measured = t >= options_.prefill_tokens;

    // Retained mass per query head: the full-cache weight on kept positions, before eviction.
    retained_.resize(group);
    for (std::size_t h = 0; h < group; ++h) {
        const float* row = s.rows[h];
        double retained = 0.0;
        for (std::size_t j = 0; j < held; ++j) retained += row[kept_[j]];
        retained_[h] = retained;
    }
    if (measured) {
        for (std::size_t h = 0; h < group; ++h) {
            // The current token is always in the cache: where its own weight is known, it counts.
            metrics_.retained_mass += retained_[h] + (s.own_weight.empty() ? 0.0 : s.own_weight[h]);
            int64_t hits = 0;
            for (int32_t p : s.heavy[h]) hits += is_kept_[p];
            metrics_.heavy_hitter_hits += hits;
            metrics_.heavy_hitter_possible += static_cast<int64_t>(s.heavy[h].size());
        }
        metrics_.steps += static_cast<int64_t>(group);
    }

    // What the policy sees, index-aligned with kept_.
    attn_.resize(held);
    if (options_.view == AttentionView::raw) {
        // The full softmax restricted to the positions held, not renormalised.
        for (std::size_t j = 0; j < held; ++j) attn_[j] = s.combined[kept_[j]];
    } else {
        // The softmax over held positions and the current token: each head's raw weights divided
        // by what that head keeps, then combined across the group.
        float scale[64];
        std::vector<float> big_scale;
        float* sc = scale;
        if (group > 64) {
            big_scale.resize(group);
            sc = big_scale.data();
        }
        for (std::size_t h = 0; h < group; ++h) {
            const double total = retained_[h] + s.self_weight[h];  // kept positions and the token itself
            sc[h] = total > 0 ? static_cast<float>(1.0 / total) : 0.0f;
        }
        for (std::size_t j = 0; j < held; ++j) {
            const int32_t p = kept_[j];
            float v = s.rows[0][p] * sc[0];
            for (std::size_t h = 1; h < group; ++h) {
                const float w = s.rows[h][p] * sc[h];
                v = options_.reduce == GroupReduce::max ? std::max(v, w) : v + w;
            }
            attn_[j] = options_.reduce == GroupReduce::mean ? v / static_cast<float>(group) : v;
        }
    }

    try {
        policy_->on_decode_step(t, attn_);
    } catch (const std::logic_error& e) {
        fail(t, e.what());
    }
    kept_.push_back(t);
    is_kept_[t] = 1;

    // During a prefill the cache grows freely; after its last token it is compressed once.
    if (t + 1 < options_.prefill_tokens) return;
    if (kept_.size() > static_cast<std::size_t>(budget_)) evict(t);
}

void Harness::evict(int32_t t) {
    ++metrics_.eviction_calls;
    victims_.clear();
    try {
        policy_->evict(budget_, victims_);
    } catch (const std::logic_error& e) {
        fail(t, e.what());
    }
    victim_slots_.clear();
    for (int32_t v : victims_) {
        if (v < 0 || v > t || !is_kept_[v]) fail(t, "evicted position " + std::to_string(v) + " which it does not hold");
        is_kept_[v] = 0;
        victim_slots_.push_back(static_cast<std::size_t>(std::lower_bound(kept_.begin(), kept_.end(), v) - kept_.begin()));
    }
    std::sort(victim_slots_.begin(), victim_slots_.end());
    erase_slots(kept_, victim_slots_);
    if (kept_.size() > static_cast<std::size_t>(budget_))
        fail(t, "left " + std::to_string(kept_.size()) + " positions cached, over the budget of " +
                    std::to_string(budget_));
}

}  // namespace kvsim
