#include "sim/precision.h"

#include <algorithm>
#include <cmath>

#include "sim/quantize.h"

namespace kvsim {
namespace {

QuantSpec spec_for(const TierFormat& f, int bits) {
    QuantSpec spec;
    spec.bits = bits;
    spec.key_group = (bits == 8 && f.int8_key_group) ? f.int8_key_group : f.key_group;
    spec.value_group = (bits == 8 && f.int8_value_group) ? f.int8_value_group : f.value_group;
    spec.per_token_keys = f.per_token_keys;
    return spec;
}

}  // namespace

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

void cached_attention_output(const float* q, std::span<const int32_t> held, std::span<const uint8_t> key_tier,
                             std::span<const uint8_t> value_tier, const TierArrays& arrays, int kv_head,
                             int num_kv_heads, int head_dim, std::vector<float>& scratch, float* out) {
    const std::size_t n = held.size();
    scratch.resize(n);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    float peak = -INFINITY;
    for (std::size_t j = 0; j < n; ++j) {
        const int32_t p = held[j];
        const float* k = arrays.k[key_tier[p]] + (static_cast<int64_t>(p) * num_kv_heads + kv_head) * head_dim;
        float dot = 0;
        for (int i = 0; i < head_dim; ++i) dot += q[i] * k[i];
        scratch[j] = dot * scale;
        peak = std::max(peak, scratch[j]);
    }
    double total = 0;
    for (float& s : scratch) total += (s = std::exp(s - peak));
    std::fill(out, out + head_dim, 0.0f);
    for (std::size_t j = 0; j < n; ++j) {
        const int32_t p = held[j];
        const float* v = arrays.v[value_tier[p]] + (static_cast<int64_t>(p) * num_kv_heads + kv_head) * head_dim;
        const float w = static_cast<float>(scratch[j] / total);
        for (int i = 0; i < head_dim; ++i) out[i] += w * v[i];
    }
}

}  // namespace kvsim
