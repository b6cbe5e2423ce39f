#include "src/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <set>

#include "policies/policy.h"
#include "search/profile.h"
#include "base/errors.h"
#include "base/input_file.h"

namespace kvsim {
namespace {

std::string resolve_against(const std::string& config_path, const std::string& relative);

class ConfigParser {
public:
    explicit ConfigParser(std::string file) : file_(std::move(file)) {}

    [[noreturn]] void fail(const YAML::Node& node, const std::string& key, const std::string& what) const {
        std::string where = file_;
        if (node.IsDefined() && node.Mark().line >= 0) where += ":" + std::to_string(node.Mark().line + 1);
        throw InputError(where + ": " + (key.empty() ? "" : key + ": ") + what);
    }
    std::string where(const YAML::Node& node, const std::string& key) const {
        std::string w = file_;
        if (node.IsDefined() && node.Mark().line >= 0) w += ":" + std::to_string(node.Mark().line + 1);
        return w + ": " + key;
    }

    double number(const YAML::Node& node, const std::string& key) const {
        if (!node.IsScalar()) fail(node, key, "expected a number");
        const std::string text = node.Scalar();
        double value = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value))
            fail(node, key, "expected a number, got '" + text + "'");
        return value;
    }

    // An integer in [min_value, max_value], checked before it is narrowed to any smaller type.
    int64_t integer(const YAML::Node& node, const std::string& key, int64_t min_value, int64_t max_value) const {
        const double value = number(node, key);
        if (value != std::floor(value)) fail(node, key, "expected an integer, got " + node.Scalar());
        if (value < static_cast<double>(min_value))
            fail(node, key, "must be >= " + std::to_string(min_value) + ", got " + node.Scalar());
        if (value > static_cast<double>(max_value))
            fail(node, key, node.Scalar() + " is too large (at most " + std::to_string(max_value) + ")");
        return static_cast<int64_t>(value);
    }
    int int32(const YAML::Node& node, const std::string& key, int min_value, int max_value) const {
        return static_cast<int>(integer(node, key, min_value, max_value));
    }

    std::string string(const YAML::Node& node, const std::string& key) const {
        if (!node.IsScalar()) fail(node, key, "expected a string");
        return node.Scalar();
    }

    bool boolean(const YAML::Node& node, const std::string& key) const {
        bool value = false;
        if (!node.IsScalar() || !YAML::convert<bool>::decode(node, value)) fail(node, key, "expected true or false");
        return value;
    }

    // Checks a map's keys against the allowed ones.
    void only_keys(const YAML::Node& map, const std::string& key, const std::set<std::string>& allowed) const {
        if (!map.IsMap()) fail(map, key, "expected a map");
        for (const auto& item : map) {
            const std::string name = item.first.as<std::string>();
            if (!allowed.count(name)) {
                std::string known;
                for (const auto& a : allowed) known += (known.empty() ? "" : ", ") + a;
                fail(item.first, key.empty() ? name : key + "." + name, "unknown key (known: " + known + ")");
            }
        }
    }

    // A list item that is a name, or a one-key map from the name to its options.
    std::pair<std::string, YAML::Node> named_item(const YAML::Node& item, const std::string& key) const {
        if (item.IsScalar()) return {item.Scalar(), YAML::Node()};
        if (item.IsMap() && item.size() == 1) {
            const auto entry = *item.begin();
            return {string(entry.first, key), entry.second};
        }
        fail(item, key, "expected a name, or a one-key map from a name to its parameters");
    }

    // A per-layer budget profile: a non-empty list of budgets >= 1.
    BudgetColumn layer_profile(const YAML::Node& list, const std::string& key, std::string label) const {
        if (!list.IsSequence() || list.size() == 0) fail(list, key, "expected a non-empty list of per-layer budgets");
        std::vector<int> budgets;
        for (std::size_t i = 0; i < list.size(); ++i)
            budgets.push_back(int32(list[i], key + "[" + std::to_string(i) + "]", 1, kMaxBudgetTokens));
        return profile_budget_column(std::move(label), where(list, key), std::move(budgets));
    }

    // search: {policy, split, target, objective, fit, grid}
    SearchSpec search_spec(const YAML::Node& node) const {
        SearchSpec spec;
        spec.where = where(node, "search");
        only_keys(node, "search", {"policy", "split", "target", "objective", "fit", "grid", "streaming", "tiers", "ranks",
                                   "deploy", "prompt", "sample", "screen", "coarse_grid"});
        spec.deploy_where = spec.where;
        if (const YAML::Node deploy = node["deploy"]) {
            spec.deploy = string(deploy, "search.deploy");
            spec.deploy_where = where(deploy, "search.deploy");
            const auto& known = known_deploy_targets();
            if (std::find(known.begin(), known.end(), spec.deploy) == known.end())
                fail(deploy, "search.deploy", "unknown target '" + spec.deploy + "' (kvsim, kvpress or duo)");
            if (spec.deploy == "kvpress") spec.fits = {"layer_budgets"};
            if (spec.deploy == "duo") spec.fits = {"streaming"};
        }
        spec.prompt_where = spec.where;
        if (const YAML::Node prompt = node["prompt"]) {
            spec.prompt_where = where(prompt, "search.prompt");
            if (spec.deploy != "kvpress")
                fail(prompt, "search.prompt",
                     "splits each sequence into a prompt compressed once and its continuation, for deploy: kvpress; "
                     "this search deploys to " + spec.deploy);
            if (!prompt.IsMap() || prompt.size() != 1 || !(prompt["tokens"] || prompt["continuation"]))
                fail(prompt, "search.prompt", "expected {tokens: N} (the first N of every sequence) or {continuation: N} "
                                              "(all but the last N)");
            if (prompt["tokens"])
                spec.prompt.tokens = int32(prompt["tokens"], "search.prompt.tokens", 2, kMaxSequenceTokens);
            else
                spec.prompt.continuation = int32(prompt["continuation"], "search.prompt.continuation", 1, kMaxSequenceTokens);
        } else if (spec.deploy == "kvpress") {
            fail(node, "search", "deploy: kvpress needs key 'prompt': how each sequence splits into the prompt kvpress "
                                 "compresses and the continuation measured, e.g. prompt: {continuation: 64}");
        }
        if (const YAML::Node ranks = node["ranks"]) {  // fit: ranks: {pre_rope: true} fits keys before RoPE
            if (!ranks.IsMap()) fail(ranks, "search.ranks", "expected a map, e.g. {pre_rope: true}");
            only_keys(ranks, "search.ranks", {"pre_rope", "pre_rope_theta", "bases_format"});
            if (const YAML::Node format = ranks["bases_format"]) {
                spec.ranks_bases_format = format.IsScalar() ? format.as<std::string>() : "";
                if (spec.ranks_bases_format != "auto" && spec.ranks_bases_format != "json" &&
                    spec.ranks_bases_format != "hdf5")
                    fail(format, "search.ranks.bases_format", "must be auto, json or hdf5");
            }
            if (const YAML::Node pre = ranks["pre_rope"]) spec.ranks_pre_rope = boolean(pre, "search.ranks.pre_rope");
            if (const YAML::Node theta = ranks["pre_rope_theta"]) {
                spec.ranks_pre_rope_theta = number(theta, "search.ranks.pre_rope_theta");
                if (!(spec.ranks_pre_rope_theta > 0))
                    fail(theta, "search.ranks.pre_rope_theta", "must be a positive number (the model's RoPE base)");
                if (ranks["pre_rope"] && !spec.ranks_pre_rope)
                    fail(theta, "search.ranks.pre_rope_theta", "is a RoPE base for pre_rope keys, but pre_rope is false");
                spec.ranks_pre_rope = true;
            }
        }
        spec.tiers_where = spec.where + ".tiers";
        if (const YAML::Node tiers = node["tiers"]) {  // stratigraphic's parameters for fit: tiers
            spec.tiers_where = where(tiers, "search.tiers");
            if (!tiers.IsMap()) fail(tiers, "search.tiers", "expected a map of stratigraphic parameters, e.g. {recent: 16}");
            for (const auto& kv : tiers) {
                const std::string param = string(kv.first, "search.tiers");
                if (param == "profile") fail(kv.second, "search.tiers.profile", "the tier search writes the profile; it reads none");
                spec.tier_params[param] = number(kv.second, "search.tiers." + param);
            }
        }
        spec.streaming_where = spec.where + ".streaming";
        if (const YAML::Node streaming = node["streaming"]) {
            spec.streaming_where = where(streaming, "search.streaming");
            only_keys(streaming, "search.streaming", {"sinks", "recent", "pattern"});
            if (streaming["pattern"])
                spec.streaming_pattern = resolve_against(file_, string(streaming["pattern"], "search.streaming.pattern"));
            if (streaming["sinks"]) spec.streaming_sinks = int32(streaming["sinks"], "search.streaming.sinks", 0, kMaxBudgetTokens);
            if (streaming["recent"])
                spec.streaming_recent = int32(streaming["recent"], "search.streaming.recent", 1, kMaxBudgetTokens);
        }
        const YAML::Node policy = node["policy"];
        // Streaming heads alone (DuoAttention's, say) evict by no policy: then it may be left out.
        const bool streaming_only = spec.deploy == "duo" || (node["fit"] && node["fit"].IsSequence() &&
                                                             node["fit"].size() == 1 && node["fit"][0].IsScalar() &&
                                                             node["fit"][0].Scalar() == "streaming");
        if (!policy && !streaming_only)
            fail(node, "search", spec.deploy == "kvpress"
                                     ? "missing key 'policy' (the kvpress press whose per-layer ratios are fitted, e.g. "
                                       "{snapkv_press: {window_size: 64}})"
                                     : "missing key 'policy' (the eviction policy whose budgets are fitted)");
        auto [name, params] = policy ? named_item(policy, "search.policy") : std::pair<std::string, YAML::Node>{};
        spec.policy.where = spec.where + ".policy";
        if (policy) {
        spec.policy.name = name;
        spec.policy.where = where(policy, "search.policy." + name);
        if (params && !params.IsNull()) {
            if (!params.IsMap()) fail(params, "search.policy." + name, "expected a map of parameters");
            for (const auto& kv : params) {
                const std::string param = string(kv.first, "search.policy." + name);
                spec.policy.params[param] = number(kv.second, "search.policy." + name + "." + param);
            }
        }
        }
        if (const YAML::Node split = node["split"]) {
            spec.split_where = where(split, "search.split");
            only_keys(split, "search.split", {"heldout", "heldout_fraction", "seed"});
            if (split["heldout"] && split["heldout_fraction"])
                fail(split, "search.split", "give either 'heldout' (sequence indices) or 'heldout_fraction', not both");
            if (const YAML::Node list = split["heldout"]) {
                if (!list.IsSequence() || list.size() == 0)
                    fail(list, "search.split.heldout", "expected a non-empty list of sequence indices");
                for (std::size_t i = 0; i < list.size(); ++i) {
                    const int index = int32(list[i], "search.split.heldout[" + std::to_string(i) + "]", 0, kMaxSequenceTokens);
                    if (std::find(spec.heldout.begin(), spec.heldout.end(), index) != spec.heldout.end())
                        fail(list[i], "search.split.heldout[" + std::to_string(i) + "]", "sequence " + std::to_string(index) + " is listed twice");
                    spec.heldout.push_back(index);
                }
            }
            if (const YAML::Node f = split["heldout_fraction"]) {
                spec.heldout_fraction = number(f, "search.split.heldout_fraction");
                if (!(spec.heldout_fraction > 0 && spec.heldout_fraction < 1))
                    fail(f, "search.split.heldout_fraction", "must be between 0 and 1 (exclusive), got " + f.Scalar());
            }
            if (const YAML::Node seed = split["seed"])
                spec.seed = static_cast<uint64_t>(integer(seed, "search.split.seed", 0, int64_t{1} << 53));
        } else {
            spec.split_where = spec.where;
        }
        const YAML::Node target = node["target"];
        if (!target) fail(node, "search", "missing key 'target' (e.g. target: [2x, 3x] or {bytes_per_token: 12})");
        std::vector<YAML::Node> items;
        if (target.IsSequence()) {
            if (target.size() == 0) fail(target, "search.target", "empty list");
            for (const YAML::Node& t : target) items.push_back(t);
        } else {
            items.push_back(target);
        }
        for (std::size_t i = 0; i < items.size(); ++i) {
            const YAML::Node& t = items[i];
            const std::string key = target.IsSequence() ? "search.target[" + std::to_string(i) + "]" : "search.target";
            SearchTarget st;
            st.where = where(t, key);
            std::string ratio_text;
            if (t.IsScalar()) {
                ratio_text = t.Scalar();
            } else if (t.IsMap() && t.size() == 1 && t["compression"]) {
                ratio_text = string(t["compression"], key + ".compression");
            } else if (t.IsMap() && t.size() == 1 && t["bytes_per_token"]) {
                st.bytes_per_token = number(t["bytes_per_token"], key + ".bytes_per_token");
                if (!(st.bytes_per_token > 0)) fail(t, key + ".bytes_per_token", "must be > 0");
                // The shortest text that reads back as the same number: 12 and 12.0000001 stay apart.
                char label[48];
                char* end = std::to_chars(label, label + sizeof label - 2, st.bytes_per_token).ptr;
                *end = 'B';
                end[1] = '\0';
                st.label = label;
            } else {
                fail(t, key, "expected a compression ratio like 2x, {compression: 2x} or {bytes_per_token: N}");
            }
            if (!ratio_text.empty()) {
                double ratio = 0;
                const char* begin = ratio_text.data();
                const char* end = begin + ratio_text.size() - (ratio_text.back() == 'x' ? 1 : 0);
                const auto [stop, ec] = std::from_chars(begin, end, ratio);
                if (ratio_text.back() != 'x' || ec != std::errc() || stop != end || !(ratio > 1) || ratio > 1e6)
                    fail(t, key, "expected a compression ratio above 1 like 2x, got '" + ratio_text + "'");
                st.compression = ratio;
                st.label = ratio_text;
            }
            // The same target twice, however written (2x and 2.0x; 12 and 12.0 bytes per token).
            for (const SearchTarget& other : spec.targets)
                if ((st.compression > 0 && other.compression == st.compression) ||
                    (st.bytes_per_token > 0 && other.bytes_per_token == st.bytes_per_token))
                    fail(t, key, "target " + st.label + " is listed twice (as " + other.label + ")");
            spec.targets.push_back(st);
        }
        if (const YAML::Node objective = node["objective"]) {
            spec.objective = string(objective, "search.objective");
            spec.objective_where = where(objective, "search.objective");
            if (spec.objective != "output_rel_error" && spec.objective != "retained_mass")
                fail(objective, "search.objective",
                     "expected output_rel_error or retained_mass, got '" + spec.objective +
                         "' (delta_ppl is a confirmation: give --model and --text)");
        } else {
            spec.objective_where = spec.where;
        }
        if (const YAML::Node sample = node["sample"]) {
            spec.sample_where = where(sample, "search.sample");
            if (!sample.IsMap()) fail(sample, "search.sample", "expected {steps: 0.125, seed: 1}");
            only_keys(sample, "search.sample", {"steps", "seed"});
            const YAML::Node steps = sample["steps"];
            if (!steps) fail(sample, "search.sample", "missing key 'steps' (the share of decode steps measured, e.g. 0.125)");
            spec.sample_steps = number(steps, "search.sample.steps");
            if (!(spec.sample_steps > 0 && spec.sample_steps <= 1))
                fail(steps, "search.sample.steps", "must be in (0, 1], got " + steps.Scalar());
            if (const YAML::Node seed = sample["seed"])
                spec.sample_seed = static_cast<uint64_t>(integer(seed, "search.sample.seed", 0, (int64_t{1} << 32) - 1));
        }
        if (const YAML::Node screen = node["screen"]) {
            spec.screen_where = where(screen, "search.screen");
            if (!screen.IsMap()) fail(screen, "search.screen", "expected {steps: 1024, keep: 10}");
            only_keys(screen, "search.screen", {"steps", "keep"});
            const YAML::Node steps = screen["steps"];
            if (!steps)
                fail(screen, "search.screen", "missing key 'steps' (the decode steps of each fitting sequence screened, e.g. 1024)");
            spec.screen_steps = integer(steps, "search.screen.steps", 16, kMaxSequenceTokens);
            if (const YAML::Node keep = screen["keep"]) spec.screen_keep = int32(keep, "search.screen.keep", 2, 1000);
        }
        if (const YAML::Node coarse = node["coarse_grid"]) {
            spec.coarse_grid_where = where(coarse, "search.coarse_grid");
            spec.coarse_grid = int32(coarse, "search.coarse_grid", 2, 1024);
        }
        if (const YAML::Node fit = node["fit"]) {
            spec.fits_where = where(fit, "search.fit");
            if (!fit.IsSequence() || fit.size() == 0) fail(fit, "search.fit", "expected a non-empty list, e.g. [layer_budgets]");
            spec.fits.clear();
            for (std::size_t i = 0; i < fit.size(); ++i) {
                const std::string key = "search.fit[" + std::to_string(i) + "]";
                const std::string name = string(fit[i], key);
                const auto& known = known_search_fits();
                if (std::find(known.begin(), known.end(), name) == known.end())
                    fail(fit[i], key, "unknown fit '" + name + "' (this kvsim fits: layer_budgets, head_budgets, streaming, tiers, ranks)");
                if (std::find(spec.fits.begin(), spec.fits.end(), name) != spec.fits.end())
                    fail(fit[i], key, "'" + name + "' is listed twice");
                spec.fits.push_back(name);
            }
        }
        if (const YAML::Node grid = node["grid"]; grid && spec.deploy == "kvpress") {
            // kvpress's ratios, each a share of the prompt removed, to a thousandth: the grid holds
            // the shares kept, in thousandths, ascending.
            spec.grid_where = where(grid, "search.grid");
            if (!grid.IsSequence() || grid.size() < 2)
                fail(grid, "search.grid", "expected a list of at least two compression ratios in [0, 1)");
            for (std::size_t i = 0; i < grid.size(); ++i) {
                const std::string key = "search.grid[" + std::to_string(i) + "]";
                const double ratio = number(grid[i], key);
                const double kept = (1 - ratio) * 1000;
                if (!(ratio >= 0 && ratio < 1) || std::abs(kept - std::round(kept)) > 1e-6 || std::round(kept) < 1)
                    fail(grid[i], key, "expected a compression ratio in [0, 1) to a thousandth (e.g. 0.25), got " +
                                           grid[i].Scalar());
                const int thousandths = static_cast<int>(std::round(kept));
                if (std::find(spec.grid.begin(), spec.grid.end(), thousandths) != spec.grid.end())
                    fail(grid[i], key, "ratio " + grid[i].Scalar() + " is listed twice");
                spec.grid.push_back(thousandths);
            }
            std::sort(spec.grid.begin(), spec.grid.end());
        } else if (grid) {
            spec.grid_where = where(grid, "search.grid");
            if (!grid.IsSequence() || grid.size() < 2) fail(grid, "search.grid", "expected a list of at least two budgets");
            for (std::size_t i = 0; i < grid.size(); ++i) {
                const std::string key = "search.grid[" + std::to_string(i) + "]";
                const int b = int32(grid[i], key, 1, kMaxBudgetTokens);
                if (!spec.grid.empty() && b <= spec.grid.back()) fail(grid[i], key, "budgets must ascend");
                spec.grid.push_back(b);
            }
        } else {
            spec.grid_where = spec.where;
        }
        return spec;
    }

    std::string file_;
};

// Paths inside a config are relative to the config file, so it runs from any folder.
std::string resolve_against(const std::string& config_path, const std::string& relative) {
    const std::filesystem::path p(relative);
    if (p.is_absolute()) return p.string();
    return (std::filesystem::path(config_path).parent_path() / p).lexically_normal().string();
}

bool is_file_param(const std::string& policy, const std::string& param) {
    if (const PolicyDescriptor* d = find_policy(policy))
        for (const ParamSpec& spec : d->params)
            if (spec.name == param) return spec.file;
    return false;
}

}  // namespace

ExperimentConfig load_config(const std::string& path) {
    ConfigParser p(path);
    const YAML::Node root = load_yaml_file(path);
    if (!root.IsMap()) throw InputError(path + ": expected a map of keys (trace, budgets, policies, ...)");
    p.only_keys(root, "", {"trace", "budgets", "layer_budgets", "policies", "metrics", "grid", "output",
                           "attention_view", "group_reduce", "prefill_tokens", "search"});

    ExperimentConfig config;
    config.file = path;

    // trace: a path, or {synthetic: policybook, name: decode-4096, max_steps: N}
    // trace: a path, or {synthetic: ...}. kvsim eval runs a model instead and needs none.
    const YAML::Node trace = root["trace"];
    config.trace.where = p.where(trace, "trace");
    if (!trace) {
    } else if (trace.IsScalar()) {
        config.trace.path = resolve_against(path, trace.Scalar());
    } else {
        p.only_keys(trace, "trace", {"synthetic", "name", "max_steps", "path", "sequences"});
        if (const YAML::Node list = trace["sequences"]) {
            if (!trace["path"]) p.fail(list, "trace.sequences", "selects sequences of a trace file: give 'path' too");
            if (!list.IsSequence() || list.size() == 0)
                p.fail(list, "trace.sequences", "expected a non-empty list of sequence indices, e.g. [3, 4]");
            for (std::size_t i = 0; i < list.size(); ++i) {
                const std::string key = "trace.sequences[" + std::to_string(i) + "]";
                const int index = p.int32(list[i], key, 0, kMaxSequenceTokens);
                if (std::find(config.trace.sequences.begin(), config.trace.sequences.end(), index) !=
                    config.trace.sequences.end())
                    p.fail(list[i], key, "sequence " + std::to_string(index) + " is listed twice");
                config.trace.sequences.push_back(index);
            }
        }
        if (trace["path"]) {
            if (trace["synthetic"]) p.fail(trace, "trace", "give either 'path' or 'synthetic', not both");
            config.trace.path = resolve_against(path, p.string(trace["path"], "trace.path"));
        } else {
            if (!trace["synthetic"]) p.fail(trace, "trace", "missing key 'synthetic' (or 'path')");
            config.trace.synthetic = p.string(trace["synthetic"], "trace.synthetic");
            if (config.trace.synthetic != "policybook" && config.trace.synthetic != "qkv")
                p.fail(trace["synthetic"], "trace.synthetic", "unknown generator '" + config.trace.synthetic +
                                                                  "' (known: policybook, qkv)");
            const char* default_name = config.trace.synthetic == "qkv" ? "llama-1b-4096" : "decode-4096";
            config.trace.name = trace["name"] ? p.string(trace["name"], "trace.name") : default_name;
        }
        if (trace["max_steps"])
            config.trace.max_steps = p.integer(trace["max_steps"], "trace.max_steps", 1, kMaxSequenceTokens);
    }

    const YAML::Node budgets = root["budgets"];
    if (budgets) {
        if (!budgets.IsSequence()) p.fail(budgets, "budgets", "expected a list of integers, e.g. [256, 512, 1024]");
        if (budgets.size() == 0) p.fail(budgets, "budgets", "empty list");
        for (std::size_t i = 0; i < budgets.size(); ++i) {
            const std::string key = "budgets[" + std::to_string(i) + "]";
            // "2x": a budget per sequence that holds the cache at that compression ratio on average.
            const std::string text = budgets[i].IsScalar() ? budgets[i].Scalar() : std::string();
            if (text.size() > 1 && text.back() == 'x') {
                double ratio = 0;
                const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size() - 1, ratio);
                if (ec != std::errc() || end != text.data() + text.size() - 1 || !(ratio >= 1) || ratio > 1e6)
                    p.fail(budgets[i], key, "expected a token count or a compression ratio >= 1 like 2x, got '" + text + "'");
                config.compression_budgets.push_back(ratio);
                continue;
            }
            config.budgets.push_back(p.int32(budgets[i], key, 1, kMaxBudgetTokens));
        }
    }
    // layer_budgets: a list (one profile), a profile file, or a list of profile files.
    if (const YAML::Node layers = root["layer_budgets"]) {
        if (layers.IsSequence() && layers.size() == 0)
            p.fail(layers, "layer_budgets", "empty list (give per-layer budgets or profile files)");
        if (layers.IsSequence() && layers[0].IsScalar() && !layers[0].Scalar().empty() &&
            !std::isalpha(static_cast<unsigned char>(layers[0].Scalar()[0]))) {
            config.layer_budget_profiles.push_back(p.layer_profile(layers, "layer_budgets", "per-layer"));
        } else if (layers.IsScalar()) {
            config.layer_budget_profiles.push_back(load_budget_profile(resolve_against(path, layers.Scalar())));
        } else if (layers.IsSequence()) {
            for (std::size_t i = 0; i < layers.size(); ++i)
                config.layer_budget_profiles.push_back(load_budget_profile(
                    resolve_against(path, p.string(layers[i], "layer_budgets[" + std::to_string(i) + "]"))));
        } else {
            p.fail(layers, "layer_budgets", "expected a list of per-layer budgets or profile files");
        }
    }
    if (const YAML::Node view = root["attention_view"]) {
        config.attention_view = p.string(view, "attention_view");
        if (config.attention_view != "raw" && config.attention_view != "renormalized" && config.attention_view != "cached")
            p.fail(view, "attention_view", "expected raw, renormalized or cached, got '" + config.attention_view + "'");
    }
    if (const YAML::Node reduce = root["group_reduce"]) {
        config.group_reduce = p.string(reduce, "group_reduce");
        if (config.group_reduce != "mean" && config.group_reduce != "max" && config.group_reduce != "sum")
            p.fail(reduce, "group_reduce", "expected mean, max or sum, got '" + config.group_reduce + "'");
    }
    if (const YAML::Node prefill = root["prefill_tokens"])
        config.prefill_tokens = p.int32(prefill, "prefill_tokens", 0, kMaxSequenceTokens);

    if (const YAML::Node search = root["search"]) config.search = p.search_spec(search);
    const YAML::Node policies = config.search && !root["policies"] ? YAML::Node(YAML::NodeType::Sequence) : root["policies"];
    if (!policies) throw InputError(path + ": missing key 'policies'");
    if (!policies.IsSequence() || (policies.size() == 0 && !config.search))
        p.fail(policies, "policies", "expected a non-empty list of policies");
    for (std::size_t i = 0; i < policies.size(); ++i) {
        const std::string key = "policies[" + std::to_string(i) + "]";
        // {evict: h2o, quantize: {bits: 4, older_than: 128}}: an eviction policy and a quantisation;
        // {evict: h2o, adakv: {floor: 0.2}}: its budget shared across a layer's KV heads (either or both).
        YAML::Node item = policies[i];
        // {evict: h2o, project: {lowrank: {key_rank: 4, bases: b.json}}}: each kept token projected.
        YAML::Node quantize, adakv, project;  // a default Node is a defined null: has_quantize, has_adakv say which
        const bool composed = item.IsMap() && item["evict"];
        const bool has_quantize = composed && item["quantize"], has_adakv = composed && item["adakv"];
        const bool has_project = composed && item["project"];
        if (composed) {
            p.only_keys(item, key, {"evict", "quantize", "adakv", "project"});
            quantize = item["quantize"];
            adakv = item["adakv"];
            project = item["project"];
            if (!has_quantize && !has_adakv && !has_project)
                p.fail(item, key, "'evict' needs a 'quantize', 'adakv' or 'project' map beside it (or list the policy alone)");
            if (has_quantize && !quantize.IsMap()) p.fail(quantize, key + ".quantize", "expected a map, e.g. {bits: 4, older_than: 128}");
            if (has_adakv && !adakv.IsMap() && !adakv.IsNull()) p.fail(adakv, key + ".adakv", "expected a map, e.g. {floor: 0.2}");
            item = item["evict"];
        }
        auto [name, params] = p.named_item(item, key);
        if (name == "profile" && !composed) {  // {profile: FILE}: a fitted profile from kvsim search
            if (!params.IsScalar()) p.fail(item, key + ".profile", "expected the path of a profile.json");
            const std::string file = resolve_against(path, params.Scalar());
            const Profile profile = load_profile(file);
            PolicyEntry entry;
            entry.name = profile.policy;
            entry.params = profile.params;
            entry.where = p.where(policies[i], key + ".profile") + " (" + file + ")";
            entry.profile_shape = profile.model;
            // load_profile checked what the profile asks of its policy (search/profile.h). Replayed as
            // the engine it was fitted for runs it: kvpress's prompt and byte model, DuoAttention's bytes.
            entry.bookkeeping = profile.deploy == "kvsim";
            if (!profile.prompt_ratios.empty()) {  // kvpress: a press at per-layer ratios of each prompt
                const PolicyDescriptor* press = find_policy(profile.policy);
                if (!press || !press->prompt_press)
                    p.fail(item, key + ".profile", file + ": per-layer prompt ratios are for a kvpress press, not " +
                                                       profile.policy);
                entry.prompt = profile.prompt;
                entry.profile_budgets.push_back(profile_column(profile, entry.where));
            } else if (profile.streaming || profile.tiers || profile.mixed) {  // the policy reads its heads or shares from the file itself
                entry.files["profile"] = file;
            } else if (!profile.layer_budgets.empty()) {
                entry.profile_budgets.push_back(profile_column(profile, entry.where));
            }
            config.policies.push_back(entry);
            continue;
        }
        PolicyEntry entry;
        if (has_quantize) {
            entry.quantized = true;
            for (const auto& kv : quantize)
                entry.quantize[p.string(kv.first, key + ".quantize")] =
                    p.number(kv.second, key + ".quantize." + kv.first.as<std::string>());
        }
        entry.name = name;
        entry.where = p.where(policies[i], key + "." + name);
        if (has_project) {
            auto [projection, projection_params] = p.named_item(project, key + ".project");
            entry.project = projection;
            entry.project_where = p.where(project, key + ".project." + projection);
            const std::string at = key + ".project." + projection;
            if (projection_params && !projection_params.IsNull()) {
                if (!projection_params.IsMap()) p.fail(projection_params, at, "expected a map of parameters");
                for (const auto& kv : projection_params) {
                    const std::string param = p.string(kv.first, at);
                    if (is_file_param(projection, param))
                        entry.project_files[param] = resolve_against(path, p.string(kv.second, at + "." + param));
                    else
                        entry.project_params[param] = p.number(kv.second, at + "." + param);
                }
            }
        }
        if (has_adakv) {
            entry.adakv = true;
            entry.adakv_where = entry.where + ".adakv";
            if (adakv.IsMap())
                for (const auto& kv : adakv)
                    entry.adakv_params[p.string(kv.first, key + ".adakv")] =
                        p.number(kv.second, key + "." + name + ".adakv." + kv.first.as<std::string>());
        }
        if (params && !params.IsNull()) {
            if (!params.IsMap()) p.fail(params, key + "." + name, "expected a map of parameters");
            for (const auto& kv : params) {
                const std::string param = p.string(kv.first, key + "." + name);
                // A policy's file parameter is a path beside the config; everything else is a number.
                if (is_file_param(name, param))
                    entry.files[param] = resolve_against(path, p.string(kv.second, key + "." + name + "." + param));
                else
                    entry.params[param] = p.number(kv.second, key + "." + name + "." + param);
            }
        }
        config.policies.push_back(entry);
    }

    // Budgets: from the config, or every policy brings its own (a fitted profile).
    const bool all_profiles = std::all_of(config.policies.begin(), config.policies.end(),
                                          [](const PolicyEntry& e) { return e.profile_shape.num_layers > 0; });
    if (!budgets && !root["layer_budgets"] && !all_profiles && !config.search)
        throw InputError(path + ": missing key 'budgets'");

    if (const YAML::Node metrics = root["metrics"]) {
        if (!metrics.IsSequence() || metrics.size() == 0) p.fail(metrics, "metrics", "expected a non-empty list");
        config.metrics.clear();
        for (std::size_t i = 0; i < metrics.size(); ++i) {
            const std::string key = "metrics[" + std::to_string(i) + "]";
            auto [name, options] = p.named_item(metrics[i], key);
            bool known = false;
            for (const auto& m : known_metrics()) known |= (m == name);
            if (!known) {
                std::string list;
                for (const auto& m : known_metrics()) list += (list.empty() ? "" : ", ") + m;
                p.fail(metrics[i], key, "unknown metric '" + name + "' (known: " + list + ")");
            }
            if (options && !options.IsNull()) {
                if (name != "heavy_hitter_recall") p.fail(options, key + "." + name, "takes no options");
                p.only_keys(options, key + "." + name, {"k"});
                if (options["k"]) config.heavy_hitter_k = p.int32(options["k"], key + ".k", 1, kMaxSequenceTokens);
            }
            config.metrics.push_back(name);
        }
    }

    if (const YAML::Node grid = root["grid"]) {
        if (!grid.IsMap()) p.fail(grid, "grid", "expected a map from policy.parameter to a list of values");
        for (const auto& kv : grid) {
            const std::string axis_key = p.string(kv.first, "grid");
            const std::string key = "grid." + axis_key;
            GridAxis axis;
            const auto dot = axis_key.find('.');
            if (dot == std::string::npos || dot == 0 || dot + 1 == axis_key.size())
                p.fail(kv.first, key, "expected policy.parameter, e.g. h2o.recent_window");
            axis.policy = axis_key.substr(0, dot);
            axis.param = axis_key.substr(dot + 1);
            axis.where = p.where(kv.first, key);
            if (!kv.second.IsSequence() || kv.second.size() == 0) p.fail(kv.second, key, "expected a non-empty list");
            for (std::size_t i = 0; i < kv.second.size(); ++i)
                axis.values.push_back(p.number(kv.second[i], key + "[" + std::to_string(i) + "]"));
            config.grid.push_back(axis);
        }
    }

    config.output_dir = "results/" + std::filesystem::path(path).stem().string();
    if (const YAML::Node output = root["output"]) {
        p.only_keys(output, "output", {"dir", "format", "per_layer", "per_sequence", "layout"});
        if (output["layout"]) {
            config.output_layout = p.string(output["layout"], "output.layout");
            if (config.output_layout != "matrix" && config.output_layout != "comparison")
                p.fail(output["layout"], "output.layout", "expected matrix or comparison");
        }
        if (output["dir"]) {
            config.output_dir = p.string(output["dir"], "output.dir");
            if (config.output_dir.empty()) p.fail(output["dir"], "output.dir", "empty folder name");
        }
        if (output["format"]) {
            config.output_format = p.string(output["format"], "output.format");
            if (config.output_format != "table" && config.output_format != "csv" && config.output_format != "json")
                p.fail(output["format"], "output.format", "expected table, csv or json");
        }
        if (output["per_layer"]) config.per_layer = p.boolean(output["per_layer"], "output.per_layer");
        if (output["per_sequence"]) config.per_sequence = p.boolean(output["per_sequence"], "output.per_sequence");
    }
    return config;
}

bool changes_values(const PolicyEntry& entry) {
    const PolicyDescriptor* policy = find_policy(entry.name);
    return entry.quantized || !entry.project.empty() || (policy && policy->changes_values);
}

std::vector<std::string> table_metrics(const ExperimentConfig& config, bool values_known) {
    if (!config.metrics.empty()) return config.metrics;
    if (values_known && std::any_of(config.policies.begin(), config.policies.end(), changes_values))
        return {"output_rel_error", "compression_ratio"};
    return {"retained_mass", "heavy_hitter_recall"};
}

BudgetColumn load_budget_profile(const std::string& path) {
    ConfigParser p(path);
    const YAML::Node root = load_yaml_file(path);
    if (!root.IsMap()) throw InputError(path + ": expected a map with key 'layer_budgets'");
    p.only_keys(root, "", {"name", "layer_budgets", "source", "method", "fitted_on"});
    if (!root["layer_budgets"]) throw InputError(path + ": missing key 'layer_budgets'");
    return p.layer_profile(root["layer_budgets"], "layer_budgets",
                           root["name"] ? p.string(root["name"], "name") : std::filesystem::path(path).stem().string());
}

std::vector<BudgetColumn> budget_columns(const ExperimentConfig& config) {
    std::vector<BudgetColumn> columns;
    for (int b : config.budgets) columns.push_back({std::to_string(b), b, {}, config.file + ": budgets", 0, {}});
    for (double ratio : config.compression_budgets) {
        char label[32];
        std::snprintf(label, sizeof label, "%gx", ratio);
        columns.push_back({label, 1, {}, config.file + ": budgets", ratio, {}});
    }
    columns.insert(columns.end(), config.layer_budget_profiles.begin(), config.layer_budget_profiles.end());
    return columns;
}

std::vector<int> parse_budget_list(const std::string& text, const std::string& where) {
    std::vector<int> budgets;
    std::size_t start = 0;
    while (start <= text.size()) {
        std::size_t comma = text.find(',', start);
        if (comma == std::string::npos) comma = text.size();
        const std::string item = text.substr(start, comma - start);
        int64_t value = 0;
        const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
        if (item.empty() || ec != std::errc() || end != item.data() + item.size() || value < 1 ||
            value > kMaxBudgetTokens)
            throw InputError(where + ": '" + item + "' is not a budget (an integer from 1 to " +
                             std::to_string(kMaxBudgetTokens) + ")");
        budgets.push_back(static_cast<int>(value));
        start = comma + 1;
    }
    return budgets;
}

GridAxis parse_grid_flag(const std::string& text, const std::string& where) {
    const auto eq = text.find('=');
    const auto dot = text.find('.');
    if (eq == std::string::npos || dot == std::string::npos || dot == 0 || dot + 1 >= eq || eq + 1 >= text.size())
        throw InputError(where + ": '" + text + "' is not policy.parameter=v1,v2,... (e.g. h2o.recent_window=16,32,64)");
    GridAxis axis;
    axis.policy = text.substr(0, dot);
    axis.param = text.substr(dot + 1, eq - dot - 1);
    axis.where = where + " " + text.substr(0, eq);
    std::size_t start = eq + 1;
    while (start <= text.size()) {
        std::size_t comma = text.find(',', start);
        if (comma == std::string::npos) comma = text.size();
        const std::string item = text.substr(start, comma - start);
        double value = 0;
        const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
        if (item.empty() || ec != std::errc() || end != item.data() + item.size() || !std::isfinite(value))
            throw InputError(where + ": '" + item + "' in '" + text + "' is not a number");
        axis.values.push_back(value);
        start = comma + 1;
    }
    return axis;
}

}  // namespace kvsim
