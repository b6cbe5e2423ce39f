// kvpress's presses as kvsim scores them (policies/prompt_press.h), against kept sets recorded by
// hand from NVIDIA kvpress's own press code (tests/goldens/README.md, kvpress_kept.json): on
// Q/K/V rebuilt here from the recording script's formula, and on the prompt of one layer of the
// stories260K trace the repository ships.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "base/json_file.h"
#include "policies/prompt_press.h"
#include "sim/trace_store.h"

using namespace kvsim;

namespace {

const std::string kGoldens = std::string(KVSIM_SOURCE_DIR) + "/tests/goldens/kvpress_kept.json";

// record_kvpress.py's tensor(): exact float32 values from a multiplicative hash of the index.
std::vector<float> synthetic_tensor(int salt, std::size_t n) {
    std::vector<float> out(n);
    for (std::size_t i = 0; i < n; ++i) {
        const uint64_t x = (static_cast<uint64_t>(i) * 2654435761ull + static_cast<uint64_t>(salt) * 40503ull) % (1ull << 32);
        const int64_t v = static_cast<int64_t>((x >> 8) % 2001) - 1000;
        out[i] = static_cast<float>(static_cast<double>(v) / 1024.0);
    }
    return out;
}

// What a press keeps of `prompt` at `ratio`, run as the harness runs it: every prompt position
// admitted, the prompt scored at its end, one eviction to kvpress's count.
std::vector<int> kept_by(const std::string& name, const nlohmann::json& params, double ratio, PromptView prompt) {
    const PolicyDescriptor* policy = find_policy(name);
    REQUIRE(policy != nullptr);
    REQUIRE(policy->prompt_press);
    std::map<std::string, double> given;
    for (const auto& [param, value] : params.items()) given[param] = value.get<double>();
    const ParamValues values = resolve_params(*policy, given, "test");
    const int budget = kvpress_kept_tokens(prompt.length, ratio);
    const PolicyContext ctx{budget, prompt.length + 1, prompt.layer, prompt.num_layers, prompt.kv_head,
                            prompt.num_kv_heads, prompt.head_dim};
    std::unique_ptr<Policy> press = policy->make(values, ctx);
    REQUIRE(press->reads_prompt());
    for (int t = 1; t < prompt.length; ++t) press->on_decode_step(t, {});
    press->score_prompt(prompt);
    std::vector<int32_t> victims;
    press->evict(budget, victims);
    std::vector<int> kept;
    for (int p = 0; p < prompt.length; ++p)
        if (!std::binary_search(victims.begin(), victims.end(), p)) kept.push_back(p);
    return kept;
}

// The first `length` positions of one layer of a trace, as a press reads them.
PromptView trace_prompt(const TraceMetadata& m, const QkvLayer& layer, int layer_index, int length) {
    PromptView prompt;
    prompt.length = length;
    prompt.layer = layer_index;
    prompt.num_layers = static_cast<int>(m.num_layers);
    prompt.num_query_heads = static_cast<int>(m.num_query_heads);
    prompt.num_kv_heads = static_cast<int>(m.num_kv_heads);
    prompt.head_dim = static_cast<int>(m.head_dim);
    prompt.queries = layer.q.data();
    prompt.keys = layer.k.data();
    prompt.values = layer.v.data();
    return prompt;
}

void check_cases(const nlohmann::json& cases, PromptView prompt) {
    for (const nlohmann::json& c : cases) {
        const std::string name = c["policy"];
        for (int kv = 0; kv < prompt.num_kv_heads; ++kv) {
            INFO(name << " " << c["params"].dump() << " at ratio " << c["ratio"].get<double>() << ", KV head " << kv);
            prompt.kv_head = kv;
            CHECK(kept_by(name, c["params"], c["ratio"].get<double>(), prompt) == c["kept"][kv].get<std::vector<int>>());
        }
    }
}

}  // namespace

TEST_CASE("kvpress's count of kept prompt tokens truncates as Python does") {
    CHECK(kvpress_kept_tokens(10, 0.9) == 0);  // 10 * 0.09999999999999998
    CHECK(kvpress_kept_tokens(10, 0.0) == 10);
    CHECK(kvpress_kept_tokens(361, 0.6) == 144);
    CHECK(kvpress_kept_tokens(425, 0.5) == 212);
    CHECK(kvpress_kept_tokens(40, 0.55) == 18);
    CHECK(kvpress_kept_tokens(7, 1.0) == 0);
}

TEST_CASE("kvpress's presses keep what kvpress keeps: synthetic Q/K/V") {
    const nlohmann::json goldens = load_json_file(kGoldens);
    const nlohmann::json& g = goldens["synthetic"];
    const int S = g["positions"], K = g["kv_heads"], group = g["group"], d = g["head_dim"];
    const std::vector<float> q = synthetic_tensor(1, static_cast<std::size_t>(S) * K * group * d);
    const std::vector<float> k = synthetic_tensor(2, static_cast<std::size_t>(S) * K * d);
    const std::vector<float> v = synthetic_tensor(3, static_cast<std::size_t>(S) * K * d);
    PromptView prompt;
    prompt.length = S;
    prompt.num_query_heads = K * group;
    prompt.num_kv_heads = K;
    prompt.head_dim = d;
    prompt.queries = q.data();
    prompt.keys = k.data();
    prompt.values = v.data();
    REQUIRE(g["cases"].size() == 12);
    check_cases(g["cases"], prompt);
}

TEST_CASE("kvpress's presses keep what kvpress keeps: a prompt of stories260K's own attention") {
    const nlohmann::json goldens = load_json_file(kGoldens);
    const nlohmann::json& g = goldens["stories260K"];
    const TraceReader reader(std::string(KVSIM_SOURCE_DIR) + "/" + g["trace"].get<std::string>());
    const QkvLayer layer = reader.read_qkv(g["sequence"], g["layer"]);
    const PromptView prompt = trace_prompt(reader.metadata(), layer, g["layer"], g["prompt"]);
    REQUIRE(g["cases"].size() == 9);
    check_cases(g["cases"], prompt);
}

// A profile fitted by kvsim search with deploy: kvpress (tests/cli_search_test.py's), its exported
// ratios given to kvpress's PerLayerCompressionPress on the prompts it was fitted for
// (record_kvpress_per_layer.py): every layer's heads keep exactly kvpress's positions.
TEST_CASE("kvpress's per-layer press at a fitted profile's ratios keeps what kvsim replays") {
    const nlohmann::json g = load_json_file(std::string(KVSIM_SOURCE_DIR) + "/tests/goldens/kvpress_per_layer.json");
    const TraceReader reader(std::string(KVSIM_SOURCE_DIR) + "/" + g["trace"].get<std::string>());
    const TraceMetadata& m = reader.metadata();
    const std::vector<double> ratios = g["ratios"];
    REQUIRE(ratios.size() == static_cast<std::size_t>(m.num_layers));
    REQUIRE(g["sequences"].size() == 2);
    for (const nlohmann::json& s : g["sequences"]) {
        for (int l = 0; l < static_cast<int>(m.num_layers); ++l) {
            const QkvLayer layer = reader.read_qkv(s["sequence"], l);
            PromptView prompt = trace_prompt(m, layer, l, g["prompt"]);
            for (int kv = 0; kv < prompt.num_kv_heads; ++kv) {
                INFO("sequence " << s["sequence"].get<int>() << ", layer " << l << ", KV head " << kv);
                prompt.kv_head = kv;
                const std::vector<int> kept = s["kept"][l][kv];
                CHECK(kvpress_kept_tokens(prompt.length, ratios[l]) == static_cast<int>(kept.size()));
                CHECK(kept_by(g["policy"], g["params"], ratios[l], prompt) == kept);
            }
        }
    }
}
