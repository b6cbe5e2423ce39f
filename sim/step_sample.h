// Output error on a stratified sample of a stream's decode steps (search.sample): the M steps cut
// into n strata of consecutive steps, one step drawn from each. A stream's error drifts with its
// context (a cache fills, then evicts), and a simple random sample pays for that drift in its
// variance; one step a stratum does not (on Llama-3.2-1B's shape, 4,096 steps, 1/8 of them: a
// median 2.6x to 9.2x less variance for stratigraphic and H2O streams; docs/search-and-export.md).
#pragma once
#include <array>
#include <cstdint>

#include "sim/rng.h"

namespace kvsim {

// Where stratum h of n starts among M steps: floor(h M / n), so sizes differ by at most one.
int64_t stratum_begin(int64_t h, int64_t population, int64_t strata);

// One offset drawn uniformly from each of the n strata of M steps by `rng`, stratum by stratum:
// chosen[offset] = 1 (chosen holds M entries, all 0 before). 2 <= n <= M.
void draw_stratified_steps(int64_t population, int64_t strata, Xoshiro128& rng, uint8_t* chosen);

// The estimate of a stream's every-step sums from its sampled steps, added stratum by stratum in
// order: each step's value times its stratum's size. The variance of the first sum's estimate is
// the collapsed-strata estimator (one step a stratum leaves no variance within a stratum to
// measure): strata paired in order, the last three together where n is odd, and per group of L
// strata of sizes m_h and values y_h, L / (L - 1) sum_h m_h^2 (y_h - y_g)^2, y_g the group's
// size-weighted mean. It counts the drift between paired strata as variance too: an overestimate
// where the error drifts, never an underestimate from it.
class StratifiedSum {
public:
    StratifiedSum(int64_t population, int64_t strata);
    // The next stratum's sampled step: its value and a second one estimated alongside (no variance).
    void add(double value, double second);
    bool complete() const { return added_ == strata_; }
    double total() const { return total_; }
    double second_total() const { return second_total_; }
    double variance() const { return variance_; }

private:
    void close_group();

    int64_t population_, strata_, added_ = 0;
    double total_ = 0, second_total_ = 0, variance_ = 0;
    // The open group's strata (two, or three for the last where n is odd): values and sizes.
    std::array<double, 3> group_values_{}, group_sizes_{};
    std::size_t group_count_ = 0;
};

}  // namespace kvsim
