// Profiles in the forms other tools load.
//   duo:    a DuoAttention pattern folder: full_attention_heads.tsv (one row per layer, one
//           tab-separated gate per KV head) and config.json (sink_size, recent_size, sparsity = the
//           share of streaming heads). A profile fitted with deploy: duo writes its gates, the fitted
//           ranking in (0, 1), streaming heads below 0.5, which DuoAttention's loader thresholds by
//           quantile at its --sparsity: at the sparsity written, exactly the fitted heads stream.
//           Its recent_size leaves out the current token, which kvsim's window counts. Any other
//           profile writes 1 = full cache, 0 = streaming, and kvsim's window.
//   ratios: per-layer compression ratios as a JSON list. A profile fitted with deploy: kvpress
//           writes its ratios of the prompt, which kvpress's PerLayerCompressionPress applies as
//           kvsim replayed them (int(prompt * (1 - ratio)) tokens kept per layer); any other, 1 -
//           each layer's decode-time kept share, which means something else in kvpress.
#pragma once
#include <string>

#include "search/profile.h"

namespace kvsim {

// Each returns a line for the user: what the export means in the program that loads it.
// Writes the folder `dir` (created if needed; both files atomically). InputError naming the
// profile when it has no streaming heads.
std::string export_duo_pattern(const Profile& profile, const std::string& profile_path, const std::string& dir);
// Writes the JSON list to `path` (atomically): a kvpress profile's prompt ratios, or else each
// layer's decode-time kept share. InputError when the profile has neither.
std::string export_layer_ratios(const Profile& profile, const std::string& profile_path, const std::string& path);

}  // namespace kvsim
