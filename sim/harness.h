// One policy replaying one KV head's attention stream (a sequence's layer and KV head) under one
// budget, with the reference harness's semantics and metrics (policybook-kvcache.md section 3),
// extended to grouped-query attention, two attention views and a prefill.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "policies/policy.h"
#include "sim/attention_source.h"
#include "sim/step_sample.h"
#include "cache_math/tiers.h"

namespace kvsim {

struct StreamMetrics {
    double retained_mass = 0.0;  // summed over (query head, decode step); divide by steps
    int64_t steps = 0;           // query-head decode steps measured
    int64_t heavy_hitter_hits = 0;
    int64_t heavy_hitter_possible = 0;
    int64_t eviction_calls = 0;  // per KV head stream
    // Output error (Q/K/V traces): per (query head, decode step), the cached attention output
    // against the full cache's at full precision.
    double output_rel_error = 0.0;  // summed relative L2 error
    double output_cosine = 0.0;     // summed cosine similarity
    int64_t output_steps = 0;
    // Where output error is measured on a sample of decode steps (OutputErrorSample): the two sums
    // above are estimates of the every-step sums (output_steps still counts every step), and this
    // is the estimated variance of output_rel_error's estimate. 0 where every step is measured.
    double output_error_variance = 0.0;
    // Memory (Q/K/V traces): per (KV head, decode step), bytes the cache holds while attending,
    // what a full fp16 cache would hold, and the tokens of context.
    double cache_bytes = 0.0;
    double fp16_bytes = 0.0;
    int64_t context_tokens = 0;

    void add(const StreamMetrics& o) {
        retained_mass += o.retained_mass;
        steps += o.steps;
        heavy_hitter_hits += o.heavy_hitter_hits;
        heavy_hitter_possible += o.heavy_hitter_possible;
        eviction_calls += o.eviction_calls;
        output_rel_error += o.output_rel_error;
        output_cosine += o.output_cosine;
        output_steps += o.output_steps;
        output_error_variance += o.output_error_variance;
        cache_bytes += o.cache_bytes;
        fp16_bytes += o.fp16_bytes;
        context_tokens += o.context_tokens;
    }
};

// How the attention of a KV head's query heads is combined into the one row its policy sees.
enum class GroupReduce { mean, max, sum };

// Reduces a group's rows (t weights each) into one row: what a policy sees in the raw view.
void combine_group_rows(std::span<const float* const> rows, int64_t t, GroupReduce reduce, float* out);

// Each row's weights on the kept positions (ascending), copied to gathered[h * kept.size() + slot]
// (where gathered is not null) and summed in double into retained[h]: the bits of the sum in
// position order, however summed.
// `interleaved`, where given for a group of 4 rows, holds the same weights [position][row];
// `bounded` says that every one of them is +0 or in [2^-29, 2) (interleave_rows' answer).
void sum_kept_weights(std::span<const float* const> rows, std::span<const int32_t> kept, float* gathered,
                      double* retained, const float* interleaved = nullptr, bool bounded = false);

// Four rows of t weights into out[position * 4 + row]. Returns whether every weight is +0 or in
// [2^-29, 2), where sum_kept_weights' four-head sums are exact in any order.
bool interleave_rows(std::span<const float* const> rows, int64_t t, float* out);

struct HarnessOptions {
    AttentionView view = AttentionView::raw;
    GroupReduce reduce = GroupReduce::mean;
    int prefill_tokens = 0;  // positions 0..N-1 enter unevicted; then one compression to budget
    // Whether the memory metric counts the policy's bookkeeping per slot: kvsim's runtime holds it;
    // an engine that keeps K and V alone (kvpress, DuoAttention) does not.
    bool bookkeeping = true;
    // Whether retained mass and heavy-hitter recall are measured. Without them, and with a policy
    // that keeps by position alone, a step's attention rows are never read: the replay makes none.
    bool attention_metrics = true;
};

// The options a config names (its keys already checked): attention_view "raw", "renormalized",
// "cached", or "" for the default, which is what the model really computes after eviction
// (renormalized) wherever values are known (a Q/K/V trace, the model in the loop) and the
// reference harness's raw view on attention traces; group_reduce "mean", "max" or "sum". The
// cached view computes attention from the keys held, so it needs values: without them an
// InputError names `config` (the file that asked for it).
HarnessOptions named_harness_options(const std::string& attention_view, const std::string& group_reduce,
                                     bool values_known, int prefill_tokens, const std::string& config);

// What one step shows the harness of one KV head: its query heads' rows (t weights each), their
// weights on their own position, their top-k positions, and (raw view) the combined row.
struct GroupStep {
    int32_t t = 0;
    std::span<const float* const> rows;
    std::span<const float> self_weight;  // empty unless the view needs it (derived if need be)
    std::span<const float> own_weight;   // the token's weight on itself where the source records it
    std::span<const std::span<const int32_t>> heavy;
    // The same positions as bits (bit p % 64 of word p / 64, (t + 63) / 64 words a head), where the
    // source builds them once for every harness: each then counts its hits a word at a time.
    std::span<const uint64_t* const> heavy_bits;
    const float* combined = nullptr;  // raw view: the reduced row
    // Groups of 4 query heads: their rows interleaved, [position][head], where the replay built
    // them (one load per kept position instead of four); null otherwise.
    const float* interleaved = nullptr;
    bool interleaved_bounded = false;  // every interleaved weight +0 or in [2^-29, 2)
    // Output error: each query head's query at t and the full cache's output (head_dim each).
    std::span<const float* const> queries;
    std::span<const float* const> full_output;
    // The arrays the full outputs were made from (their fp16 keys and values): a cache that holds
    // every position of them at fp16 has those outputs, bit for bit.
    const TierArrays* full_output_arrays = nullptr;
    // Where the replay computed them once for every harness of the step, per tier (0 fp16, 1 INT8,
    // 2 INT4): each query head's scores against every position's key in `tier_scores_keys[tier]`
    // (cache_math/tiers.h, score_row). A harness whose keys at a tier are other arrays (another
    // format's, a projected cache's) computes its own.
    std::array<std::span<const float* const>, 3> tier_scores;
    std::array<const float*, 3> tier_scores_keys{};
};

// Output error measured on a stratified sample of a stream's decode steps (sim/step_sample.h):
// `steps[t]` says whether step t is in it, one step from each of `strata` runs of consecutive
// steps among the `population` measured; the harness scales its sums up to every step at
// `last_step` (the stream's last) and estimates their variance there (sim/replay.h, ReplayOptions).
struct OutputErrorSample {
    const uint8_t* steps = nullptr;
    int64_t last_step = 0;
    int64_t population = 0, strata = 0;
};

// Where a harness finds the values its cache holds (Q/K/V traces only).
struct CacheValues {
    const TierArrays* arrays = nullptr;  // the tiers of the policy's format (fp16 only for none)
    int kv_head = 0, num_kv_heads = 1, head_dim = 0;
    bool output_error = false;  // compute the output-error metric
    bool memory = false;        // compute the memory metric
    // A projected cache (cache_math/lowrank.h): numbers a token's key and value keep (0: head_dim), the
    // share of them this KV head carries, and bytes it holds whatever the context (its bases).
    int key_dim = 0, value_dim = 0;
    double byte_share = 1.0;
    double fixed_bytes = 0.0;
    OutputErrorSample sample{};  // steps null: output error at every measured step
    // The cached view computes the cache's outputs only at steps whose output error is measured
    // (a replay's); otherwise at every step, for last_outputs (kvsim eval's model reads them).
    bool outputs_when_measured = false;
};

// `start` plus the bytes of the held positions `kept`, each its key's and its value's tier's
// bytes (tiers 0, 1, 2, by position): the sum token by token, in kept's order. Where `start` and
// every tier's bytes are whole numbers (start at most 2^52, a tier's bytes 2^20), every partial
// sum is an integer at most 2^53 and so exact, and the held tokens per tier times their bytes is
// the same double: a count per tier gives it, without the chain of dependent floating adds that
// was the metric's cost on a tiered replay.
double held_tier_bytes(double start, std::span<const int32_t> kept, const uint8_t* key_tier, const uint8_t* value_tier,
                       const double key_bytes[3], const double value_bytes[3]);
// Whether `start` and every tier's bytes are the whole numbers held_tier_bytes counts with.
bool tier_bytes_are_whole(double start, const double key_bytes[3], const double value_bytes[3]);
// Held positions, and how many of them hold their key and their value at INT8 and at INT4 (the
// rest at fp16).
struct HeldTierCounts {
    int64_t held = 0, key_int8 = 0, key_int4 = 0, value_int8 = 0, value_int4 = 0;
};
// `start` plus their bytes, as held_tier_bytes adds them where the bytes are whole.
double tier_bytes_of_counts(double start, const HeldTierCounts& counts, const double key_bytes[3],
                            const double value_bytes[3]);

class Harness {
public:
    // `label` and `where` name the policy and the stream in error messages.
    Harness(std::unique_ptr<Policy> policy, int budget, int64_t sequence_length, const HarnessOptions& options,
            std::string label, std::string where);

    void step(const GroupStep& s);
    // Where this step's output error is measured, its cached attention without the value sums,
    // for a caller that makes several harnesses' sums in one pass (cached_attention_values_of_caches,
    // as LockstepReplay does for a KV head's plans); then values_shared(s.t) before step(s), which
    // then takes those outputs as its own. Null where there are none to share (step() makes them
    // itself, or they were made whole here); the outputs are the same bits either way.
    const CachedValueSums* weights_for_shared_values(const GroupStep& s);
    void values_shared(int32_t t) { attended_step_ = t; }
    // A step in two halves, for heads that share one budget (Ada-KV): observe() measures the step,
    // shows the policy its attention and admits the token; evict_to() then brings the cache down
    // to `keep` positions (Policy::evict_to) once a prefill is over, and assigns tiers.
    void observe(const GroupStep& s);
    void evict_to(int32_t t, int keep);
    // Enables the value-level metrics; `values` must outlive the steps that use it.
    void set_values(const CacheValues& values);
    // The prompt a prefill-time compressor (Policy::reads_prompt) reads at the prompt's end: its
    // arrays must outlive that step. Its length is the harness's prefill_tokens.
    void set_prompt(const PromptView& prompt);

    const StreamMetrics& metrics() const { return metrics_; }
    const Policy& policy() const { return *policy_; }
    Policy& policy() { return *policy_; }
    int budget() const { return budget_; }
    int prefill_tokens() const { return options_.prefill_tokens; }
    std::span<const int32_t> kept() const { return kept_; }
    // The attention outputs (query heads of the group x head_dim) of the cache this harness held
    // at its last measured step, when the output-error metric is on.
    std::span<const float> last_outputs() const { return last_outputs_; }

private:
    [[noreturn]] void fail(int32_t t, const std::string& what) const;
    void evict(int32_t t, int budget, bool exact);
    void assign_tiers(int32_t t);

    std::unique_ptr<Policy> policy_;
    int budget_;
    HarnessOptions options_;
    std::string label_;
    std::string where_;
    SlotArray<int32_t> kept_;       // ascending
    int64_t sequence_length_;
    std::vector<uint64_t> kept_bits_;  // by position, a bit each (as GroupStep::heavy_bits)
    bool is_kept(int32_t p) const { return (kept_bits_[p >> 6] >> (p & 63)) & 1; }
    void set_kept(int32_t p, bool kept) {
        const uint64_t bit = uint64_t{1} << (p & 63);
        kept_bits_[p >> 6] = kept ? kept_bits_[p >> 6] | bit : kept_bits_[p >> 6] & ~bit;
    }
    std::vector<float> attn_;       // this step's weights on kept_, index-aligned
    std::vector<double> retained_;  // per query head of the group, this step
    std::vector<float> gathered_;   // [head][kept slot] weights (sum_kept_weights)
    std::vector<float> scale_;      // renormalized view: per head, 1 / (its kept mass + its own weight)
    std::vector<int32_t> victims_;
    std::vector<std::size_t> victim_slots_;  // victims' indices in kept_
    StreamMetrics metrics_;
    // Precision: each position's key and value tier (Tier as uint8_t), and the metrics' inputs.
    std::vector<uint8_t> key_tier_, value_tier_;
    bool tiered_ = false;
    CacheValues values_;
    PromptView prompt_;
    double key_bytes_[3] = {}, value_bytes_[3] = {};
    std::vector<int32_t> attended_;  // kept_ plus the current token
    std::vector<float> last_outputs_;
    Eigen::ArrayXf scratch_;
    std::vector<CachedQuery> group_queries_;  // attend_cached's heads, kept to reuse its memory
    int64_t state_next_ = 0;  // the next position a streaming head's linear state takes

    void measure_values(const GroupStep& s);
    void finish_sample(int64_t group);
    // The sampled output error: per sampled step, the group's summed relative error and cosine,
    // stratum by stratum; the measured steps of the stream, sampled or not.
    std::optional<StratifiedSum> sample_sums_;
    int64_t population_steps_ = 0;
    void attend_cached(const GroupStep& s, bool with_outputs);
    const CachedValueSums* attend_cached_weights(const GroupStep& s, bool with_outputs);
    bool output_measured(int32_t t) const;
    bool holds_the_full_cache(const GroupStep& s) const;
    void feed_linear_state(int32_t t);
    std::vector<float> cached_weights_;  // cached view: [head][attended position] weights
    int64_t attended_step_ = -1;         // the step last_outputs_ holds (-1: none)
    CachedValueSums pending_values_;     // attend_cached_weights' sums still to make
};

}  // namespace kvsim
