// One policy replaying one attention stream (a sequence's layer and head) under one budget,
// with the reference harness's semantics and metrics (policybook-kvcache.md section 3).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "policies/policy.h"

namespace kvsim {

struct StreamMetrics {
    double retained_mass = 0.0;  // summed over steps; divide by steps
    int64_t steps = 0;
    int64_t heavy_hitter_hits = 0;
    int64_t heavy_hitter_possible = 0;
    int64_t eviction_calls = 0;

    void add(const StreamMetrics& o) {
        retained_mass += o.retained_mass;
        steps += o.steps;
        heavy_hitter_hits += o.heavy_hitter_hits;
        heavy_hitter_possible += o.heavy_hitter_possible;
        eviction_calls += o.eviction_calls;
    }
};

class Harness {
public:
    // `label` and `where` name the policy and the stream in error messages.
    Harness(std::unique_ptr<Policy> policy, int budget, int64_t sequence_length, std::string label, std::string where);

    // Decode step t: row holds the weights on positions 0..t-1, heavy the row's top-k positions.
    void step(int32_t t, std::span<const float> row, std::span<const int32_t> heavy);

    const StreamMetrics& metrics() const { return metrics_; }
    const Policy& policy() const { return *policy_; }

private:
    [[noreturn]] void fail(int32_t t, const std::string& what) const;

    std::unique_ptr<Policy> policy_;
    int budget_;
    std::string label_;
    std::string where_;
    std::vector<int32_t> kept_;    // ascending
    std::vector<uint8_t> is_kept_;  // by position
    std::vector<float> attn_;      // this step's weights on kept_, index-aligned
    std::vector<int32_t> victims_;
    std::vector<std::size_t> victim_slots_;  // victims' indices in kept_
    StreamMetrics metrics_;
};

}  // namespace kvsim
