// Where the CUDA backend keeps a cache on the device, written without CUDA so the host can check
// it: one byte pool for every (layer, KV head) (keys then values, tiers 0..2 in TierStore's row
// format but a row per slot, slot s at row s, then a code per slot), and the staging of changed
// slots into it (each read from wherever the host's packed store keeps that slot's row). cuda_attention.cu
// allocates the pool with cudaMalloc and scatters the staged bytes with a kernel; the tests do
// the same into host memory.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/tier_store.h"

namespace kvsim::runtime {

// One (layer, KV head) as a backend declares it: its tiers' layouts (a TierStore's view; only the
// layout is read) and its slots; capacity 0 for a head not kept in the pool (a streaming head).
struct HeadLayout {
    TierView keys[3], values[3];
    int capacity = 0;
};

// One head inside a pool: its tiers' views at their place in the pool, and its slot codes.
struct PooledHead {
    TierView keys[3], values[3];
    const uint8_t* codes = nullptr;  // per slot: key tier | value tier << 2, or kEmptyCode
    int capacity = 0;
};

// What a slot holds, in one byte: its key tier | value tier << 2, or kEmptyCode. The host's head
// cache writes it, the pool carries it, the kernels read it.
inline constexpr uint8_t kEmptyCode = 0xff;
constexpr uint8_t slot_code(uint8_t key_tier, uint8_t value_tier) {
    return static_cast<uint8_t>(key_tier | value_tier << 2);
}
inline constexpr int kChunkSlots = 256;      // slots one warp attends before its result is merged

// A staged copy: `length` bytes from the staging area into the pool.
struct PoolCopy {
    uint64_t pool_offset;
    uint32_t staged_offset, length;
};

class DevicePool {
public:
    static constexpr std::size_t kStagedBytes = std::size_t{4} << 20, kMaxCopies = 65536;

    explicit DevicePool(const std::vector<HeadLayout>& layouts);
    std::size_t bytes() const { return bytes_; }
    int max_capacity() const { return max_capacity_; }
    int heads() const { return static_cast<int>(layouts_.size()); }
    const HeadLayout& layout(int head) const { return layouts_[head]; }
    // Every head as it lies in a pool that starts at `base`.
    std::vector<PooledHead> heads_at(uint8_t* base) const;

    // Stages head `head`'s slot: its key and value rows from the host views (at the tiers its code
    // names; none for an empty slot), then its code. False when the staging area is full: flush
    // (send staged(), copies(), then clear()) and stage the slot again.
    bool stage(int head, int slot, uint8_t code, const TierView (&keys)[3], const TierView (&values)[3]);
    const std::vector<uint8_t>& staged() const { return staged_; }
    std::size_t staged_bytes() const { return staged_used_; }
    const std::vector<PoolCopy>& copies() const { return copies_; }
    void clear() { copies_.clear(), staged_used_ = 0; }

private:
    struct Offsets {
        std::size_t half[2][3], levels[2][3], scales[2][3], codes;
    };
    std::vector<HeadLayout> layouts_;
    std::vector<Offsets> offsets_;
    std::size_t bytes_ = 0;
    int max_capacity_ = 0;
    std::vector<uint8_t> staged_;
    std::size_t staged_used_ = 0;
    std::vector<PoolCopy> copies_;
};

// What the scatter kernel does, on the host: each copy's bytes into the pool.
void scatter_on_host(uint8_t* pool, const uint8_t* staged, const std::vector<PoolCopy>& copies);

}  // namespace kvsim::runtime
