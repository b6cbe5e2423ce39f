#include "sim/harness.h"

#include <algorithm>
#include <stdexcept>

#include "src/errors.h"

namespace kvsim {

Harness::Harness(std::unique_ptr<Policy> policy, int budget, int64_t sequence_length, std::string label,
                 std::string where)
    : policy_(std::move(policy)), budget_(budget), label_(std::move(label)), where_(std::move(where)),
      is_kept_(sequence_length, 0) {
    kept_.reserve(budget + 1);
    attn_.reserve(budget + 1);
    kept_.push_back(0);
    is_kept_[0] = 1;
}

void Harness::fail(int32_t t, const std::string& what) const {
    throw PolicyError("policy " + label_ + " at step " + std::to_string(t) + where_ + ": " + what);
}

void Harness::step(int32_t t, std::span<const float> row, std::span<const int32_t> heavy) {
    // What the policy sees: the full softmax restricted to the positions it holds, not
    // renormalised, so its sum is the mass retained before this step's eviction.
    const std::size_t held = kept_.size();
    attn_.resize(held);
    double retained = 0.0;
    for (std::size_t j = 0; j < held; ++j) {
        attn_[j] = row[kept_[j]];
        retained += attn_[j];
    }
    metrics_.retained_mass += retained;
    ++metrics_.steps;

    int64_t hits = 0;
    for (int32_t p : heavy) hits += is_kept_[p];
    metrics_.heavy_hitter_hits += hits;
    metrics_.heavy_hitter_possible += static_cast<int64_t>(heavy.size());

    try {
        policy_->on_decode_step(t, attn_);
    } catch (const std::logic_error& e) {
        fail(t, e.what());
    }
    kept_.push_back(t);
    is_kept_[t] = 1;

    if (kept_.size() <= static_cast<std::size_t>(budget_)) return;
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
