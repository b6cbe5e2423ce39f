// A FIFO of positions for the policies that read no attention (sliding window, StreamingLLM).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "policies/policy.h"

namespace kvsim {

class PositionRing {
public:
    explicit PositionRing(std::size_t capacity) : slots_(capacity) {}

    void push(int32_t pos) {
        if (count_ == slots_.size()) throw std::logic_error("admitted past its capacity");
        slots_[(head_ + count_) % slots_.size()] = pos;
        ++count_;
    }
    int32_t pop_oldest() {
        const int32_t pos = slots_[head_];
        head_ = (head_ + 1) % slots_.size();
        --count_;
        return pos;
    }
    std::size_t size() const { return count_; }

private:
    std::vector<int32_t> slots_;
    std::size_t head_ = 0;
    std::size_t count_ = 0;
};

}  // namespace kvsim
