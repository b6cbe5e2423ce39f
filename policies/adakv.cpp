// Ada-KV: Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference".
//
// A layer's cache budget is one pool for all its KV heads. Uniform allocation gives every head the
// same B tokens; Ada-KV keeps the layer's best tokens wherever they are, so a head whose attention
// is diffuse (many tokens matter a little) gets more slots and a concentrated head (a few tokens
// matter a lot) fewer. Per decode step, for a layer with heads 1..H and uniform shares B_1..B_H:
//
//   1. every head observes the step's attention and admits the token (its own policy's scores);
//   2. if the heads together hold no more than B = B_1 + ... + B_H, nothing is evicted;
//   3. each head keeps its protected tokens (its policy's recent window, an unobserved token):
//      they count against its budget and are never outranked;
//   4. safeguard: each head keeps its own best tokens up to floor x B_h (protected ones included);
//   5. the rest of B goes to the highest-scoring remaining tokens of all heads together;
//   6. each head evicts down to what it was given, by its own policy's order.
//
// Selection uses the wrapped policy's order (policies/scored_eviction.h: lowest score first, NaN
// lowest of all, ties to the lower position; across heads, then to the lower head), so step 6
// evicts exactly the tokens steps 3-5 left out. Scores compare across heads because each head's
// row is an attention distribution over the same positions, every step handing every head the
// same unit of mass (at most 1 in the raw view, exactly 1 renormalised): accumulated attention
// (H2O), the last step's (TOVA), an observation window's sums (SnapKV, PyramidKV) and votes over
// each head's own uniform share (Scissorhands) are on one scale for every head of a layer.
// With floor 1 every head keeps exactly its share: the wrapped policy at uniform budgets.
#include "policies/adakv.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <stdexcept>

#include "base/errors.h"
#include "policies/ranking.h"

namespace kvsim {

const PolicyDescriptor& adakv_descriptor() {
    static const PolicyDescriptor descriptor{
        "adakv",
        "Feng et al. 2024, Ada-KV: Adaptive Budget Allocation across a layer's KV heads "
        "(wraps a scored policy: {evict: h2o, adakv: {floor: 0.2}})",
        {{"floor", 0.2, false, 0, "each head keeps at least this fraction of its uniform share (0 to 1)"}},
        nullptr,
        nullptr};
    return descriptor;
}

AdaKvRule resolve_adakv(const std::map<std::string, double>& given, const std::string& where) {
    const ParamValues values = resolve_params(adakv_descriptor(), given, where);
    AdaKvRule rule;
    rule.floor = values.at("floor");
    if (rule.floor > 1) {
        char text[64];
        std::snprintf(text, sizeof text, "%g", rule.floor);
        throw InputError(where + ".floor: must be between 0 and 1, got " + text);
    }
    return rule;
}

std::string adakv_label(const AdaKvRule& rule) {
    if (rule.floor == AdaKvRule{}.floor) return "adakv";
    char text[64];
    std::snprintf(text, sizeof text, "adakv(floor=%g)", rule.floor);
    return text;
}

namespace {

// Ada-KV's order of eviction across heads, the wrapped policy's and then the lower head, as one
// key: the score's ascending_key (NaN lowest, -0 and +0 one key, as evicted_before has them), then
// the position, then the head. The larger key is kept first. Two of these compare as two
// integers, where the comparator they replace tested for NaN twice a comparison (the selections
// were 10-14% of the samples of a 16-layer search pass with Ada-KV's plans).
unsigned __int128 kept_key(double score, int32_t position, int head) {
    const uint64_t tie = (static_cast<uint64_t>(static_cast<uint32_t>(position)) << 32) | static_cast<uint32_t>(head);
    return (static_cast<unsigned __int128>(ascending_key(score)) << 64) | tie;
}

int head_of(unsigned __int128 key) { return static_cast<int>(static_cast<uint32_t>(key)); }

}  // namespace

void AdaKvAllocator::allocate(std::span<Policy* const> heads, std::span<const int> shares, std::vector<int>& keep) {
    const std::size_t count = heads.size();
    keep.assign(count, 0);
    held_.resize(count);
    int64_t total = 0, held = 0;
    for (std::size_t h = 0; h < count; ++h) {
        if (!heads[h]->held_scores(held_[h])) throw std::logic_error("adakv: the wrapped policy reports no scores");
        total += std::max(shares[h], 0);
        held += static_cast<int64_t>(held_[h].position.size());
    }
    // 2. Within the layer's total: every head keeps what it holds.
    if (held <= total) {
        for (std::size_t h = 0; h < count; ++h) keep[h] = static_cast<int>(held_[h].position.size());
        return;
    }
    const auto kept_first = std::greater<Candidate>();
    pool_.clear();
    int64_t given = 0;
    for (std::size_t h = 0; h < count; ++h) {
        const HeldScores& s = held_[h];
        // 3. Protected tokens stay and count against the head.
        int protected_count = 0;
        evictable_.clear();
        for (std::size_t i = 0; i < s.position.size(); ++i) {
            if (s.protect[i])
                ++protected_count;
            else
                evictable_.push_back(kept_key(s.score[i], s.position[i], static_cast<int>(h)));
        }
        // 4. The safeguard: the head's own best tokens up to floor x its share.
        const int floor_tokens = static_cast<int>(std::floor(rule_.floor * std::max(shares[h], 0)));
        const std::size_t guaranteed =
            static_cast<std::size_t>(std::clamp(floor_tokens - protected_count, 0, static_cast<int>(evictable_.size())));
        std::nth_element(evictable_.begin(), evictable_.begin() + guaranteed, evictable_.end(), kept_first);
        keep[h] = protected_count + static_cast<int>(guaranteed);
        given += keep[h];
        pool_.insert(pool_.end(), evictable_.begin() + guaranteed, evictable_.end());
    }
    // 5. The rest of the layer's total: the best remaining tokens of all heads.
    const std::size_t rest = static_cast<std::size_t>(std::clamp<int64_t>(total - given, 0, static_cast<int64_t>(pool_.size())));
    std::nth_element(pool_.begin(), pool_.begin() + rest, pool_.end(), kept_first);
    for (std::size_t i = 0; i < rest; ++i) ++keep[head_of(pool_[i])];
}

}  // namespace kvsim
