// One policy replaying one KV head's attention stream (a sequence's layer and KV head) under one
// budget, with the reference harness's semantics and metrics (policybook-kvcache.md section 3),
// extended to grouped-query attention, two attention views and a prefill.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "policies/policy.h"
#include "sim/attention_source.h"

namespace kvsim {

struct StreamMetrics {
    double retained_mass = 0.0;  // summed over (query head, decode step); divide by steps
    int64_t steps = 0;           // query-head decode steps measured
    int64_t heavy_hitter_hits = 0;
    int64_t heavy_hitter_possible = 0;
    int64_t eviction_calls = 0;  // per KV head stream

    void add(const StreamMetrics& o) {
        retained_mass += o.retained_mass;
        steps += o.steps;
        heavy_hitter_hits += o.heavy_hitter_hits;
        heavy_hitter_possible += o.heavy_hitter_possible;
        eviction_calls += o.eviction_calls;
    }
};

// How the attention of a KV head's query heads is combined into the one row its policy sees.
enum class GroupReduce { mean, max, sum };

struct HarnessOptions {
    AttentionView view = AttentionView::raw;
    GroupReduce reduce = GroupReduce::mean;
    int prefill_tokens = 0;  // positions 0..N-1 enter unevicted; then one compression to budget
};

// What one step shows the harness of one KV head: its query heads' rows (t weights each), their
// weights on their own position, their top-k positions, and (raw view) the combined row.
struct GroupStep {
    int32_t t = 0;
    std::span<const float* const> rows;
    std::span<const float> self_weight;  // empty unless the view needs it (derived if need be)
    std::span<const float> own_weight;   // the token's weight on itself where the source records it
    std::span<const std::span<const int32_t>> heavy;
    const float* combined = nullptr;  // raw view: the reduced row
};

class Harness {
public:
    // `label` and `where` name the policy and the stream in error messages.
    Harness(std::unique_ptr<Policy> policy, int budget, int64_t sequence_length, const HarnessOptions& options,
            std::string label, std::string where);

    void step(const GroupStep& s);

    const StreamMetrics& metrics() const { return metrics_; }
    const Policy& policy() const { return *policy_; }
    const std::vector<int32_t>& kept() const { return kept_; }

private:
    [[noreturn]] void fail(int32_t t, const std::string& what) const;
    void evict(int32_t t);

    std::unique_ptr<Policy> policy_;
    int budget_;
    HarnessOptions options_;
    std::string label_;
    std::string where_;
    std::vector<int32_t> kept_;     // ascending
    std::vector<uint8_t> is_kept_;  // by position
    std::vector<float> attn_;       // this step's weights on kept_, index-aligned
    std::vector<double> retained_;  // per query head of the group, this step
    std::vector<int32_t> victims_;
    std::vector<std::size_t> victim_slots_;  // victims' indices in kept_
    StreamMetrics metrics_;
};

}  // namespace kvsim
