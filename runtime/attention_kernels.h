// The inner loops of the runtime's decode attention (the `cpu` backend), over one tier's packed
// rows read where they lie: FP16 half bits widened by the CPU's own conversion (F16C), INT8 and
// INT4 levels widened and multiplied by their scale in registers. Nothing is copied out of the
// cache first and nothing is called per row.
//
// The values attention sees are numerics.h's, bit for bit: half_bits_to_float for FP16, and
// dequantize_level(level, scale) = level * scale for INT8 and INT4 (a level of at most 8 bits
// times an fp16 scale is exact in float, so the vector product is the same number). What differs
// from the simulator's arithmetic is the order of summation: a dot product is summed in eight
// (AVX2) or sixteen (AVX-512) lanes with fused multiply-adds, then across the lanes, where the
// simulator sums in sixteen lanes without fusing (cache_math/tiers.h, fixed_order_dot). The query
// is never rounded to int8: that would move each of its numbers by up to 1/254 of its largest,
// where the agreement with the oracle (1e-5) leaves room for float rounding only. Where the CPU
// has AMX tiles (Sapphire Rapids and later), INT8 and INT4 keys are scored by integer tile
// products against the query split exactly into four int8 parts (to 2^-29 of its largest
// number), each scale group's sums then scaled in float.
//
// With AVX2, FMA and F16C in the build (-march=native on any x86-64 CPU since 2015) the kernels
// are vector code, eight channels a vector; with AVX-512 (F, BW, DQ, VL and VBMI: Ice Lake, Zen 4
// and later) sixteen, for head sizes that are whole sixteens, summed in sixteen lanes; with AMX
// the quantised keys' scores as above, for tiers of 256 rows or more. Elsewhere
// the portable ones, plain loops over the same numerics, serve. Every set a build holds is
// compiled in and reachable by name, and the tests hold each to the others.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvsim::runtime {

// One tier's rows as the kernels read them: `count` rows packed from row 0 (TierStore's layout),
// and the slot each row belongs to.
struct TierRows {
    int tier = 0, head_dim = 0, count = 0;
    int row_bytes = 0, groups = 0, group_channels = 1;  // quantised tiers: levels a row, scales a row
    const uint16_t* half = nullptr;   // FP16: head_dim half bits a row
    const uint8_t* levels = nullptr;  // INT8: a signed byte a channel; INT4: two's-complement nibbles, low first
    const uint16_t* scales = nullptr; // `groups` fp16 scales a row, one per `group_channels` channels
    const int32_t* slot_of_row = nullptr;
    // KIVI keys (groups == 0): no scales in the rows; channel c of a row whose slot holds position
    // p is scaled by channel_scales[(p / key_group) * head_dim + c].
    const float* channel_scales = nullptr;
    const int32_t* position_of_slot = nullptr;
    int key_group = 1;
};

// Rows a kernel takes at a time, and the scratch floats it needs for a head size and scale groups.
inline constexpr int kKernelBlock = 32;
inline std::size_t kernel_scratch_floats(int head_dim, int groups) {
    return static_cast<std::size_t>(kKernelBlock) * (static_cast<std::size_t>(head_dim) + groups + 8 + 8);
}

// scores[h * stride + r] = scale * (q_h . row r) for each row r of `rows` and query head h <
// group (q: group x head_dim); peaks[h] is raised to the largest score of head h.
void score_rows(const TierRows& rows, const float* q, int group, float scale, float* scores, std::size_t stride,
                float* peaks, float* scratch);

// out[h * head_dim + c] += w * row r[c] for each row r, with w = weights[h * stride + i] and
// i = index_of_slot[slot_of_row[r]]: the weight of the row's token wherever its score lies.
void accumulate_rows(const TierRows& rows, const float* weights, std::size_t stride, const int32_t* index_of_slot,
                     int group, float* out, float* scratch);

// float(1 / the sum of x[0..n)), the sum taken in double: a softmax's total as the oracle's
// softmax_numerators takes it (in another order).
float reciprocal_of_sum(const float* x, std::size_t n);

// The same two, as plain loops: what builds without AVX2, FMA and F16C run, and what the tests
// hold the vector kernels to.
void score_rows_portable(const TierRows& rows, const float* q, int group, float scale, float* scores,
                         std::size_t stride, float* peaks, float* scratch);
void accumulate_rows_portable(const TierRows& rows, const float* weights, std::size_t stride,
                              const int32_t* index_of_slot, int group, float* out, float* scratch);

// Whether score_rows and accumulate_rows are the vector kernels in this build.
bool vector_kernels();

// The kernel sets this build holds, portable first; the last is what score_rows and
// accumulate_rows use.
enum class KernelSet { portable, avx2, avx512, amx };
std::vector<KernelSet> kernel_sets();
const char* kernel_set_name(KernelSet set);

// score_rows and accumulate_rows with a chosen set (one this build holds); where it does not serve
// a head size (AVX-512: not a whole number of sixteens), the next set below it does.
void score_rows_with(KernelSet set, const TierRows& rows, const float* q, int group, float scale, float* scores,
                     std::size_t stride, float* peaks, float* scratch);
void accumulate_rows_with(KernelSet set, const TierRows& rows, const float* weights, std::size_t stride,
                          const int32_t* index_of_slot, int group, float* out, float* scratch);

}  // namespace kvsim::runtime
