// KV-cache quantisation numerics and memory arithmetic for simulated INT8/INT4 caches.
// The arrangement follows KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
// Quantization for KV Cache"), made symmetric here (no zero point): keys are quantised per
// channel with a scale shared by a group of consecutive tokens, values per token with a scale
// shared by a group of consecutive channels. A per-token arrangement (keys like values) serves
// token-level tiering, where neighbouring tokens may sit at different tiers.
//
// Numerics of one group of values sharing one scale (all arithmetic in float):
//   inputs are first rounded to fp16 (a real cache starts from fp16 activations);
//   scale = fp16(max|x| / qmax), qmax = 127 (8 bits) or 7 (4 bits); scales are stored as fp16;
//   q = clamp(round_half_away_from_zero(x / scale), -qmax, qmax); dequantised x^ = q * scale.
//   A scale that rounds to 0 (an all-zero group, or one too small for fp16) makes the group
//   dequantise to 0, so the output is always finite for finite input.
// Everything here is computed once per layer, so every policy of a run shares it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cache_math/numerics.h"
#include "cache_math/qkv_layer.h"

namespace kvsim {

struct QuantSpec {
    int bits = 8;              // 4 or 8
    int key_group = 128;       // KIVI keys: tokens sharing one per-channel scale (groups start at position 0)
    int value_group = 128;     // channels sharing one per-token scale; >= head_dim means the whole head
    bool per_token_keys = false;  // keys quantised like values (per token, channel groups) instead of KIVI
};

// Dequantised copies of a layer's K and V as a cache would hold them ([tokens][kv_heads][d]).
struct DequantizedKV {
    std::vector<float> k, v;
};

// --- Scalar building blocks (exposed so tests and later tiers use the same arithmetic) ---

// Largest quantised magnitude: 127 for 8 bits, 7 for 4 bits (symmetric, -qmax..qmax).
// Throws std::invalid_argument for other bit widths.
int quant_qmax(int bits);

// round_to_fp16 (nearest even, saturating at +-65504) and the per-value arithmetic below come
// from cache_math/numerics.h, which the runtime's CPU and CUDA backends share.

// The fp16-stored scale of a group whose largest fp16 magnitude is max_abs: fp16(max_abs / qmax),
// or 0 when that rounds to 0 (the group then dequantises to 0).
float quant_scale(float max_abs, int bits);

// Round-trips one value that is already fp16-rounded through a group scale from quant_scale.
float quant_roundtrip(float x_fp16, float scale, int qmax);

// Round-trips `count` values spaced `stride` floats apart that share one scale, writing the
// dequantised values at the same offsets of `out`; returns the scale used.
float roundtrip_group(const float* in, float* out, int64_t count, int64_t stride, int bits);

// Whether `value_group` (>= 1) cuts a head of `head_dim` channels into whole groups; a group of
// head_dim or more is the whole head. The whole-layer quantiser needs it, so every check asks this.
inline bool value_group_fits(int value_group, int head_dim) {
    return value_group >= head_dim || head_dim % value_group == 0;
}

// --- Per-layer arrays ---

// Dequantised copies of the layer's K and V under `spec`. Keys (KIVI): the last token group may
// be incomplete at the end of the layer; it is quantised over the tokens present, but
// key_group_pending reports every such token as still fp16 for all steps in the trace.
// Throws std::invalid_argument on a bad spec (bits, group sizes < 1, a value_group below
// head_dim that does not divide it) or on array sizes that do not match the shape.
DequantizedKV dequantize_layer(const QkvLayer& layer, int num_kv_heads, int head_dim, const QuantSpec& spec);

// fp16-rounded copies of the layer's K and V (the fp16 tier).
DequantizedKV fp16_layer(const QkvLayer& layer);

// Requantises already-dequantised values: a token sinking from INT8 to INT4 is requantised from
// what the cache holds, not from the original. Same arrangement and checks as dequantize_layer.
DequantizedKV requantize(const DequantizedKV& from, int tokens, int num_kv_heads, int head_dim,
                         const QuantSpec& spec);

// Whether token `pos`'s key is still fp16 at decode step `t` under the KIVI arrangement: its
// token group [g*G, (g+1)*G) is complete only from step (g+1)*G - 1 on. Throws
// std::invalid_argument for key_group < 1 or pos < 0.
bool key_group_pending(int64_t pos, int64_t t, int key_group);

// --- Memory arithmetic (closed form) ---

// Bytes per cached token per KV head for K plus V at a tier. bits = 16: 2*d each. bits = 8 or 4:
// d*bits/8 each plus fp16 scales: keys (KIVI) d channels x 2 bytes per key_group tokens, i.e.
// 2*d/key_group per token; keys (per token) and values 2*ceil(d / min(value_group, d)) per token.
// `bits` selects the tier, so one spec's group sizes price every tier; spec.bits is not read.
// Fractional results are amortised scales. Throws std::invalid_argument on bad arguments.
double kv_bytes_per_token(int head_dim, int bits, const QuantSpec& spec);

// Compression ratio against an fp16 cache (4*d bytes per token per KV head).
double compression_vs_fp16(int head_dim, double bytes_per_token);

// --- Validation of user input ---

// Throws kvsim::InputError with one line naming `where` and the key, e.g.
// "where.bits: must be 4 or 8, got 3", "where.key_group: must be >= 1, got 0",
// "where.value_group: 24 does not divide the head size 128".
void check_quant_spec(const QuantSpec& spec, int head_dim, const std::string& where);

}  // namespace kvsim
