#include "search/export.h"

#include <nlohmann/json.hpp>

#include <filesystem>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/output_folder.h"

namespace kvsim {

void export_duo_pattern(const Profile& profile, const std::string& profile_path, const std::string& dir) {
    if (!profile.streaming)
        throw InputError(profile_path + ": streaming: missing; --format duo needs streaming heads (a profile "
                                        "fitted with fit: [streaming])");
    const StreamingHeads& s = *profile.streaming;
    const int L = profile.model.num_layers, K = profile.model.num_kv_heads;
    std::string tsv;
    int streaming = 0;
    for (int l = 0; l < L; ++l) {
        for (int kv = 0; kv < K; ++kv) {
            const bool streams = s.heads.at(static_cast<std::size_t>(l) * K + kv) != 0;
            streaming += streams;
            tsv += (kv ? "\t" : "") + std::string(streams ? "0" : "1");
        }
        tsv += "\n";
    }
    nlohmann::ordered_json config = {{"sink_size", s.sinks},
                                     {"recent_size", s.recent},
                                     {"sparsity", static_cast<double>(streaming) / (static_cast<double>(L) * K)}};
    FolderCommit files(dir);  // the two files change together (base/output_folder.h)
    files.add("full_attention_heads.tsv", tsv);
    files.add("config.json", config.dump(2) + "\n");
    files.commit();
}

void export_layer_ratios(const Profile& profile, const std::string& profile_path, const std::string& path) {
    if (profile.layer_kept_fraction.size() != static_cast<std::size_t>(profile.model.num_layers))
        throw InputError(profile_path + ": expected.layer_kept_fraction: missing; --format ratios needs each "
                                        "layer's kept share (kvsim search writes it)");
    nlohmann::json ratios = nlohmann::json::array();
    for (double kept : profile.layer_kept_fraction) ratios.push_back(1.0 - kept);
    write_file_atomically(path, ratios.dump() + "\n");
}

}  // namespace kvsim
