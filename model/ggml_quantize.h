// Quantisers for ggml's block formats (layouts: ggml_blocks.h), so kvsim's GGUF writer can make
// files of every type the reader dequantises. Plain round-to-nearest with the block's scales
// chosen from its extremes (k-quant sub-block scales: the better of rounding down or up); not
// ggml's error-minimising search, so its files of the same weights differ and err a little more.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/gguf.h"

namespace kvsim::model {

// One block each: reads the format's block_elements floats from `in`, writes block_bytes to `out`.
void quantize_q4_0(const float* in, uint8_t* out);
void quantize_q4_1(const float* in, uint8_t* out);
void quantize_q5_0(const float* in, uint8_t* out);
void quantize_q5_1(const float* in, uint8_t* out);
void quantize_q8_0(const float* in, uint8_t* out);
void quantize_q2_k(const float* in, uint8_t* out);
void quantize_q3_k(const float* in, uint8_t* out);
void quantize_q4_k(const float* in, uint8_t* out);
void quantize_q5_k(const float* in, uint8_t* out);
void quantize_q6_k(const float* in, uint8_t* out);
void quantize_q8_k(const float* in, uint8_t* out);

// `values` (a whole number of blocks) as the blocks of `type`, which must be one of the quantised
// formats above; throws std::invalid_argument otherwise.
std::vector<uint8_t> quantize_blocks(TensorType type, std::span<const float> values);

}  // namespace kvsim::model
