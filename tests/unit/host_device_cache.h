// The CUDA backend's device, done on the host for tests on machines without a GPU: the pool in
// host memory, filled as the scatter kernel fills it, and attended with the kernels' algorithm
// (slots in chunks of kChunkSlots, each chunk an online softmax, the chunks merged in order, then
// the group's mean weight per slot), one query head after another instead of a warp each.
#pragma once
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "runtime/cuda_attention.h"

namespace kvsim::runtime {

class HostDeviceCache final : public cuda::DeviceCache {
public:
    HostDeviceCache(const std::vector<HeadLayout>& layouts, int num_kv_heads, int group, int head_dim)
        : pool_(layouts), memory_(pool_.bytes(), kEmptyCode), kv_heads_(num_kv_heads), group_(group), d_(head_dim) {
        heads_ = pool_.heads_at(memory_.data());
    }

    // Every `fail_every`-th attend fails as a failed CUDA call would (what was staged is lost).
    int fail_every = 0;
    std::shared_ptr<int> failures;  // counts them, when set

    bool stage(int head, int slot, uint8_t code, const TierView (&keys)[3], const TierView (&values)[3],
               std::string&) override {
        if (pool_.stage(head, slot, code, keys, values)) return true;
        flush();
        return pool_.stage(head, slot, code, keys, values);
    }

    bool attend(int layer, const float* q, float* out, float* slot_weights, std::string& error) override {
        if (fail_every > 0 && ++calls_ % fail_every == 0) {
            pool_.clear();
            if (failures) ++*failures;
            error = "backend 'cuda': an injected failure";
            return false;
        }
        flush();
        const int capacity = pool_.max_capacity();
        const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
        std::vector<float> scores(capacity), acc(d_), part_acc(d_);
        for (int kv = 0; kv < kv_heads_; ++kv) {
            const PooledHead& head = heads_[static_cast<std::size_t>(layer) * kv_heads_ + kv];
            float* weights = slot_weights + static_cast<std::size_t>(kv) * capacity;
            std::fill(weights, weights + capacity, 0.0f);
            if (head.capacity == 0) continue;
            for (int g = 0; g < group_; ++g) {
                const int h = kv * group_ + g;
                const float* qh = q + static_cast<std::size_t>(h) * d_;
                OnlineSoftmax merged;
                std::fill(acc.begin(), acc.end(), 0.0f);
                for (int first = 0; first < head.capacity; first += kChunkSlots) {
                    OnlineSoftmax part;
                    std::fill(part_acc.begin(), part_acc.end(), 0.0f);
                    for (int slot = first; slot < std::min(first + kChunkSlots, head.capacity); ++slot) {
                        const uint8_t code = head.codes[slot];
                        if (code == kEmptyCode) continue;
                        float dot = 0.0f;
                        for (int c = 0; c < d_; ++c) dot += qh[c] * head.keys[code & 3].element(slot, c);
                        scores[slot] = dot * scale;
                        float w = 0.0f;
                        const float rescale = part.add(scores[slot], w);
                        for (int c = 0; c < d_; ++c)
                            part_acc[c] = part_acc[c] * rescale + w * head.values[code >> 2].element(slot, c);
                    }
                    float mine = 0.0f, theirs = 0.0f;
                    merged.merge(part, mine, theirs);
                    for (int c = 0; c < d_; ++c) acc[c] = acc[c] * mine + part_acc[c] * theirs;
                }
                const float inv_sum = 1.0f / merged.sum;
                for (int c = 0; c < d_; ++c) out[static_cast<std::size_t>(h) * d_ + c] = acc[c] * inv_sum;
                for (int slot = 0; slot < head.capacity; ++slot)
                    if (head.codes[slot] != kEmptyCode) weights[slot] += std::exp(scores[slot] - merged.maximum) * inv_sum;
            }
            for (int slot = 0; slot < head.capacity; ++slot) weights[slot] /= static_cast<float>(group_);
        }
        return true;
    }

    int max_capacity() const override { return pool_.max_capacity(); }
    std::size_t reserved_bytes() const override { return pool_.bytes(); }

private:
    void flush() {
        scatter_on_host(memory_.data(), pool_.staged().data(), pool_.copies());
        pool_.clear();
    }
    DevicePool pool_;
    std::vector<uint8_t> memory_;
    std::vector<PooledHead> heads_;
    int kv_heads_, group_, d_;
    int calls_ = 0;
};

}  // namespace kvsim::runtime
