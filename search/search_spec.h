// What `kvsim search` is asked to fit: the config's `search:` section, as plain data.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "sim/experiment_spec.h"

namespace kvsim {

// A memory target: a compression ratio against the full fp16 cache, or bytes per token of
// context per (layer, KV head), counted as kvsim's bytes_per_token metric counts them.
struct SearchTarget {
    double compression = 0;      // > 0: "2x"
    double bytes_per_token = 0;  // > 0: {bytes_per_token: N}
    std::string label;           // "2x" or "12.5B"
    std::string where;           // "FILE:LINE: search.target[0]"
    // The target in bytes per token, given what a full fp16 cache holds per token (4 * head size).
    double bytes(double full_fp16_bytes_per_token) const {
        return compression > 0 ? full_fp16_bytes_per_token / compression : bytes_per_token;
    }
};

// Where a fitted profile is deployed: what kvsim replays and fits it under, and the byte model.
//   kvsim:   kvsim's runtime: decode-time eviction at every step, tiers, streaming heads with or
//            without a linear state; bytes count the policy's bookkeeping.
//   kvpress: NVIDIA's kvpress: the prompt compressed once, at its end, by a press keeping a share of
//            each layer's prompt tokens (per-layer ratios); decoding then appends without eviction;
//            the continuation is measured; bytes are K and V alone.
//   duo:     DuoAttention: streaming heads hold their sinks and recent window only, every other head
//            its whole cache; bytes are K and V alone.
inline const std::vector<std::string>& known_deploy_targets() {
    static const std::vector<std::string> targets = {"kvsim", "kvpress", "duo"};
    return targets;
}

struct SearchSpec {
    std::string where;                  // "FILE:LINE: search"
    std::string deploy = "kvsim";       // one of known_deploy_targets()
    std::string deploy_where;
    PromptSplit prompt;                 // deploy kvpress: each sequence's prompt and continuation
    std::string prompt_where;
    PolicyEntry policy;                 // the eviction policy whose budgets are fitted
    // Held-out sequences by index, or a fraction of them drawn with a seed (deterministic).
    std::vector<int> heldout;
    double heldout_fraction = 0.4;
    uint64_t seed = 1;
    std::string split_where;
    std::vector<SearchTarget> targets;
    std::string objective;              // output_rel_error or retained_mass; "" for the trace's default
    std::string objective_where;
    // sample: output error measured on this share of each stream's decode steps (1: every step),
    // one step drawn from each of as many runs of consecutive steps (sim/step_sample.h) by
    // sample_seed; every figure then carries a 95% interval.
    double sample_steps = 1.0;
    uint64_t sample_seed = 1;
    std::string sample_where;
    // screen: the tier fit's candidates first replayed on the first screen_steps decode steps of
    // each fitting sequence; per head, the screen_keep nearest its lower hull of bytes and error
    // (the whole hull at least) go on to the full passes. 0: every candidate replayed in full.
    int64_t screen_steps = 0;
    int screen_keep = 10;
    std::string screen_where;
    std::vector<std::string> fits = {"layer_budgets", "head_budgets"};
    std::string fits_where;
    std::vector<int> grid;              // budgets measured per unit; empty: chosen from the trace
    std::string grid_where;
    // coarse_grid: the budget fits first measure every coarse_grid-th grid budget (and the last),
    // then, a quarter of the stride each pass, only the budgets beside what each fit and baseline
    // chose. 0: every grid budget measured.
    int coarse_grid = 0;
    std::string coarse_grid_where;
    // fit: streaming: the tokens a streaming head keeps exactly.
    int streaming_sinks = 4;
    int streaming_recent = 64;
    std::string streaming_where;
    // A DuoAttention pattern file (full_attention_heads.tsv) to compare with: its gates rank the
    // heads that stream; empty: no such baseline.
    std::string streaming_pattern;
    // fit: tiers: stratigraphic's parameters (sinks, recent, anchors; surface, slope, int8_share
    // and int4_share shape the published baseline), as given; defaults fill the rest.
    std::map<std::string, double> tier_params;
    std::string tiers_where;
    // fit: ranks: {pre_rope: true} fits key bases before RoPE with the RoPE the trace records;
    // pre_rope_theta (which implies pre_rope) gives the base for a trace that records none.
    bool ranks_pre_rope = false;
    double ranks_pre_rope_theta = 0;
    // The form of the bases file the search writes: "json", "hdf5", or "auto": HDF5 when the bases
    // hold more than kAutoHdf5BasesNumbers numbers (JSON spends about 24 bytes a number, HDF5 9).
    std::string ranks_bases_format = "auto";
};

inline const std::vector<std::string>& known_search_fits() {
    static const std::vector<std::string> fits = {"layer_budgets", "head_budgets", "streaming", "tiers", "ranks", "mixed"};
    return fits;
}

}  // namespace kvsim
