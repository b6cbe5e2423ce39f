// Low-rank bases fitted from a trace file: which keys they are fitted on (before or after RoPE)
// and the pass over a Q/K/V trace's fitting sequences that feeds cache_math/lowrank.h's fitter.
#pragma once
#include <string>
#include <vector>

#include "cache_math/lowrank.h"
#include "sim/trace_store.h"

namespace kvsim {

// Which keys the key bases are fitted on.
struct KeyFrame {
    bool pre_rope = false;  // before RoPE (Palu's way), with RoPE applied after reconstruction
    // For a trace that records no RoPE: the model's RoPE base (adjacent pairs, unscaled); a
    // trace that records its RoPE (every capture since it was added) needs none.
    double rope_theta = 0;
    bool joint = true;  // also fit the joint bases (one per layer over its KV heads concatenated)
};

// The RoPE pre-RoPE key bases of this trace rotate by: the one the trace records, else adjacent
// pairs at `rope_theta`. InputError naming the file when there is neither, when the head size is
// odd, or when a given rope_theta disagrees with the recorded RoPE.
Rope pre_rope_of_trace(const TraceMetadata& metadata, const std::string& path, double rope_theta);

// Fits bases on `sequences` (indices into the trace file; empty: every one) of a Q/K/V trace,
// every token of every layer: InputError naming the file where it records attention only. Pre-RoPE
// keys come from the trace's k_pre_rope where it records them.
KvBases fit_kv_bases(const std::string& trace_path, const std::vector<int>& sequences, const KeyFrame& keys = {});

}  // namespace kvsim
