#include "cache_math/quantize.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "base/errors.h"

namespace kvsim {

namespace {

// Channels sharing one per-token scale: a value_group of head_dim or more means the whole head.
int channel_group(int value_group, int head_dim) { return std::min(value_group, head_dim); }

// Programmer-facing checks. User input is checked before it gets here, with InputError: a
// policy's parameters as it is made (policies/quantized.cpp), its format against the head size
// by check_tier_format (cache_math/tiers.h).
void require_valid(const QuantSpec& spec, int num_kv_heads, int head_dim) {
    quant_qmax(spec.bits);  // throws for bits other than 4 or 8
    if (head_dim < 1 || num_kv_heads < 1)
        throw std::invalid_argument("quantize: head_dim and num_kv_heads must be >= 1, got " +
                                    std::to_string(head_dim) + " and " + std::to_string(num_kv_heads));
    if (spec.key_group < 1) throw std::invalid_argument("quantize: key_group must be >= 1, got " + std::to_string(spec.key_group));
    if (spec.value_group < 1)
        throw std::invalid_argument("quantize: value_group must be >= 1, got " + std::to_string(spec.value_group));
    if (!value_group_fits(spec.value_group, head_dim))
        throw std::invalid_argument("quantize: value_group " + std::to_string(spec.value_group) +
                                    " does not divide head_dim " + std::to_string(head_dim));
}

// Per token: each (token, head) row is cut into channel groups of `group` with one scale each.
// Tokens are independent, so blocks of tokens run in parallel with thread-count-free results.
void quantize_per_token(const float* in, float* out, int64_t tokens, int num_kv_heads, int head_dim, int group,
                        int bits) {
    const int64_t row = static_cast<int64_t>(num_kv_heads) * head_dim;
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, tokens, 16), [&](const tbb::blocked_range<int64_t>& range) {
        for (int64_t t = range.begin(); t < range.end(); ++t)
            for (int64_t c = 0; c < row; c += group) roundtrip_group(in + t * row + c, out + t * row + c, group, 1, bits);
    });
}

// KIVI keys: per channel, one scale per group of `key_group` tokens aligned to position 0. Walks
// each (token group, head) tile row by row (contiguous channels) rather than channel by channel
// down the token stride; tiles are independent and run in parallel.
void quantize_keys_per_channel(const float* in, float* out, int64_t tokens, int num_kv_heads, int head_dim,
                               int key_group, int bits) {
    const int qmax = quant_qmax(bits);
    const int64_t row = static_cast<int64_t>(num_kv_heads) * head_dim;
    const int64_t groups = (tokens + key_group - 1) / key_group;
    tbb::parallel_for(int64_t{0}, groups * num_kv_heads, [&](int64_t tile) {
        const int64_t g = tile / num_kv_heads;
        const int h = static_cast<int>(tile % num_kv_heads);
        const int64_t first = g * key_group, end = std::min(tokens, first + key_group);
        const int64_t offset = static_cast<int64_t>(h) * head_dim;
        std::vector<float> scale(head_dim, 0.0f);  // max |x| per channel, then the channel's scale
        for (int64_t t = first; t < end; ++t) {
            const float* x = in + t * row + offset;
            for (int c = 0; c < head_dim; ++c) scale[c] = std::max(scale[c], std::abs(round_to_fp16(x[c])));
        }
        for (int c = 0; c < head_dim; ++c) scale[c] = quant_scale(scale[c], bits);
        for (int64_t t = first; t < end; ++t) {
            const float* x = in + t * row + offset;
            float* y = out + t * row + offset;
            for (int c = 0; c < head_dim; ++c) y[c] = quant_roundtrip(round_to_fp16(x[c]), scale[c], qmax);
        }
    });
}

DequantizedKV quantize_arrays(const std::vector<float>& k, const std::vector<float>& v, int64_t tokens,
                              int num_kv_heads, int head_dim, const QuantSpec& spec) {
    require_valid(spec, num_kv_heads, head_dim);
    if (tokens < 0) throw std::invalid_argument("quantize: tokens must be >= 0, got " + std::to_string(tokens));
    const std::size_t expected = static_cast<std::size_t>(tokens) * num_kv_heads * head_dim;
    if (k.size() != expected || v.size() != expected)
        throw std::invalid_argument("quantize: K/V hold " + std::to_string(k.size()) + "/" + std::to_string(v.size()) +
                                    " floats, expected tokens x kv_heads x head_dim = " + std::to_string(expected));
    const int group = channel_group(spec.value_group, head_dim);
    DequantizedKV result;
    result.k.resize(expected);
    result.v.resize(expected);
    if (spec.per_token_keys)
        quantize_per_token(k.data(), result.k.data(), tokens, num_kv_heads, head_dim, group, spec.bits);
    else
        quantize_keys_per_channel(k.data(), result.k.data(), tokens, num_kv_heads, head_dim, spec.key_group, spec.bits);
    quantize_per_token(v.data(), result.v.data(), tokens, num_kv_heads, head_dim, group, spec.bits);
    return result;
}

}  // namespace

int quant_qmax(int bits) {
    if (bits == 8) return 127;
    if (bits == 4) return 7;
    throw std::invalid_argument("quantize: bits must be 4 or 8, got " + std::to_string(bits));
}

float quant_scale(float max_abs, int bits) { return group_scale(max_abs, quant_qmax(bits)); }

float quant_roundtrip(float x_fp16, float scale, int qmax) {
    return dequantize_level(quant_level(x_fp16, scale, qmax), scale);
}

float roundtrip_group(const float* in, float* out, int64_t count, int64_t stride, int bits) {
    const int qmax = quant_qmax(bits);
    float max_abs = 0.0f;
    for (int64_t i = 0; i < count; ++i) max_abs = std::max(max_abs, std::abs(round_to_fp16(in[i * stride])));
    const float scale = quant_scale(max_abs, bits);
    for (int64_t i = 0; i < count; ++i) out[i * stride] = quant_roundtrip(round_to_fp16(in[i * stride]), scale, qmax);
    return scale;
}

DequantizedKV dequantize_layer(const QkvLayer& layer, int num_kv_heads, int head_dim, const QuantSpec& spec) {
    return quantize_arrays(layer.k, layer.v, layer.tokens, num_kv_heads, head_dim, spec);
}

DequantizedKV fp16_layer(const QkvLayer& layer) {
    DequantizedKV result;
    result.k.resize(layer.k.size());
    result.v.resize(layer.v.size());
    std::transform(layer.k.begin(), layer.k.end(), result.k.begin(), round_to_fp16);
    std::transform(layer.v.begin(), layer.v.end(), result.v.begin(), round_to_fp16);
    return result;
}

DequantizedKV requantize(const DequantizedKV& from, int tokens, int num_kv_heads, int head_dim, const QuantSpec& spec) {
    // The cache's dequantised values are taken as fp16 again before requantising, as a kernel
    // that dequantises into fp16 registers would.
    return quantize_arrays(from.k, from.v, tokens, num_kv_heads, head_dim, spec);
}

bool key_group_pending(int64_t pos, int64_t t, int key_group) {
    if (key_group < 1) throw std::invalid_argument("key_group_pending: key_group must be >= 1, got " + std::to_string(key_group));
    if (pos < 0) throw std::invalid_argument("key_group_pending: pos must be >= 0, got " + std::to_string(pos));
    const int64_t group_last = (pos / key_group + 1) * key_group - 1;  // last position of pos's group
    return t < group_last;
}

double kv_bytes_per_token(int head_dim, int bits, const QuantSpec& spec) {
    if (head_dim < 1) throw std::invalid_argument("kv_bytes_per_token: head_dim must be >= 1, got " + std::to_string(head_dim));
    const double d = head_dim;
    if (bits == 16) return 4.0 * d;
    if (bits != 8 && bits != 4)
        throw std::invalid_argument("kv_bytes_per_token: bits must be 16, 8 or 4, got " + std::to_string(bits));
    if (spec.key_group < 1 || spec.value_group < 1)
        throw std::invalid_argument("kv_bytes_per_token: group sizes must be >= 1, got key_group " +
                                    std::to_string(spec.key_group) + ", value_group " + std::to_string(spec.value_group));
    const double payload = d * bits / 8.0;
    const int group = channel_group(spec.value_group, head_dim);
    const double per_token_scales = 2.0 * static_cast<double>((head_dim + group - 1) / group);
    const double key_scales = spec.per_token_keys ? per_token_scales : 2.0 * d / spec.key_group;
    return (payload + key_scales) + (payload + per_token_scales);
}

double compression_vs_fp16(int head_dim, double bytes_per_token) {
    if (!(bytes_per_token > 0.0))
        throw std::invalid_argument("compression_vs_fp16: bytes_per_token must be > 0, got " + std::to_string(bytes_per_token));
    return 4.0 * head_dim / bytes_per_token;
}

void check_quant_spec(const QuantSpec& spec, int head_dim, const std::string& where) {
    if (spec.bits != 4 && spec.bits != 8)
        throw InputError(where + ".bits: must be 4 or 8, got " + std::to_string(spec.bits));
    if (spec.key_group < 1) throw InputError(where + ".key_group: must be >= 1, got " + std::to_string(spec.key_group));
    if (spec.value_group < 1)
        throw InputError(where + ".value_group: must be >= 1, got " + std::to_string(spec.value_group));
    if (!value_group_fits(spec.value_group, head_dim))
        throw InputError(where + ".value_group: " + std::to_string(spec.value_group) + " does not divide the head size " +
                         std::to_string(head_dim));
}

}  // namespace kvsim
