#include "search/golden_section.h"

#include <stdexcept>

namespace kvsim {

GoldenSections::GoldenSections(std::size_t units)
    : low_(units, 0.0),
      high_(units, 1.0),
      left_(units, 1.0 - kGolden),
      right_(units, kGolden),
      left_error_(units),
      right_error_(units),
      probe_(units),
      new_left_(units) {}

void GoldenSections::first_errors(const std::vector<double>& left_error, const std::vector<double>& right_error) {
    if (left_error.size() != left_.size() || right_error.size() != left_.size())
        throw std::logic_error("golden sections: an error per unit and probe");
    left_error_ = left_error;
    right_error_ = right_error;
}

const std::vector<double>& GoldenSections::shrink() {
    for (std::size_t u = 0; u < low_.size(); ++u) {
        new_left_[u] = left_error_[u] <= right_error_[u];
        if (new_left_[u]) {  // the minimum lies left of the right probe, which becomes the new high
            high_[u] = right_[u];
            right_[u] = left_[u];
            right_error_[u] = left_error_[u];
            left_[u] = probe_[u] = high_[u] - kGolden * (high_[u] - low_[u]);
        } else {
            low_[u] = left_[u];
            left_[u] = right_[u];
            left_error_[u] = right_error_[u];
            right_[u] = probe_[u] = low_[u] + kGolden * (high_[u] - low_[u]);
        }
    }
    return probe_;
}

void GoldenSections::new_errors(const std::vector<double>& errors) {
    if (errors.size() != low_.size()) throw std::logic_error("golden sections: an error per unit");
    for (std::size_t u = 0; u < low_.size(); ++u) (new_left_[u] ? left_error_ : right_error_)[u] = errors[u];
}

}  // namespace kvsim
