#include "model/ggml_blocks.h"

#include <cstring>

#include "model/gguf.h"

namespace kvsim::model {

namespace {

float fp16_at(const uint8_t* bytes) {
    uint16_t bits;
    std::memcpy(&bits, bytes, 2);
    return half_to_float(bits);
}

uint32_t u32_at(const uint8_t* bytes) {
    uint32_t value;
    std::memcpy(&value, bytes, 4);
    return value;
}

// Weight j of a 32-weight block whose nibbles are packed as Q4_0's: j < 16 low nibble of qs[j].
int nibble_of_32(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4; }

// Sub-block j's 6-bit scale and min in the 12 bytes of a Q4_K or Q5_K block.
void k4_scale_and_min(const uint8_t* scales, int j, int& scale, int& min) {
    if (j < 4) {
        scale = scales[j] & 63;
        min = scales[j + 4] & 63;
    } else {
        scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
        min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

// Sub-block s's 6-bit scale (0..63, stored with an offset of 32) in Q3_K's 12 scale bytes.
int q3_k_scale(const uint8_t* scales, int s) {
    const int low = s < 8 ? scales[s] & 0xF : scales[s - 8] >> 4;
    const int high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
    return low | (high << 4);
}

void f32_block(const uint8_t* block, float* out) { std::memcpy(out, block, 4); }
void f16_block(const uint8_t* block, float* out) { *out = fp16_at(block); }
void bf16_block(const uint8_t* block, float* out) {
    uint16_t bits;
    std::memcpy(&bits, block, 2);
    *out = bf16_to_float(bits);
}

// Runs a one-block dequantiser over `blocks` consecutive blocks (inlined: same translation unit).
template <void (*Block)(const uint8_t*, float*), int Elements, int Bytes>
void each_block(const uint8_t* data, size_t blocks, float* out) {
    for (size_t b = 0; b < blocks; ++b) Block(data + b * Bytes, out + b * Elements);
}

constexpr BlockFormat kFormats[] = {
    {0, "F32", 1, 4, each_block<f32_block, 1, 4>},
    {1, "F16", 1, 2, each_block<f16_block, 1, 2>},
    {30, "BF16", 1, 2, each_block<bf16_block, 1, 2>},
    {2, "Q4_0", 32, 18, each_block<dequantize_q4_0, 32, 18>},
    {3, "Q4_1", 32, 20, each_block<dequantize_q4_1, 32, 20>},
    {6, "Q5_0", 32, 22, each_block<dequantize_q5_0, 32, 22>},
    {7, "Q5_1", 32, 24, each_block<dequantize_q5_1, 32, 24>},
    {8, "Q8_0", 32, 34, each_block<dequantize_q8_0, 32, 34>},
    {10, "Q2_K", 256, 84, each_block<dequantize_q2_k, 256, 84>},
    {11, "Q3_K", 256, 110, each_block<dequantize_q3_k, 256, 110>},
    {12, "Q4_K", 256, 144, each_block<dequantize_q4_k, 256, 144>},
    {13, "Q5_K", 256, 176, each_block<dequantize_q5_k, 256, 176>},
    {14, "Q6_K", 256, 210, each_block<dequantize_q6_k, 256, 210>},
    {15, "Q8_K", 256, 292, each_block<dequantize_q8_k, 256, 292>},
};

}  // namespace

const BlockFormat* find_block_format(uint32_t type_id) {
    for (const BlockFormat& format : kFormats)
        if (format.type_id == type_id) return &format;
    return nullptr;
}

const char* supported_type_names() {
    return "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K";
}

void dequantize_q4_0(const uint8_t* block, float* out) {
    const float d = fp16_at(block);
    const uint8_t* qs = block + 2;
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(nibble_of_32(qs, j) - 8);
}

void dequantize_q4_1(const uint8_t* block, float* out) {
    const float d = fp16_at(block), m = fp16_at(block + 2);
    const uint8_t* qs = block + 4;
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(nibble_of_32(qs, j)) + m;
}

void dequantize_q5_0(const uint8_t* block, float* out) {
    const float d = fp16_at(block);
    const uint32_t qh = u32_at(block + 2);
    const uint8_t* qs = block + 6;
    for (int j = 0; j < 32; ++j) {
        const int q = nibble_of_32(qs, j) | static_cast<int>(((qh >> j) & 1) << 4);
        out[j] = d * static_cast<float>(q - 16);
    }
}

void dequantize_q5_1(const uint8_t* block, float* out) {
    const float d = fp16_at(block), m = fp16_at(block + 2);
    const uint32_t qh = u32_at(block + 4);
    const uint8_t* qs = block + 8;
    for (int j = 0; j < 32; ++j) {
        const int q = nibble_of_32(qs, j) | static_cast<int>(((qh >> j) & 1) << 4);
        out[j] = d * static_cast<float>(q) + m;
    }
}

void dequantize_q8_0(const uint8_t* block, float* out) {
    const float d = fp16_at(block);
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
}

void dequantize_q2_k(const uint8_t* block, float* out) {
    const uint8_t* scales = block;
    const uint8_t* qs = block + 16;
    const float d = fp16_at(block + 80), dmin = fp16_at(block + 82);
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 32; ++l) {
                const int sub = 8 * h + 2 * k + l / 16;
                const int q = (qs[32 * h + l] >> (2 * k)) & 3;
                out[128 * h + 32 * k + l] =
                    d * static_cast<float>(scales[sub] & 0xF) * static_cast<float>(q) - dmin * static_cast<float>(scales[sub] >> 4);
            }
}

void dequantize_q3_k(const uint8_t* block, float* out) {
    const uint8_t* hmask = block;
    const uint8_t* qs = block + 32;
    const uint8_t* scales = block + 96;
    const float d = fp16_at(block + 108);
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 32; ++l) {
                const int sub = 8 * h + 2 * k + l / 16;
                const int low = (qs[32 * h + l] >> (2 * k)) & 3;
                const int high = (hmask[l] >> (4 * h + k)) & 1;
                const int q = low | (high << 2);
                out[128 * h + 32 * k + l] = d * static_cast<float>(q3_k_scale(scales, sub) - 32) * static_cast<float>(q - 4);
            }
}

void dequantize_q4_k(const uint8_t* block, float* out) {
    const float d = fp16_at(block), dmin = fp16_at(block + 2);
    const uint8_t* scales = block + 4;
    const uint8_t* qs = block + 16;
    for (int c = 0; c < 4; ++c)
        for (int half = 0; half < 2; ++half) {
            int scale, min;
            k4_scale_and_min(scales, 2 * c + half, scale, min);
            const float step = d * static_cast<float>(scale), offset = dmin * static_cast<float>(min);
            for (int l = 0; l < 32; ++l) {
                const int q = half == 0 ? qs[32 * c + l] & 0xF : qs[32 * c + l] >> 4;
                out[64 * c + 32 * half + l] = step * static_cast<float>(q) - offset;
            }
        }
}

void dequantize_q5_k(const uint8_t* block, float* out) {
    const float d = fp16_at(block), dmin = fp16_at(block + 2);
    const uint8_t* scales = block + 4;
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + 48;
    for (int c = 0; c < 4; ++c)
        for (int half = 0; half < 2; ++half) {
            int scale, min;
            k4_scale_and_min(scales, 2 * c + half, scale, min);
            const float step = d * static_cast<float>(scale), offset = dmin * static_cast<float>(min);
            for (int l = 0; l < 32; ++l) {
                const int low = half == 0 ? qs[32 * c + l] & 0xF : qs[32 * c + l] >> 4;
                const int high = (qh[l] >> (2 * c + half)) & 1;
                out[64 * c + 32 * half + l] = step * static_cast<float>(low | (high << 4)) - offset;
            }
        }
}

void dequantize_q6_k(const uint8_t* block, float* out) {
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = fp16_at(block + 208);
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 32; ++l) {
                const uint8_t low_byte = ql[64 * h + 32 * (k % 2) + l];
                const int low = k < 2 ? low_byte & 0xF : low_byte >> 4;
                const int high = (qh[32 * h + l] >> (2 * k)) & 3;
                const int sub = 8 * h + 2 * k + l / 16;
                out[128 * h + 32 * k + l] = d * static_cast<float>(scales[sub]) * static_cast<float>((low | (high << 4)) - 32);
            }
}

void dequantize_q8_k(const uint8_t* block, float* out) {
    float d;
    std::memcpy(&d, block, 4);
    for (int j = 0; j < 256; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(block[4 + j]));
}

}  // namespace kvsim::model
