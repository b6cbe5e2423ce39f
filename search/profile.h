// A fitted profile: what `kvsim search` writes (profile.json), `kvsim run` and `kvsim eval` replay
// (`policies: [{profile: FILE}]`), `kvsim export` converts, and a serving runtime loads. The
// schema, versioned, is in docs/profile-format.md.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "sim/experiment_spec.h"
#include "cache_math/tier_shares.h"

namespace kvsim {

inline constexpr const char* kProfileFormat = "kvsim-profile";
inline constexpr int kProfileVersion = 1;

struct StreamingHeads {
    int sinks = 4;
    int recent = 64;
    std::vector<uint8_t> heads;      // per (layer, KV head): 1 = streams, 0 = full cache
    std::vector<double> lambda;      // per (layer, KV head), in [0, 1]: the decay of its linear state
    std::vector<uint8_t> stateless;  // per (layer, KV head): 1 = streams with no state; empty: none
    // deploy duo: per (layer, KV head), in [0, 1]: the fitted ranking as DuoAttention gates (the
    // lowest streams first; the streaming heads' below 0.5, the others' above); may be empty.
    std::vector<double> gates;
};

struct Profile {
    std::string name;                        // e.g. "stories260K-h2o-head_budgets-2x"
    ModelShape model;
    std::string policy;                      // the eviction policy whose budgets these are
    std::map<std::string, double> params;    // its parameters (every one, defaults included)
    std::string method;                      // "fitted layer budgets", "fitted head budgets", ...
    std::string target;                      // "2x" or "12.5 bytes/token"
    std::vector<int> layer_budgets;          // per layer (with head budgets: each layer's mean)
    std::vector<int> head_budgets;           // per (layer, KV head), layer * num_kv_heads + kv; may be empty
    std::optional<StreamingHeads> streaming;
    std::optional<TierShares> tiers;         // per-head zone shares of a tiered cache (stratigraphic)
    // What the search expects and measured: bytes per token of context per (layer, KV head), the
    // compression against a full fp16 cache, and each layer's share of tokens kept.
    double bytes_per_token = 0;
    double compression_ratio = 0;
    std::vector<double> layer_kept_fraction;
    std::string objective;                   // output_rel_error or retained_mass
    double heldout_value = 0;                // the objective on the held-out sequences
    std::vector<std::string> heldout_sequences;
    // Provenance.
    std::string trace;
    std::string trace_sha256;
    std::string config;
    std::string config_sha256;
};

// The profile as JSON text, and written to a file (atomically).
std::string profile_json(const Profile& profile);
void write_profile(const Profile& profile, const std::string& path);
// Reads and checks a profile: format and version, shape, every array's length, budgets >= 1,
// lambdas in [0, 1], gates 0 or 1. Bad input is one InputError naming the file and the key.
Profile load_profile(const std::string& path);

// The budget column a profile replays with: its head budgets (or layer budgets) under its name.
BudgetColumn profile_column(const Profile& profile, const std::string& where);

// InputError unless `actual` (a trace's or model's shape, described by `what`) is the profile's.
void check_profile_shape(const ModelShape& profile_shape, const std::string& profile_where, const ModelShape& actual,
                         const std::string& what);

}  // namespace kvsim
