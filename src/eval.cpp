#include "src/eval.h"

#include "search/profile.h"

#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <optional>
#include <thread>

#include "sim/heavy_hitters.h"
#include "cache_math/lowrank.h"
#include "cache_math/tiers.h"
#include "sim/harness.h"
#include "sim/replay.h"
#include "sim/sweep.h"
#include "base/errors.h"
#include "base/size_limits.h"
#include "src/experiment.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "src/model_text.h"
#include "src/progress.h"

namespace kvsim {
namespace {

// One policy per (layer, KV head) controlling the model's cache. At each step it is shown the
// attention the model computes (from the current query and the cached keys), exactly as a replay
// harness would be. An eviction policy's kept positions become the model's attention mask; a
// policy that changes values (quantised tiers, a streaming head's linear state) has its cache
// simulated here, and its attention output replaces the model's own.
class PolicyInTheLoop : public model::ForwardHooks {
public:
    // chunk: the positions the model runs at once (forward_batch); this hook keeps each layer's
    // Q, K and V of that many positions until their steps.
    PolicyInTheLoop(const model::LlamaModel& llama, const ReplayCombo& combo, const HarnessOptions& options,
                    int heavy_hitter_k, int length, int chunk)
        : llama_(llama), config_(llama.config()), heavy_k_(heavy_hitter_k),
          group_(config_.n_heads / config_.n_kv_heads), chunk_(chunk), query_(config_.n_layers),
          key_(config_.n_layers), value_(config_.n_layers), admitted_(config_.n_layers, 0) {
        // The combination's own prompt (a kvpress profile's split) and byte model, as a replay's.
        HarnessOptions own = options;
        own.prefill_tokens = prompt_ = combo.prompt_length(length, options.prefill_tokens);
        own.bookkeeping = options.bookkeeping && combo.bookkeeping;
        for (int layer = 0; layer < config_.n_layers; ++layer) {
            query_[layer].resize(static_cast<std::size_t>(chunk) * config_.q_dim());
            key_[layer].resize(static_cast<std::size_t>(chunk) * config_.kv_dim());
            value_[layer].resize(static_cast<std::size_t>(chunk) * config_.kv_dim());
            for (int kv = 0; kv < config_.n_kv_heads; ++kv) {
                const int budget = combo.budget_for(layer, kv, config_.n_kv_heads, length, prompt_);
                const int most = combo.capacity_budget(layer, kv, config_.n_kv_heads, length, prompt_);
                const int capacity = std::min(std::max(most, prompt_), length) + 1;
                harnesses_.emplace_back(
                    combo.make({budget, capacity, layer, config_.n_layers, kv, config_.n_kv_heads, config_.head_dim}),
                    budget, length, own, combo.label,
                    " (layer " + std::to_string(layer) + ", KV head " + std::to_string(kv) + ")");
            }
        }
        // A prefill-time compressor (kvpress's press) reads the whole prompt's Q, K and V of its
        // layer at the prompt's end, as the replay gives it the trace's: kept here from after_qkv.
        if (std::any_of(harnesses_.begin(), harnesses_.end(), [](const Harness& h) { return h.policy().reads_prompt(); })) {
            prompt_query_.resize(config_.n_layers);
            prompt_key_.resize(config_.n_layers);
            prompt_value_.resize(config_.n_layers);
            for (int layer = 0; layer < config_.n_layers; ++layer) {
                prompt_query_[layer].resize(static_cast<std::size_t>(prompt_) * config_.q_dim());
                prompt_key_[layer].resize(static_cast<std::size_t>(prompt_) * config_.kv_dim());
                prompt_value_[layer].resize(static_cast<std::size_t>(prompt_) * config_.kv_dim());
                for (int kv = 0; kv < config_.n_kv_heads; ++kv) {
                    Harness& h = harnesses_[layer * config_.n_kv_heads + kv];
                    if (!h.policy().reads_prompt()) continue;
                    PromptView view;
                    view.layer = layer;
                    view.num_layers = config_.n_layers;
                    view.kv_head = kv;
                    view.num_query_heads = config_.n_heads;
                    view.num_kv_heads = config_.n_kv_heads;
                    view.head_dim = config_.head_dim;
                    view.queries = prompt_query_[layer].data();
                    view.keys = prompt_key_[layer].data();
                    view.values = prompt_value_[layer].data();
                    h.set_prompt(view);
                }
            }
        }
        if (combo.adakv) {  // the heads of a layer step together: the model calls them in order, per position
            adakv_.emplace(*combo.adakv);
            prefill_tokens_ = options.prefill_tokens;
            for (Harness& h : harnesses_) {
                layer_policies_.push_back(&h.policy());
                shares_.push_back(h.policy().eviction_target(h.budget()));
            }
        }
        for (const Harness& h : harnesses_)  // the config cannot know the model's head size
            if (const TierFormat* f = h.policy().tier_format())
                check_tier_format(*f, config_.head_dim,
                                  combo.where.empty() ? combo.label : combo.where + " (" + combo.label + ")",
                                  "model " + llama_.path());
        const Policy& probe = harnesses_.front().policy();
        const KvProjection* projection = probe.projection();
        // The tiers' format: every tiered head of a cache shares one (a mixed profile's first head
        // may hold no tiers while its tier heads do; the others hold every token at fp16).
        const TierFormat* tier_format = probe.tier_format();
        for (const Harness& h : harnesses_)
            if (!tier_format) tier_format = h.policy().tier_format();
        // Any head that changes values (a streaming profile's first head may keep its cache while
        // later heads stream) makes the whole cache simulated: the model's own attention cannot
        // hold it, and a simulated full head attends to everything, as the model does.
        // The cached view, too: the policy is shown the attention of the simulated cache as held.
        simulated_ = options.view == AttentionView::cached || tier_format != nullptr || projection != nullptr ||
                     std::any_of(harnesses_.begin(), harnesses_.end(),
                                 [](const Harness& h) { return h.policy().linear_state() != nullptr; });
        // Every (layer, KV head) measures its memory; simulated caches also their output error
        // against the model's own full-cache attention at the same step.
        for (int layer = 0; layer < config_.n_layers; ++layer) {
            tiers_.emplace_back(std::make_unique<IncrementalTiers>(tier_format, length, config_.n_kv_heads,
                                                                   config_.head_dim, projection, layer));
            for (int kv = 0; kv < config_.n_kv_heads; ++kv) {
                CacheValues values{&tiers_[layer]->arrays(), kv, config_.n_kv_heads, config_.head_dim, simulated_, true};
                if (projection) {  // the model attends to the K and V the cache reconstructs
                    values.key_dim = projection->stored_key_dim(layer, kv, config_.head_dim);
                    values.value_dim = projection->stored_value_dim(layer, kv, config_.head_dim);
                    values.byte_share = projection->share(config_.n_kv_heads);
                    values.fixed_bytes = projection->basis_bytes(layer, kv, config_.n_kv_heads, config_.head_dim);
                }
                harnesses_[layer * config_.n_kv_heads + kv].set_values(values);
            }
        }
        rows_.resize(group_);
        self_.resize(group_);
        heavy_.resize(group_);
        raw_view_ = options.view == AttentionView::raw;
        reduce_ = options.reduce;
    }

    // This position's query, key and value, kept until its steps: run in chunks, the model
    // computes every position's Q, K and V of a layer before a simulated cache's steps.
    void after_qkv(int layer, int pos, float* q, float* k, float* v) override {
        std::copy(q, q + config_.q_dim(), query_row(layer, pos));
        std::copy(k, k + config_.kv_dim(), key_row(layer, pos));
        std::copy(v, v + config_.kv_dim(), value_row(layer, pos));
        if (!prompt_query_.empty() && pos < prompt_) {
            std::copy(q, q + config_.q_dim(), prompt_query_[layer].data() + static_cast<std::size_t>(pos) * config_.q_dim());
            std::copy(k, k + config_.kv_dim(), prompt_key_[layer].data() + static_cast<std::size_t>(pos) * config_.kv_dim());
            std::copy(v, v + config_.kv_dim(), prompt_value_[layer].data() + static_cast<std::size_t>(pos) * config_.kv_dim());
        }
    }

    const uint8_t* attention_mask(int layer, int kv, int pos) override {
        admit(layer, pos);
        if (pos == 0 || simulated_) return nullptr;  // simulated caches answer in attention_output
        Harness& harness = harnesses_[layer * config_.n_kv_heads + kv];
        // The model attends to what the cache holds before this step's eviction, plus itself.
        mask_.assign(pos + 1, 0);
        for (int32_t p : harness.kept()) mask_[p] = 1;
        mask_[pos] = 1;
        step(layer, kv, pos, nullptr);
        return mask_.data();
    }

    bool attention_output(int layer, int kv, int pos, const float*, float* out) override {
        admit(layer, pos);
        if (!simulated_ || pos == 0) return false;
        // `out` holds the model's full-cache attention: the reference of the output-error metric.
        const int width = group_ * config_.head_dim;
        full_output_.assign(out, out + width);
        Harness& harness = harnesses_[layer * config_.n_kv_heads + kv];
        step(layer, kv, pos, full_output_.data());
        const std::span<const float> simulated = harness.last_outputs();
        std::copy(simulated.begin(), simulated.end(), out);
        return true;
    }

    StreamMetrics metrics() const {
        StreamMetrics total;
        for (const Harness& h : harnesses_) total.add(h.metrics());
        return total;
    }
    std::size_t bytes_per_slot() const { return harnesses_.front().policy().bytes_per_slot(); }

private:
    float* query_row(int layer, int pos) { return query_[layer].data() + static_cast<std::size_t>(pos % chunk_) * config_.q_dim(); }
    float* key_row(int layer, int pos) { return key_[layer].data() + static_cast<std::size_t>(pos % chunk_) * config_.kv_dim(); }
    float* value_row(int layer, int pos) { return value_[layer].data() + static_cast<std::size_t>(pos % chunk_) * config_.kv_dim(); }

    // The simulated cache takes position pos just before its first step, as it would token by
    // token: its arrays then hold the same tokens at each step whatever the chunk (today's tiers
    // read only what the policy holds, so this keeps the order rather than fixing a result).
    void admit(int layer, int pos) {
        if (admitted_[layer] > pos) return;
        tiers_[layer]->add_token(pos, key_row(layer, pos), value_row(layer, pos));
        admitted_[layer] = pos + 1;
    }

    // One (layer, KV head) step. With Ada-KV each head observes and admits; after the layer's last
    // head (the model calls them in order) the allocation shares the layer's total among them and
    // each evicts down to its share, as a replay does. Outputs are measured before eviction.
    void step(int layer, int kv, int pos, const float* full_output) {
        Harness& harness = harnesses_[layer * config_.n_kv_heads + kv];
        if (!adakv_) {
            harness.step(group_step(layer, kv, pos, full_output));
            return;
        }
        harness.observe(group_step(layer, kv, pos, full_output));
        if (kv + 1 < config_.n_kv_heads) return;
        const std::size_t first = static_cast<std::size_t>(layer) * config_.n_kv_heads, heads = config_.n_kv_heads;
        if (pos + 1 >= prefill_tokens_)
            adakv_->allocate(std::span(layer_policies_).subspan(first, heads), std::span(shares_).subspan(first, heads), keep_);
        for (int h = 0; h < config_.n_kv_heads; ++h) harnesses_[first + h].evict_to(pos, keep_[h]);
    }

    // The full-cache attention of each query head of the group: what the proxies measure.
    GroupStep group_step(int layer, int kv, int pos, const float* full_output) {
        const int d = config_.head_dim;
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        row_ptrs_.resize(group_);
        heavy_spans_.resize(group_);
        query_ptrs_.resize(group_);
        full_ptrs_.resize(group_);
        for (int h = 0; h < group_; ++h) {
            const float* q = query_row(layer, pos) + static_cast<std::size_t>(kv * group_ + h) * d;
            std::vector<float>& row = rows_[h];
            row.resize(pos + 1);
            float peak = -INFINITY;
            // Eight cached positions at a time: eight independent sums, each over i = 0..d-1 in
            // the order of a single position's loop below (the same floats), without every product
            // waiting on the one before it. This loop is the policy's share of a long eval.
            constexpr int kLanes = 8;
            int p = 0;
            for (; p + kLanes <= pos; p += kLanes) {
                const float* k = llama_.cached_keys(layer, kv, p, kLanes);
                float dots[kLanes] = {};
                for (int i = 0; i < d; ++i)
                    for (int j = 0; j < kLanes; ++j) dots[j] += q[i] * k[static_cast<std::size_t>(j) * d + i];
                for (int j = 0; j < kLanes; ++j) {
                    row[p + j] = dots[j] * scale;
                    peak = std::max(peak, row[p + j]);
                }
            }
            for (; p <= pos; ++p) {
                const float* k = p < pos ? llama_.cached_key(layer, kv, p) : key_row(layer, pos) + kv * d;
                float dot = 0;
                for (int i = 0; i < d; ++i) dot += q[i] * k[i];
                row[p] = dot * scale;
                peak = std::max(peak, row[p]);
            }
            double total = 0;
            for (float& w : row) total += (w = std::exp(w - peak));
            // The model checked q and k, but their product can still overflow; a policy shown NaN
            // weights has no order to keep positions in.
            if (!std::isfinite(peak) || !std::isfinite(total))
                throw model::NonFiniteError(llama_.path(), "attention scores", layer, pos);
            for (float& w : row) w = static_cast<float>(w / total);
            self_[h] = row[pos];
            heavy_[h].clear();
            top_k_positions({row.data(), static_cast<std::size_t>(pos)}, heavy_k_, heavy_[h]);
            row_ptrs_[h] = row.data();
            heavy_spans_[h] = heavy_[h];
            query_ptrs_[h] = q;
            if (full_output) full_ptrs_[h] = full_output + static_cast<std::size_t>(h) * d;
        }
        if (raw_view_) {
            combined_.resize(pos);
            combine_group_rows(row_ptrs_, pos, reduce_, combined_.data());
        }
        GroupStep step;
        step.t = pos;
        step.rows = row_ptrs_;
        step.self_weight = self_;
        step.own_weight = self_;
        step.heavy = heavy_spans_;
        step.combined = raw_view_ ? combined_.data() : nullptr;
        if (full_output) {
            step.queries = query_ptrs_;
            step.full_output = full_ptrs_;
        }
        return step;
    }

    const model::LlamaModel& llama_;
    const model::LlamaConfig& config_;
    int heavy_k_;
    int group_;
    int chunk_;
    bool raw_view_ = false, simulated_ = false;
    GroupReduce reduce_ = GroupReduce::mean;
    // Per layer: the chunk's Q (all heads), K and V (all KV heads), position p in row p % chunk.
    std::vector<std::vector<float>> query_, key_, value_;
    int prompt_ = 0;  // the combination's prompt: its positions enter unevicted
    // A prompt press's: per layer, the prompt's Q, K and V, position-major as PromptView reads them.
    std::vector<std::vector<float>> prompt_query_, prompt_key_, prompt_value_;
    std::vector<int> admitted_;              // per layer: positions given to tiers_
    std::vector<std::unique_ptr<IncrementalTiers>> tiers_;  // per layer: K/V as each tier holds them
    std::vector<Harness> harnesses_;         // [layer][kv head]
    std::vector<std::vector<float>> rows_;
    std::vector<float> self_, combined_, full_output_;
    std::vector<std::vector<int32_t>> heavy_;
    std::vector<const float*> row_ptrs_, query_ptrs_, full_ptrs_;
    std::vector<std::span<const int32_t>> heavy_spans_;
    std::vector<uint8_t> mask_;
    // Ada-KV: the allocation, every harness's policy and uniform share, and a step's keeps.
    std::optional<AdaKvAllocator> adakv_;
    int prefill_tokens_ = 0;
    std::vector<Policy*> layer_policies_;
    std::vector<int> shares_, keep_;
};

std::vector<double> average_ranks(const std::vector<double>& v) {
    std::vector<std::size_t> order(v.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return v[a] < v[b]; });
    std::vector<double> ranks(v.size());
    for (std::size_t i = 0; i < order.size();) {
        std::size_t j = i;
        while (j + 1 < order.size() && v[order[j + 1]] == v[order[i]]) ++j;
        for (std::size_t k = i; k <= j; ++k) ranks[order[k]] = (i + j) / 2.0 + 1;
        i = j + 1;
    }
    return ranks;
}

}  // namespace

double perplexity_rise(double nll, double full_nll) {
    const double ppl = std::exp(nll), full_ppl = std::exp(full_nll);
    if (std::isfinite(ppl) && std::isfinite(full_ppl)) return ppl - full_ppl;
    if (nll == full_nll) return 0.0;
    // A perplexity passed a double (a random-weight model's mean NLL passes 709.8 nats):
    // exp(a) - exp(b) = exp(a + log(1 - exp(b - a))) for the larger a.
    const double larger = std::max(nll, full_nll), smaller = std::min(nll, full_nll);
    const double magnitude = std::exp(larger + std::log1p(-std::exp(smaller - larger)));
    return nll > full_nll ? magnitude : -magnitude;
}

double spearman(const std::vector<double>& x, const std::vector<double>& y) {
    const std::vector<double> rx = average_ranks(x), ry = average_ranks(y);
    const double n = static_cast<double>(x.size());
    const double mx = std::accumulate(rx.begin(), rx.end(), 0.0) / n, my = std::accumulate(ry.begin(), ry.end(), 0.0) / n;
    double sxy = 0, sxx = 0, syy = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
        sxy += (rx[i] - mx) * (ry[i] - my);
        sxx += (rx[i] - mx) * (rx[i] - mx);
        syy += (ry[i] - my) * (ry[i] - my);
    }
    return (sxx == 0 || syy == 0) ? NAN : sxy / std::sqrt(sxx * syy);
}

TokenizedText select_eval_sequences(const TokenizedText& text, const EvalOptions& options,
                                    std::vector<std::size_t>& original) {
    original.resize(text.sequences.size());
    std::iota(original.begin(), original.end(), std::size_t{0});
    if (options.sequences.empty()) return text;
    TokenizedText selected = text;
    selected.sequences.clear();
    original.clear();
    for (std::size_t i = 0; i < options.sequences.size(); ++i) {
        const int index = options.sequences[i];
        if (index < 0 || index >= static_cast<int>(text.sequences.size()))
            throw InputError(options.sequences_where + ": sequence " + std::to_string(index) + " is not in " +
                             options.input.text_path + " (it splits into " + std::to_string(text.sequences.size()) + ")");
        const std::vector<int>& tokens = text.sequences[index];
        if (i < options.expected_tokens.size() && !options.expected_tokens[i].empty() &&
            !std::equal(tokens.begin(), tokens.end(), options.expected_tokens[i].begin(), options.expected_tokens[i].end()))
            throw InputError(options.input.text_path + ": sequence " + std::to_string(index) + " tokenizes to " +
                             std::to_string(tokens.size()) + " tokens that differ from the trace's " +
                             std::to_string(options.expected_tokens[i].size()) + " (" + options.sequences_where +
                             "; give the text, --split-on and --max-tokens the trace was captured with)");
        selected.sequences.push_back(tokens);
        original.push_back(static_cast<std::size_t>(index));
    }
    return selected;
}

EvalResult run_eval(const ExperimentConfig& config, const std::vector<GridAxis>& extra_axes, const EvalOptions& options) {
    std::vector<GridAxis> grid = merge_grid(config.grid, extra_axes);
    // The full cache is the baseline row of every eval; a `full` entry in the config is that row.
    std::vector<ReplayCombo> combos = expand_sweep(config.policies, grid, budget_columns(config));
    std::erase_if(combos, [](const ReplayCombo& c) { return c.policy->name == "full" && !c.quantize; });

    const LoadedInput input = load_model_input(options.input);
    const model::LlamaModel& loaded = input.model;
    std::vector<std::size_t> original;
    const TokenizedText text = select_eval_sequences(input.text, options, original);
    const model::LlamaConfig& mc = loaded.config();
    for (const BudgetColumn& column : config.layer_budget_profiles)
        if (static_cast<int>(column.layer_budgets.size()) != mc.n_layers)
            throw InputError(column.where + ": " + std::to_string(column.layer_budgets.size()) +
                             " per-layer budgets, but model " + options.input.model_path + " has " +
                             std::to_string(mc.n_layers) + " layers");

    for (const PolicyEntry& entry : config.policies)
        if (entry.profile_shape.num_layers > 0)
            check_profile_shape(entry.profile_shape, entry.where,
                                ModelShape{options.input.model_path, mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.head_dim},
                                "model " + options.input.model_path);

    // A combination with its own prompt split (a kvpress profile) compresses each sequence's prompt
    // once, at its end, and is scored on the continuation after it.
    for (const ReplayCombo& c : combos)
        if (!c.prompt.empty())
            for (std::size_t i = 0; i < text.sequences.size(); ++i) {
                const int64_t length = static_cast<int64_t>(text.sequences[i].size());
                const int64_t prompt = c.prompt.prompt_length(length);
                if (prompt < 2 || prompt >= length)
                    throw InputError(c.where + ": " + c.prompt.describe() + " of sequence " +
                                     std::to_string(original[i]) + " of " + options.input.text_path + " (" +
                                     std::to_string(length) + " tokens) leave" + (c.prompt.tokens > 0 ? "" : "s") +
                                     " no prompt of 2 tokens and a continuation after it");
            }
    for (std::size_t i = 0; i < text.sequences.size(); ++i)
        if (config.prefill_tokens >= static_cast<int>(text.sequences[i].size()))
            throw InputError(config.file + ": prefill_tokens = " + std::to_string(config.prefill_tokens) +
                             " leaves no decode step in sequence " + std::to_string(i) + " of " +
                             options.input.text_path + " (" + std::to_string(text.sequences[i].size()) + " tokens)");

    // In the loop the policy is shown what the model computes: renormalized unless asked otherwise;
    // cached shows it the attention of its cache as held, as kvsim's runtime does.
    const HarnessOptions harness =
        named_harness_options(config.attention_view, config.group_reduce, /*values_known=*/true, config.prefill_tokens,
                              config.file);

    EvalResult result;
    result.description = std::filesystem::path(options.input.model_path).filename().string() + " on " +
                         std::filesystem::path(options.input.text_path).filename().string();
    for (const auto& seq : text.sequences) result.tokens += static_cast<long>(seq.size()) - 1;

    // Configuration 0 is the full cache; each worker thread runs whole configurations on its own
    // copy of the model, so results do not depend on the thread count.
    struct Outcome {
        double nll = 0;
        StreamMetrics metrics;
        std::size_t bytes_per_slot = 0;
        std::vector<double> sequence_nll;          // per sequence, summed into nll in order
        std::vector<StreamMetrics> sequence_metrics;
        // The full cache, and a combination with its own prompt split: each predicted token's NLL
        // per sequence, from which a continuation is scored.
        std::vector<std::vector<double>> token_nll;
    };
    std::vector<Outcome> outcomes(combos.size() + 1);
    for (Outcome& out : outcomes) {
        out.sequence_nll.resize(text.sequences.size());
        out.sequence_metrics.resize(text.sequences.size());
        out.token_nll.resize(text.sequences.size());
    }
    // Each worker thread runs on its own copy of the model (sharing its weights: a copy is its KV
    // cache and RoPE tables), with a policy's simulated cache for a sequence: every layer's K and V
    // in fp32 and in each quantised tier, at most 16 bytes per cached element (cache_math/tiers.h),
    // besides the harnesses' own bookkeeping.
    const auto copies = static_cast<uint64_t>(
        std::min<std::size_t>(outcomes.size(), static_cast<std::size_t>(tbb::this_task_arena::max_concurrency())));
    std::size_t longest = 0;
    for (const auto& tokens : text.sequences) longest = std::max(longest, tokens.size());
    const std::string what = options.input.model_path + ": " + std::to_string(copies) +
                             " copies of the model and of a simulated cache for " + std::to_string(longest) +
                             " tokens, one per thread (--threads)";
    const uint64_t per_thread = checked_add(
        loaded.memory_bytes() - loaded.weight_bytes(),
        checked_mul(checked_mul(static_cast<uint64_t>(mc.n_layers) * static_cast<uint64_t>(mc.kv_dim()), longest, what),
                    16, what),
        what);
    check_memory(checked_add(loaded.memory_bytes(), checked_mul(copies, per_thread, what), what), what);
    if (options.chunk < 1) throw std::invalid_argument("run_eval: chunk must be at least 1");
    tbb::enumerable_thread_specific<model::LlamaModel> models(loaded);
    ProgressBar bar(options.show_progress);
    std::atomic<int> done{0};
    const auto main_thread = std::this_thread::get_id();
    const auto start = std::chrono::steady_clock::now();
    tbb::parallel_for(std::size_t{0}, outcomes.size(), std::size_t{1}, [&](std::size_t i) {
        model::LlamaModel& llama = models.local();
        Outcome& out = outcomes[i];
        for (std::size_t s = 0; s < text.sequences.size(); ++s) {
            const std::vector<int>& tokens = text.sequences[s];
            try {
                if (i == 0) {
                    out.sequence_nll[s] = llama.sequence_nll(tokens, nullptr, options.chunk, &out.token_nll[s]);
                } else {
                    PolicyInTheLoop hooks(llama, combos[i - 1], harness, config.heavy_hitter_k,
                                          static_cast<int>(tokens.size()), options.chunk);
                    out.sequence_nll[s] = llama.sequence_nll(tokens, &hooks, options.chunk,
                                                             combos[i - 1].prompt.empty() ? nullptr : &out.token_nll[s]);
                    out.sequence_metrics[s] = hooks.metrics();
                    out.metrics.add(hooks.metrics());
                    out.bytes_per_slot = hooks.bytes_per_slot();
                }
                out.nll += out.sequence_nll[s];
            } catch (const model::NonFiniteError& error) {
                throw error.in_sequence(input.text.sequence_name(options.input.text_path, original[s]));
            }
        }
        ++done;
        if (std::this_thread::get_id() == main_thread) bar.update(static_cast<double>(done) / outcomes.size());
    }, tbb::simple_partitioner());
    bar.finish();
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    result.full_nll = outcomes[0].nll / result.tokens;
    result.full_ppl = std::exp(result.full_nll);
    // The full cache's record: the reference of every metric, so each is exact by definition.
    auto full_record = [&](double nll) {
        ResultRecord full;
        full.policy = "full";
        full.label = "full";
        full.budget_label = "full";
        full.nll = nll;
        full.ppl = std::exp(nll);
        full.delta_ppl = 0;
        full.retained_mass = 1.0;
        full.heavy_hitter_recall = 1.0;
        full.output_rel_error = 0.0;  // the reference itself
        full.output_cosine = 1.0;
        full.bytes_per_token = 4.0 * mc.head_dim;  // K and V at fp16, no bookkeeping
        full.compression_ratio = 1.0;
        return full;
    };
    result.records.push_back(full_record(result.full_nll));

    // A combination's record over the metrics given, its perplexity from `nll` over `tokens`
    // against the full cache's mean NLL; sequence_length 0: pooled over every sequence.
    auto combo_record = [&](std::size_t i, const StreamMetrics& metrics, double nll, long tokens, double full_nll,
                            int64_t sequence_length) {
        ResultRecord r;
        r.policy = combos[i].policy->name;
        r.label = combos[i].label;
        r.params = combos[i].params;
        r.budget = record_budget(combos[i], sequence_length);
        r.budget_label = combos[i].budget_label;
        r.layer_budgets = combos[i].layer_budgets;
        set_measured(r, metrics);
        r.policy_bytes_per_slot = outcomes[i + 1].bytes_per_slot;
        r.nll = nll / tokens;
        r.ppl = std::exp(r.nll);
        r.delta_ppl = perplexity_rise(r.nll, full_nll);
        return r;
    };
    // A combination with its own prompt split is scored on the continuation after each prompt (the
    // tokens the model predicts once the prompt is compressed, and the first one, predicted from
    // the whole prompt), against the full cache's NLL of the same tokens, summed in the same order.
    struct Scored {
        double nll = 0, full_nll = 0;
        long tokens = 0;
    };
    auto continuation = [&](std::size_t i, std::size_t s) {
        Scored scored;
        const int64_t length = static_cast<int64_t>(text.sequences[s].size());
        const int64_t prompt = combos[i].prompt.prompt_length(length);
        const std::vector<double>& own = outcomes[i + 1].token_nll[s];
        const std::vector<double>& full = outcomes[0].token_nll[s];
        for (int64_t token = prompt; token < length; ++token) {  // token j's NLL is entry j - 1
            scored.nll += own[static_cast<std::size_t>(token - 1)];
            scored.full_nll += full[static_cast<std::size_t>(token - 1)];
        }
        scored.tokens = static_cast<long>(length - prompt);
        return scored;
    };
    const bool any_split = std::any_of(combos.begin(), combos.end(), [](const ReplayCombo& c) { return !c.prompt.empty(); });
    std::vector<double> mass, recall, nll;
    for (std::size_t i = 0; i < combos.size(); ++i) {
        const Outcome& out = outcomes[i + 1];
        ResultRecord r;
        double reference = result.full_nll;
        if (combos[i].prompt.empty()) {
            r = combo_record(i, out.metrics, out.nll, result.tokens, result.full_nll, 0);
        } else {
            Scored total;
            for (std::size_t s = 0; s < text.sequences.size(); ++s) {
                const Scored one = continuation(i, s);
                total.nll += one.nll;
                total.full_nll += one.full_nll;
                total.tokens += one.tokens;
            }
            reference = total.full_nll / total.tokens;
            r = combo_record(i, out.metrics, total.nll, total.tokens, reference, 0);
        }
        mass.push_back(r.retained_mass);
        recall.push_back(r.heavy_hitter_recall);
        // Ranked by the rise in mean NLL over each one's own reference where some are scored on a
        // continuation (the same order as the NLL where every one is scored on the whole text).
        nll.push_back(any_split ? r.nll - reference : r.nll);
        result.records.push_back(r);
    }
    if (config.per_sequence)
        for (std::size_t s = 0; s < text.sequences.size(); ++s) {
            const long tokens = static_cast<long>(text.sequences[s].size()) - 1;
            const double full_nll = outcomes[0].sequence_nll[s] / tokens;
            auto in_sequence = [&](ResultRecord r) {
                r.sequence = static_cast<int>(original[s]);
                r.sequence_name = TokenizedText::trace_sequence_name(options.input.text_path, original[s]);
                result.records.push_back(std::move(r));
            };
            in_sequence(full_record(full_nll));
            for (std::size_t i = 0; i < combos.size(); ++i) {
                const int64_t length = static_cast<int64_t>(text.sequences[s].size());
                if (combos[i].prompt.empty()) {
                    in_sequence(combo_record(i, outcomes[i + 1].sequence_metrics[s], outcomes[i + 1].sequence_nll[s],
                                             tokens, full_nll, length));
                } else {
                    const Scored one = continuation(i, s);
                    in_sequence(combo_record(i, outcomes[i + 1].sequence_metrics[s], one.nll, one.tokens,
                                             one.full_nll / one.tokens, length));
                }
            }
        }
    result.configurations = combos.size();
    result.spearman_retained_mass = spearman(mass, nll);
    result.spearman_heavy_hitter_recall = spearman(recall, nll);
    return result;
}

}  // namespace kvsim
