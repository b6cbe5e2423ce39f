// What a cache's precision costs and what it does to attention: the dequantised K and V each tier
// serves (computed once per layer and shared by every policy with the same format), the bytes a
// tiered cache holds, and the attention output of the cache a policy actually holds.
#pragma once
#include <Eigen/Core>
#include <array>
#include <memory>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cache_math/qkv_layer.h"
#include "cache_math/tier_format.h"

namespace kvsim {

struct KvProjection;  // cache_math/lowrank.h

// K and V as the fp16, int8 and int4 tiers of one format hold them, [token][kv_head][d] each.
// The fp16 tier is the trace's own values: a full cache has zero output error by construction.
struct TierArrays {
    TierFormat format;
    std::array<const float*, 3> k{}, v{};
    std::vector<float> storage_k8, storage_v8, storage_k4, storage_v4;
    std::vector<float> storage_k16, storage_v16;  // a projected cache's reconstruction (cache_math/lowrank.h)
};

// The same tiers built token by token, for a model running live (kvsim eval): a value is
// quantised as its token arrives, a KIVI key group when its last token arrives.
// With a projection (cache_math/lowrank.h), what is quantised is the token's latent, as the cache stores
// it, and every tier serves the reconstruction.
class IncrementalTiers {
public:
    IncrementalTiers(const TierFormat* format, int64_t tokens, int num_kv_heads, int head_dim,
                     const KvProjection* projection = nullptr, int layer = 0);
    // Token t's keys and values for every KV head (num_kv_heads * head_dim floats each).
    void add_token(int64_t t, const float* k, const float* v);
    const TierArrays& arrays() const { return arrays_; }

private:
    void quantize_values(int64_t t, const float* v_in, float* v_out, const float* k_in, float* k_out, int bits);
    void quantize_key_group(int64_t first, int64_t count, const float* k_in, float* k_out, int bits);
    // Projected caches: rebuilds tokens [first, first + count) of a tier from its latents.
    void reconstruct(bool key, const std::vector<float>& latent, std::vector<float>& out, int64_t first, int64_t count);
    bool tiered_;
    int kv_heads_, head_dim_;
    int quant_heads_, quant_dim_;  // how quantisation groups a row: per KV head, or one joint latent
    std::vector<float> k_, v_;
    TierArrays arrays_;
    std::shared_ptr<const KvProjection> projection_;  // a copy: the policy may go first
    int layer_ = 0;
    std::vector<float> latent_k_, latent_v_, latent_k8_, latent_v8_, latent_k4_, latent_v4_;
};

// A tier format's value groups (INT4's, and INT8's where it has its own) must cut the head size
// into whole groups. Every place a format meets a head size (a replay, kvsim eval's model, the
// runtime's profile) asks this, so they accept the same formats: the InputError names the
// policy (`label`) and the trace, model or profile (`of`).
void check_tier_format(const TierFormat& format, int head_dim, const std::string& label, const std::string& of);

// Builds the int8 and int4 tiers of `layer` for `format` (fp16 points into `layer` itself).
void build_tier_arrays(const QkvLayer& layer, int num_kv_heads, int head_dim, TierArrays& arrays);

// Bytes one cached token's key (or value) takes per KV head at a tier, scales included
// (amortised over their groups): the closed forms of cache_math/quantize.h.
double key_bytes(Tier tier, int head_dim, const TierFormat* format);
double value_bytes(Tier tier, int head_dim, const TierFormat* format);

// The attention output of one query head over the cached positions `held` (ascending, the current
// token included), with each position's key and value read from its tier: softmax of
// q.k / sqrt(d) over held only (renormalised), weighted sum of v. out has head_dim floats, or is
// null where only the weights are wanted; weights, when given, receives the softmax weight of each
// held position (held.size() floats).
// `shared_scores[tier]`, where given, holds score_row's scores of this query against every
// position's key in arrays.k[tier]: a position whose key is at that tier takes its score from
// there instead of a dot product of its own (the same bits), so the many caches of one replay
// step share that work.
void cached_attention_output(const float* q, std::span<const int32_t> held, std::span<const uint8_t> key_tier,
                             std::span<const uint8_t> value_tier, const TierArrays& arrays, int kv_head,
                             int num_kv_heads, int head_dim, Eigen::ArrayXf& scratch, float* out,
                             float* weights = nullptr, const std::array<const float*, 3>& shared_scores = {});

// One query head of a group for cached_attention_outputs: what cached_attention_output takes of it.
struct CachedQuery {
    const float* q;
    float* out;      // head_dim floats, or null
    float* weights;  // held.size() floats, or null
    std::array<const float*, 3> shared_scores;
};

// cached_attention_output for the query heads of one KV head at once, each head's output and
// weights bit for bit its own call's; the value rows are read once for the group, not once a head.
// scratch grows to the group's scores and is not shrunk.
void cached_attention_outputs(std::span<const CachedQuery> heads, std::span<const int32_t> held,
                              std::span<const uint8_t> key_tier, std::span<const uint8_t> value_tier,
                              const TierArrays& arrays, int kv_head, int num_kv_heads, int head_dim,
                              Eigen::ArrayXf& scratch);

// cached_attention_outputs in two halves, so that several caches of one KV head at one step (a
// replay's plans) can share the second: the first makes each head's weights (and `weights`), the
// second sums the weighted value rows into each head's `out`. Each head's output is bit for bit
// cached_attention_outputs'.
inline constexpr std::size_t kMaxCachedGroup = 64;  // heads one CachedValueSums holds (GQA groups are 1 to 16)
struct CachedValueSums {
    std::span<const int32_t> held;            // ascending positions
    std::span<const uint8_t> value_tier;      // by position
    const TierArrays* arrays = nullptr;
    int kv_head = 0, num_kv_heads = 1, head_dim = 0;
    std::size_t heads = 0;                    // heads with an output
    std::array<const float*, kMaxCachedGroup> numerators{};  // exp(score - peak), one per held position
    std::array<float, kMaxCachedGroup> inv_totals{};
    std::array<float*, kMaxCachedGroup> outs{};
};
// The first half for at most kMaxCachedGroup heads; the numerators live in `scratch` until the
// sums are made.
CachedValueSums cached_attention_weights(std::span<const CachedQuery> heads, std::span<const int32_t> held,
                                         std::span<const uint8_t> key_tier, std::span<const uint8_t> value_tier,
                                         const TierArrays& arrays, int kv_head, int num_kv_heads, int head_dim,
                                         Eigen::ArrayXf& scratch);
// The second half for one cache: cached_attention_values_of_caches of it alone.
void cached_attention_values(const CachedValueSums& cache);
// The second half for several caches at once (a replay step's plans of one KV head): block by
// block of positions, each cache adds the rows it holds there, so a row one cache brought into the
// processor's caches serves the others that hold it. Each cache's sums are taken in its own held
// order, so each output is the same bits as its own call's.
void cached_attention_values_of_caches(std::span<const CachedValueSums* const> caches);

// The scores cached_attention_output gives positions 0..count-1 whose keys are `keys`
// ([token][kv_head][d]): q.k / sqrt(d), bit for bit.
void score_row(const float* q, const float* keys, int64_t count, int kv_head, int num_kv_heads, int head_dim,
               float* scores);
// score_row for `heads` query heads of one KV head at once (scores[h] for queries[h]), each score
// the same bits; each key is read once for the group, not once a head.
void score_rows_of_group(const float* const* queries, int heads, const float* keys, int64_t count, int kv_head,
                         int num_kv_heads, int head_dim, float* const* scores);

// The softmax of `scores` (q.k / sqrt(d), one per cached token) as cached_attention_output computes
// it: scores become exp(score - max) in place; returns 1 / their sum, so weight j is
// scores[j] * (returned value). Shared with the runtime's CPU backend, which must match it bit for bit.
float softmax_numerators(Eigen::ArrayXf& scores);
// The same on n scores at `scores`, which must be aligned as an Eigen array's storage is.
float softmax_numerators(float* scores, Eigen::Index n);

// A dot product whose summation order depends only on n (not on alignment or the caller):
// sixteen lanes summed in a fixed order, vectorisable. Inline, so the runtime's hot loop inlines it.
inline float fixed_order_dot(const float* a, const float* b, int n) {
    if (n < 16) {  // no full block, so every lane is +0: adding them all is adding +0 once
        float total = 0;
        for (int i = 0; i < n; ++i) total += a[i] * b[i];
        return total + 0.0f;  // -0 becomes +0, as the lanes' sum makes it
    }
    float lanes[16] = {};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * b[i + l];
    // The tail's products fused into the sum, written out: left to the compiler, whether it fuses
    // them depends on the target (-march=native), and score_rows_of_group must give these bits.
    float total = 0;
    for (; i < n; ++i) total = std::fma(a[i], b[i], total);
    for (int l = 0; l < 16; ++l) total += lanes[l];
    return total;
}

}  // namespace kvsim
