// Ranks for a search (fit: [ranks]): per (layer, KV head), the key and value ranks of the lowrank
// policy that cut the output error most for the bytes, and per layer the same for a joint latent
// (MLA-style), each fitted to a target; against a uniform rank and KV-head grouping (contiguous,
// and by fitted similarity) at the same bytes.
//
// How: the bases are fitted on the fitting sequences only (cache_math/lowrank.h). A ladder of (key rank,
// value rank) pairs is replayed for every head at once (one lockstep pass over the fitting set for
// the errors; bytes per head follow from the ranks, counted on the held-out set by the same
// arithmetic as the memory metric); then per target one pair per unit by marginal gain
// (search/allocation.h). Every method is then measured on the held-out sequences.
#pragma once
#include <string>
#include <vector>

#include "search/search.h"

namespace kvsim {

// The ranks measured for a latent of n numbers: every rank up to 8, then steps of about a third,
// and n itself.
std::vector<int> rank_ladder(int n);

// Appends one record per target and method and notes; sets outcome.bases to the fitted bases.
void fit_ranks(const FitInput& input, SearchOutcome& outcome);

}  // namespace kvsim
