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
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "search/search.h"

namespace kvsim {

// The ranks measured for a latent of n numbers: every rank up to 8, then steps of about a third,
// and n itself.
std::vector<int> rank_ladder(int n);

// How many plans the fit replays on the fitting sequences before it chooses: every (key rank,
// value rank) pair of the per-KV-head ladder, then of the joint (per layer) ladder.
std::size_t rank_fit_plan_count(int head_dim, int num_kv_heads);

// The fit's bases, from the fitting sequences only, written as HDF5 at `path` for the lowrank plans
// to read (the same numbers, float64, whatever form the search writes them in).
std::shared_ptr<KvBases> fit_rank_bases(const FitInput& input, const std::string& path);

// Plans `plans` (indices as counted above) side by side in one lockstep pass over the fitting
// sequences, restricted to `layers` when not empty, reading the bases at `bases_path`.
std::vector<ComboResult> replay_rank_plans(const FitInput& input, const std::string& bases_path,
                                           const std::vector<std::size_t>& plans, const std::vector<int>& layers,
                                           const std::function<void(double)>& progress);

// Appends one record per target and method and notes; sets outcome.bases to the fitted bases.
// With input.rank_measured, the fitting pass over every plan is read from there.
void fit_ranks(const FitInput& input, SearchOutcome& outcome);

}  // namespace kvsim
