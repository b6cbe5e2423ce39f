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
#include "policies/mixed.h"

namespace kvsim {

inline constexpr const char* kProfileFormat = "kvsim-profile";
// Version 2 adds where the profile is deployed (deploy, kvpress's prompt_ratios), stateless
// streaming heads and DuoAttention gates, and the lengths its bytes were measured on; a version 1
// profile reads as one deployed in kvsim. Version 3 adds a method per head (mixed); a profile is
// written at the lowest version that holds its keys, so every other profile is still version 2.
inline constexpr int kProfileVersion = 3;
inline constexpr int kMixedProfileVersion = 3;

// deploy duo: the fitted ranking's held-out figure at one DuoAttention sparsity.
struct SparsityPoint {
    double sparsity = 0;       // what to pass DuoAttention: the share of heads that stream
    int streaming_heads = 0;   // how many stream there (DuoAttention's threshold picks that many)
    double heldout = 0;        // output error on the held-out sequences
    double bytes_per_token = 0, compression_ratio = 0;
};

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
    std::optional<MixedPlan> mixed;          // per head, its method and level (policy mixed; version 3)
    // Where the profile is deployed (search.deploy): "kvsim", "kvpress" or "duo".
    std::string deploy = "kvsim";
    // deploy kvpress: how each sequence splits into the prompt compressed once and its
    // continuation, and per layer the share of the prompt removed (kvpress's compression ratio).
    PromptSplit prompt;
    std::vector<double> prompt_ratios;
    // deploy duo: the fitted ranking at a series of sparsities, on the held-out sequences.
    std::vector<SparsityPoint> sparsity_curve;
    // What the search expects and measured: bytes per token of context per (layer, KV head), the
    // compression against a full fp16 cache, and each layer's share of tokens kept.
    double bytes_per_token = 0;
    double compression_ratio = 0;
    std::vector<double> layer_kept_fraction;
    std::string objective;                   // output_rel_error or retained_mass
    double heldout_value = 0;                // the objective on the held-out sequences
    std::vector<std::string> heldout_sequences;
    // The lengths its bytes and figure were measured on, per held-out sequence: its tokens, and
    // (deploy kvpress) its prompt. A budget is a count of tokens: at other lengths the same
    // profile holds other bytes (kvsim run reports them).
    std::vector<int64_t> measured_tokens, measured_prompts;
    // The same plan on the fitting sequences' lengths (budget and kvpress fits; 0 when not
    // measured): a token budget sized for one set of lengths compresses another set differently.
    std::vector<std::string> fitting_sequences;
    std::vector<int64_t> fitting_tokens, fitting_prompts;
    double fitting_bytes_per_token = 0, fitting_compression_ratio = 0;
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

// The budget column a profile replays with: its head budgets (or layer budgets, or kvpress's
// ratios) under its name.
BudgetColumn profile_column(const Profile& profile, const std::string& where);

// Per layer, the prompt tokens kvpress keeps of a prompt of `prompt_length` under the profile's ratios.
std::vector<int> profile_prompt_kept(const Profile& profile, int64_t prompt_length);

// InputError unless `actual` (a trace's or model's shape, described by `what`) is the profile's.
void check_profile_shape(const ModelShape& profile_shape, const std::string& profile_where, const ModelShape& actual,
                         const std::string& what);

}  // namespace kvsim
