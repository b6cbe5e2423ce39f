// Per-(layer, KV head) zone shares of a tiered cache: the share of the tokens seen that a head
// keeps at FP16, INT8 and INT4 (the rest is evicted). What a tier search fits, what a profile
// carries under `tiers`, and what the stratigraphic policy's `profile` parameter reads.
#pragma once
#include <string>
#include <vector>

namespace kvsim {

struct TierShares {
    int num_layers = 0, num_kv_heads = 0;
    std::vector<double> fp16, int8, int4;  // each [layer * num_kv_heads + kv], in [0, 1], summing to <= 1

    std::size_t index(int layer, int kv) const { return static_cast<std::size_t>(layer) * num_kv_heads + kv; }
};

// The shares of a kvsim profile.json or a YAML file, both under a `tiers` map with keys fp16,
// int8 and int4, each num_layers rows of num_kv_heads numbers. Throws InputError, one line naming
// the file and the key: a missing key, a shape that disagrees with the trace or model, a share
// outside [0, 1], or a head whose shares sum past 1.
TierShares load_tier_shares(const std::string& path, int num_layers, int num_kv_heads);

// The same checks on shares already in memory; `where` prefixes the error ("FILE: tiers").
void check_tier_shares(const TierShares& shares, const std::string& where);

// The `tiers` object as JSON text: {"fp16": [[...], ...], "int8": ..., "int4": ...}.
std::string tier_shares_json(const TierShares& shares);

}  // namespace kvsim
