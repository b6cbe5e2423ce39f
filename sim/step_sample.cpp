#include "sim/step_sample.h"

#include <stdexcept>
#include <string>

namespace kvsim {

int64_t stratum_begin(int64_t h, int64_t population, int64_t strata) {
    // h M fits: both are step counts of one sequence (under 2^31).
    return h * population / strata;
}

void draw_stratified_steps(int64_t population, int64_t strata, Xoshiro128& rng, uint8_t* chosen) {
    if (strata < 2 || strata > population)
        throw std::logic_error("draw_stratified_steps: " + std::to_string(strata) + " strata of " +
                               std::to_string(population) + " steps");
    for (int64_t h = 0; h < strata; ++h) {
        const int64_t begin = stratum_begin(h, population, strata), end = stratum_begin(h + 1, population, strata);
        chosen[begin + rng.next_int(static_cast<uint64_t>(end - begin))] = 1;
    }
}

StratifiedSum::StratifiedSum(int64_t population, int64_t strata) : population_(population), strata_(strata) {
    if (strata < 2 || strata > population)
        throw std::logic_error("StratifiedSum: " + std::to_string(strata) + " strata of " + std::to_string(population) +
                               " steps");
}

void StratifiedSum::add(double value, double second) {
    if (complete()) throw std::logic_error("StratifiedSum: more sampled steps than strata");
    const double size = static_cast<double>(stratum_begin(added_ + 1, population_, strata_) -
                                            stratum_begin(added_, population_, strata_));
    total_ += size * value;
    second_total_ += size * second;
    group_values_[group_count_] = value;
    group_sizes_[group_count_] = size;
    ++group_count_;
    ++added_;
    // Pairs in order; where n is odd the last pair takes the last stratum too.
    const bool odd = strata_ % 2 == 1;
    if (complete() || (group_count_ == 2 && !(odd && added_ == strata_ - 1))) close_group();
}

void StratifiedSum::close_group() {
    const std::size_t count = group_count_;
    double weighted = 0, sizes = 0;
    for (std::size_t i = 0; i < count; ++i) weighted += group_sizes_[i] * group_values_[i], sizes += group_sizes_[i];
    const double mean = weighted / sizes;
    double squares = 0;
    for (std::size_t i = 0; i < count; ++i) {
        const double deviation = group_sizes_[i] * (group_values_[i] - mean);
        squares += deviation * deviation;
    }
    variance_ += static_cast<double>(count) / static_cast<double>(count - 1) * squares;
    group_count_ = 0;
}

}  // namespace kvsim
