// Tier profiles for a search: per (layer, KV head), the zone shares of the stratigraphic policy
// (FP16, INT8, INT4; the rest evicted) that cut the output error most for the bytes, fitted to a
// target, against the published shares and depth slope scaled to the same bytes.
//
// How: a ladder of candidate share triples, each replayed for every head at once (one lockstep
// pass over the fitting set for the errors, one over the held-out set for the bytes each head
// holds, which depend on how tokens sink and so are measured, not modelled); then per target one
// option per head by marginal gain (search/allocation.h). The published shape is scaled by a
// factor read off the same bytes pass. Both are then measured on the held-out sequences.
#pragma once
#include <array>
#include <functional>
#include <string>
#include <vector>

#include "search/search.h"
#include "cache_math/tier_shares.h"

namespace kvsim {

// Writes {"tiers": ...} where stratigraphic's `profile` parameter reads it; returns the path.
std::string write_tier_plan(const std::string& folder, const std::string& name, const TierShares& shares);

// What the tier fit replays before it chooses: every candidate share triple uniform over the
// heads (each head's options), then the published shape on a ladder of scales (the baseline's).
struct TierFitPlans {
    ParamValues params;  // stratigraphic's, resolved from search.tiers
    std::vector<std::array<double, 3>> candidates;
    std::vector<double> scales;
    std::vector<TierShares> plans;  // the candidates', then the scales'
    double published_sum = 0;       // the published FP16, INT8 and INT4 shares summed
};

// InputError naming search.tiers for parameters stratigraphic refuses.
TierFitPlans tier_fit_plans(const SearchSpec& spec, int num_layers, int num_kv_heads);

// The fit's two big passes, measured by a search's shards (kvsim search --shard) and summed:
// every plan's bytes on the held-out sequences, every candidate's errors on the fitting ones.
struct TierMeasurements {
    std::vector<ComboResult> heldout_bytes;   // per plan of TierOptions
    std::vector<ComboResult> fitting_errors;  // per option
    // Screened (search.screen): per (layer, KV head), its options' candidate indices as the shard
    // that measured its layer screened them (TierOptions::kept), so the merge screens no layer
    // again; empty where the fit does not screen.
    std::vector<std::vector<std::size_t>> kept;
};

// The tier fit's options per (layer, KV head), and the plans that measure them.
struct TierOptions {
    std::vector<std::vector<std::size_t>> kept;  // per head: its options' candidate indices, ascending
    int64_t screen_steps = 0;                    // search.screen's prefix; 0: every candidate an option
    std::vector<TierShares> plans;               // the k-th gives every head its k-th option; then the scales'
};

// Options per head: search.screen.keep where it screens, else every candidate.
std::size_t tier_option_count(const SearchSpec& spec, const TierFitPlans& plans);

// Screened (search.screen): every candidate replayed on the first steps of each fitting sequence
// (of `layers`, or every layer where empty), then per head the options that best describe the
// lower hull of their bytes and error there (screen_options), every share 0 first; the heads of
// layers not screened get the first candidates, a plan's place-holders. Unscreened: every candidate.
// In a merge (input.tier_measured with options), the options the shards screened, screening nothing.
TierOptions tier_options(const FitInput& input, const TierFitPlans& plans, const std::vector<int>& layers,
                         const std::function<void(double)>& progress);

// Replays the fit's cheapest plan (every share 0: a zone only adds tokens kept) on the held-out
// sequences, and returns its result: InputError naming the target when even it holds more bytes
// than the target allows.
ComboResult refuse_unreachable_tier_targets(const FitInput& input, const TierFitPlans& plans);

// `plans` side by side in one lockstep pass over `source` (restricted to `layers` when not empty),
// as the tier fit replays them: one result per plan. `output_error` false measures bytes only.
std::vector<ComboResult> replay_tier_plans(const FitInput& input, const ParamValues& params, AttentionSource& source,
                                           const std::vector<TierShares>& plans, bool output_error,
                                           const std::vector<int>& layers, const std::function<void(double)>& progress);

// Appends one record per target and method ("fitted tier profile", marked to have its profile
// written by run_search; "published shares and slope (scaled xS)"), and notes (the published
// shares unscaled, the fitted shares). With input.tier_measured, its two big passes are read from
// there and only the baselines and the held-out confirmation are replayed.
void fit_tier_profiles(const FitInput& input, SearchOutcome& outcome);

}  // namespace kvsim
