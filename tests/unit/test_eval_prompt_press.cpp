// kvsim eval of a kvpress profile (a press at per-layer ratios of each prompt): the prompt runs
// with the full cache, is compressed once at its end, decoding appends, and the continuation is
// scored. Checked against the same semantics run by hand on the model: the press's kept set of
// each (layer, KV head) from the prompt's own Q, K and V, then masks of that set plus every token
// after the prompt.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "model/llama.h"
#include "policies/prompt_press.h"
#include "src/eval.h"

using namespace kvsim;

namespace {

const std::string kModel = KVSIM_SHARED_DIR "/models/stories260K/stories260K.gguf";
const std::string kText = KVSIM_SHARED_DIR "/text/tinystories_sample.txt";
constexpr int kTokens = 120, kPrompt = 64;

EvalOptions story_options() {
    EvalOptions options;
    options.input = {kModel, kText, "<|endoftext|>", kTokens, 0};
    options.sequences = {0};
    options.show_progress = false;
    return options;
}

ExperimentConfig press_config(const std::vector<double>& ratios) {
    ExperimentConfig config;
    config.file = "test";
    config.metrics = {"ppl", "delta_ppl"};
    PolicyEntry entry;
    entry.name = "snapkv_press";
    entry.params = {{"window_size", 8}};
    entry.where = "test";
    entry.prompt.tokens = kPrompt;
    entry.bookkeeping = false;
    BudgetColumn column;
    column.label = "ratios";
    column.where = "test";
    column.prompt_ratios = ratios;
    entry.profile_budgets = {column};
    config.policies.push_back(entry);
    return config;
}

// Records every layer's prompt Q, K and V (position-major, as PromptView reads them).
struct PromptRecorder : model::ForwardHooks {
    const model::LlamaConfig& c;
    std::vector<std::vector<float>> q, k, v;
    explicit PromptRecorder(const model::LlamaConfig& config)
        : c(config), q(config.n_layers), k(config.n_layers), v(config.n_layers) {}
    void after_qkv(int layer, int pos, float* qp, float* kp, float* vp) override {
        if (pos >= kPrompt) return;
        q[layer].insert(q[layer].end(), qp, qp + c.q_dim());
        k[layer].insert(k[layer].end(), kp, kp + c.kv_dim());
        v[layer].insert(v[layer].end(), vp, vp + c.kv_dim());
    }
};

// The prompt positions each (layer, KV head) keeps, by the press itself (the replay's selection).
struct KeptMask : model::ForwardHooks {
    const model::LlamaConfig& c;
    std::vector<std::vector<uint8_t>> kept;  // [layer * n_kv + kv][position]
    std::vector<uint8_t> mask;
    bool every_step = false;  // compress again at each decoding step (what a kvpress cache does not do)
    KeptMask(const model::LlamaConfig& config, const PromptRecorder& prompt, const std::vector<double>& ratios)
        : c(config) {
        const PolicyDescriptor* press = find_policy("snapkv_press");
        const ParamValues params = resolve_params(*press, {{"window_size", 8}}, "test");
        for (int layer = 0; layer < c.n_layers; ++layer)
            for (int kv = 0; kv < c.n_kv_heads; ++kv) {
                const PromptView view{.length = kPrompt, .layer = layer, .num_layers = c.n_layers, .kv_head = kv,
                                      .num_query_heads = c.n_heads, .num_kv_heads = c.n_kv_heads,
                                      .head_dim = c.head_dim, .queries = prompt.q[layer].data(),
                                      .keys = prompt.k[layer].data(), .values = prompt.v[layer].data()};
                const int budget = kvpress_kept_tokens(kPrompt, ratios[layer]);
                std::unique_ptr<Policy> policy =
                    press->make(params, {budget, kPrompt + 1, layer, c.n_layers, kv, c.n_kv_heads, c.head_dim});
                for (int t = 1; t < kPrompt; ++t) policy->on_decode_step(t, {});
                policy->score_prompt(view);
                std::vector<int32_t> victims;
                policy->evict(budget, victims);
                std::vector<uint8_t> keep(kTokens, 1);
                for (int32_t p : victims) keep[p] = 0;
                kept.push_back(keep);
            }
    }
    const uint8_t* attention_mask(int layer, int kv, int pos) override {
        if (pos < kPrompt) return nullptr;  // the prompt runs with the full cache
        const std::vector<uint8_t>& keep = kept[layer * c.n_kv_heads + kv];
        mask.assign(keep.begin(), keep.begin() + pos + 1);
        if (every_step)  // the budget enforced at every step: only the newest tokens beyond the prompt's
            for (int p = kPrompt; p <= pos - 1; ++p) mask[p] = 0;
        return mask.data();
    }
};

struct HandCheck {
    double nll = 0, full_nll = 0;  // mean NLL of the continuation's tokens
};

HandCheck by_hand(const std::vector<double>& ratios, bool every_step = false) {
    const LoadedInput input = load_model_input(story_options().input);
    model::LlamaModel llama = input.model;
    const std::vector<int>& tokens = input.text.sequences.at(0);
    REQUIRE(tokens.size() == static_cast<std::size_t>(kTokens));
    PromptRecorder recorder(llama.config());
    std::vector<double> full, pressed;
    llama.sequence_nll(tokens, &recorder, 1, &full);
    KeptMask masks(llama.config(), recorder, ratios);
    masks.every_step = every_step;
    llama.sequence_nll(tokens, &masks, 1, &pressed);
    HandCheck h;
    for (int token = kPrompt; token < kTokens; ++token) {  // token j's NLL is entry j - 1
        h.nll += pressed[token - 1];
        h.full_nll += full[token - 1];
    }
    h.nll /= kTokens - kPrompt;
    h.full_nll /= kTokens - kPrompt;
    return h;
}

}  // namespace

TEST_CASE("kvsim eval of a kvpress press compresses the prompt once and scores the continuation") {
    if (!std::filesystem::exists(kModel)) {
        MESSAGE("skipped: " << kModel << " not present");
        return;
    }
    SUBCASE("ratio 0 keeps the whole prompt: the full cache's perplexity of the continuation") {
        const EvalResult result = run_eval(press_config({0, 0, 0, 0, 0}), {}, story_options());
        REQUIRE(result.records.size() == 2);
        const ResultRecord& r = result.records[1];
        const HandCheck full = by_hand({0, 0, 0, 0, 0});
        CHECK(r.nll == doctest::Approx(full.full_nll).epsilon(1e-12));
        CHECK(r.delta_ppl == doctest::Approx(0).epsilon(1e-9));
        // The continuation's perplexity, not the whole text's.
        CHECK(std::abs(r.nll - result.full_nll) > 1e-3);
    }
    SUBCASE("per-layer ratios: the press's kept set, then every decoded token appended") {
        const std::vector<double> ratios = {0.7, 0.5, 0.6, 0.3, 0.5};
        const EvalResult result = run_eval(press_config(ratios), {}, story_options());
        const ResultRecord& r = result.records.at(1);
        const HandCheck once = by_hand(ratios);
        CHECK(r.nll == doctest::Approx(once.nll).epsilon(1e-12));
        CHECK(r.delta_ppl == doctest::Approx(std::exp(once.nll) - std::exp(once.full_nll)).epsilon(1e-9));
        CHECK(r.delta_ppl > 0);
        // Compressing again at every decoding step is another cache, with another perplexity.
        const HandCheck every = by_hand(ratios, true);
        CHECK(std::abs(every.nll - once.nll) > 1e-3);
        CHECK(std::abs(r.nll - every.nll) > 1e-3);
    }
}
