#include "search/profile.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/input_file.h"
#include "base/json_file.h"
#include "policies/policy.h"
#include "policies/prompt_press.h"
#include "sim/experiment_spec.h"

namespace kvsim {

using Json = nlohmann::ordered_json;

namespace {

// Per-(layer, KV head) values as rows of one layer each.
template <class T>
Json rows_of(const std::vector<T>& values, int num_layers, int num_kv_heads) {
    Json rows = Json::array();
    for (int l = 0; l < num_layers; ++l) {
        Json row = Json::array();
        for (int kv = 0; kv < num_kv_heads; ++kv) row.push_back(values.at(static_cast<std::size_t>(l) * num_kv_heads + kv));
        rows.push_back(row);
    }
    return rows;
}

// Reads a profile's JSON with one error line per problem: the file and the key.
class ProfileReader {
public:
    explicit ProfileReader(std::string path) : path_(std::move(path)) {}

    [[noreturn]] void fail(const std::string& key, const std::string& what) const {
        throw InputError(path_ + ": " + key + ": " + what);
    }
    const Json& at(const Json& object, const std::string& name, const std::string& key) const {
        if (!object.is_object()) fail(key, "expected an object");
        const auto it = object.find(name);
        if (it == object.end()) fail(key.empty() ? name : key + "." + name, "missing");
        return *it;
    }
    double number(const Json& j, const std::string& key) const {
        if (!j.is_number()) fail(key, "expected a number");
        const double v = j.get<double>();
        if (!std::isfinite(v)) fail(key, "expected a finite number");
        return v;
    }
    int64_t integer(const Json& j, const std::string& key, int64_t lo, int64_t hi) const {
        const double v = number(j, key);
        if (v != std::floor(v)) fail(key, "expected an integer, got " + j.dump());
        if (v < static_cast<double>(lo) || v > static_cast<double>(hi))
            fail(key, j.dump() + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
        return static_cast<int64_t>(v);
    }
    std::string string(const Json& j, const std::string& key) const {
        if (!j.is_string()) fail(key, "expected a string");
        return j.get<std::string>();
    }
    const Json& list(const Json& j, const std::string& key, std::size_t size) const {
        if (!j.is_array()) fail(key, "expected a list");
        if (j.size() != size)
            fail(key, "expected " + std::to_string(size) + " entries, got " + std::to_string(j.size()));
        return j;
    }
    // A per-(layer, KV head) table: num_layers rows of num_kv_heads numbers each, flattened.
    std::vector<double> table(const Json& j, const std::string& key, const ModelShape& m, double lo, double hi) const {
        std::vector<double> out;
        list(j, key, static_cast<std::size_t>(m.num_layers));
        for (int l = 0; l < m.num_layers; ++l) {
            const std::string row_key = key + "[" + std::to_string(l) + "]";
            list(j[l], row_key, static_cast<std::size_t>(m.num_kv_heads));
            for (int kv = 0; kv < m.num_kv_heads; ++kv) {
                const std::string cell = row_key + "[" + std::to_string(kv) + "]";
                const double v = number(j[l][kv], cell);
                if (v < lo || v > hi) {
                    char range[64];
                    std::snprintf(range, sizeof range, " is outside [%g, %g]", lo, hi);
                    fail(cell, j[l][kv].dump() + range);
                }
                out.push_back(v);
            }
        }
        return out;
    }

private:
    std::string path_;
};

// What the profile asks of its policy, checked once here for every reader (run, eval, generate and
// the runtime, export, report): the policy exists and takes these parameters; a profile holds
// streaming heads (for streaming_attention), tier shares (for stratigraphic) or budgets (for an
// eviction policy), never two of them; and the policy's parameters fit inside every budget.
void check_profile_policy(const Profile& p, const ProfileReader& r) {
    const PolicyDescriptor* policy = find_policy(p.policy);
    if (!policy) r.fail("policy.name", "unknown policy '" + p.policy + "' (known: " + known_policy_names() + ")");
    ParamValues values;
    try {
        values = resolve_params(*policy, p.params, "policy.params");
    } catch (const InputError& e) {
        r.fail("policy", e.what());
    }
    for (const ParamSpec& spec : policy->params)
        if (spec.file && p.params.count(spec.name))
            r.fail("policy.params." + spec.name, "is a file parameter; a profile's parameters are numbers");
    if (p.mixed && p.policy != "mixed") r.fail("mixed", "per-head methods are for policy mixed, not " + p.policy);
    if (p.policy == "mixed" && !p.mixed) r.fail("mixed", "missing: a mixed profile names each head's method");
    if (p.mixed && (p.streaming || p.tiers))
        r.fail(p.streaming ? "streaming" : "tiers", "beside mixed: a mixed profile holds each head's level under mixed");
    if (p.streaming && p.tiers) r.fail("streaming", "beside tiers: a profile holds streaming heads or tier shares, not both");
    if (p.streaming && p.policy != "streaming_attention")
        r.fail("streaming", "streaming heads are for policy streaming_attention, not " + p.policy);
    if (p.tiers && p.policy != "stratigraphic") r.fail("tiers", "tier shares are for policy stratigraphic, not " + p.policy);
    const bool budgets = !p.layer_budgets.empty() || !p.head_budgets.empty();
    if (policy->keeps_everything) {
        if (budgets)
            r.fail(p.head_budgets.empty() ? "layer_budgets" : "head_budgets",
                   "policy " + p.policy + " keeps every token" +
                       (p.streaming || p.tiers ? std::string(" (its ") + (p.streaming ? "streaming heads" : "tier shares") +
                                                     " size it)"
                                               : std::string()) +
                       ": token budgets do not apply; remove them, or name an eviction policy");
        if (p.policy == "streaming_attention" && !p.streaming)
            r.fail("streaming", "missing: a streaming_attention profile names its streaming heads");
        return;
    }
    // kvpress's ratios size a press's prompt instead of budgets.
    if (!p.prompt_ratios.empty()) {
        if (!policy->prompt_press)
            r.fail("prompt_ratios", "per-layer prompt ratios are for a kvpress press, not " + p.policy);
        return;
    }
    // An eviction policy: its window (or other parameter) must leave room in the tightest budget.
    if (!policy->check_budget || p.layer_budgets.empty()) return;
    const std::vector<int>& per = p.head_budgets.empty() ? p.layer_budgets : p.head_budgets;
    const auto tightest = std::min_element(per.begin(), per.end());
    const std::size_t at = static_cast<std::size_t>(tightest - per.begin());
    const std::string problem = policy->check_budget(values, *tightest);
    if (problem.empty()) return;
    const int K = p.model.num_kv_heads;
    r.fail(p.head_budgets.empty() ? "layer_budgets[" + std::to_string(at) + "]"
                                  : "head_budgets[" + std::to_string(at / K) + "][" + std::to_string(at % K) + "]",
           problem + " (policy.params)");
}

}  // namespace

void write_profile(const Profile& profile, const std::string& path) {
    write_file_atomically(path, profile_json(profile));
}

std::string profile_json(const Profile& p) {
    const int L = p.model.num_layers, K = p.model.num_kv_heads;
    Json j;
    j["format"] = kProfileFormat;
    j["version"] = p.mixed ? kMixedProfileVersion : 2;  // the lowest version that holds its keys
    j["name"] = p.name;
    j["model"] = {{"name", p.model.name},
                  {"num_layers", L},
                  {"num_query_heads", p.model.num_query_heads},
                  {"num_kv_heads", K},
                  {"head_dim", p.model.head_dim}};
    Json params = Json::object();
    for (const auto& [name, value] : p.params) params[name] = value;
    j["policy"] = {{"name", p.policy}, {"params", params}};
    j["method"] = p.method;
    j["target"] = p.target;
    j["deploy"] = p.deploy;
    if (!p.prompt.empty())
        j["prompt"] = p.prompt.tokens > 0 ? Json{{"tokens", p.prompt.tokens}} : Json{{"continuation", p.prompt.continuation}};
    if (!p.prompt_ratios.empty()) {
        j["prompt_ratios"] = p.prompt_ratios;
        // What the ratios mean at the prompts they were measured on: kvpress's kept tokens per layer.
        Json kept = Json::array();
        std::vector<int64_t> prompts = p.measured_prompts;
        std::sort(prompts.begin(), prompts.end());
        prompts.erase(std::unique(prompts.begin(), prompts.end()), prompts.end());
        for (int64_t prompt : prompts) kept.push_back({{"prompt", prompt}, {"tokens", profile_prompt_kept(p, prompt)}});
        j["prompt_kept"] = kept;
    }
    if (!p.layer_budgets.empty()) j["layer_budgets"] = p.layer_budgets;
    if (!p.head_budgets.empty()) j["head_budgets"] = rows_of(p.head_budgets, L, K);
    if (p.streaming) {
        std::vector<int> heads(p.streaming->heads.begin(), p.streaming->heads.end());
        j["streaming"] = {{"sinks", p.streaming->sinks},
                          {"recent", p.streaming->recent},
                          {"heads", rows_of(heads, L, K)},
                          {"lambda", rows_of(p.streaming->lambda, L, K)}};
        if (!p.streaming->stateless.empty()) {
            std::vector<int> stateless(p.streaming->stateless.begin(), p.streaming->stateless.end());
            j["streaming"]["stateless"] = rows_of(stateless, L, K);
        }
        if (!p.streaming->gates.empty()) j["streaming"]["gates"] = rows_of(p.streaming->gates, L, K);
    }
    if (p.mixed) j["mixed"] = mixed_plan_json(*p.mixed);
    if (p.tiers)
        j["tiers"] = {{"fp16", rows_of(p.tiers->fp16, L, K)},
                      {"int8", rows_of(p.tiers->int8, L, K)},
                      {"int4", rows_of(p.tiers->int4, L, K)}};
    j["expected"] = {{"bytes_per_token", p.bytes_per_token}, {"compression_ratio", p.compression_ratio}};
    if (!p.layer_kept_fraction.empty()) j["expected"]["layer_kept_fraction"] = p.layer_kept_fraction;
    if (!p.sparsity_curve.empty()) {
        Json curve = Json::array();
        for (const SparsityPoint& c : p.sparsity_curve)
            curve.push_back({{"sparsity", c.sparsity},
                             {"streaming_heads", c.streaming_heads},
                             {"heldout", c.heldout},
                             {"bytes_per_token", c.bytes_per_token},
                             {"compression_ratio", c.compression_ratio}});
        j["sparsity_curve"] = curve;
    }
    j["heldout"] = {{"objective", p.objective}, {"value", p.heldout_value}, {"sequences", p.heldout_sequences}};
    if (!p.measured_tokens.empty()) {
        j["measured_on"] = {{"sequences", p.heldout_sequences}, {"tokens", p.measured_tokens}};
        if (!p.measured_prompts.empty()) j["measured_on"]["prompts"] = p.measured_prompts;
        j["measured_on"]["bytes_per_token"] = p.bytes_per_token;
        j["measured_on"]["compression_ratio"] = p.compression_ratio;
        if (p.fitting_bytes_per_token > 0) {
            Json fitting = {{"sequences", p.fitting_sequences}, {"tokens", p.fitting_tokens}};
            if (!p.fitting_prompts.empty()) fitting["prompts"] = p.fitting_prompts;
            fitting["bytes_per_token"] = p.fitting_bytes_per_token;
            fitting["compression_ratio"] = p.fitting_compression_ratio;
            j["measured_on"]["fitting"] = fitting;
        }
    }
    j["source"] = {{"trace", p.trace},
                   {"trace_sha256", p.trace_sha256},
                   {"config", p.config},
                   {"config_sha256", p.config_sha256}};
    return j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

Profile load_profile(const std::string& path) {
    const Json root = load_json_file(path);
    ProfileReader r(path);
    if (!root.is_object()) r.fail("(top level)", "expected a JSON object");
    if (r.string(r.at(root, "format", ""), "format") != kProfileFormat)
        r.fail("format", "expected \"" + std::string(kProfileFormat) + "\"");
    const int64_t version = r.integer(r.at(root, "version", ""), "version", 0, 1 << 30);
    if (version < 1 || version > kProfileVersion)
        r.fail("version", std::to_string(version) + " is not supported (this kvsim reads versions 1 to " +
                              std::to_string(kProfileVersion) + ")");
    Profile p;
    p.name = r.string(r.at(root, "name", ""), "name");
    const Json& model = r.at(root, "model", "");
    p.model.name = r.string(r.at(model, "name", "model"), "model.name");
    p.model.num_layers = static_cast<int>(r.integer(r.at(model, "num_layers", "model"), "model.num_layers", 1, 1 << 16));
    p.model.num_query_heads =
        static_cast<int>(r.integer(r.at(model, "num_query_heads", "model"), "model.num_query_heads", 1, 1 << 16));
    p.model.num_kv_heads = static_cast<int>(r.integer(r.at(model, "num_kv_heads", "model"), "model.num_kv_heads", 1, 1 << 16));
    p.model.head_dim = static_cast<int>(r.integer(r.at(model, "head_dim", "model"), "model.head_dim", 1, 1 << 16));
    if (p.model.num_query_heads % p.model.num_kv_heads != 0)
        r.fail("model.num_query_heads", "is not a multiple of model.num_kv_heads");
    const Json& policy = r.at(root, "policy", "");
    p.policy = r.string(r.at(policy, "name", "policy"), "policy.name");
    const Json& params = r.at(policy, "params", "policy");
    if (!params.is_object()) r.fail("policy.params", "expected an object");
    for (const auto& [name, value] : params.items()) p.params[name] = r.number(value, "policy.params." + name);
    if (root.contains("method")) p.method = r.string(root["method"], "method");
    if (root.contains("target")) p.target = r.string(root["target"], "target");

    const int L = p.model.num_layers;
    if (root.contains("deploy")) {
        p.deploy = r.string(root["deploy"], "deploy");
        if (p.deploy != "kvsim" && p.deploy != "kvpress" && p.deploy != "duo")
            r.fail("deploy", "\"" + p.deploy + "\" is not a target this kvsim knows (kvsim, kvpress, duo)");
    }
    if (p.deploy == "kvpress") {  // a share of each prompt per layer, and how sequences split
        const Json& prompt = r.at(root, "prompt", "");
        if (!prompt.is_object() || prompt.size() != 1 || !(prompt.contains("tokens") || prompt.contains("continuation")))
            r.fail("prompt", "expected {\"tokens\": N} or {\"continuation\": N}");
        if (prompt.contains("tokens"))
            p.prompt.tokens = static_cast<int>(r.integer(prompt["tokens"], "prompt.tokens", 2, kMaxSequenceTokens));
        else
            p.prompt.continuation =
                static_cast<int>(r.integer(prompt["continuation"], "prompt.continuation", 1, kMaxSequenceTokens));
        const Json& ratios = r.list(r.at(root, "prompt_ratios", ""), "prompt_ratios", static_cast<std::size_t>(L));
        for (int l = 0; l < L; ++l) {
            const std::string key = "prompt_ratios[" + std::to_string(l) + "]";
            const double v = r.number(ratios[l], key);
            if (v < 0 || v >= 1) r.fail(key, ratios[l].dump() + " is outside [0, 1)");
            p.prompt_ratios.push_back(v);
        }
    } else if (root.contains("prompt_ratios") || root.contains("prompt")) {
        r.fail(root.contains("prompt") ? "prompt" : "prompt_ratios",
               "is kvpress's, but the profile deploys to " + p.deploy + " (deploy)");
    }
    // Budgets, unless the policy keeps every token or the profile streams heads, holds tier shares
    // or kvpress's ratios instead (then every other head keeps its cache).
    const PolicyDescriptor* descriptor = find_policy(p.policy);
    const bool keeps_everything = descriptor && descriptor->keeps_everything;
    if (root.contains("layer_budgets") ||
        !(keeps_everything || root.contains("streaming") || root.contains("tiers") || !p.prompt_ratios.empty())) {
        const Json& layers = r.list(r.at(root, "layer_budgets", ""), "layer_budgets", static_cast<std::size_t>(L));
        for (int l = 0; l < L; ++l)
            p.layer_budgets.push_back(static_cast<int>(
                r.integer(layers[l], "layer_budgets[" + std::to_string(l) + "]", 1, kMaxBudgetTokens)));
    }
    if (root.contains("head_budgets") && p.layer_budgets.empty()) r.fail("head_budgets", "needs layer_budgets beside it");
    if (root.contains("head_budgets")) {
        const std::vector<double> heads = r.table(root["head_budgets"], "head_budgets", p.model, 1, kMaxBudgetTokens);
        for (std::size_t i = 0; i < heads.size(); ++i) {
            if (heads[i] != std::floor(heads[i]))
                r.fail("head_budgets[" + std::to_string(i / p.model.num_kv_heads) + "][" +
                           std::to_string(i % p.model.num_kv_heads) + "]",
                       "expected an integer");
            p.head_budgets.push_back(static_cast<int>(heads[i]));
        }
    }
    if (root.contains("streaming")) {
        const Json& s = root["streaming"];
        StreamingHeads heads;
        heads.sinks = static_cast<int>(r.integer(r.at(s, "sinks", "streaming"), "streaming.sinks", 0, kMaxBudgetTokens));
        heads.recent = static_cast<int>(r.integer(r.at(s, "recent", "streaming"), "streaming.recent", 0, kMaxBudgetTokens));
        for (double g : r.table(r.at(s, "heads", "streaming"), "streaming.heads", p.model, 0, 1)) {
            if (g != 0 && g != 1) r.fail("streaming.heads", "every gate must be 0 or 1");
            heads.heads.push_back(static_cast<uint8_t>(g));
        }
        heads.lambda = r.table(r.at(s, "lambda", "streaming"), "streaming.lambda", p.model, 0, 1);
        if (s.contains("stateless"))
            for (double g : r.table(s["stateless"], "streaming.stateless", p.model, 0, 1)) {
                if (g != 0 && g != 1) r.fail("streaming.stateless", "every entry must be 0 or 1");
                heads.stateless.push_back(static_cast<uint8_t>(g));
            }
        if (s.contains("gates")) {
            heads.gates = r.table(s["gates"], "streaming.gates", p.model, 0, 1);
            // The gates rank the heads: the streaming ones below 0.5, the rest above, all distinct,
            // so that DuoAttention's threshold picks the profile's heads.
            for (std::size_t u = 0; u < heads.gates.size(); ++u)
                if ((heads.gates[u] < 0.5) != (heads.heads[u] == 1) || heads.gates[u] == 0.5)
                    r.fail("streaming.gates[" + std::to_string(u / p.model.num_kv_heads) + "][" +
                               std::to_string(u % p.model.num_kv_heads) + "]",
                           "a streaming head's gate must be below 0.5 and every other head's above");
            std::vector<double> sorted = heads.gates;
            std::sort(sorted.begin(), sorted.end());
            // DuoAttention adds up to 1e-6 of noise to every gate before its threshold: closer gates
            // could swap places there.
            if (std::adjacent_find(sorted.begin(), sorted.end(), [](double a, double b) { return b - a <= 1e-6; }) !=
                sorted.end())
                r.fail("streaming.gates", "two heads' gates lie within 1e-6 (DuoAttention's tie-breaking noise); the "
                                          "gates must rank every head");
        }
        p.streaming = heads;
    }
    if (root.contains("tiers")) {
        const Json& t = root["tiers"];
        TierShares shares;
        shares.num_layers = L;
        shares.num_kv_heads = p.model.num_kv_heads;
        shares.fp16 = r.table(r.at(t, "fp16", "tiers"), "tiers.fp16", p.model, 0, 1);
        shares.int8 = r.table(r.at(t, "int8", "tiers"), "tiers.int8", p.model, 0, 1);
        shares.int4 = r.table(r.at(t, "int4", "tiers"), "tiers.int4", p.model, 0, 1);
        check_tier_shares(shares, path + ": tiers");
        p.tiers = shares;
    }
    if (root.contains("mixed")) {  // version 3: each head's method and level
        if (version < kMixedProfileVersion)
            r.fail("mixed", "is a version 3 key, but the profile says version " + std::to_string(version));
        p.mixed = parse_mixed_plan(root["mixed"], L, p.model.num_kv_heads, path + ": mixed");
    }
    if (root.contains("expected")) {
        const Json& e = root["expected"];
        if (e.contains("bytes_per_token")) p.bytes_per_token = r.number(e["bytes_per_token"], "expected.bytes_per_token");
        if (e.contains("compression_ratio"))
            p.compression_ratio = r.number(e["compression_ratio"], "expected.compression_ratio");
        if (e.contains("layer_kept_fraction")) {
            const Json& f = r.list(e["layer_kept_fraction"], "expected.layer_kept_fraction", static_cast<std::size_t>(L));
            for (int l = 0; l < L; ++l) {
                const std::string key = "expected.layer_kept_fraction[" + std::to_string(l) + "]";
                const double v = r.number(f[l], key);
                if (v < 0 || v > 1) r.fail(key, f[l].dump() + " is outside [0, 1]");
                p.layer_kept_fraction.push_back(v);
            }
        }
    }
    if (root.contains("heldout")) {
        const Json& h = root["heldout"];
        if (h.contains("objective")) p.objective = r.string(h["objective"], "heldout.objective");
        if (h.contains("value")) p.heldout_value = r.number(h["value"], "heldout.value");
        if (h.contains("sequences")) {
            if (!h["sequences"].is_array()) r.fail("heldout.sequences", "expected a list");
            for (std::size_t i = 0; i < h["sequences"].size(); ++i)
                p.heldout_sequences.push_back(r.string(h["sequences"][i], "heldout.sequences[" + std::to_string(i) + "]"));
        }
    }
    if (p.deploy == "duo" && !p.streaming) r.fail("streaming", "missing: a profile for DuoAttention streams heads");
    if (p.deploy == "duo" && p.streaming->gates.empty())
        r.fail("streaming.gates", "missing: a profile for DuoAttention ranks its heads by gates");
    if (p.deploy == "duo")  // DuoAttention's streaming heads hold their sinks and window alone
        for (std::size_t u = 0; u < p.streaming->heads.size(); ++u)
            if (p.streaming->heads[u] && (p.streaming->stateless.empty() || !p.streaming->stateless[u]))
                r.fail("streaming.stateless", "every streaming head of a profile for DuoAttention keeps no state");
    if (root.contains("sparsity_curve")) {
        const Json& curve = root["sparsity_curve"];
        if (!curve.is_array()) r.fail("sparsity_curve", "expected a list");
        for (std::size_t i = 0; i < curve.size(); ++i) {
            const std::string key = "sparsity_curve[" + std::to_string(i) + "]";
            SparsityPoint c;
            c.sparsity = r.number(r.at(curve[i], "sparsity", key), key + ".sparsity");
            if (c.sparsity < 0 || c.sparsity > 1) r.fail(key + ".sparsity", "is outside [0, 1]");
            c.streaming_heads = static_cast<int>(r.integer(r.at(curve[i], "streaming_heads", key), key + ".streaming_heads",
                                                           0, static_cast<int64_t>(L) * p.model.num_kv_heads));
            c.heldout = r.number(r.at(curve[i], "heldout", key), key + ".heldout");
            c.bytes_per_token = r.number(r.at(curve[i], "bytes_per_token", key), key + ".bytes_per_token");
            c.compression_ratio = r.number(r.at(curve[i], "compression_ratio", key), key + ".compression_ratio");
            p.sparsity_curve.push_back(c);
        }
    }
    if (root.contains("measured_on")) {
        const Json& m = root["measured_on"];
        const std::size_t n = r.at(m, "tokens", "measured_on").is_array() ? m["tokens"].size() : 0;
        const Json& tokens = r.list(m["tokens"], "measured_on.tokens", n);
        for (std::size_t i = 0; i < n; ++i)
            p.measured_tokens.push_back(
                r.integer(tokens[i], "measured_on.tokens[" + std::to_string(i) + "]", 1, kMaxSequenceTokens));
        if (m.contains("prompts")) {
            const Json& prompts = r.list(m["prompts"], "measured_on.prompts", n);
            for (std::size_t i = 0; i < n; ++i)
                p.measured_prompts.push_back(r.integer(prompts[i], "measured_on.prompts[" + std::to_string(i) + "]", 1,
                                                       p.measured_tokens[i]));
        }
        if (m.contains("fitting")) {  // the plan's bytes at the fitting sequences' lengths
            const Json& f = m["fitting"];
            const std::size_t count = r.at(f, "tokens", "measured_on.fitting").is_array() ? f["tokens"].size() : 0;
            const Json& tokens = r.list(f["tokens"], "measured_on.fitting.tokens", count);
            for (std::size_t i = 0; i < count; ++i)
                p.fitting_tokens.push_back(r.integer(tokens[i], "measured_on.fitting.tokens[" + std::to_string(i) + "]",
                                                     1, kMaxSequenceTokens));
            if (f.contains("prompts")) {
                const Json& prompts = r.list(f["prompts"], "measured_on.fitting.prompts", count);
                for (std::size_t i = 0; i < count; ++i)
                    p.fitting_prompts.push_back(r.integer(prompts[i], "measured_on.fitting.prompts[" +
                                                                          std::to_string(i) + "]", 1, p.fitting_tokens[i]));
            }
            if (f.contains("sequences"))
                for (std::size_t i = 0; i < f["sequences"].size(); ++i)
                    p.fitting_sequences.push_back(
                        r.string(f["sequences"][i], "measured_on.fitting.sequences[" + std::to_string(i) + "]"));
            p.fitting_bytes_per_token = r.number(r.at(f, "bytes_per_token", "measured_on.fitting"),
                                                 "measured_on.fitting.bytes_per_token");
            p.fitting_compression_ratio = r.number(r.at(f, "compression_ratio", "measured_on.fitting"),
                                                   "measured_on.fitting.compression_ratio");
            if (!(p.fitting_bytes_per_token > 0))
                r.fail("measured_on.fitting.bytes_per_token", "must be above 0");
        }
    }
    if (root.contains("prompt_kept")) {  // derived from the ratios: refused where they disagree
        const Json& kept = root["prompt_kept"];
        if (!kept.is_array()) r.fail("prompt_kept", "expected a list");
        for (std::size_t i = 0; i < kept.size(); ++i) {
            const std::string key = "prompt_kept[" + std::to_string(i) + "]";
            const int64_t prompt = r.integer(r.at(kept[i], "prompt", key), key + ".prompt", 1, kMaxSequenceTokens);
            const Json& tokens = r.list(r.at(kept[i], "tokens", key), key + ".tokens", static_cast<std::size_t>(L));
            const std::vector<int> planned = profile_prompt_kept(p, prompt);
            for (int l = 0; l < L; ++l)
                if (r.integer(tokens[l], key + ".tokens[" + std::to_string(l) + "]", 0, prompt) != planned[l])
                    r.fail(key + ".tokens[" + std::to_string(l) + "]",
                           "disagrees with prompt_ratios[" + std::to_string(l) + "], which keeps " +
                               std::to_string(planned[l]) + " of " + std::to_string(prompt) + " tokens");
        }
    }
    if (root.contains("source")) {
        const Json& s = root["source"];
        if (!s.is_object()) r.fail("source", "expected an object");
        auto text = [&](const char* name, std::string& out) {
            if (s.contains(name)) out = r.string(s[name], std::string("source.") + name);
        };
        text("trace", p.trace);
        text("trace_sha256", p.trace_sha256);
        text("config", p.config);
        text("config_sha256", p.config_sha256);
    }
    check_profile_policy(p, r);
    return p;
}

BudgetColumn profile_column(const Profile& p, const std::string& where) {
    if (!p.prompt_ratios.empty()) {
        BudgetColumn column;
        column.label = p.name;
        column.where = where;
        column.prompt_ratios = p.prompt_ratios;
        return column;
    }
    return profile_budget_column(p.name, where, p.layer_budgets, p.head_budgets);
}

std::vector<int> profile_prompt_kept(const Profile& p, int64_t prompt_length) {
    std::vector<int> kept;
    for (double ratio : p.prompt_ratios) kept.push_back(kvpress_kept_tokens(prompt_length, ratio));
    return kept;
}

void check_profile_shape(const ModelShape& profile_shape, const std::string& profile_where, const ModelShape& actual,
                         const std::string& what) {
    if (!profile_shape.same_as(actual))
        throw InputError(profile_where + ": the profile was fitted to " + profile_shape.describe() + " (" +
                         profile_shape.name + "), but " + what + " has " + actual.describe());
}

}  // namespace kvsim
