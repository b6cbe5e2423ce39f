// Profiles in the forms other tools load.
//   duo:    a DuoAttention pattern folder: full_attention_heads.tsv (one row per layer, one
//           tab-separated gate per KV head, 1 = retrieval head with its full cache, 0 = streaming
//           head) and config.json (sink_size, recent_size, sparsity = the share of streaming heads).
//   ratios: per-layer compression ratios as a JSON list, the share of each layer's KV pairs a
//           per-layer compression wrapper removes (0 keeps all): 1 - the layer's kept share of
//           tokens over the sequences the profile was measured on.
#pragma once
#include <string>

#include "search/profile.h"

namespace kvsim {

// Writes the folder `dir` (created if needed; both files atomically). InputError naming the
// profile when it has no streaming heads.
void export_duo_pattern(const Profile& profile, const std::string& profile_path, const std::string& dir);
// Writes the JSON list to `path` (atomically). InputError when the profile lacks kept shares.
void export_layer_ratios(const Profile& profile, const std::string& profile_path, const std::string& path);

}  // namespace kvsim
