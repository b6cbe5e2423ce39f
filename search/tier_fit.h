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
#include <string>

#include "search/search.h"
#include "cache_math/tier_shares.h"

namespace kvsim {

// Writes {"tiers": ...} where stratigraphic's `profile` parameter reads it; returns the path.
std::string write_tier_plan(const std::string& folder, const std::string& name, const TierShares& shares);

// Appends one record per target and method ("fitted tier profile", marked to have its profile
// written by run_search; "published shares and slope (scaled xS)"), and notes (the published
// shares unscaled, the fitted shares).
void fit_tier_profiles(const FitInput& input, SearchOutcome& outcome);

}  // namespace kvsim
