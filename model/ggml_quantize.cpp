#include "model/ggml_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "model/ggml_blocks.h"

namespace kvsim::model {

namespace {

// Stores `value` as fp16 and returns what a reader will see, so quants are chosen against the
// scale the file really holds.
float store_fp16(uint8_t* at, float value) {
    const uint16_t bits = float_to_half(value);
    std::memcpy(at, &bits, 2);
    return half_to_float(bits);
}

int nearest(float x) { return static_cast<int>(std::lround(x)); }

// The element of largest magnitude, sign kept. Symmetric ("type-0") formats map it to their most
// negative quant, the side with one more level (ggml does the same).
float signed_extreme(const float* x, int n) {
    float extreme = 0.0f;
    for (int i = 0; i < n; ++i)
        if (std::fabs(x[i]) > std::fabs(extreme)) extreme = x[i];
    return extreme;
}

// q = x / step rounded, within [low, high]; 0 when the step is 0.
int quant_of(float x, float step, int low, int high) {
    return step == 0.0f ? 0 : std::clamp(nearest(x / step), low, high);
}

// Squared error of n weights quantised as x ≈ step * q - offset with q in [low, high].
float squared_error(const float* x, int n, float step, float offset, int low, int high) {
    float error = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float back = step * static_cast<float>(quant_of(x[i] + offset, step, low, high)) - offset;
        error += (x[i] - back) * (x[i] - back);
    }
    return error;
}

// A sub-block's integer scale: `wanted` / d rounded down or up, whichever reconstructs the
// sub-block better (plain rounding can cut off its largest weights), within [low, high].
int sub_block_scale(const float* x, int n, float wanted, float d, float offset, int scale_low, int scale_high,
                    int q_low, int q_high) {
    if (d == 0.0f) return 0;
    const float ratio = wanted / d;
    const int down = std::clamp(static_cast<int>(std::floor(ratio)), scale_low, scale_high);
    const int up = std::clamp(static_cast<int>(std::ceil(ratio)), scale_low, scale_high);
    const float error_down = squared_error(x, n, d * static_cast<float>(down), offset, q_low, q_high);
    const float error_up = squared_error(x, n, d * static_cast<float>(up), offset, q_low, q_high);
    return error_up < error_down ? up : down;
}

// Q4_0/Q4_1/Q5_0/Q5_1 nibbles: weight j < 16 in the low nibble of qs[j], j + 16 in the high.
void pack_nibbles_of_32(const int* q, uint8_t* qs) {
    for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
}

// Q5_0/Q5_1: bit j of the little-endian u32 is weight j's fifth bit.
void pack_fifth_bits_of_32(const int* q, uint8_t* qh) {
    uint32_t bits = 0;
    for (int j = 0; j < 32; ++j) bits |= static_cast<uint32_t>((q[j] >> 4) & 1) << j;
    std::memcpy(qh, &bits, 4);
}

// Symmetric 32-weight blocks (Q4_0, Q5_0): d = extreme / -(levels / 2), q stored with +levels/2.
void quantize_symmetric_32(const float* in, uint8_t* d_at, int levels, int* q) {
    const float d = store_fp16(d_at, signed_extreme(in, 32) / -static_cast<float>(levels / 2));
    for (int j = 0; j < 32; ++j) q[j] = quant_of(in[j], d, -levels / 2, levels / 2 - 1) + levels / 2;
}

// Affine 32-weight blocks (Q4_1, Q5_1): x = d * q + m with m the block's minimum.
void quantize_affine_32(const float* in, uint8_t* dm_at, int levels, int* q) {
    const auto [low, high] = std::minmax_element(in, in + 32);
    const float d = store_fp16(dm_at, (*high - *low) / static_cast<float>(levels - 1));
    const float m = store_fp16(dm_at + 2, *low);
    for (int j = 0; j < 32; ++j) q[j] = quant_of(in[j] - m, d, 0, levels - 1);
}

// The k-quants with mins (Q2_K, Q4_K, Q5_K): `subs` sub-blocks of `n` weights, each x = d*sc*q -
// dmin*m with q in [0, levels), sc and m integers in [0, scale_max]. The sub-block's range is
// stretched to include 0 so its offset m is never negative, as the formats store it unsigned.
// Writes d and dmin at d_at, the integer scales, mins and quants to the arrays.
void quantize_with_mins(const float* in, int subs, int n, int levels, int scale_max, uint8_t* d_at, int* scales,
                        int* mins, int* q) {
    float wanted_scale[16], wanted_offset[16], max_scale = 0.0f, max_offset = 0.0f;
    for (int s = 0; s < subs; ++s) {
        const auto [low, high] = std::minmax_element(in + s * n, in + (s + 1) * n);
        wanted_offset[s] = -std::min(*low, 0.0f);
        wanted_scale[s] = (*high + wanted_offset[s]) / static_cast<float>(levels - 1);
        max_scale = std::max(max_scale, wanted_scale[s]);
        max_offset = std::max(max_offset, wanted_offset[s]);
    }
    const float d = store_fp16(d_at, max_scale / static_cast<float>(scale_max));
    const float dmin = store_fp16(d_at + 2, max_offset / static_cast<float>(scale_max));
    for (int s = 0; s < subs; ++s) {
        const float* x = in + s * n;
        mins[s] = dmin == 0.0f ? 0 : std::clamp(nearest(wanted_offset[s] / dmin), 0, scale_max);
        const float offset = dmin * static_cast<float>(mins[s]);
        scales[s] = sub_block_scale(x, n, wanted_scale[s], d, offset, 0, scale_max, 0, levels - 1);
        const float step = d * static_cast<float>(scales[s]);
        for (int i = 0; i < n; ++i) q[s * n + i] = quant_of(x[i] + offset, step, 0, levels - 1);
    }
}

// The symmetric k-quants (Q3_K, Q6_K): 16 sub-blocks of 16, x = d * sc * q with q in
// [-levels/2, levels/2) and sc in [scale_low, scale_high]; d is fp16 at d_at.
void quantize_symmetric_k(const float* in, int levels, int scale_low, int scale_high, uint8_t* d_at, int* scales,
                          int* q) {
    float wanted[16];
    for (int s = 0; s < 16; ++s) wanted[s] = signed_extreme(in + 16 * s, 16) / -static_cast<float>(levels / 2);
    const float d = store_fp16(d_at, signed_extreme(wanted, 16) / static_cast<float>(scale_low));
    for (int s = 0; s < 16; ++s) {
        const float* x = in + 16 * s;
        scales[s] = sub_block_scale(x, 16, wanted[s], d, 0.0f, scale_low, scale_high, -levels / 2, levels / 2 - 1);
        const float step = d * static_cast<float>(scales[s]);
        for (int i = 0; i < 16; ++i) q[16 * s + i] = quant_of(x[i], step, -levels / 2, levels / 2 - 1);
    }
}

// Q4_K/Q5_K's 12 bytes of 6-bit scales and mins (the inverse of ggml_blocks.cpp's reading).
void pack_k4_scales(const int* scales, const int* mins, uint8_t* out) {
    std::memset(out, 0, 12);
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            out[j] |= static_cast<uint8_t>(scales[j]);
            out[j + 4] |= static_cast<uint8_t>(mins[j]);
        } else {
            out[j + 4] = static_cast<uint8_t>((scales[j] & 0xF) | ((mins[j] & 0xF) << 4));
            out[j - 4] |= static_cast<uint8_t>((scales[j] >> 4) << 6);
            out[j] |= static_cast<uint8_t>((mins[j] >> 4) << 6);
        }
    }
}

template <void (*Block)(const float*, uint8_t*)>
std::vector<uint8_t> each_block(std::span<const float> values, const BlockFormat& format) {
    const size_t blocks = values.size() / static_cast<size_t>(format.block_elements);
    std::vector<uint8_t> bytes(blocks * static_cast<size_t>(format.block_bytes));
    for (size_t b = 0; b < blocks; ++b)
        Block(values.data() + b * format.block_elements, bytes.data() + b * format.block_bytes);
    return bytes;
}

}  // namespace

void quantize_q4_0(const float* in, uint8_t* out) {
    int q[32];
    quantize_symmetric_32(in, out, 16, q);
    pack_nibbles_of_32(q, out + 2);
}

void quantize_q4_1(const float* in, uint8_t* out) {
    int q[32];
    quantize_affine_32(in, out, 16, q);
    pack_nibbles_of_32(q, out + 4);
}

void quantize_q5_0(const float* in, uint8_t* out) {
    int q[32];
    quantize_symmetric_32(in, out, 32, q);
    pack_fifth_bits_of_32(q, out + 2);
    pack_nibbles_of_32(q, out + 6);
}

void quantize_q5_1(const float* in, uint8_t* out) {
    int q[32];
    quantize_affine_32(in, out, 32, q);
    pack_fifth_bits_of_32(q, out + 4);
    pack_nibbles_of_32(q, out + 8);
}

void quantize_q8_0(const float* in, uint8_t* out) {
    // The quants divide by the unrounded scale, as kvsim always has: the fuzz corpus holds its bytes.
    float max_abs = 0.0f;
    for (int j = 0; j < 32; ++j) max_abs = std::max(max_abs, std::fabs(in[j]));
    const float scale = max_abs / 127.0f;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    store_fp16(out, scale);
    for (int j = 0; j < 32; ++j) out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::lround(in[j] * inverse)));
}

void quantize_q2_k(const float* in, uint8_t* out) {
    int scales[16], mins[16], q[256];
    quantize_with_mins(in, 16, 16, 4, 15, out + 80, scales, mins, q);
    for (int s = 0; s < 16; ++s) out[s] = static_cast<uint8_t>(scales[s] | (mins[s] << 4));
    uint8_t* qs = out + 16;
    std::memset(qs, 0, 64);
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 32; ++l) qs[32 * h + l] |= static_cast<uint8_t>(q[128 * h + 32 * k + l] << (2 * k));
}

void quantize_q3_k(const float* in, uint8_t* out) {
    int scales[16], q[256];
    quantize_symmetric_k(in, 8, -32, 31, out + 108, scales, q);
    uint8_t* hmask = out;
    uint8_t* qs = out + 32;
    uint8_t* packed_scales = out + 96;
    std::memset(out, 0, 108);
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 32; ++l) {
                const int stored = q[128 * h + 32 * k + l] + 4;  // 0..7
                qs[32 * h + l] |= static_cast<uint8_t>((stored & 3) << (2 * k));
                hmask[l] |= static_cast<uint8_t>((stored >> 2) << (4 * h + k));
            }
    for (int s = 0; s < 16; ++s) {
        const int stored = scales[s] + 32;  // 0..63
        packed_scales[s % 8] |= static_cast<uint8_t>((stored & 0xF) << (s < 8 ? 0 : 4));
        packed_scales[8 + s % 4] |= static_cast<uint8_t>((stored >> 4) << (2 * (s / 4)));
    }
}

void quantize_q4_k(const float* in, uint8_t* out) {
    int scales[8], mins[8], q[256];
    quantize_with_mins(in, 8, 32, 16, 63, out, scales, mins, q);
    pack_k4_scales(scales, mins, out + 4);
    uint8_t* qs = out + 16;
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l)
            qs[32 * c + l] = static_cast<uint8_t>(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
}

void quantize_q5_k(const float* in, uint8_t* out) {
    int scales[8], mins[8], q[256];
    quantize_with_mins(in, 8, 32, 32, 63, out, scales, mins, q);
    pack_k4_scales(scales, mins, out + 4);
    uint8_t* qh = out + 16;
    uint8_t* qs = out + 48;
    std::memset(qh, 0, 32);
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            const int first = q[64 * c + l], second = q[64 * c + 32 + l];
            qs[32 * c + l] = static_cast<uint8_t>((first & 0xF) | ((second & 0xF) << 4));
            qh[l] |= static_cast<uint8_t>(((first >> 4) << (2 * c)) | ((second >> 4) << (2 * c + 1)));
        }
}

void quantize_q6_k(const float* in, uint8_t* out) {
    int scales[16], q[256];
    quantize_symmetric_k(in, 64, -128, 127, out + 208, scales, q);
    uint8_t* ql = out;
    uint8_t* qh = out + 128;
    std::memset(out, 0, 192);
    for (int s = 0; s < 16; ++s) out[192 + s] = static_cast<uint8_t>(static_cast<int8_t>(scales[s]));
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 32; ++l) {
                const int stored = q[128 * h + 32 * k + l] + 32;  // 0..63
                ql[64 * h + 32 * (k % 2) + l] |= static_cast<uint8_t>((stored & 0xF) << (k < 2 ? 0 : 4));
                qh[32 * h + l] |= static_cast<uint8_t>((stored >> 4) << (2 * k));
            }
}

void quantize_q8_k(const float* in, uint8_t* out) {
    float max_abs = 0.0f;
    for (int j = 0; j < 256; ++j) max_abs = std::max(max_abs, std::fabs(in[j]));
    const float d = max_abs / 127.0f;  // stored as f32: no rounding to account for
    std::memcpy(out, &d, 4);
    for (int g = 0; g < 16; ++g) {
        int16_t sum = 0;
        for (int i = 0; i < 16; ++i) {
            const int q = quant_of(in[16 * g + i], d, -127, 127);
            out[4 + 16 * g + i] = static_cast<uint8_t>(static_cast<int8_t>(q));
            sum = static_cast<int16_t>(sum + q);
        }
        std::memcpy(out + 260 + 2 * g, &sum, 2);
    }
}

std::vector<uint8_t> quantize_blocks(TensorType type, std::span<const float> values) {
    const BlockFormat* format = find_block_format(static_cast<uint32_t>(type));
    if (format == nullptr || format->block_elements == 1)
        throw std::invalid_argument("quantize_blocks: type " + std::to_string(static_cast<uint32_t>(type)) +
                                    " is not a block format");
    if (values.size() % static_cast<size_t>(format->block_elements) != 0)
        throw std::invalid_argument(std::string("quantize_blocks: ") + format->name + ": length " +
                                    std::to_string(values.size()) + " is not a multiple of " +
                                    std::to_string(format->block_elements));
    switch (type) {
        case TensorType::Q4_0: return each_block<quantize_q4_0>(values, *format);
        case TensorType::Q4_1: return each_block<quantize_q4_1>(values, *format);
        case TensorType::Q5_0: return each_block<quantize_q5_0>(values, *format);
        case TensorType::Q5_1: return each_block<quantize_q5_1>(values, *format);
        case TensorType::Q8_0: return each_block<quantize_q8_0>(values, *format);
        case TensorType::Q2_K: return each_block<quantize_q2_k>(values, *format);
        case TensorType::Q3_K: return each_block<quantize_q3_k>(values, *format);
        case TensorType::Q4_K: return each_block<quantize_q4_k>(values, *format);
        case TensorType::Q5_K: return each_block<quantize_q5_k>(values, *format);
        case TensorType::Q6_K: return each_block<quantize_q6_k>(values, *format);
        case TensorType::Q8_K: return each_block<quantize_q8_k>(values, *format);
        default: break;
    }
    throw std::invalid_argument(std::string("quantize_blocks: no quantiser for ") + format->name);
}

}  // namespace kvsim::model
