// One method per (layer, KV head) across the families a search fits (fit: mixed). Each family
// leaves its per-head options in MixedTables as it runs (eviction budgets off the grid replay's
// per-head curves, tier share triples, the head streaming at its fitted lambda or without a
// state); with the full cache beside them, one allocation across every head and option by
// marginal gain on the lower hull (choose_by_marginal_gain) meets each target. Units are
// independent on a trace (a head's output error depends on its own KV head's cache alone), so
// the plan's fitting error is the sum of its options'; the fit checks that by replaying each plan
// on the fitting sequences and comparing head by head, and says so in the notes. Every plan is
// then replayed on the held-out sequences as the `mixed` policy runs it (policies/mixed.h).
// Baselines at the same bytes: the same allocation restricted to two families (with the full
// cache), for every pair the search fitted.
#pragma once
#include "search/search.h"

namespace kvsim {

// Writes {"mixed": ...} where the mixed policy's `profile` parameter reads it; returns the path.
std::string write_mixed_plan(const std::string& folder, const std::string& name, const MixedPlan& plan);

void fit_mixed_heads(const FitInput& input, const MixedTables& tables, SearchOutcome& outcome);

}  // namespace kvsim
