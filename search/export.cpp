#include "search/export.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/output_folder.h"

namespace kvsim {

std::string export_duo_pattern(const Profile& profile, const std::string& profile_path, const std::string& dir) {
    if (!profile.streaming)
        throw InputError(profile_path + ": streaming: missing; --format duo needs streaming heads (a profile "
                                        "fitted with fit: [streaming])");
    const StreamingHeads& s = *profile.streaming;
    const int L = profile.model.num_layers, K = profile.model.num_kv_heads;
    // deploy duo: the fitted ranking as gates (DuoAttention re-thresholds them by quantile at its
    // --sparsity), and DuoAttention's recent_size, which leaves out the current token that kvsim's
    // window counts. Otherwise the heads as 0/1 gates and kvsim's window, as fitted in kvsim.
    const bool duo = profile.deploy == "duo";
    std::string tsv;
    int streaming = 0;
    for (int l = 0; l < L; ++l) {
        for (int kv = 0; kv < K; ++kv) {
            const std::size_t u = static_cast<std::size_t>(l) * K + kv;
            const bool streams = s.heads.at(u) != 0;
            streaming += streams;
            tsv += kv ? "\t" : "";
            if (duo) {
                tsv += nlohmann::json(s.gates.at(u)).dump();  // the shortest text that reads back exactly
            } else {
                tsv += streams ? "0" : "1";
            }
        }
        tsv += "\n";
    }
    const double sparsity = static_cast<double>(streaming) / (static_cast<double>(L) * K);
    nlohmann::ordered_json config = {{"sink_size", s.sinks},
                                     {"recent_size", duo ? s.recent - 1 : s.recent},
                                     {"sparsity", sparsity}};
    FolderCommit files(dir);  // the two files change together (base/output_folder.h)
    files.add("full_attention_heads.tsv", tsv);
    files.add("config.json", config.dump(2) + "\n");
    files.commit();
    const std::string given = nlohmann::json(sparsity).dump();
    if (duo)
        return "DuoAttention ignores the sparsity in config.json and re-thresholds the gates at its --sparsity: pass "
               "--sparsity " + given + " for the " + std::to_string(streaming) + " of " + std::to_string(L * K) +
               " heads fitted to stream (the profile's sparsity_curve has the figure at others)";
    return "fitted in kvsim: DuoAttention re-thresholds these 0/1 gates at its --sparsity (pass " + given +
           ") and runs its streaming heads without a state; fit with search.deploy: duo for its semantics";
}

std::string export_layer_ratios(const Profile& profile, const std::string& profile_path, const std::string& path) {
    if (!profile.prompt_ratios.empty()) {  // deploy kvpress: the fitted ratios, which kvpress applies as fitted
        nlohmann::json ratios = profile.prompt_ratios;
        write_file_atomically(path, ratios.dump() + "\n");
        std::string note = "kvpress ratios of each layer's prompt (PerLayerCompressionPress); kept tokens per layer";
        std::vector<int64_t> prompts = profile.measured_prompts;
        std::sort(prompts.begin(), prompts.end());
        prompts.erase(std::unique(prompts.begin(), prompts.end()), prompts.end());
        for (int64_t prompt : prompts) {
            note += std::string(prompt == prompts.front() ? ": " : "; ") + "prompt " + std::to_string(prompt) + ":";
            for (int kept : profile_prompt_kept(profile, prompt)) note += " " + std::to_string(kept);
        }
        return note;
    }
    if (profile.layer_kept_fraction.size() != static_cast<std::size_t>(profile.model.num_layers))
        throw InputError(profile_path + ": expected.layer_kept_fraction: missing; --format ratios needs each "
                                        "layer's kept share (kvsim search writes it)");
    nlohmann::json ratios = nlohmann::json::array();
    for (double kept : profile.layer_kept_fraction) ratios.push_back(1.0 - kept);
    write_file_atomically(path, ratios.dump() + "\n");
    return "kvsim's decode-time shares, not kvpress's: kvpress removes a ratio of the prompt once, at prefill, "
           "and keeps more; fit with search.deploy: kvpress for ratios that keep in kvpress what kvsim measured";
}

}  // namespace kvsim
