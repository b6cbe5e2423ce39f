#include "runtime/device_pool.h"

#include <algorithm>

namespace kvsim::runtime {
namespace {
std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }

// A slot's row in one of a tier's arrays. A tier lacks some arrays (FP16 has no levels or scales,
// INT8 and INT4 no halves): their base is null, their row is 0 bytes, and null + offset would be
// undefined behaviour, so such a row has no address at all.
template <class T>
const void* row_at(const T* base, std::size_t offset, std::size_t row_bytes) {
    return row_bytes ? base + offset : nullptr;
}

}  // namespace

DevicePool::DevicePool(const std::vector<HeadLayout>& layouts) : layouts_(layouts), offsets_(layouts.size()) {
    for (std::size_t u = 0; u < layouts.size(); ++u) {
        const std::size_t capacity = static_cast<std::size_t>(layouts[u].capacity);
        Offsets& o = offsets_[u];
        for (int side = 0; side < 2; ++side)
            for (int tier = 0; tier < 3; ++tier) {
                const TierView& view = side == 0 ? layouts[u].keys[tier] : layouts[u].values[tier];
                o.half[side][tier] = bytes_, bytes_ += align16(capacity * view.half_row_bytes());
                o.levels[side][tier] = bytes_, bytes_ += align16(capacity * view.level_row_bytes());
                o.scales[side][tier] = bytes_, bytes_ += align16(capacity * view.scale_row_bytes());
            }
        o.codes = bytes_, bytes_ += align16(capacity);
        max_capacity_ = std::max(max_capacity_, layouts[u].capacity);
    }
    bytes_ = std::max<std::size_t>(bytes_, 16);
    staged_.resize(kStagedBytes);
    copies_.reserve(kMaxCopies);
}

std::vector<PooledHead> DevicePool::heads_at(uint8_t* base) const {
    std::vector<PooledHead> heads(layouts_.size());
    for (std::size_t u = 0; u < layouts_.size(); ++u) {
        const Offsets& o = offsets_[u];
        for (int side = 0; side < 2; ++side)
            for (int tier = 0; tier < 3; ++tier) {
                TierView view = side == 0 ? layouts_[u].keys[tier] : layouts_[u].values[tier];
                view.half = reinterpret_cast<const uint16_t*>(base + o.half[side][tier]);
                view.levels = base + o.levels[side][tier];
                view.scales = reinterpret_cast<const uint16_t*>(base + o.scales[side][tier]);
                view.row_of_slot = nullptr;  // the pool keeps slot s at row s
                (side == 0 ? heads[u].keys : heads[u].values)[tier] = view;
            }
        heads[u].codes = base + o.codes;
        heads[u].capacity = layouts_[u].capacity;
    }
    return heads;
}

bool DevicePool::stage(int head, int slot, uint8_t code, const TierView (&keys)[3], const TierView (&values)[3]) {
    const Offsets& o = offsets_[head];
    const std::size_t s = static_cast<std::size_t>(slot);
    struct Piece {
        uint64_t pool_offset;
        const void* from;
        std::size_t length;
    };
    Piece pieces[7];
    int count = 0;
    if (code != kEmptyCode)
        for (int side = 0; side < 2; ++side) {
            const int tier = side == 0 ? code & 3 : code >> 2;
            const TierView& v = side == 0 ? keys[tier] : values[tier];
            const std::size_t r = v.row(slot);  // where the host holds the slot's row
            pieces[count++] = {o.half[side][tier] + s * v.half_row_bytes(), row_at(v.half, r * v.head_dim, v.half_row_bytes()),
                               v.half_row_bytes()};
            pieces[count++] = {o.levels[side][tier] + s * v.level_row_bytes(),
                               row_at(v.levels, r * v.row_bytes, v.level_row_bytes()), v.level_row_bytes()};
            pieces[count++] = {o.scales[side][tier] + s * v.scale_row_bytes(),
                               row_at(v.scales, r * v.groups, v.scale_row_bytes()), v.scale_row_bytes()};
        }
    pieces[count++] = {o.codes + s, &code, 1};
    // A slot goes whole or not at all.
    std::size_t need = 0;
    for (int i = 0; i < count; ++i) need += pieces[i].length;
    if (staged_used_ + need > staged_.size() || copies_.size() + count > kMaxCopies) return false;
    for (int i = 0; i < count; ++i) {
        if (pieces[i].length == 0) continue;
        std::copy_n(static_cast<const uint8_t*>(pieces[i].from), pieces[i].length, staged_.data() + staged_used_);
        copies_.push_back(PoolCopy{pieces[i].pool_offset, static_cast<uint32_t>(staged_used_),
                                   static_cast<uint32_t>(pieces[i].length)});
        staged_used_ += pieces[i].length;
    }
    return true;
}

void scatter_on_host(uint8_t* pool, const uint8_t* staged, const std::vector<PoolCopy>& copies) {
    for (const PoolCopy& c : copies) std::copy_n(staged + c.staged_offset, c.length, pool + c.pool_offset);
}

}  // namespace kvsim::runtime
