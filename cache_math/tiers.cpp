#include "cache_math/tiers.h"

#include <Eigen/Core>
#include <algorithm>
#include <stdexcept>
#include <cmath>
#include <cstring>
#include <utility>

#include "base/errors.h"
#include "cache_math/lowrank.h"
#include "cache_math/quantize.h"
#include "cache_math/softmax_exp.h"
#include "cache_math/tier_gather.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvsim {
namespace {

// row[positions[j]] for j < n, into out: sixteen a gather with AVX-512 (the copy loop took a load,
// a load and a store a number; a step's shared scores are gathered for every cache it holds).
void gather_at(const float* row, const int32_t* positions, std::ptrdiff_t n, float* out) {
    std::ptrdiff_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(out + j, _mm512_i32gather_ps(_mm512_loadu_si512(positions + j), row, 4));
#endif
    for (; j < n; ++j) out[j] = row[positions[j]];
}

// Whether every tiers[positions[j]] is 0 (fp16): sixteen a gather with AVX-512.
bool all_zero_at(const uint8_t* tiers, const int32_t* positions, std::ptrdiff_t n) {
    std::ptrdiff_t j = 0;
    uint32_t any = 0;
#if defined(__AVX512F__)
    const TierGather gather(tiers);
    __m512i seen = _mm512_setzero_si512();
    for (; j + 16 <= n; j += 16) seen = _mm512_or_si512(seen, gather.at(_mm512_loadu_si512(positions + j)));
    any = static_cast<uint32_t>(_mm512_reduce_or_epi32(seen));
#endif
    for (; j < n; ++j) any |= tiers[positions[j]];
    return any == 0;
}

QuantSpec spec_for(const TierFormat& f, int bits) {
    QuantSpec spec;
    spec.bits = bits;
    spec.key_group = (bits == 8 && f.int8_key_group) ? f.int8_key_group : f.key_group;
    spec.value_group = (bits == 8 && f.int8_value_group) ? f.int8_value_group : f.value_group;
    spec.per_token_keys = f.per_token_keys;
    return spec;
}

}  // namespace

void check_tier_format(const TierFormat& format, int head_dim, const std::string& label, const std::string& of) {
    for (const int group : {format.value_group, format.int8_value_group})
        if (group > 0 && !value_group_fits(group, head_dim))
            throw InputError(label + ": value_group " + std::to_string(group) + " does not divide the head size " +
                             std::to_string(head_dim) + " of " + of);
}

void build_tier_arrays(const QkvLayer& layer, int num_kv_heads, int head_dim, TierArrays& arrays) {
    const TierFormat& f = arrays.format;
    arrays.k[0] = layer.k.data();
    arrays.v[0] = layer.v.data();
    DequantizedKV int8 = dequantize_layer(layer, num_kv_heads, head_dim, spec_for(f, 8));
    DequantizedKV int4 = f.int4_from_int8
                             ? requantize(int8, layer.tokens, num_kv_heads, head_dim, spec_for(f, 4))
                             : dequantize_layer(layer, num_kv_heads, head_dim, spec_for(f, 4));
    arrays.storage_k8 = std::move(int8.k);
    arrays.storage_v8 = std::move(int8.v);
    arrays.storage_k4 = std::move(int4.k);
    arrays.storage_v4 = std::move(int4.v);
    arrays.k[1] = arrays.storage_k8.data();
    arrays.v[1] = arrays.storage_v8.data();
    arrays.k[2] = arrays.storage_k4.data();
    arrays.v[2] = arrays.storage_v4.data();
}

IncrementalTiers::IncrementalTiers(const TierFormat* format, int64_t tokens, int num_kv_heads, int head_dim,
                                   const KvProjection* projection, int layer)
    : tiered_(format != nullptr), kv_heads_(num_kv_heads), head_dim_(head_dim),
      quant_heads_(num_kv_heads), quant_dim_(head_dim), k_(tokens * num_kv_heads * head_dim), v_(k_.size()),
      layer_(layer) {
    arrays_.k[0] = k_.data();
    arrays_.v[0] = v_.data();
    if (projection) {
        projection_ = std::make_shared<KvProjection>(*projection);
        if (projection->kind == KvProjection::Kind::joint_low_rank) quant_heads_ = 1, quant_dim_ = num_kv_heads * head_dim;
        for (auto* storage : {&latent_k_, &latent_v_, &arrays_.storage_k16, &arrays_.storage_v16})
            storage->assign(k_.size(), 0.0f);
        arrays_.k[0] = arrays_.storage_k16.data();
        arrays_.v[0] = arrays_.storage_v16.data();
        if (tiered_)
            for (auto* storage : {&latent_k8_, &latent_v8_, &latent_k4_, &latent_v4_}) storage->assign(k_.size(), 0.0f);
    }
    if (!tiered_) return;
    arrays_.format = *format;
    for (auto* storage : {&arrays_.storage_k8, &arrays_.storage_v8, &arrays_.storage_k4, &arrays_.storage_v4})
        storage->assign(k_.size(), 0.0f);
    arrays_.k[1] = arrays_.storage_k8.data();
    arrays_.v[1] = arrays_.storage_v8.data();
    arrays_.k[2] = arrays_.storage_k4.data();
    arrays_.v[2] = arrays_.storage_v4.data();
}

// Values (and per-token keys) of token t: each head's channel groups share a scale.
void IncrementalTiers::quantize_values(int64_t t, const float* v_in, float* v_out, const float* k_in, float* k_out,
                                       int bits) {
    const QuantSpec spec = spec_for(arrays_.format, bits);
    const int group = std::min(spec.value_group, quant_dim_);
    const int64_t row = t * quant_heads_ * quant_dim_;
    for (int g = 0; g < quant_heads_; ++g)
        for (int c = 0; c < quant_dim_; c += group) {
            const int64_t at = row + static_cast<int64_t>(g) * quant_dim_ + c;
            const int n = std::min(group, quant_dim_ - c);
            roundtrip_group(v_in + at, v_out + at, n, 1, bits);
            if (spec.per_token_keys) roundtrip_group(k_in + at, k_out + at, n, 1, bits);
        }
}

// A complete KIVI key group: each channel's scale spans the group's tokens.
void IncrementalTiers::quantize_key_group(int64_t first, int64_t count, const float* k_in, float* k_out, int bits) {
    const int64_t stride = static_cast<int64_t>(quant_heads_) * quant_dim_;
    for (int g = 0; g < quant_heads_; ++g)
        for (int c = 0; c < quant_dim_; ++c) {
            const int64_t at = first * stride + static_cast<int64_t>(g) * quant_dim_ + c;
            roundtrip_group(k_in + at, k_out + at, count, stride, bits);
        }
}

void IncrementalTiers::reconstruct(bool key, const std::vector<float>& latent, std::vector<float>& out, int64_t first,
                                   int64_t count) {
    const int64_t at = first * kv_heads_ * head_dim_;
    reconstruct_tokens(*projection_, layer_, kv_heads_, head_dim_, key, latent.data() + at, nullptr, out.data() + at,
                       count, first);
}

void IncrementalTiers::add_token(int64_t t, const float* k, const float* v) {
    const std::size_t width = static_cast<std::size_t>(kv_heads_) * head_dim_;
    std::copy(k, k + width, k_.begin() + t * width);
    std::copy(v, v + width, v_.begin() + t * width);
    const bool projected = projection_ != nullptr;
    if (projected) {
        float* lk = latent_k_.data() + t * width;
        float* lv = latent_v_.data() + t * width;
        project_tokens(*projection_, layer_, kv_heads_, head_dim_, true, k, lk, 1, t);
        project_tokens(*projection_, layer_, kv_heads_, head_dim_, false, v, lv, 1, t);
        reconstruct_tokens(*projection_, layer_, kv_heads_, head_dim_, true, lk, k,
                           arrays_.storage_k16.data() + t * width, 1, t);
        reconstruct_tokens(*projection_, layer_, kv_heads_, head_dim_, false, lv, v,
                           arrays_.storage_v16.data() + t * width, 1, t);
    }
    if (!tiered_) return;
    const TierFormat& f = arrays_.format;
    // What is quantised: the token's vectors, or a projected cache's latents (rebuilt below).
    const std::vector<float>& k_in = projected ? latent_k_ : k_;
    const std::vector<float>& v_in = projected ? latent_v_ : v_;
    std::vector<float>& k8 = projected ? latent_k8_ : arrays_.storage_k8;
    std::vector<float>& v8 = projected ? latent_v8_ : arrays_.storage_v8;
    std::vector<float>& k4 = projected ? latent_k4_ : arrays_.storage_k4;
    std::vector<float>& v4 = projected ? latent_v4_ : arrays_.storage_v4;
    // int4 comes from the original values, or from the int8 form a token sank from.
    const float* k4_from = f.int4_from_int8 ? k8.data() : k_in.data();
    const float* v4_from = f.int4_from_int8 ? v8.data() : v_in.data();
    quantize_values(t, v_in.data(), v8.data(), k_in.data(), k8.data(), 8);
    quantize_values(t, v4_from, v4.data(), k4_from, k4.data(), 4);
    if (projected) {
        reconstruct(false, v8, arrays_.storage_v8, t, 1);
        reconstruct(false, v4, arrays_.storage_v4, t, 1);
        if (f.per_token_keys) {
            reconstruct(true, k8, arrays_.storage_k8, t, 1);
            reconstruct(true, k4, arrays_.storage_k4, t, 1);
        }
    }
    if (!f.per_token_keys) {
        for (int bits : {8, 4}) {
            const int group = spec_for(f, bits).key_group;
            if ((t + 1) % group != 0) continue;
            std::vector<float>& out = bits == 8 ? k8 : k4;
            quantize_key_group(t + 1 - group, group, bits == 8 ? k_in.data() : k4_from, out.data(), bits);
            if (projected) reconstruct(true, out, bits == 8 ? arrays_.storage_k8 : arrays_.storage_k4, t + 1 - group, group);
        }
    }
}

double key_bytes(Tier tier, int head_dim, const TierFormat* format) {
    if (tier == Tier::fp16 || !format) return 2.0 * head_dim;
    const int bits = tier == Tier::int8 ? 8 : 4;
    const QuantSpec spec = spec_for(*format, bits);
    // Half of K+V's closed form is the value's; the key's scales differ under KIVI.
    return kv_bytes_per_token(head_dim, bits, spec) - value_bytes(tier, head_dim, format);
}

double value_bytes(Tier tier, int head_dim, const TierFormat* format) {
    if (tier == Tier::fp16 || !format) return 2.0 * head_dim;
    const int bits = tier == Tier::int8 ? 8 : 4;
    const QuantSpec spec = spec_for(*format, bits);
    const int group = std::min(spec.value_group, head_dim);
    return head_dim * bits / 8.0 + 2.0 * ((head_dim + group - 1) / group);
}

float softmax_numerators(Eigen::ArrayXf& scores) { return softmax_numerators(scores.data(), scores.size()); }

float softmax_numerators(float* scores, Eigen::Index n) {
    // Elementwise, on aligned storage: the same values whatever the caller or thread.
    exp_minus_peak(scores, n, Eigen::Map<const Eigen::ArrayXf, Eigen::AlignedMax>(scores, n).maxCoeff());
    double total = 0;
    for (Eigen::Index j = 0; j < n; ++j) total += scores[j];
    return static_cast<float>(1.0 / total);
}

namespace {

using Lanes16 = float __attribute__((vector_size(64)));

[[gnu::always_inline]] inline Lanes16 load16(const float* at) {
    Lanes16 x;
    std::memcpy(&x, at, sizeof x);
    return x;
}

// Two-source shuffles of swap_blocks<M>, their lanes constants as both gcc and clang require:
// row r takes row r + M's columns c - M where c & M; row r + M takes row r's c + M where not.
template <int M, std::size_t... C>
[[gnu::always_inline]] inline Lanes16 upper_of(Lanes16 top, Lanes16 bottom, std::index_sequence<C...>) {
    return __builtin_shufflevector(top, bottom, ((C & M) ? 16 + C - M : C)...);
}
template <int M, std::size_t... C>
[[gnu::always_inline]] inline Lanes16 lower_of(Lanes16 top, Lanes16 bottom, std::index_sequence<C...>) {
    return __builtin_shufflevector(top, bottom, ((C & M) ? 16 + C : C + M)...);
}

// The 16 x 16 transpose of rows[0..15] in place: four rounds, each swapping the off-diagonal m x m
// blocks of every 2m x 2m block (m = 8, 4, 2, 1), each row a two-source shuffle.
template <int M>
[[gnu::always_inline]] inline void swap_blocks(Lanes16 (&rows)[16]) {
    constexpr auto lanes = std::make_index_sequence<16>{};
    for (int r = 0; r < 16; ++r) {
        if (r & M) continue;
        const Lanes16 top = rows[r], bottom = rows[r + M];
        rows[r] = upper_of<M>(top, bottom, lanes);
        rows[r + M] = lower_of<M>(top, bottom, lanes);
    }
}

// 16 / H keys against H query heads (16 sums in all), fixed_order_dot's arithmetic: each (head,
// key) sums its products in 16 lanes, chunk after chunk; the channels past the last whole sixteen
// one after another; then the lanes onto that, one after another from 0. So every score keeps
// fixed_order_dot's bits. The keys' chunks are loaded once for the H heads (a key is read from
// memory once for the group, not once a head); the 16 sums are independent chains, and the lanes
// are added for all 16 at once, transposed, where each key's were a chain of scalar additions.
template <int H>
void score_key_block(const float* const* queries, const float* first_key, int64_t stride, int head_dim, float scale,
                     float* const* scores, int64_t p) {
    constexpr int kKeys = 16 / H;
    const int blocked = head_dim / 16 * 16;
    Lanes16 sums[16] = {};  // sums[h * kKeys + j]
    for (int c = 0; c < blocked; c += 16) {
        Lanes16 x[kKeys];
        for (int j = 0; j < kKeys; ++j) x[j] = load16(first_key + j * stride + c);
        for (int h = 0; h < H; ++h) {
            const Lanes16 q = load16(queries[h] + c);
            for (int j = 0; j < kKeys; ++j) sums[h * kKeys + j] += q * x[j];
        }
    }
    Lanes16 total = {};
    for (int c = blocked; c < head_dim; ++c)  // a tail, where the head size is no whole sixteens
        for (int h = 0; h < H; ++h)
            for (int j = 0; j < kKeys; ++j)  // fused, as fixed_order_dot's tail
                total[h * kKeys + j] = std::fma(queries[h][c], first_key[j * stride + c], total[h * kKeys + j]);
    swap_blocks<8>(sums);
    swap_blocks<4>(sums);
    swap_blocks<2>(sums);
    swap_blocks<1>(sums);
    for (int l = 0; l < 16; ++l) total += sums[l];  // sums[l] now holds lane l of every (head, key)
    total *= scale;
    float out[16];
    std::memcpy(out, &total, sizeof out);
    for (int h = 0; h < H; ++h) std::memcpy(scores[h] + p, out + h * kKeys, kKeys * sizeof(float));
}

}  // namespace

void score_rows_of_group(const float* const* queries, int heads, const float* keys, int64_t count, int kv_head,
                         int num_kv_heads, int head_dim, float* const* scores) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const float* k = keys + static_cast<int64_t>(kv_head) * head_dim;
    const int64_t stride = static_cast<int64_t>(num_kv_heads) * head_dim;
    int64_t p = 0;
    if (head_dim >= 16) {
        // Sixteen keys at a time, two heads a pass (16 sums and 8 keys: 24 of AVX-512's 32
        // registers), the 16 keys' chunks read from memory by the first pass.
        for (; p + 16 <= count; p += 16) {
            const float* first_key = k + p * stride;
            if (p + 32 <= count)  // the next sixteen keys, a page apart each (see add_rows_to_sums)
                for (int j = 16; j < 32; ++j)
                    for (int c = 0; c < head_dim; c += 16) __builtin_prefetch(first_key + j * stride + c, 0, 2);
            int h = 0;
            for (; h + 2 <= heads; h += 2) {
                score_key_block<2>(queries + h, first_key, stride, head_dim, scale, scores + h, p);
                score_key_block<2>(queries + h, first_key + 8 * stride, stride, head_dim, scale, scores + h, p + 8);
            }
            if (h < heads) score_key_block<1>(queries + h, first_key, stride, head_dim, scale, scores + h, p);
        }
    }
    // Head sizes under 16, and the last keys: one dot product at a time.
    for (; p < count; ++p)
        for (int h = 0; h < heads; ++h) scores[h][p] = fixed_order_dot(queries[h], k + p * stride, head_dim) * scale;
}

void score_row(const float* q, const float* keys, int64_t count, int kv_head, int num_kv_heads, int head_dim,
               float* scores) {
    score_rows_of_group(&q, 1, keys, count, kv_head, num_kv_heads, head_dim, &scores);
}

void cached_attention_output(const float* q, std::span<const int32_t> held, std::span<const uint8_t> key_tier,
                             std::span<const uint8_t> value_tier, const TierArrays& arrays, int kv_head,
                             int num_kv_heads, int head_dim, Eigen::ArrayXf& scratch, float* out,
                             float* weights, const std::array<const float*, 3>& shared_scores) {
    const CachedQuery head{q, out, weights, shared_scores};
    cached_attention_outputs({&head, 1}, held, key_tier, value_tier, arrays, kv_head, num_kv_heads, head_dim, scratch);
}

void cached_attention_outputs(std::span<const CachedQuery> heads, std::span<const int32_t> held,
                              std::span<const uint8_t> key_tier, std::span<const uint8_t> value_tier,
                              const TierArrays& arrays, int kv_head, int num_kv_heads, int head_dim,
                              Eigen::ArrayXf& scratch) {
    // (multi-query models group 71 heads and more) each head is its own: in parts
    for (std::size_t first = 0; first < heads.size(); first += kMaxCachedGroup)
        cached_attention_values(cached_attention_weights(heads.subspan(first, std::min(kMaxCachedGroup, heads.size() - first)),
                                                         held, key_tier, value_tier, arrays, kv_head, num_kv_heads,
                                                         head_dim, scratch));
}

CachedValueSums cached_attention_weights(std::span<const CachedQuery> heads, std::span<const int32_t> held,
                                         std::span<const uint8_t> key_tier, std::span<const uint8_t> value_tier,
                                         const TierArrays& arrays, int kv_head, int num_kv_heads, int head_dim,
                                         Eigen::ArrayXf& scratch) {
    if (heads.size() > kMaxCachedGroup) throw std::logic_error("cached_attention_weights: more heads than a pass takes");
    CachedValueSums sums;
    sums.held = held, sums.value_tier = value_tier, sums.arrays = &arrays;
    sums.kv_head = kv_head, sums.num_kv_heads = num_kv_heads, sums.head_dim = head_dim;
    const Eigen::Index n = static_cast<Eigen::Index>(held.size());
    // Each head's scores start on a 64-byte boundary, as a lone head's Eigen array does.
    const Eigen::Index stride = (n + 15) / 16 * 16;
    const Eigen::Index needed = stride * static_cast<Eigen::Index>(heads.size());
    if (scratch.size() < needed) scratch.resize(needed);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    // Where every held key is at fp16 (an untiered cache) and a head's fp16 scores are shared, its
    // scores are a plain gather: no tier looked up per position and head.
    const int32_t* const positions = held.data();
    const uint8_t* const tiers = key_tier.data();
    const bool all_fp16 = all_zero_at(tiers, positions, n);
    for (std::size_t h = 0; h < heads.size(); ++h) {
        const CachedQuery& head = heads[h];
        float* const scores = scratch.data() + static_cast<Eigen::Index>(h) * stride;  // plain indexing in the hot loops
        const std::array<const float*, 3> shared = head.shared_scores;
        if (all_fp16 && shared[0]) {
            gather_at(shared[0], positions, n, scores);
        } else {
            for (Eigen::Index j = 0; j < n; ++j) {
                const int32_t p = positions[j];
                const uint8_t tier = tiers[p];
                if (const float* row = shared[tier]) {
                    scores[j] = row[p];
                    continue;
                }
                const float* k = arrays.k[tier] + (static_cast<int64_t>(p) * num_kv_heads + kv_head) * head_dim;
                scores[j] = fixed_order_dot(head.q, k, head_dim) * scale;
            }
        }
        const float inv_total = softmax_numerators(scores, n);
        if (head.weights)
            for (Eigen::Index j = 0; j < n; ++j) head.weights[j] = scores[j] * inv_total;
        if (!head.out) continue;
        sums.numerators[sums.heads] = scores;
        sums.inv_totals[sums.heads] = inv_total;
        sums.outs[sums.heads++] = head.out;
    }
    return sums;
}

namespace {

// Where position p's value row lies in a cache.
inline const float* value_row_of(const CachedValueSums& c, int32_t p) {
    return c.arrays->v[c.value_tier[p]] + (static_cast<int64_t>(p) * c.num_kv_heads + c.kv_head) * c.head_dim;
}

}  // namespace

void cached_attention_values(const CachedValueSums& c) {
    const CachedValueSums* const one = &c;
    cached_attention_values_of_caches({&one, 1});
}

namespace {

// Held positions a block of cached_attention_values_of_caches spans: the rows of 256 positions
// (128 KiB at 128 channels) stay in the second-level cache while every cache adds those it holds.
constexpr int32_t kBlockPositions = 256;

constexpr std::size_t kAhead = 8;  // value rows fetched ahead of the one being read

// Cache c's rows j0..j1-1 added into its running sums (head h's channels at sums + h * D), for H
// query heads at once: sums_h[i] += (numerators_h[j] * inv_total_h) * row(j)[i], j ascending, one
// head alone's arithmetic element for element (each head's sums are its own). The group's heads
// read each value row once: sixty-four channels of every head at a time, H x 4 sums of sixteen that
// stay in registers (GCC's vector extension, split to the target's width; left to itself the
// compiler unrolled and jammed the plain loop into scalar code), carried through memory between
// blocks (a float stored and loaded is the same float).
template <int D, int H>
void add_rows_to_sums(const CachedValueSums& c, std::size_t h0, std::size_t j0, std::size_t j1, float* sums) {
    using Lanes = float __attribute__((vector_size(64)));
    const auto load = [](const float* at) {
        Lanes x;
        std::memcpy(&x, at, sizeof x);
        return x;
    };
    for (int c0 = 0; c0 < D; c0 += 64) {
        Lanes acc[H][4];
        for (int h = 0; h < H; ++h)
            for (int k = 0; k < 4; ++k) acc[h][k] = load(sums + (h0 + h) * D + c0 + 16 * k);
        for (std::size_t j = j0; j < j1; ++j) {
            // Rows of one KV head lie a page apart or more, where the hardware prefetcher does not
            // follow: fetch the row kAhead rows on while this one is summed.
            if (j + kAhead < c.held.size()) {
                const float* ahead = value_row_of(c, c.held[j + kAhead]) + c0;
                for (int l = 0; l < 64; l += 16) __builtin_prefetch(ahead + l);
            }
            const float* v = value_row_of(c, c.held[j]) + c0;
            const Lanes x0 = load(v), x1 = load(v + 16), x2 = load(v + 32), x3 = load(v + 48);
            for (int h = 0; h < H; ++h) {
                const float w = c.numerators[h0 + h][j] * c.inv_totals[h0 + h];
                acc[h][0] += w * x0;
                acc[h][1] += w * x1;
                acc[h][2] += w * x2;
                acc[h][3] += w * x3;
            }
        }
        for (int h = 0; h < H; ++h)
            for (int k = 0; k < 4; ++k) std::memcpy(sums + (h0 + h) * D + c0 + 16 * k, &acc[h][k], sizeof(Lanes));
    }
}

template <int D>
void add_rows_of_heads(const CachedValueSums& c, std::size_t j0, std::size_t j1, float* sums) {
    for (std::size_t h = 0; h < c.heads; h += 4) {
        switch (std::min<std::size_t>(4, c.heads - h)) {
            case 1: add_rows_to_sums<D, 1>(c, h, j0, j1, sums); break;
            case 2: add_rows_to_sums<D, 2>(c, h, j0, j1, sums); break;
            case 3: add_rows_to_sums<D, 3>(c, h, j0, j1, sums); break;
            default: add_rows_to_sums<D, 4>(c, h, j0, j1, sums); break;
        }
    }
}

// Any head size: cached_attention_values' plain loop, its sums carried the same way.
void add_rows_plain(const CachedValueSums& c, std::size_t j0, std::size_t j1, float* sums) {
    const int d = c.head_dim;
    for (std::size_t h = 0; h < c.heads; ++h) {
        float* out = sums + h * d;
        for (std::size_t j = j0; j < j1; ++j) {
            const float* v = value_row_of(c, c.held[j]);
            const float w = c.numerators[h][j] * c.inv_totals[h];
            for (int i = 0; i < d; ++i) out[i] += w * v[i];
        }
    }
}

}  // namespace

void cached_attention_values_of_caches(std::span<const CachedValueSums* const> caches) {
    thread_local std::vector<float> sums;       // each cache's heads' running sums
    thread_local std::vector<std::size_t> first_sum, next;  // where a cache's sums start; its next held index
    first_sum.resize(caches.size());
    next.assign(caches.size(), 0);
    std::size_t floats = 0;
    int32_t end = 0;
    for (std::size_t s = 0; s < caches.size(); ++s) {
        first_sum[s] = floats;
        floats += caches[s]->heads * static_cast<std::size_t>(caches[s]->head_dim);
        if (caches[s]->heads > 0 && !caches[s]->held.empty()) end = std::max(end, caches[s]->held.back() + 1);
    }
    sums.assign(floats, 0.0f);
    // Block by block of positions, each cache adds the rows it holds there: a row one cache brought
    // in serves the others that hold it, where one cache after another read every row again.
    for (int32_t block = 0; block < end; block += kBlockPositions) {
        const int32_t block_end = block + kBlockPositions;
        for (std::size_t s = 0; s < caches.size(); ++s) {
            const CachedValueSums& c = *caches[s];
            if (c.heads == 0) continue;
            const std::size_t j0 = next[s];
            std::size_t j1 = j0;
            while (j1 < c.held.size() && c.held[j1] < block_end) ++j1;
            next[s] = j1;
            if (j1 == j0) continue;
            float* at = sums.data() + first_sum[s];
            switch (c.head_dim) {
                case 64: add_rows_of_heads<64>(c, j0, j1, at); break;
                case 128: add_rows_of_heads<128>(c, j0, j1, at); break;
                default: add_rows_plain(c, j0, j1, at); break;
            }
        }
    }
    for (std::size_t s = 0; s < caches.size(); ++s)
        for (std::size_t h = 0; h < caches[s]->heads; ++h)
            std::copy_n(sums.data() + first_sum[s] + h * caches[s]->head_dim, caches[s]->head_dim, caches[s]->outs[h]);
}

}  // namespace kvsim
