// Hostile trace files, written with kvsim's TraceWriter and then edited with the HDF5 C API:
// shared by the unit tests and by make_hostile_trace, which writes them for the CLI tests.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "sim/trace_store.h"

namespace kvsim::test {

// The small Q/K/V trace shape the tests write: 2 layers, 4 query heads, 2 KV heads, head size 8.
TraceMetadata small_qkv_metadata(const std::string& model_name);
// One layer of that shape: Q, K and V drawn from N(0, sigma^2) with a fixed seed.
QkvLayer random_qkv_layer(int64_t tokens, const TraceMetadata& m, unsigned seed, float sigma = 1.0f);

// The shape of the small valid Q/K/V trace the Q/K/V kinds start from: 2 layers, 4 query heads,
// 2 KV heads, head size 8, one sequence of 64 tokens.
inline constexpr int kHostileQkvTokens = 64;
// The attention kinds start from one layer and head, one sequence of 64 tokens, rows of uniform
// weights 1 / (t + 1) (their own weight is the rest).
inline constexpr int kHostileAttentionTokens = 64;

// Writes the trace `kind` names to `path`; throws std::invalid_argument for an unknown kind.
//   valid-qkv, valid-attention            the starting points, valid
//   qkv-nan, qkv-inf                      one NaN in layer 1's K (element 1000), one +Inf in layer 0's Q (element 77)
//   qkv-fp16-nan                          one NaN in layer 0's V, stored as float16
//   qkv-overflow                          finite Q and K near 1e20: q.k overflows float32 at layer 1, head 3, step 5
//   attention-nan                         one NaN at step 10, position 3
//   attention-above-one, attention-negative  a weight of 1.5 / -0.25 at step 20, position 7
//   attention-row-sum                     every weight of step 30's row 0.05 (it sums to 1.5)
//   length-2e31                           length 2^31 claimed, 63 rows written
//   attention-unstored                    length 2^20 claimed, one chunk of its dataset written
//   qkv-unstored                          length 2^24 claimed, Q/K/V datasets with no chunk written
//   big-chunk                             a 4096-token attention trace stored as a single chunk of 32 MiB
//   num-layers-2e32                       num_layers = 2^32 + 1
//   string-array                          model_name holds 3 strings instead of one
//   external-link                         layer 1's K is an external link (to a dataset of another file)
//   qkv-beyond-fp16                       finite K and V of layer 0 past float16's range (1e5, -2e6), float32
//   qkv-beyond-fp16-stored-fp16           the same stored as float16: the writer refuses it (InputError)
void write_hostile_trace(const std::string& kind, const std::string& path);

std::vector<std::string> hostile_trace_kinds();

}  // namespace kvsim::test
