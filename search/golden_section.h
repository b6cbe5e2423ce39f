// Golden-section searches of many units' minima over [0, 1] at once (a streaming head's lambda
// each), measured in passes: the first measures both probes of every bracket, each later pass one
// new probe a unit, since a shrunk bracket keeps the probe it shrank towards as one of its next
// two (the golden ratio). Which side the new probe lies on differs from unit to unit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvsim {

class GoldenSections {
public:
    static constexpr double kGolden = 0.6180339887498949;  // (sqrt(5) - 1) / 2

    explicit GoldenSections(std::size_t units);

    // The first pass: every unit's left probe, then its right one; their errors to first_errors.
    const std::vector<double>& left() const { return left_; }
    const std::vector<double>& right() const { return right_; }
    void first_errors(const std::vector<double>& left_error, const std::vector<double>& right_error);

    // Each bracket kept around its lower probe (the left where they tie, as a search alone would);
    // returns the one new probe each unit needs, whose errors go to new_errors.
    const std::vector<double>& shrink();
    void new_errors(const std::vector<double>& errors);

    const std::vector<double>& low() const { return low_; }
    const std::vector<double>& high() const { return high_; }

private:
    std::vector<double> low_, high_, left_, right_, left_error_, right_error_, probe_;
    std::vector<uint8_t> new_left_;  // per unit: whether shrink() moved its left probe
};

}  // namespace kvsim
