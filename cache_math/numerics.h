// The arithmetic of a tiered KV cache that the simulator and the runtime share, in one place:
// fp16 rounding, the symmetric group quantisation of cache_math/quantize.h (a group's fp16 scale, a
// value's level, its dequantised value), and the online-softmax update of a decode attention that
// reads tiers one after another. Every function is __host__ __device__ under nvcc, so the CPU
// tests exercise the same code the CUDA kernels run; plain inline C++ everywhere else.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVSIM_HD __host__ __device__
#else
#define KVSIM_HD
#endif

namespace kvsim {

inline constexpr float kFp16Max = 65504.0f;

KVSIM_HD inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
#endif
}
KVSIM_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
#endif
}

// IEEE binary16 from a float, rounded to nearest even; |x| >= 65520 becomes infinity, NaN stays
// NaN (quiet). Written from the format's definition: rebias the exponent (127 -> 15) and round
// the mantissa's low 13 bits away; below 2^-14 the value is a multiple of 2^-24 (subnormal).
KVSIM_HD inline uint16_t float_to_half_bits(float value) {
    uint32_t x = float_bits(value);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00u;    // NaN
    if (x >= 0x477ff000u) return sign | 0x7c00u;   // 65520 and up round to infinity
    if (x >= 0x38800000u) {                         // a normal half: |value| >= 2^-14
        const uint32_t rebased = x - 0x38000000u;   // exponent 127 -> 15 bias
        const uint32_t round = 0xfffu + ((rebased >> 13) & 1u);  // half an ulp, ties to even
        return sign | static_cast<uint16_t>((rebased + round) >> 13);
    }
    if (x <= 0x33000000u) return sign;              // at most 2^-25: zero (2^-25 itself ties to even)
    // Subnormal: |value| = mantissa * 2^(exponent - 150); in units of 2^-24 that is
    // mantissa >> (126 - exponent), rounded to nearest even.
    const uint32_t exponent = x >> 23;
    const uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;         // 14..24
    const uint32_t truncated = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u), half_unit = 1u << (shift - 1);
    const uint32_t rounded = truncated + ((rest > half_unit || (rest == half_unit && (truncated & 1u))) ? 1u : 0u);
    return sign | static_cast<uint16_t>(rounded);
}

KVSIM_HD inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
        const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // infinity, NaN
    return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// x rounded to the nearest fp16 value, saturating at +-65504 (one out-of-range activation must not
// turn its whole quantisation group into NaN); NaN stays NaN.
KVSIM_HD inline float round_to_fp16(float x) {
    if (x != x) return x;
    const float clamped = x < -kFp16Max ? -kFp16Max : (x > kFp16Max ? kFp16Max : x);
    return half_bits_to_float(float_to_half_bits(clamped));
}

// Largest level of a symmetric quantiser: 127 for 8 bits, 7 for 4 bits.
KVSIM_HD inline int quant_levels(int bits) { return bits == 8 ? 127 : 7; }

// The fp16-stored scale of a group whose largest fp16 magnitude is max_abs: fp16(max_abs / qmax),
// or 0 when that rounds to 0 (the group then dequantises to 0).
KVSIM_HD inline float group_scale(float max_abs, int qmax) {
    const float scale = round_to_fp16(max_abs / static_cast<float>(qmax));
    return scale > 0.0f ? scale : 0.0f;
}

// roundf(x), round half away from zero, without the library call: x - trunc(x) is exact, so the
// test against one half is too (at |x| >= 2^23 every float is whole and the difference is 0); NaN
// and infinities pass through. A loop of these vectorises where one of roundf calls libm.
KVSIM_HD inline float round_half_away(float x) {
    const float whole = truncf(x);
    return fabsf(x - whole) >= 0.5f ? whole + copysignf(1.0f, x) : whole;
}

// A fp16 value's level under a group scale, as a float: round half away from zero, clamped to
// [-qmax, qmax]; 0 for a zero scale. NaN stays NaN (the simulator passes it through; the runtime
// refuses non-finite input before it gets here).
KVSIM_HD inline float quant_level(float x_fp16, float scale, int qmax) {
    if (scale == 0.0f) return x_fp16 * 0.0f;
    const float bound = static_cast<float>(qmax);
    const float q = round_half_away(x_fp16 / scale);
    return q < -bound ? -bound : (q > bound ? bound : q);
}

// The signed level of channel i in a row of INT4 levels packed two a byte, low nibble first
// (two's complement): the nibble shifted to the top of a signed byte and back, no branch.
KVSIM_HD inline int int4_level(const uint8_t* packed, int i) {
    const uint8_t byte = packed[i / 2];
    return static_cast<int8_t>(static_cast<uint8_t>(i % 2 ? byte & 0xf0u : byte << 4)) >> 4;
}

// What a level dequantises to: the value attention reads.
KVSIM_HD inline float dequantize_level(float level, float scale) { return level * scale; }

// Online softmax over scores met one at a time (Milakov and Gimelshein 2018): the running maximum,
// and the running sum of exp(score - maximum); an output accumulator is rescaled by the factor
// this returns whenever the maximum rises. After the last score, weight_j = exp(s_j - max) / sum.
struct OnlineSoftmax {
    float maximum = -INFINITY;
    float sum = 0.0f;
    // Takes one score; returns the factor to rescale what was accumulated so far, and sets
    // `weight` to this score's unnormalised weight at the new maximum.
    KVSIM_HD float add(float score, float& weight) {
        if (score > maximum) {
            const float rescale = maximum == -INFINITY ? 0.0f : expf(maximum - score);
            sum = sum * rescale + 1.0f;
            maximum = score;
            weight = 1.0f;
            return rescale;
        }
        weight = expf(score - maximum);
        sum += weight;
        return 1.0f;
    }
    // A block of scores at once: raises the maximum to the block's (when higher) and returns the
    // factor that rescales the sum (done here) and the caller's accumulator; the caller then adds
    // the block's exp(score - maximum) to `sum`.
    KVSIM_HD float raise_to(float block_maximum) {
        if (!(block_maximum > maximum)) return 1.0f;
        const float rescale = maximum == -INFINITY ? 0.0f : expf(maximum - block_maximum);
        sum *= rescale;
        maximum = block_maximum;
        return rescale;
    }
    // Folds in another softmax over a disjoint set of scores (split-K attention: chunks of the
    // cache attended apart, then combined). Returns the factors for this side's accumulator and
    // the other's: combined = mine * mine_rescale + other's * other_rescale.
    KVSIM_HD void merge(const OnlineSoftmax& other, float& mine_rescale, float& other_rescale) {
        if (other.maximum == -INFINITY) {
            mine_rescale = 1.0f, other_rescale = 0.0f;
            return;
        }
        if (!(other.maximum > maximum)) {
            other_rescale = expf(other.maximum - maximum);
            mine_rescale = 1.0f;
        } else {
            mine_rescale = maximum == -INFINITY ? 0.0f : expf(maximum - other.maximum);
            other_rescale = 1.0f;
            maximum = other.maximum;
        }
        sum = sum * mine_rescale + other.sum * other_rescale;
    }
};

}  // namespace kvsim
