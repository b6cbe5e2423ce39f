// ggml's block formats for GGUF tensor data, and one dequantiser per format.
//
// A quantised row is a run of blocks; each block holds a fixed number of weights in a fixed
// number of bytes (little-endian, fp16 scales as IEEE binary16). Layouts as ggml defines them
// (ggml-common.h; the k-quants are described in llama.cpp PR 1684):
//
//   Q4_0   32 weights, 18 bytes: fp16 d, u8 qs[16]. Weight j < 16 is the low nibble of qs[j],
//          weight j + 16 its high nibble; x = d * (q - 8).
//   Q4_1   32 weights, 20 bytes: fp16 d, fp16 m, u8 qs[16], nibbles as Q4_0; x = d * q + m.
//   Q5_0   32 weights, 22 bytes: fp16 d, u32 qh, u8 qs[16]. Nibbles as Q4_0; bit j of qh is
//          weight j's fifth bit; x = d * (q - 16).
//   Q5_1   32 weights, 24 bytes: fp16 d, fp16 m, u32 qh, u8 qs[16], bits as Q5_0; x = d * q + m.
//   Q8_0   32 weights, 34 bytes: fp16 d, i8 qs[32]; x = d * q.
//
// The k-quants: super-blocks of 256 weights made of sub-blocks, each sub-block with its own
// quantised scale (and min), the super-block with fp16 factors for those.
//
//   Q2_K   84 bytes: u8 scales[16], u8 qs[64], fp16 d, fp16 dmin. 16 sub-blocks of 16; scales[s]
//          holds sub-block s's scale (low nibble) and min (high nibble); x = d*sc*q - dmin*m.
//          2-bit q: weight 128*h + 32*k + l (h < 2, k < 4, l < 32) is bits 2k..2k+1 of
//          qs[32*h + l], in sub-block 8*h + 2*k + l/16.
//   Q3_K   110 bytes: u8 hmask[32], u8 qs[64], u8 scales[12], fp16 d. 16 sub-blocks of 16;
//          x = d * (sc - 32) * (q - 4), q 3 bits: its low two bits placed as Q2_K's, its high
//          bit is bit 4*h + k of hmask[l]. The 6-bit scales: sub-block s's low 4 bits are the
//          low nibble of scales[s] (s < 8) or the high nibble of scales[s - 8] (s >= 8); its high
//          2 bits are bits 2*(s/4)..2*(s/4)+1 of scales[8 + s%4].
//   Q4_K   144 bytes: fp16 d, fp16 dmin, u8 scales[12], u8 qs[128]. 8 sub-blocks of 32;
//          x = d*sc*q - dmin*m, sc and m 6 bits (packing below). Weight 64*c + l (c < 4, l < 32)
//          is the low nibble of qs[32*c + l] in sub-block 2c, weight 64*c + 32 + l its high
//          nibble in sub-block 2c + 1.
//   Q5_K   176 bytes: fp16 d, fp16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]. As Q4_K with a
//          fifth bit: weight 64*c + l's is bit 2c of qh[l], weight 64*c + 32 + l's bit 2c + 1.
//   Q6_K   210 bytes: u8 ql[128], u8 qh[64], i8 scales[16], fp16 d. 16 sub-blocks of 16;
//          x = d * sc * (q - 32), q 6 bits. Weight 128*h + 32*k + l (h < 2, k < 4, l < 32) is in
//          sub-block 8*h + 2*k + l/16; its low 4 bits are a nibble of ql[64*h + 32*(k%2) + l] (the
//          low nibble for k < 2, the high for k >= 2), its high 2 bits are bits 2k..2k+1 of
//          qh[32*h + l].
//   Q8_K   292 bytes: f32 d, i8 qs[256], i16 bsums[16] (sums of 16 quants, for dot products;
//          not needed to dequantise); x = d * q.
//
// Q4_K/Q5_K 6-bit scale packing (12 bytes, sub-blocks j < 8): for j < 4, sc = scales[j] & 63 and
// m = scales[j + 4] & 63; for j >= 4, the low 4 bits of sc and m are the low and high nibbles of
// scales[j + 4], and their high 2 bits are the top two bits of scales[j - 4] and scales[j].
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvsim::model {

inline constexpr int kSuperBlockSize = 256;  // QK_K: weights per k-quant super-block

// How a tensor type stores its weights: `block_elements` weights in `block_bytes` bytes, turned
// into floats by `dequantize` (which reads `blocks` consecutive blocks). F32, F16 and BF16 are
// blocks of one weight.
struct BlockFormat {
    uint32_t type_id;
    const char* name;
    int block_elements;
    int block_bytes;
    void (*dequantize)(const uint8_t* data, size_t blocks, float* out);
};

// The format of a type id kvsim reads, or nullptr for any other.
const BlockFormat* find_block_format(uint32_t type_id);
// "F32, F16, BF16, Q4_0, ...": the types find_block_format knows, for error messages.
const char* supported_type_names();

// One block each: reads the format's block_bytes from `block`, writes block_elements floats.
void dequantize_q4_0(const uint8_t* block, float* out);
void dequantize_q4_1(const uint8_t* block, float* out);
void dequantize_q5_0(const uint8_t* block, float* out);
void dequantize_q5_1(const uint8_t* block, float* out);
void dequantize_q8_0(const uint8_t* block, float* out);
void dequantize_q2_k(const uint8_t* block, float* out);
void dequantize_q3_k(const uint8_t* block, float* out);
void dequantize_q4_k(const uint8_t* block, float* out);
void dequantize_q5_k(const uint8_t* block, float* out);
void dequantize_q6_k(const uint8_t* block, float* out);
void dequantize_q8_k(const uint8_t* block, float* out);

}  // namespace kvsim::model
