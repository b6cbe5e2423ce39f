// The top-k "heavy hitter" positions of one attention row, with the reference harness's tie
// rule: every position above the k-th largest weight, then positions equal to it in ascending
// order until k are chosen. Computed once per step and shared by every policy of a run.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace kvsim {

// Appends the top-min(k, row.size()) positions of `row` to `out` (order unspecified). Weights rank
// by IEEE 754 totalOrder (-NaN < -Inf < ... < -0 < +0 < ... < +Inf < +NaN), so any row, valid or
// not, gives that many distinct positions in range; on finite weights >= 0 it is the usual order.
void top_k_positions(std::span<const float> row, int k, std::vector<int32_t>& out);

// The same positions in the same order, faster along a head's successive rows. `floor_hint`
// (start each head at kNoTopKHint) is a guess at a key no greater than this row's k-th largest,
// updated here for the next row: the previous row's threshold, lowered a little. It decides how
// much of the row is examined, never the output.
inline constexpr int32_t kNoTopKHint = -1;
void top_k_positions(std::span<const float> row, int k, std::vector<int32_t>& out, int32_t& floor_hint);

// The same, where the caller gathered the row's positions at or above floor_hint (> 0) as it
// wrote the row (the attention does, while the row is in registers): `at_or_above` must be
// exactly positions_at_or_above(row, floor_hint), every position whose key is at least the hint,
// ascending. The one pass over the row above is then skipped.
void top_k_positions(std::span<const float> row, int k, std::vector<int32_t>& out, int32_t& floor_hint,
                     std::span<const int32_t> at_or_above);

// Every position of `row` whose key (the weight's bits, for weights >= +0) is at least floor_key,
// ascending: what the hint's pass gathers. The positions lie in a buffer of this thread's, valid
// until its next call. For tests, and for the callers above.
std::span<const int32_t> positions_at_or_above(std::span<const float> row, int32_t floor_key);

}  // namespace kvsim
