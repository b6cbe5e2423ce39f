// A mixed cache: each (layer, KV head) runs its own method, chosen per head by `kvsim search`
// (fit: mixed): an eviction policy at its own budget, stratigraphic at its own tier shares, a
// streaming head with its own lambda (or no state), or the full cache. The plan is plain data; the
// `mixed` policy builds, per head, the policy its method names, so that tiers, streaming states and
// eviction reach the harness and the runtime through the one mechanism they already share.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "policies/policy.h"

namespace kvsim {

enum class HeadMethod : uint8_t { evict = 0, tiers = 1, streaming = 2, full = 3 };
inline constexpr int kHeadMethods = 4;
std::string_view head_method_name(HeadMethod m);  // "evict", "tiers", "streaming", "full"

struct MixedPlan {
    int num_layers = 0, num_kv_heads = 0;
    std::vector<HeadMethod> method;  // per (layer, KV head), layer-major
    // Eviction heads: the policy, its parameters (every one) and each head's budget (0 elsewhere).
    std::string evict_policy;
    ParamValues evict_params;
    std::vector<int> budgets;
    // Tier heads: stratigraphic's parameters and each head's shares (0 elsewhere).
    ParamValues tier_params;
    std::vector<double> fp16, int8, int4;
    // Streaming heads: the tokens kept exactly, each head's lambda and whether it keeps no state.
    int sinks = 0, recent = 0;
    std::vector<double> lambda;
    std::vector<uint8_t> stateless;

    std::size_t index(int layer, int kv) const { return static_cast<std::size_t>(layer) * num_kv_heads + kv; }
    std::size_t count(HeadMethod m) const;
};

// The plan as the JSON value of a profile's "mixed" key (docs/profile-format.md).
nlohmann::ordered_json mixed_plan_json(const MixedPlan& plan);
// Reads and checks a "mixed" value: one InputError naming `where` (e.g. "FILE: mixed") and the key.
MixedPlan parse_mixed_plan(const nlohmann::json& mixed, int num_layers, int num_kv_heads, const std::string& where);
// The "mixed" key of a JSON file (a profile, or a plan the search writes).
MixedPlan load_mixed_plan(const std::string& path, int num_layers, int num_kv_heads);

// The policy of one (layer, KV head) under a plan (ctx.layer, ctx.kv_head pick the head).
std::unique_ptr<Policy> make_mixed_head(const MixedPlan& plan, const PolicyContext& ctx);

}  // namespace kvsim
