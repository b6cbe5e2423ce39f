// How coarsely a cache holds a token: its tier (FP16, INT8, INT4) and the quantisation format
// behind the INT8 and INT4 tiers. Shared by the policies that choose tiers, the simulator that
// replays them and the runtime that stores them.
#pragma once
#include <cstdint>

namespace kvsim {

// How precisely a cached position's key or value is held. Eviction decides which positions stay;
// tiers decide how coarsely, and compose with any eviction policy (policies/quantized.cpp).
enum class Tier : uint8_t { fp16 = 0, int8 = 1, int4 = 2 };

// The quantisation behind the int8 and int4 tiers of a policy (cache_math/quantize.h does the numerics).
struct TierFormat {
    int key_group = 128;          // KIVI keys: tokens sharing a per-channel scale
    int value_group = 128;        // channels sharing a per-token scale
    bool per_token_keys = false;  // keys per token like values (for token-level tiering)
    bool int4_from_int8 = false;  // int4 tokens are requantised from their int8 form (they sank there)
    int int8_key_group = 0, int8_value_group = 0;  // 0: the same groups as int4
    bool operator==(const TierFormat&) const = default;
};

}  // namespace kvsim
