#include "sim/heavy_hitters.h"

#include <algorithm>
#include <functional>

namespace kvsim {

void top_k_positions(std::span<const float> row, int k, std::vector<int32_t>& out) {
    const std::size_t n = row.size();
    const std::size_t want = std::min<std::size_t>(static_cast<std::size_t>(k), n);
    if (want == 0) return;
    // The k-th largest weight (with multiplicity) by a min-heap of the k largest seen so far:
    // most weights fail the first comparison, so this is about one comparison per weight.
    float heap[256];
    std::vector<float> big_heap;
    float* h = heap;
    if (want > 256) {
        big_heap.resize(want);
        h = big_heap.data();
    }
    std::copy(row.begin(), row.begin() + want, h);
    std::make_heap(h, h + want, std::greater<float>());
    for (std::size_t i = want; i < n; ++i) {
        if (row[i] > h[0]) {
            std::pop_heap(h, h + want, std::greater<float>());
            h[want - 1] = row[i];
            std::push_heap(h, h + want, std::greater<float>());
        }
    }
    const float threshold = h[0];
    std::size_t above = 0;
    for (std::size_t i = 0; i < n; ++i) above += row[i] > threshold;
    std::size_t ties_left = want - above;
    for (std::size_t i = 0; i < n; ++i) {
        if (row[i] > threshold) {
            out.push_back(static_cast<int32_t>(i));
        } else if (row[i] == threshold && ties_left > 0) {
            out.push_back(static_cast<int32_t>(i));
            --ties_left;
        }
    }
}

}  // namespace kvsim
