// The CUDA backend's pieces that run on the host: TierView (how the kernels read a row) against
// TierStore::read, and the device pool's layout and staging, scattered into host memory as the
// scatter kernel does. The whole backend is checked in test_runtime.cpp, with its device done on
// the host everywhere and on a GPU where one is present.
#include <doctest/doctest.h>

#include <random>
#include <string>
#include <vector>

#include "runtime/cuda_attention.h"
#include "runtime/device_pool.h"
#include "runtime/tier_store.h"

using namespace kvsim;
using namespace kvsim::runtime;

namespace {

// Every slot held at every tier, added last slot first: a host store packs its rows in the order
// slots arrive, so slot s is not at row s (the device pool's layout) and staging must map them.
void fill(TierStore (&stores)[3], int rows, int d, int group, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> row(d);
    for (int tier = 0; tier < 3; ++tier) {
        stores[tier].plan(tier, rows, d, group);
        for (int slot = rows - 1; slot >= 0; --slot) {
            for (float& x : row) x = normal(rng);
            stores[tier].add(slot);
            stores[tier].write(slot, row.data());
        }
    }
}

}  // namespace

TEST_CASE("TierView reads every tier as TierStore::read does, bit for bit") {
    std::mt19937 rng(7);
    for (const auto& shape : {std::pair{128, 32}, std::pair{8, 8}, std::pair{67, 16}, std::pair{64, 64}}) {
        const int d = shape.first, group = shape.second;  // not a structured binding: clang 14 cannot capture one
        TierStore stores[3];
        fill(stores, 9, d, group, rng);
        std::vector<float> row(d);
        for (int tier = 0; tier < 3; ++tier)
            for (int r = 0; r < 9; ++r) {
                stores[tier].read(r, row.data());
                const TierView view = stores[tier].view();
                for (int c = 0; c < d; ++c) {
                    INFO("head size " << d << ", group " << group << ", tier " << tier << ", row " << r << ", channel " << c);
                    REQUIRE(view.element(r, c) == row[c]);
                }
            }
    }
}

TEST_CASE("device pool: staged slots land where the pool's views read them") {
    std::mt19937 rng(9);
    const int d = 24, heads = 3;
    std::vector<int> capacity = {5, 0, 11};  // the middle head is not kept (a streaming head)
    TierStore keys[3][3], values[3][3];
    std::vector<HeadLayout> layouts(heads);
    for (int u = 0; u < heads; ++u) {
        fill(keys[u], std::max(capacity[u], 1), d, 8, rng);
        fill(values[u], std::max(capacity[u], 1), d, 12, rng);
        for (int tier = 0; tier < 3; ++tier) layouts[u].keys[tier] = keys[u][tier].view(), layouts[u].values[tier] = values[u][tier].view();
        layouts[u].capacity = capacity[u];
    }
    DevicePool pool(layouts);
    CHECK(pool.max_capacity() == 11);
    std::vector<uint8_t> memory(pool.bytes(), kEmptyCode);
    const std::vector<PooledHead> pooled = pool.heads_at(memory.data());
    CHECK(pooled[1].capacity == 0);

    // Stage every slot of heads 0 and 2 at some (key tier, value tier), one slot left empty.
    std::vector<std::vector<uint8_t>> codes(heads);
    for (int u : {0, 2}) {
        TierView k[3], v[3];
        for (int tier = 0; tier < 3; ++tier) k[tier] = keys[u][tier].view(), v[tier] = values[u][tier].view();
        for (int slot = 0; slot < capacity[u]; ++slot) {
            const uint8_t code = slot == 3 ? kEmptyCode : slot_code(slot % 3, slot / 3 % 3);
            codes[u].push_back(code);
            REQUIRE(pool.stage(u, slot, code, k, v));
        }
    }
    scatter_on_host(memory.data(), pool.staged().data(), pool.copies());
    pool.clear();
    CHECK(pool.copies().empty());
    std::vector<float> row(d);
    for (int u : {0, 2})
        for (int slot = 0; slot < capacity[u]; ++slot) {
            INFO("head " << u << ", slot " << slot);
            REQUIRE(pooled[u].codes[slot] == codes[u][slot]);
            if (codes[u][slot] == kEmptyCode) continue;
            const int key_tier = codes[u][slot] & 3, value_tier = codes[u][slot] >> 2;
            keys[u][key_tier].read(slot, row.data());
            for (int c = 0; c < d; ++c) REQUIRE(pooled[u].keys[key_tier].element(slot, c) == row[c]);
            values[u][value_tier].read(slot, row.data());
            for (int c = 0; c < d; ++c) REQUIRE(pooled[u].values[value_tier].element(slot, c) == row[c]);
        }
}

TEST_CASE("cuda: without a device, the backend refuses in one line saying why") {
    std::string why;
    if (cuda::device_available(why)) {
        MESSAGE("a CUDA device is present: checked against the CPU in test_runtime.cpp");
        return;
    }
    CHECK_FALSE(why.empty());
    std::string error;
    CHECK(cuda::DeviceCache::create({}, 1, 1, 8, error) == nullptr);
    CHECK(error == "backend 'cuda': " + why);
}
