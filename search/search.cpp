#include "search/search.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <array>
#include <map>
#include <optional>
#include <random>
#include <set>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/output_folder.h"
#include "base/sha256.h"
#include "policies/policy.h"
#include "search/allocation.h"
#include "search/streaming_fit.h"
#include "search/rank_fit.h"
#include "search/tier_fit.h"
#include "search/mixed_fit.h"
#include "sim/qkv_attention.h"
#include "sim/replay.h"
#include "sim/shard_plan.h"
#include "sim/sweep.h"
#include "sim/trace_store.h"

namespace kvsim {

std::string format_three_digits(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3g", x);
    return text;
}

namespace {

using Json = nlohmann::ordered_json;

// One unit's objective summed over its steps (lower is better) and the steps it is summed over.
double error_sum(const StreamMetrics& m, bool output_error) {
    return output_error ? m.output_rel_error : static_cast<double>(m.steps) - m.retained_mass;
}
double step_count(const StreamMetrics& m, bool output_error) {
    return static_cast<double>(output_error ? m.output_steps : m.steps);
}
// The reported objective from a sum of errors: the mean error, or the mean retained mass.
double objective_value(double errors, double steps, bool output_error) {
    const double mean = steps > 0 ? errors / steps : 0.0;
    return output_error ? mean : 1.0 - mean;
}

std::string format_number(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.6g", x);
    return text;
}

struct Method {
    std::string name, fit;
    std::vector<int> layer_budgets, head_budgets;  // head_budgets empty: one budget per layer
    double fitting_errors = 0;
    double model_bytes = 0;  // bytes per token on the held-out sequences, by the byte model
    bool adakv = false;      // Ada-KV at these budgets: the layer's heads share its total
};

// "2nd", "3rd", "4th", "11th", "21st", ...
std::string ordinal(int n) {
    const int tens = n % 100, ones = n % 10;
    const char* suffix = tens >= 11 && tens <= 13 ? "th" : ones == 1 ? "st" : ones == 2 ? "nd" : ones == 3 ? "rd" : "th";
    return std::to_string(n) + suffix;
}

// Each layer's mean of its heads' budgets, rounded: what the tables show for a head allocation.
std::vector<int> layer_means(const std::vector<int>& head_budgets, int num_layers, int num_kv_heads) {
    std::vector<int> out;
    for (int l = 0; l < num_layers; ++l) {
        int64_t sum = 0;
        for (int kv = 0; kv < num_kv_heads; ++kv) sum += head_budgets[static_cast<std::size_t>(l) * num_kv_heads + kv];
        out.push_back(static_cast<int>((sum + num_kv_heads / 2) / num_kv_heads));
    }
    return out;
}

std::string join(const std::vector<int>& v, const char* sep) {
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
    return s;
}

// "0.58 0.8 0.4": per-layer ratios for tables.
std::string ratios_text(const std::vector<double>& ratios) {
    std::string text;
    for (double r : ratios) text += (text.empty() ? "" : " ") + format_number(r);
    return text;
}

// What a record keeps, for tables: its layer budgets, or how many heads stream.
std::string budgets_text(const SearchRecord& r) {
    if (r.mixed) {
        const MixedPlan& m = *r.mixed;
        return std::to_string(m.count(HeadMethod::evict)) + " evict, " + std::to_string(m.count(HeadMethod::tiers)) +
               " tiers, " + std::to_string(m.count(HeadMethod::streaming)) + " stream, " +
               std::to_string(m.count(HeadMethod::full)) + " full of " + std::to_string(m.method.size()) + " heads";
    }
    if (r.fit == "ranks") {
        if (r.replay_policy == "group_heads")
            return "groups of " + std::to_string(static_cast<int>(r.replay_params.at("group"))) + " KV heads";
        double key = 0, value = 0;
        for (std::size_t u = 0; u < r.key_rank.size(); ++u) key += r.key_rank[u], value += r.value_rank[u];
        char text[160];
        std::snprintf(text, sizeof text, "mean rank K %.3g, V %.3g %s", key / r.key_rank.size(),
                      value / r.value_rank.size(), r.replay_params.at("joint") == 1 ? "per layer (joint)" : "per KV head");
        return text;
    }
    if (r.tiers.num_layers > 0) {
        double f = 0, e = 0, q = 0;
        for (std::size_t u = 0; u < r.tiers.fp16.size(); ++u) f += r.tiers.fp16[u], e += r.tiers.int8[u], q += r.tiers.int4[u];
        const double n = static_cast<double>(r.tiers.fp16.size());
        char text[160];
        std::snprintf(text, sizeof text, "mean shares FP16 %.3f, INT8 %.3f, INT4 %.3f (sinks %d, recent %d)", f / n,
                      e / n, q / n, static_cast<int>(r.replay_params.at("sinks")), static_cast<int>(r.replay_params.at("recent")));
        return text;
    }
    if (!r.prompt_ratios.empty()) return "ratios " + ratios_text(r.prompt_ratios) + " of the prompt";
    if (r.streaming_heads.empty()) return join(r.layer_budgets, " ");
    const auto streaming = std::count(r.streaming_heads.begin(), r.streaming_heads.end(), uint8_t{1});
    std::size_t stateless = 0;
    for (std::size_t u = 0; u < r.stateless.size(); ++u) stateless += r.streaming_heads[u] && r.stateless[u];
    const std::string kinds = r.stateless.empty()     ? ""
                              : stateless == 0        ? ", each with a state"
                              : stateless == static_cast<std::size_t>(streaming) ? ", none with a state"
                                                      : ", " + std::to_string(stateless) + " without a state";
    return std::to_string(streaming) + " of " + std::to_string(r.streaming_heads.size()) + " heads stream (sinks " +
           std::to_string(r.streaming_sinks) + ", recent " + std::to_string(r.streaming_recent) + kinds + ")";
}

}  // namespace

// What every part of a search starts from, checked: the trace, the objective and fits, the
// policy, the split, the grid and the replay options. A whole search and a shard of its grid
// replay both begin here, so they refuse the same input and measure the same units.
struct SearchSetup {
    SearchSetup(const SearchSpec& spec, const SearchRun& run);
    void set_up_prompts(const SearchSpec& spec, const SearchRun& run);  // deploy kvpress

    TraceReader reader;
    SearchOutcome out;  // trace, objective, split, shape and grid filled in
    bool qkv = false, output_error = false;
    bool fit_layers = false, fit_heads = false, fit_streaming = false, fit_tiers = false, fit_budgets = false,
         fit_ranks = false, fit_mixed = false;
    const PolicyDescriptor* policy = nullptr;
    ParamValues params;
    std::vector<int> heldout, fitting;  // indices into the trace
    std::unique_ptr<AttentionSource> fitting_source, heldout_source;
    int num_layers = 0, num_kv_heads = 0, head_dim = 0;
    std::optional<ByteModel> heldout_bytes;
    // deploy kvpress: each fitting and held-out sequence's prompt, and the held-out bytes.
    std::vector<int64_t> fitting_prompts, heldout_prompts;
    std::optional<PromptByteModel> prompt_bytes;
    HarnessOptions harness;
    ReplayOptions options;
    double full_fp16 = 0;  // bytes per token of the full fp16 cache on the held-out sequences
    // The grid budgets the budget fits measure first, side by side: every one, or with
    // search.coarse_grid every coarse_grid-th and the last (indices into out.grid, ascending).
    std::vector<std::size_t> first_pass;
    std::vector<int> first_pass_budgets;
    // The full cache's outputs at the measured steps, computed once for every fit's replays: on
    // issue 34's 1B case (8 x 4,096 tokens, output error on 1/8 of the steps) they take 1.07 GB.
    // At most a quarter of the memory limit (--max-memory), so a smaller machine keeps fewer.
    FullOutputMemo full_outputs{static_cast<std::size_t>(std::min<uint64_t>(kSearchFullOutputBytes, memory_limit_bytes() / 4))};
};

SearchSetup::SearchSetup(const SearchSpec& spec, const SearchRun& run) : reader(run.trace_path) {
    const TraceMetadata& meta = reader.metadata();
    qkv = meta.kind == TraceKind::qkv;
    out.trace = run.trace_path;
    out.attention_view = run.attention_view;
    out.sample_steps = spec.sample_steps;
    out.sample_seed = spec.sample_seed;
    out.objective = spec.objective.empty() ? (qkv ? "output_rel_error" : "retained_mass") : spec.objective;
    output_error = out.objective == "output_rel_error";
    auto fits = [&](const char* name) { return std::find(spec.fits.begin(), spec.fits.end(), name) != spec.fits.end(); };
    fit_layers = fits("layer_budgets");
    fit_heads = fits("head_budgets");
    fit_streaming = fits("streaming");
    fit_tiers = fits("tiers");
    fit_budgets = fit_layers || fit_heads;
    fit_ranks = fits("ranks");
    fit_mixed = fits("mixed");
    out.deploy = spec.deploy;
    // What each deployment can run: kvpress's per-layer press takes one ratio per layer;
    // DuoAttention streams whole heads, with no state.
    for (const std::string& fit : spec.fits) {
        if (spec.deploy == "kvpress" && fit != "layer_budgets")
            throw InputError(spec.fits_where + ": deploy kvpress fits per-layer ratios (layer_budgets): kvpress's "
                                               "per-layer press takes one compression ratio per layer, and runs no " +
                             fit);
        if (spec.deploy == "duo" && fit != "streaming")
            throw InputError(spec.fits_where + ": deploy duo fits streaming heads (streaming): DuoAttention's pattern "
                                               "says which heads stream, and holds no " + fit);
    }
    const PolicyDescriptor* named = spec.policy.name.empty() ? nullptr : find_policy(spec.policy.name);
    if (named && spec.deploy == "kvpress" && !named->prompt_press)
        throw InputError(spec.policy.where + ": deploy kvpress fits the ratios of a kvpress press, and " +
                         spec.policy.name + " evicts while decoding (presses: snapkv_press, tova_press, "
                         "observed_attention_press, knorm_press, streaming_llm_press, keydiff_press, cur_press, "
                         "lagkv_press, noncausal_press)");
    if (named && spec.deploy != "kvpress" && named->prompt_press)
        throw InputError(spec.policy.where + ": " + spec.policy.name + " compresses a prompt once, as kvpress does: "
                                             "give search.deploy: kvpress and search.prompt");
    if (spec.deploy == "duo" && spec.streaming_recent < 2)
        throw InputError(spec.streaming_where + ".recent: DuoAttention keeps recent_size = recent - 1 tokens before the "
                                                "current one and needs at least 1: give recent >= 2");
    if (spec.deploy != "kvsim" && !qkv)
        throw InputError(spec.deploy_where + ": deploy " + spec.deploy + " is fitted by output error on queries, keys "
                                             "and values, but " + run.trace_path + " records attention only");
    if (fit_ranks && (!qkv || !output_error))
        throw InputError(spec.fits_where + ": ranks are fitted by their output error on keys and values, which needs a "
                                           "Q/K/V trace and objective output_rel_error");
    if (fit_mixed && (!qkv || !output_error))
        throw InputError(spec.fits_where + ": a mixed profile is fitted by each head's output error, which needs a "
                                           "Q/K/V trace and objective output_rel_error");
    if (fit_mixed && !fit_budgets && !fit_tiers && !fit_streaming)
        throw InputError(spec.fits_where + ": mixed chooses per head among the families fitted beside it: give at "
                                           "least one of head_budgets, layer_budgets, tiers or streaming");
    if (output_error && !qkv)
        throw InputError(spec.objective_where + ": output_rel_error needs a Q/K/V trace, but " + run.trace_path +
                         " records attention only (use objective: retained_mass)");
    if (fit_streaming && qkv && !output_error)
        throw InputError(spec.objective_where + ": streaming heads are fitted and reported by their output error; "
                                                "with fit: [streaming] the objective must be output_rel_error");
    if (!qkv && fit_streaming)
        throw InputError(spec.fits_where + ": streaming heads are fitted by their output error, which needs a Q/K/V "
                                           "trace, but " + run.trace_path + " records attention only");
    if (fit_tiers && qkv && !output_error)
        throw InputError(spec.objective_where + ": tier profiles are fitted and reported by their output error "
                                                "(precision leaves retained mass unchanged); with fit: [tiers] the "
                                                "objective must be output_rel_error");
    harness = named_harness_options(run.attention_view, run.group_reduce, qkv, 0, run.config_file);
    // A search by output error reads no retained mass or heavy-hitter hits: not summed.
    harness.attention_metrics = !output_error;
    if (!qkv && fit_tiers)
        throw InputError(spec.fits_where + ": tier profiles are fitted by their output error, which needs a Q/K/V "
                                           "trace, but " + run.trace_path + " records attention only");
    if (spec.coarse_grid > 0 && (!fit_budgets || spec.deploy == "kvpress"))
        throw InputError(spec.coarse_grid_where + ": refines the budget fits' grid, and " +
                         (fit_budgets ? "deploy kvpress fits prompt ratios instead; remove search.coarse_grid"
                                      : "search.fit has no layer_budgets or head_budgets; remove search.coarse_grid or add one"));
    if (spec.screen_steps > 0 && !fit_tiers)
        throw InputError(spec.screen_where + ": screens the tier fit's candidates on a prefix, and search.fit has no "
                                             "tiers; remove search.screen or add tiers to search.fit");
    if (meta.head_dim <= 0)
        throw InputError(run.trace_path + ": the trace records no head size, and byte targets are counted from it");

    // The split.
    const int count = static_cast<int>(reader.sequences().size());
    heldout = search_heldout_indices(spec, count, run.trace_path);
    for (int s = 0; s < count; ++s)
        if (!std::binary_search(heldout.begin(), heldout.end(), s)) fitting.push_back(s);
    for (int s : fitting) out.fitting_sequences.push_back(reader.sequences()[s].name);
    for (int s : heldout) out.heldout_sequences.push_back(reader.sequences()[s].name);
    out.fitting_indices = fitting;
    out.heldout_indices = heldout;

    fitting_source = open_trace_source(run.trace_path, run.max_steps, fitting);
    heldout_source = open_trace_source(run.trace_path, run.max_steps, heldout);
    const AttentionShape& shape = fitting_source->shape();
    num_layers = shape.num_layers;
    num_kv_heads = shape.num_kv_heads;
    head_dim = static_cast<int>(meta.head_dim);
    const int L = num_layers, K = num_kv_heads;
    out.shape = {meta.model_name, L, shape.num_query_heads, K, head_dim};
    full_fp16 = 4.0 * head_dim;
    if (spec.sample_steps < 1 && !output_error)
        throw InputError(spec.sample_where + ": samples the output error, but the objective is " +
                         out.objective + " (" + run.trace_path + (qkv ? ")" : " records attention only)"));
    options = search_replay_options(spec, harness, output_error, qkv);
    options.full_outputs = &full_outputs;

    if (spec.deploy == "kvpress") {
        set_up_prompts(spec, run);
        return;
    }
    if (!fit_budgets && spec.policy.name.empty()) {  // streaming heads alone (DuoAttention's): no policy, no grid
        for (const SearchTarget& target : spec.targets)
            if (target.bytes(full_fp16) >= full_fp16) {
                char detail[160];
                std::snprintf(detail, sizeof detail, "%.4g bytes per token is at or above the %.4g of keeping every token",
                              target.bytes(full_fp16), full_fp16);
                throw InputError(target.where + ": " + target.label + " (" + detail + "): nothing to fit");
            }
        return;
    }

    // The policy whose budgets are fitted.
    policy = find_policy(spec.policy.name);
    if (!policy)
        throw InputError(spec.policy.where + ": unknown policy '" + spec.policy.name + "' (known: " +
                         known_policy_names() + ")");
    if (policy->keeps_everything)
        throw InputError(spec.policy.where + ": " + spec.policy.name + " keeps every token; search fits eviction budgets");
    params = resolve_params(*policy, spec.policy.params, spec.policy.where);

    // The budget grid: from the smallest budget the policy accepts to the longest sequence.
    int64_t longest = 1;
    for (int64_t last : fitting_source->shape().last_steps) longest = std::max(longest, last);
    for (int64_t last : heldout_source->shape().last_steps) longest = std::max(longest, last);
    int lowest = 1;
    if (policy->check_budget) {
        const std::string problem = policy->check_budget(params, static_cast<int>(std::min<int64_t>(longest, kMaxBudgetTokens)));
        if (!problem.empty())
            throw InputError(spec.policy.where + ": " + problem + ", the longest sequence's decode steps: nothing to evict");
    }
    while (policy->check_budget && !policy->check_budget(params, lowest).empty() && lowest < longest) ++lowest;
    out.grid = spec.grid.empty() ? budget_grid(lowest, static_cast<int>(std::min<int64_t>(longest, kMaxBudgetTokens)), L)
                                 : spec.grid;
    if (policy->check_budget) {
        const std::string problem = policy->check_budget(params, out.grid.front());
        if (!problem.empty()) throw InputError(spec.grid_where + ": " + problem + " (the grid's smallest budget)");
    }
    first_pass = grid_stride_indices(out.grid.size(), std::max(spec.coarse_grid, 1));
    for (std::size_t i : first_pass) first_pass_budgets.push_back(out.grid[i]);

    const int slot_bytes = static_cast<int>(
        policy->make(params, PolicyContext{out.grid.front(), out.grid.front() + 1, 0, L, 0, K, head_dim})->bytes_per_slot());
    heldout_bytes.emplace(heldout_source->shape().last_steps, head_dim, slot_bytes);

    // Every target must lie between what the smallest grid budget holds and the full cache.
    full_fp16 = heldout_bytes->full_fp16_bytes_per_token();
    for (const SearchTarget& target : spec.targets) {
        const double bytes = target.bytes(full_fp16);
        const double floor_bytes = heldout_bytes->bytes_per_token(out.grid.front());
        const double ceiling_bytes = heldout_bytes->bytes_per_token(out.grid.back());
        char detail[160];
        if (fit_budgets && bytes < floor_bytes) {
            std::snprintf(detail, sizeof detail, "%.4g bytes per token is below the %.4g that budget %d alone holds",
                          bytes, floor_bytes, out.grid.front());
            throw InputError(target.where + ": " + target.label + " (" + detail + ": " + spec.policy.name +
                             "'s recent window, sinks and bookkeeping need at least that)");
        }
        if (bytes >= ceiling_bytes) {
            std::snprintf(detail, sizeof detail, "%.4g bytes per token is at or above the %.4g of keeping every token",
                          bytes, ceiling_bytes);
            throw InputError(target.where + ": " + target.label + " (" + detail + "): nothing to fit");
        }
    }
}

// deploy kvpress: the press, each sequence's prompt (every one must leave a continuation), the
// grid of kept shares and the targets' room between its ends.
void SearchSetup::set_up_prompts(const SearchSpec& spec, const SearchRun& run) {
    policy = find_policy(spec.policy.name);
    if (!policy)
        throw InputError(spec.policy.where + ": unknown policy '" + spec.policy.name + "' (known: " +
                         known_policy_names() + ")");
    params = resolve_params(*policy, spec.policy.params, spec.policy.where);
    auto prompts_of = [&](const AttentionSource& source, const std::vector<int>& indices) {
        std::vector<int64_t> prompts;
        for (std::size_t i = 0; i < indices.size(); ++i) {
            const int64_t length = source.shape().sequence_lengths[i];
            const int64_t prompt = spec.prompt.prompt_length(length);
            if (prompt < 2 || prompt > source.shape().last_steps[i])
                throw InputError(spec.prompt_where + ": " + spec.prompt.describe() + " of sequence " +
                                 source.shape().sequence_names[i] + " (" + std::to_string(length) + " tokens" +
                                 (run.max_steps > 0 ? ", " + std::to_string(source.shape().last_steps[i]) + " steps replayed" : "") +
                                 ") leave" + (spec.prompt.tokens > 0 ? "" : "s") + " no prompt of 2 tokens and a "
                                 "continuation after it");
            prompts.push_back(prompt);
        }
        return prompts;
    };
    fitting_prompts = prompts_of(*fitting_source, fitting);
    heldout_prompts = prompts_of(*heldout_source, heldout);
    prompt_bytes.emplace(heldout_prompts, heldout_source->shape().last_steps, head_dim);
    if (spec.grid.empty())  // kept shares of 2% to 100% of the prompt
        for (int kept = 20; kept <= 1000; kept += 20) out.grid.push_back(kept);
    else
        out.grid = spec.grid;
    options.harness.bookkeeping = false;  // kvpress holds K and V alone
    const double floor_bytes = prompt_bytes->bytes_per_token(out.grid.front());
    const double ceiling_bytes = prompt_bytes->bytes_per_token(1000);
    for (const SearchTarget& target : spec.targets) {
        const double bytes = target.bytes(full_fp16);
        char detail[200];
        if (bytes < floor_bytes) {
            std::snprintf(detail, sizeof detail,
                          "%.4g bytes per token is below the %.4g that keeping %g%% of every prompt holds", bytes,
                          floor_bytes, out.grid.front() / 10.0);
            throw InputError(target.where + ": " + target.label + " (" + detail +
                             " with its continuation, all of which kvpress keeps): give a longer prompt or a smaller "
                             "target");
        }
        if (bytes >= ceiling_bytes) {
            std::snprintf(detail, sizeof detail, "%.4g bytes per token is at or above the %.4g of keeping every token",
                          bytes, ceiling_bytes);
            throw InputError(target.where + ": " + target.label + " (" + detail + "): nothing to fit");
        }
    }
}

namespace {

// Where each pass's units start among a layer's, and how many plans a layer of it holds.
struct PassRange {
    std::size_t offset, plans;
};

std::array<PassRange, 5> pass_ranges(const SearchPassPlans& plans) {
    std::array<PassRange, 5> out{};
    std::size_t offset = 0;
    for (std::size_t pass = 0; pass < plans.size(); ++pass) {
        out[pass] = {offset, plans[pass]};
        offset += plans[pass];
    }
    return out;
}

std::size_t units_per_layer(const SearchPassPlans& plans) {
    std::size_t n = 0;
    for (std::size_t p : plans) n += p;
    return n;
}

std::size_t unit_total(const SearchPassPlans& plans, int layers) {
    return units_per_layer(plans) * static_cast<std::size_t>(layers);
}

// One pass's results from its units' streams, each (layer, KV head) summed over the pass's
// sequences in the order replay() sums them, so every figure is the same bits.
std::vector<ComboResult> combine_units(const std::vector<SearchUnitResult>& units, PassRange range, std::size_t sequences,
                                       int layers, int kv_heads) {
    const auto K = static_cast<std::size_t>(kv_heads);
    const std::size_t per_layer = units.size() / static_cast<std::size_t>(layers);
    std::vector<ComboResult> results(range.plans);
    for (ComboResult& r : results) r.by_stream.resize(sequences * layers * K);
    for (int layer = 0; layer < layers; ++layer)
        for (std::size_t plan = 0; plan < range.plans; ++plan) {
            const std::size_t u = static_cast<std::size_t>(layer) * per_layer + range.offset + plan;
            if (u >= units.size() || units[u].streams.size() != sequences * K)
                throw std::logic_error("search: unit streams missing");
            for (std::size_t s = 0; s < sequences; ++s)
                for (std::size_t kv = 0; kv < K; ++kv)
                    results[plan].by_stream[(s * layers + layer) * K + kv] = units[u].streams[s * K + kv];
        }
    for (ComboResult& r : results) sum_streams(r, sequences, layers, kv_heads);
    return results;
}

// A screened tier fit's options per (layer, KV head), from the first tier-errors unit of each
// layer (the merge checked that every tier unit of a layer carries the same); empty where the
// units carry none (an unscreened fit).
std::vector<std::vector<std::size_t>> combine_tier_options(const std::vector<SearchUnitResult>& units, PassRange range,
                                                           int layers, int kv_heads) {
    const auto K = static_cast<std::size_t>(kv_heads);
    const std::size_t per_layer = units.size() / static_cast<std::size_t>(layers);
    std::vector<std::vector<std::size_t>> kept;
    if (range.plans == 0) return kept;
    for (int layer = 0; layer < layers; ++layer) {
        const SearchUnitResult& unit = units.at(static_cast<std::size_t>(layer) * per_layer + range.offset);
        if (unit.tier_options.empty()) return {};
        if (unit.tier_options.size() != K) throw std::logic_error("search: tier options missing");
        kept.insert(kept.end(), unit.tier_options.begin(), unit.tier_options.end());
    }
    return kept;
}

// The streaming pass's per-layer head fits, per (layer, KV head).
std::vector<StreamingHeadFit> combine_streaming_units(const std::vector<SearchUnitResult>& units, PassRange range,
                                                      int layers, int kv_heads) {
    std::vector<StreamingHeadFit> heads;
    const std::size_t per_layer = units.size() / static_cast<std::size_t>(layers);
    for (int layer = 0; layer < layers; ++layer) {
        const std::size_t u = static_cast<std::size_t>(layer) * per_layer + range.offset;
        if (u >= units.size() || units[u].heads.size() != static_cast<std::size_t>(kv_heads))
            throw std::logic_error("search: streaming unit missing");
        heads.insert(heads.end(), units[u].heads.begin(), units[u].heads.end());
    }
    return heads;
}

// Each pass's plans a layer, as a search's shards number their units (SearchShardWork) and its
// merge reads them back.
SearchPassPlans search_pass_plans(const SearchSpec& spec, const SearchSetup& setup) {
    SearchPassPlans plans{};
    if (setup.fit_budgets) plans[0] = setup.first_pass.empty() ? setup.out.grid.size() : setup.first_pass.size();
    if (setup.fit_tiers) {
        const TierFitPlans tiers = tier_fit_plans(spec, setup.num_layers, setup.num_kv_heads);
        plans[2] = tier_option_count(spec, tiers);
        plans[1] = plans[2] + tiers.scales.size();
    }
    if (setup.fit_streaming && spec.deploy == "kvsim") plans[3] = 1;  // deploy duo's fit is not sharded
    if (setup.fit_ranks) plans[4] = rank_fit_plan_count(setup.head_dim, setup.num_kv_heads);
    return plans;
}

// What a shard's fits replay with: the whole search's input, without the mixed fit's tables.
FitInput shard_fit_input(const SearchSpec& spec, SearchSetup& setup, const std::string& scratch,
                         const std::string& trace_path, std::function<void(double)> progress) {
    return FitInput{&spec, setup.fitting_source.get(), setup.heldout_source.get(), setup.out.shape, setup.harness, scratch,
                    std::move(progress), trace_path, setup.fitting, nullptr, &setup.full_outputs};
}

}  // namespace

SearchShardWork::SearchShardWork(const SearchSpec& spec, const SearchRun& run)
    : setup_(std::make_unique<SearchSetup>(spec, run)), spec_(spec), trace_path_(run.trace_path), max_steps_(run.max_steps),
      progress_(run.progress) {
    if (spec.deploy != "kvsim")
        throw InputError(spec.deploy_where + ": --shard divides the measurements of kvsim's budget, tier, streaming "
                                             "and rank fits; a search that deploys to " + spec.deploy +
                         " runs on one machine (without --shard)");
    // Every search fits one of them: a mixed fit alone is refused by the setup.
    if (!setup_->fit_budgets && !setup_->fit_tiers && !setup_->fit_streaming && !setup_->fit_ranks)
        throw std::logic_error("search shards: no fit to divide");
    pass_plans_ = search_pass_plans(spec, *setup_);
}

SearchShardWork::~SearchShardWork() = default;

const std::vector<int>& SearchShardWork::grid() const {
    static const std::vector<int> none;
    return setup_->fit_budgets ? setup_->first_pass_budgets : none;
}
const SearchPassPlans& SearchShardWork::pass_plans() const { return pass_plans_; }
int SearchShardWork::num_layers() const { return setup_->num_layers; }
int SearchShardWork::num_kv_heads() const { return setup_->num_kv_heads; }
std::size_t SearchShardWork::unit_count() const { return unit_total(pass_plans_, num_layers()); }
const std::vector<std::string>& SearchShardWork::fitting_sequences() const { return setup_->out.fitting_sequences; }
const std::vector<std::string>& SearchShardWork::heldout_sequences() const { return setup_->out.heldout_sequences; }

std::string SearchShardWork::unit_description() const {
    std::vector<std::string> parts;
    if (pass_plans_[0]) parts.push_back("grid budgets x layers");
    if (pass_plans_[1]) parts.push_back("tier plans x layers, for bytes and for errors");
    if (pass_plans_[3]) parts.push_back("streaming fits of a layer");
    if (pass_plans_[4]) parts.push_back("rank plans x layers");
    std::string text;
    for (std::size_t i = 0; i < parts.size(); ++i) text += (i ? "; " : "") + parts[i];
    return text;
}

SearchUnit SearchShardWork::unit(std::size_t index) const { return search_unit(index, pass_plans_, num_layers()); }

SearchUnit search_unit(std::size_t index, const SearchPassPlans& plans, int layers) {
    if (index >= unit_total(plans, layers)) throw std::out_of_range("search: no such unit");
    const std::size_t per_layer = units_per_layer(plans), within = index % per_layer;
    const std::array<PassRange, 5> ranges = pass_ranges(plans);
    std::size_t pass = 0;
    while (within >= ranges[pass].offset + ranges[pass].plans) ++pass;
    return SearchUnit{static_cast<SearchUnit::Pass>(pass), static_cast<int>(index / per_layer), within - ranges[pass].offset};
}

void SearchShardWork::run_units(const std::vector<std::size_t>& units, const LayerDone& layer_done) {
    using Pass = SearchUnit::Pass;
    SearchSetup& setup = *setup_;
    const SearchSpec& spec = spec_;
    // The units by layer and pass, in unit order: one lockstep replay (or one layer's fit) each.
    std::map<std::pair<int, int>, std::vector<std::size_t>> groups;
    bool any_tier_unit = false, any_streaming_unit = false, any_rank_unit = false;
    for (std::size_t u : units) {
        const SearchUnit unit = this->unit(u);
        groups[{unit.layer, static_cast<int>(unit.pass)}].push_back(u);
        any_tier_unit = any_tier_unit || unit.pass == Pass::tier_bytes || unit.pass == Pass::tier_errors;
        any_streaming_unit = any_streaming_unit || unit.pass == Pass::streaming;
        any_rank_unit = any_rank_unit || unit.pass == Pass::rank_errors;
    }
    const auto K = static_cast<std::size_t>(setup.num_kv_heads);
    const int L = setup.num_layers;
    // The plans stratigraphic and streaming_attention read, and the bases lowrank reads.
    std::optional<TempFolder> scratch;
    if (any_tier_unit || any_streaming_unit || any_rank_unit) scratch.emplace("search");
    auto fit_input = [&](std::function<void(double)> progress) {
        FitInput input = shard_fit_input(spec, setup, scratch->path(), trace_path_, std::move(progress));
        input.max_steps = max_steps_;
        return input;
    };
    // A target a fit cannot reach is refused before hours of its units, as on one machine.
    std::optional<TierFitPlans> tier_plans;
    std::map<int, TierOptions> tier_options_of_layer;
    if (any_tier_unit) {
        tier_plans = tier_fit_plans(spec, L, setup.num_kv_heads);
        (void)refuse_unreachable_tier_targets(fit_input(nullptr), *tier_plans);
    }
    if (any_streaming_unit) refuse_unreachable_streaming_targets(fit_input(nullptr));
    // The rank plans read the bases fitted on the fitting sequences, as the whole fit's do.
    std::string bases_path;
    if (any_rank_unit) {
        bases_path = scratch->path() + "/bases.h5";
        (void)fit_rank_bases(fit_input(nullptr), bases_path);
    }

    std::size_t groups_done = 0;
    for (const auto& [key, group_units] : groups) {
        const int layer = key.first;
        const auto pass = static_cast<Pass>(key.second);
        std::function<void(double)> progress;
        if (progress_)
            progress = [&, count = groups.size()](double f) {
                progress_((static_cast<double>(groups_done) + std::min(f, 1.0)) / static_cast<double>(count));
            };
        std::vector<std::size_t> plans;  // each unit's plan in its pass, in unit order
        for (std::size_t u : group_units) plans.push_back(unit(u).plan);
        std::vector<SearchUnitResult> out(group_units.size());
        if (pass == Pass::streaming) {
            out.front().heads = fit_streaming_layer(fit_input(progress), layer);
        } else {
            AttentionSource& source = pass == Pass::tier_bytes ? *setup.heldout_source : *setup.fitting_source;
            std::vector<ComboResult> results;
            if (pass == Pass::grid) {
                const std::vector<ReplayCombo> combos = expand_sweep({spec.policy}, {}, grid());
                std::vector<ReplayCombo> layer_combos;
                for (std::size_t plan : plans) layer_combos.push_back(combos[plan]);
                ReplayOptions options = setup.options;
                options.layers = {layer};
                options.progress = progress;
                results = replay(source, layer_combos, options);
            } else if (pass == Pass::rank_errors) {
                results = replay_rank_plans(fit_input(nullptr), bases_path, plans, {layer}, progress);
            } else {
                // A screened layer's options come from its own screen, which every shard with a
                // unit of the layer replays: the same options as one machine's.
                auto options = tier_options_of_layer.find(layer);
                if (options == tier_options_of_layer.end())
                    options = tier_options_of_layer.emplace(layer, tier_options(fit_input(nullptr), *tier_plans, {layer}, nullptr)).first;
                std::vector<TierShares> shares;
                for (std::size_t plan : plans) shares.push_back(options->second.plans.at(plan));
                results = replay_tier_plans(fit_input(nullptr), tier_plans->params, source, shares,
                                            pass == Pass::tier_errors, {layer}, progress);
                if (options->second.screen_steps > 0)
                    for (SearchUnitResult& r : out)
                        for (std::size_t kv = 0; kv < K; ++kv)
                            r.tier_options.push_back(options->second.kept.at(static_cast<std::size_t>(layer) * K + kv));
            }
            // Each unit's streams: its layer's, per (sequence, KV head).
            const std::size_t sequences = source.shape().sequence_names.size();
            for (std::size_t i = 0; i < group_units.size(); ++i)
                for (std::size_t s = 0; s < sequences; ++s)
                    for (std::size_t kv = 0; kv < K; ++kv)
                        out[i].streams.push_back(results[i].by_stream[(s * L + layer) * K + kv]);
        }
        ++groups_done;
        layer_done(group_units, out);
    }
}

double output_error_interval(const StreamMetrics& m) {
    if (m.output_steps == 0 || !(m.output_error_variance > 0)) return 0.0;
    return 1.96 * std::sqrt(m.output_error_variance) / static_cast<double>(m.output_steps);
}

ReplayOptions search_replay_options(const SearchSpec& spec, const HarnessOptions& harness, bool output_error,
                                    bool memory) {
    ReplayOptions options;
    options.harness = harness;
    options.output_error = output_error;
    options.memory = memory;
    options.output_error_sample = spec.sample_steps;
    options.output_error_seed = spec.sample_seed;
    return options;
}

SearchRecord output_error_record(std::string method, std::string fit, const std::string& target,
                                 double fitting_errors, double fitting_steps, const StreamMetrics& heldout) {
    SearchRecord r;
    r.method = std::move(method);
    r.fit = std::move(fit);
    r.target = target;
    r.objective = "output_rel_error";
    r.fitting = fitting_steps > 0 ? fitting_errors / fitting_steps : 0.0;
    r.heldout = heldout.output_steps > 0 ? heldout.output_rel_error / static_cast<double>(heldout.output_steps) : 0.0;
    r.heldout_interval = output_error_interval(heldout);
    r.bytes_per_token = heldout.cache_bytes / static_cast<double>(heldout.context_tokens);
    r.compression_ratio = heldout.fp16_bytes / heldout.cache_bytes;
    return r;
}

// The held-out indices: as listed, or a seeded draw of a fraction (Fisher-Yates on mt19937_64,
// whose output the C++ standard fixes, so the split is the same on every platform).
std::vector<int> search_heldout_indices(const SearchSpec& spec, int count, const std::string& trace) {
    std::vector<int> heldout = spec.heldout;
    if (heldout.empty()) {
        std::vector<int> order(count);
        for (int i = 0; i < count; ++i) order[i] = i;
        std::mt19937_64 rng(spec.seed);
        for (int i = count - 1; i > 0; --i) std::swap(order[i], order[static_cast<int>(rng() % (i + 1))]);
        const int take = std::max(1, static_cast<int>(std::lround(spec.heldout_fraction * count)));
        heldout.assign(order.begin(), order.begin() + std::min(take, count));
    }
    for (int s : heldout)
        if (s >= count)
            throw InputError(spec.split_where + ": sequence " + std::to_string(s) + " is not in " + trace + " (it has " +
                             std::to_string(count) + ", numbered from 0)");
    std::sort(heldout.begin(), heldout.end());
    if (static_cast<int>(heldout.size()) >= count)
        throw InputError(spec.split_where + ": the split leaves no fitting sequence (" + trace + " has " +
                         std::to_string(count) + ")");
    return heldout;
}

namespace {

// deploy kvpress: per-layer compression ratios of each sequence's prompt for the search's press,
// as kvpress's per-layer press applies them (each layer's heads keep int(prompt * (1 - ratio)) of
// the prompt, then decoding appends), against one ratio everywhere and the depth schedules, all
// at the same bytes on the held-out continuations. Per-layer curves come from one lockstep pass
// over the fitting sequences, every grid ratio in every layer at once (layers are independent on
// a trace); the allocators are the budget fits', over kept shares of the prompt.
void fit_prompt_ratios(SearchSetup& setup, const SearchSpec& spec, const SearchRun& run,
                       const std::function<void(double)>& progress, std::vector<std::string>& curve_notes) {
    SearchOutcome& out = setup.out;
    const bool output_error = setup.output_error;
    const int L = setup.num_layers;
    const std::vector<int>& grid = out.grid;
    const PromptByteModel& bytes = *setup.prompt_bytes;
    PolicyEntry press = spec.policy;
    press.prompt = spec.prompt;
    press.bookkeeping = false;
    auto column = [&](std::string label, const std::vector<int>& kept) {
        BudgetColumn c;
        c.label = std::move(label);
        c.where = spec.where;
        for (int k : kept) c.prompt_ratios.push_back(kvpress_ratio(k));
        c.budget = 0;
        return c;
    };
    std::vector<BudgetColumn> grid_columns;
    for (int g : grid) grid_columns.push_back(column("ratio " + format_number(kvpress_ratio(g)), std::vector<int>(L, g)));
    ReplayOptions options = setup.options;
    if (run.progress) options.progress = [&](double f) { progress(0.7 * f); };
    const std::vector<ComboResult> measured = replay(*setup.fitting_source, expand_sweep({press}, {}, grid_columns), options);
    std::vector<UnitCurve> curves(L);
    for (int l = 0; l < L; ++l) {
        curves[l].name = "layer " + std::to_string(l);
        for (const ComboResult& r : measured) curves[l].error.push_back(error_sum(r.by_layer[l], output_error));
    }
    const double fitting_steps = step_count(measured.front().total, output_error);

    struct RatioMethod {
        const SearchTarget* target;
        std::string name;
        std::vector<int> kept;  // per layer, a grid value
        bool fitted = false;
    };
    std::vector<RatioMethod> methods;
    const int default_ratio =
        static_cast<int>(resolve_params(*find_policy("pyramidkv"), {}, "pyramidkv").at("pyramid_ratio"));
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(setup.full_fp16);
        auto best_shape = [&](auto weights_of, const std::vector<double>& candidates, double& best_value) {
            Allocation best;
            double best_error = std::numeric_limits<double>::infinity();
            for (double c : candidates) {
                const Allocation a = allocate_by_shape(weights_of(c), grid, bytes, wanted);
                const double e = allocation_error(curves, grid, a.budgets);
                if (e < best_error) best = a, best_error = e, best_value = c;
            }
            return best;
        };
        methods.push_back({&target, "uniform ratio", allocate_by_shape(std::vector<double>(L, 1.0), grid, bytes, wanted).budgets});
        methods.push_back({&target, "PyramidKV schedule (ratio " + std::to_string(default_ratio) + ")",
                           allocate_by_shape(pyramid_weights(L, default_ratio), grid, bytes, wanted).budgets});
        double ratio = 0, slope = 0;
        const Allocation pyramid = best_shape([&](double r) { return pyramid_weights(L, static_cast<int>(r)); },
                                              {2, 3, 4, 6, 8, 12, 16, 20, 32, 64}, ratio);
        methods.push_back({&target, "PyramidKV schedule (best ratio " + format_number(ratio) + ")", pyramid.budgets});
        const Allocation inverted = best_shape([&](double x) { return inverted_weights(L, x); },
                                               {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9}, slope);
        methods.push_back({&target, "inverted schedule (best slope " + format_number(slope) + ")", inverted.budgets});
        methods.push_back({&target, "fitted layer ratios", allocate_by_marginal_gain(curves, grid, bytes, wanted).budgets,
                           true});
    }
    std::size_t non_convex = 0, above = 0;
    for (const UnitCurve& c : curves) {
        const CurveShape shape = curve_shape(c, grid, bytes);
        non_convex += !shape.above_hull.empty();
        above += shape.above_hull.size();
    }
    char line[300];
    std::snprintf(line, sizeof line,
                  "%zu of %d per-layer curves of the press's error against the prompt's kept share are not convex "
                  "(%zu of %zu grid points lie above their lower hull): the allocator follows each lower hull.",
                  non_convex, L, above, curves.size() * grid.size());
    curve_notes.push_back(line);

    // One pass over the held-out sequences: every method at every target.
    std::vector<BudgetColumn> method_columns;
    for (const RatioMethod& m : methods) method_columns.push_back(column(m.name + " @ " + m.target->label, m.kept));
    if (run.progress) options.progress = [&](double f) { progress(0.7 + 0.3 * f); };
    const std::vector<ComboResult> confirmed =
        replay(*setup.heldout_source, expand_sweep({press}, {}, method_columns), options);
    for (std::size_t i = 0; i < methods.size(); ++i) {
        const RatioMethod& m = methods[i];
        const StreamMetrics& total = confirmed[i].total;
        SearchRecord r;
        r.method = m.name;
        r.fit = "layer_budgets";
        r.target = m.target->label;
        r.objective = out.objective;
        r.fitting = objective_value(allocation_error(curves, grid, m.kept), fitting_steps, output_error);
        r.heldout = objective_value(error_sum(total, output_error), step_count(total, output_error), output_error);
        r.heldout_interval = output_error_interval(total);
        r.bytes_per_token = total.cache_bytes / static_cast<double>(total.context_tokens);
        r.compression_ratio = total.fp16_bytes / total.cache_bytes;
        r.prompt_ratios = method_columns[i].prompt_ratios;
        r.writes_profile = m.fitted;
        out.records.push_back(r);
    }
    progress(1.0);
}

}  // namespace

SearchOutcome run_search(const SearchSpec& spec, const SearchRun& run) {
    const auto start = std::chrono::steady_clock::now();
    SearchSetup setup(spec, run);
    SearchOutcome& out = setup.out;
    // Each stage's wall seconds (SearchOutcome::stage_seconds), from where the last one ended.
    auto stage_start = start;
    auto stage_done = [&](const char* name) {
        const auto now = std::chrono::steady_clock::now();
        out.stage_seconds.emplace_back(name, std::chrono::duration<double>(now - stage_start).count());
        stage_start = now;
    };
    stage_done("setup");
    const TraceMetadata& meta = setup.reader.metadata();
    const bool output_error = setup.output_error;
    const bool fit_layers = setup.fit_layers, fit_heads = setup.fit_heads, fit_streaming = setup.fit_streaming;
    const bool fit_tiers = setup.fit_tiers, fit_budgets = setup.fit_budgets, fit_ranks_ = setup.fit_ranks;
    const bool fit_mixed = setup.fit_mixed;
    MixedTables mixed_tables;  // fit: mixed: each family's per-head options, as the families measure them
    MixedTables* mixed = fit_mixed ? &mixed_tables : nullptr;
    const PolicyDescriptor* policy = setup.policy;
    const ParamValues& params = setup.params;
    const std::vector<int>& fitting = setup.fitting;
    std::unique_ptr<AttentionSource>& fitting_source = setup.fitting_source;
    std::unique_ptr<AttentionSource>& heldout_source = setup.heldout_source;
    const int L = setup.num_layers, K = setup.num_kv_heads;
    const ByteModel* heldout_bytes_model = setup.heldout_bytes ? &*setup.heldout_bytes : nullptr;
    const HarnessOptions& harness = setup.harness;
    ReplayOptions options = setup.options;
    const double full_fp16 = setup.full_fp16;

    // Progress on a terminal: each fit (budgets, streaming, tiers) an equal share of the bar.
    const int stages = (fit_budgets ? 1 : 0) + (fit_streaming ? 1 : 0) + (fit_tiers ? 1 : 0) + (fit_ranks_ ? 1 : 0) +
                       (fit_mixed ? 1 : 0);
    auto stage_progress = [&](int stage, double f) {
        if (run.progress) run.progress((stage + std::min(f, 1.0)) / std::max(stages, 1));
    };
    const int streaming_stage = fit_budgets ? 1 : 0, tiers_stage = streaming_stage + (fit_streaming ? 1 : 0);
    const int ranks_stage = tiers_stage + (fit_tiers ? 1 : 0);
    const int mixed_stage = ranks_stage + (fit_ranks_ ? 1 : 0);

    // Units measured by shards, pass by pass (SearchShardWork's numbering).
    SearchPassPlans measured_plans{};
    if (run.measured_units) {
        measured_plans = search_pass_plans(spec, setup);
        if (run.measured_units->size() != unit_total(measured_plans, L)) throw std::logic_error("search: measured units missing");
    }
    const std::array<PassRange, 5> measured_ranges = pass_ranges(measured_plans);

    // Budget fits: per-unit curves from one fitting pass, every method in one held-out pass.
    std::vector<std::string> curve_notes;
    PolicyEntry entry = spec.policy;
    if (spec.deploy == "kvpress") {
        fit_prompt_ratios(setup, spec, run, [&](double f) { stage_progress(0, f); }, curve_notes);
        stage_done("prompt ratios");
    } else if (fit_budgets) {
        const ByteModel& heldout_bytes = *heldout_bytes_model;
        const std::vector<int>& grid = out.grid;
        const std::size_t G = grid.size();
        const bool refined = setup.first_pass.size() < G;
        // One lockstep pass over the fitting set: every first-pass grid budget side by side.
        // Or its units' streams, measured by shards (kvsim search --shard) and summed as replay sums.
        std::vector<ComboResult> measured;
        if (run.measured_units) {
            measured = combine_units(*run.measured_units, measured_ranges[0], fitting.size(), L, K);
        } else {
            const std::vector<ReplayCombo> grid_combos = expand_sweep({entry}, {}, setup.first_pass_budgets);
            if (run.progress) options.progress = [&](double f) { stage_progress(0, (refined ? 0.5 : 0.7) * f); };
            measured = replay(*fitting_source, grid_combos, options);
        }

        // Per-unit curves over the grid; NaN where a refined grid measured no budget.
        std::vector<UnitCurve> layer_curves(L), head_curves(static_cast<std::size_t>(L) * K);
        for (int l = 0; l < L; ++l) {
            layer_curves[l].name = "layer " + std::to_string(l);
            layer_curves[l].error.assign(G, std::numeric_limits<double>::quiet_NaN());
            for (int kv = 0; kv < K; ++kv) {
                UnitCurve& c = head_curves[static_cast<std::size_t>(l) * K + kv];
                c.name = "layer " + std::to_string(l) + ", KV head " + std::to_string(kv);
                c.error.assign(G, std::numeric_limits<double>::quiet_NaN());
            }
        }
        for (std::size_t i = 0; i < measured.size(); ++i) {
            const std::size_t g = setup.first_pass.at(i);
            for (int l = 0; l < L; ++l) layer_curves[l].error[g] = error_sum(measured[i].by_layer[l], output_error);
            for (std::size_t u = 0; u < head_curves.size(); ++u) head_curves[u].error[g] = error_sum(measured[i].by_head[u], output_error);
        }
        const double fitting_steps = step_count(measured.front().total, output_error);

        // The baselines' layer allocations at a target: uniform, and with fit: layer_budgets
        // PyramidKV's schedule and the best PyramidKV ratio and inverted slope. The best are chosen
        // by the first pass's curves (every grid budget's, unless the grid is refined) and then
        // allocated on the whole grid.
        const int default_ratio =
            static_cast<int>(resolve_params(*find_policy("pyramidkv"), {}, "pyramidkv").at("pyramid_ratio"));
        std::vector<UnitCurve> first_layer_curves = layer_curves;
        for (UnitCurve& c : first_layer_curves) {
            std::vector<double> first;
            for (std::size_t g : setup.first_pass) first.push_back(c.error[g]);
            c.error = std::move(first);
        }
        auto baselines = [&](double bytes) {
            std::vector<std::pair<std::string, Allocation>> chosen;
            chosen.emplace_back("uniform", allocate_by_shape(std::vector<double>(L, 1.0), grid, heldout_bytes, bytes));
            if (!fit_layers) return chosen;
            chosen.emplace_back("PyramidKV schedule (ratio " + std::to_string(default_ratio) + ")",
                                allocate_by_shape(pyramid_weights(L, default_ratio), grid, heldout_bytes, bytes));
            auto best_shape = [&](auto weights_of, const std::vector<double>& candidates) {
                double best_value = candidates.front(), best_error = std::numeric_limits<double>::infinity();
                for (double c : candidates) {
                    const Allocation a = allocate_by_shape(weights_of(c), setup.first_pass_budgets, heldout_bytes, bytes);
                    const double e = allocation_error(first_layer_curves, setup.first_pass_budgets, a.budgets);
                    if (e < best_error) best_value = c, best_error = e;
                }
                return std::make_pair(best_value, allocate_by_shape(weights_of(best_value), grid, heldout_bytes, bytes));
            };
            const auto [ratio, pyramid] = best_shape([&](double r) { return pyramid_weights(L, static_cast<int>(r)); },
                                                     {2, 3, 4, 6, 8, 12, 16, 20, 32, 64});
            chosen.emplace_back("PyramidKV schedule (best ratio " + format_number(ratio) + ")", pyramid);
            const auto [slope, inverted] = best_shape([&](double s) { return inverted_weights(L, s); },
                                                      {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9});
            chosen.emplace_back("inverted schedule (best slope " + format_number(slope) + ")", inverted);
            return chosen;
        };
        // Per target, in the config's order: they read the first pass's curves alone, so the
        // refinement, Ada-KV's plans and the methods all take these.
        std::vector<std::vector<std::pair<std::string, Allocation>>> target_baselines;
        for (const SearchTarget& target : spec.targets) target_baselines.push_back(baselines(target.bytes(full_fp16)));

        // Ada-KV's head allocation (fit: head_budgets, a scored policy), chosen per step by the
        // policy's scores: the policy wrapped in Ada-KV at uniform's per-layer totals, one plan a
        // target, measured on the fitting sequences.
        const std::string ada_name = "Ada-KV (floor " + format_number(kSearchAdaKvFloor) + ")";
        PolicyEntry ada_entry = entry;
        ada_entry.adakv = true;
        ada_entry.adakv_params = {{"floor", kSearchAdaKvFloor}};
        ada_entry.adakv_where = spec.fits_where;
        const bool with_ada = fit_heads && policy->scored;
        std::vector<ReplayCombo> ada_combos;
        std::vector<ComboResult> ada_fitting;
        if (with_ada)
            for (std::size_t t = 0; t < spec.targets.size(); ++t)
                for (ReplayCombo& c : expand_sweep({ada_entry}, {},
                                                   {profile_budget_column(ada_name + " @ " + spec.targets[t].label,
                                                                          spec.targets[t].where,
                                                                          target_baselines[t].front().second.budgets)}))
                    ada_combos.push_back(std::move(c));

        // search.coarse_grid: from the first pass's stride, a quarter of it each pass, measure only the
        // budgets beside what each fit chose at each target (and, in the first, the baselines'
        // budgets), every unit in the same plans. Nothing is interpolated: every option the fits
        // choose from, and every figure read off a curve, was measured.
        if (refined) {
            // Each pass divides the stride by 4: a pass costs about what 15 plans cost (every
            // step's attention rows), so fewer passes with wider brackets cost least.
            auto next_stride = [](int step) { return std::max(1, step / 4); };
            int passes = 0;
            for (int step = spec.coarse_grid; step > 1; step = next_stride(step)) ++passes;
            auto index_of = [&](int budget) {
                return static_cast<std::size_t>(std::lower_bound(grid.begin(), grid.end(), budget) - grid.begin());
            };
            std::size_t plans_replayed = 0;
            int pass = 0;
            for (int step = spec.coarse_grid; step > 1; step = next_stride(step), ++pass) {
                const int next = next_stride(step);
                std::vector<std::set<std::size_t>> wanted(head_curves.size());
                auto want_layer = [&](int l, std::size_t g) {
                    for (int kv = 0; kv < K; ++kv) wanted[static_cast<std::size_t>(l) * K + kv].insert(g);
                };
                for (std::size_t t = 0; t < spec.targets.size(); ++t) {
                    const double bytes = spec.targets[t].bytes(full_fp16);
                    if (fit_heads) {
                        const Allocation a = allocate_by_marginal_gain(head_curves, grid, heldout_bytes, bytes);
                        for (std::size_t u = 0; u < head_curves.size(); ++u)
                            for (std::size_t g : refine_bracket(index_of(a.budgets[u]), step, next, G)) wanted[u].insert(g);
                    }
                    if (fit_layers) {
                        const Allocation a = allocate_by_marginal_gain(layer_curves, grid, heldout_bytes, bytes);
                        for (int l = 0; l < L; ++l)
                            for (std::size_t g : refine_bracket(index_of(a.budgets[l]), step, next, G)) want_layer(l, g);
                    }
                    if (pass == 0)
                        for (const auto& [name, a] : target_baselines[t])
                            for (int l = 0; l < L; ++l) want_layer(l, index_of(a.budgets[l]));
                }
                // Per head, the budgets not measured yet; the k-th plan gives each head its k-th.
                std::vector<std::vector<std::size_t>> todo(head_curves.size());
                std::size_t plans = 0;
                for (std::size_t u = 0; u < head_curves.size(); ++u) {
                    for (std::size_t g : wanted[u])
                        if (std::isnan(head_curves[u].error[g])) todo[u].push_back(g);
                    plans = std::max(plans, todo[u].size());
                }
                std::vector<BudgetColumn> columns;
                for (std::size_t k = 0; k < plans; ++k) {
                    std::vector<int> head_budgets(head_curves.size());
                    // A head with fewer budgets to measure fills the plan with the cheapest (discarded).
                    for (std::size_t u = 0; u < head_curves.size(); ++u)
                        head_budgets[u] = k < todo[u].size() ? grid[todo[u][k]] : grid.front();
                    columns.push_back(profile_budget_column("refinement " + std::to_string(pass) + "." + std::to_string(k),
                                                            spec.coarse_grid_where, layer_means(head_budgets, L, K),
                                                            head_budgets));
                }
                // The first pass takes Ada-KV's plans along: a pass of their own would make every
                // step's attention rows again.
                std::vector<ReplayCombo> combos = expand_sweep({entry}, {}, columns);
                if (pass == 0) combos.insert(combos.end(), ada_combos.begin(), ada_combos.end());
                if (combos.empty()) continue;
                ReplayOptions refine_options = options;
                refine_options.progress = nullptr;
                if (run.progress)
                    refine_options.progress = [&](double f) { stage_progress(0, 0.5 + 0.2 * (pass + f) / passes); };
                std::vector<ComboResult> refinement = replay(*fitting_source, combos, refine_options);
                if (pass == 0) {
                    ada_fitting.assign(refinement.begin() + static_cast<std::ptrdiff_t>(columns.size()), refinement.end());
                    refinement.resize(columns.size());
                }
                plans_replayed += columns.size();
                for (std::size_t k = 0; k < refinement.size(); ++k)
                    for (std::size_t u = 0; u < head_curves.size(); ++u)
                        if (k < todo[u].size())
                            head_curves[u].error[todo[u][k]] = error_sum(refinement[k].by_head[u], output_error);
                // A layer's curve, where every head of it is measured: the sum of theirs.
                for (int l = 0; l < L; ++l)
                    for (std::size_t g = 0; g < G; ++g) {
                        if (!std::isnan(layer_curves[l].error[g])) continue;
                        double sum = 0;
                        for (int kv = 0; kv < K; ++kv) sum += head_curves[static_cast<std::size_t>(l) * K + kv].error[g];
                        if (!std::isnan(sum)) layer_curves[l].error[g] = sum;
                    }
            }
            std::size_t points = 0;
            for (const UnitCurve& c : head_curves)
                for (double e : c.error) points += !std::isnan(e);
            curve_notes.push_back(
                "The budget fits measured every " + ordinal(spec.coarse_grid) + " of the " + std::to_string(G) +
                " grid budgets, then in " + std::to_string(passes) + " passes, a quarter of the stride each, only the budgets "
                "beside what each fit and baseline chose (search.coarse_grid): " + std::to_string(points) + " of " +
                std::to_string(G * head_curves.size()) + " (KV head, budget) points, in " +
                std::to_string(setup.first_pass.size() + plans_replayed) + " plans. The fits chose among measured "
                "budgets only, and every figure is measured, none interpolated.");
        }

        if (mixed) {  // fit: mixed: each head's measured budgets an option, at the byte model's bytes
            mixed->evict_policy = policy->name;
            mixed->evict_params = params;
            for (const UnitCurve& c : head_curves) {
                UnitOptions o;
                std::vector<int> budgets;
                for (std::size_t g = 0; g < G; ++g)
                    if (!std::isnan(c.error[g])) {
                        budgets.push_back(grid[g]);
                        o.bytes.push_back(heldout_bytes.bytes_per_token(grid[g]));
                        o.error.push_back(c.error[g]);
                    }
                mixed->evict.push_back(o);
                mixed->evict_budgets.push_back(budgets);
            }
        }

        // The methods, per target, all at the same bytes on the held-out sequences.
        std::vector<std::pair<const SearchTarget*, Method>> methods;
        for (std::size_t t = 0; t < spec.targets.size(); ++t) {
            const SearchTarget& target = spec.targets[t];
            const double bytes = target.bytes(full_fp16);
            auto layer_method = [&](std::string name, const Allocation& a) {
                Method m{std::move(name), "layer_budgets", a.budgets, {}, allocation_error(layer_curves, grid, a.budgets),
                         a.bytes_per_token};
                methods.push_back({&target, m});
            };
            const std::vector<std::pair<std::string, Allocation>>& shapes = target_baselines[t];
            for (const auto& [name, a] : shapes) layer_method(name, a);
            if (fit_layers)
                layer_method("fitted layer budgets", allocate_by_marginal_gain(layer_curves, grid, heldout_bytes, bytes));
            if (fit_heads) {
                const Allocation a = allocate_by_marginal_gain(head_curves, grid, heldout_bytes, bytes);
                Method m{"fitted head budgets", "head_budgets", layer_means(a.budgets, L, K), a.budgets,
                         allocation_error(head_curves, grid, a.budgets), a.bytes_per_token};
                methods.push_back({&target, m});
                // Ada-KV's head allocation, chosen per step by the policy's scores rather than fitted:
                // uniform's per-layer totals, so the same bytes; its fitting error is measured below.
                // Only a scored policy has scores to share a layer's budget by.
                if (policy->scored) {
                    const Allocation& u = shapes.front().second;
                    Method ada{ada_name, "head_budgets", u.budgets, {}, 0, u.bytes_per_token, true};
                    methods.push_back({&target, ada});
                }
            }
        }
        // Ada-KV's rows, measured on the fitting sequences: with the first refining pass, or here.
        if (with_ada) {
            if (ada_fitting.empty()) {
                ReplayOptions ada_options = options;
                ada_options.progress = nullptr;
                ada_fitting = replay(*fitting_source, ada_combos, ada_options);
            }
            std::size_t next = 0;
            for (auto& [target, m] : methods)
                if (m.adakv) m.fitting_errors = error_sum(ada_fitting.at(next++).total, output_error);
        }
        // How far the measured curves are from diminishing returns: what the greedy had to step over.
        auto describe_curves = [&](const std::vector<UnitCurve>& curves, const char* what) {
            std::size_t non_convex = 0, rising = 0, points = 0, above = 0;
            for (const UnitCurve& c : curves) {
                const CurveShape shape = curve_shape(c, out.grid, heldout_bytes);
                non_convex += !shape.above_hull.empty();
                rising += !shape.rising.empty();
                above += shape.above_hull.size();
                for (double e : c.error) points += !std::isnan(e);
            }
            char line[400];
            std::snprintf(line, sizeof line,
                          "%zu of %zu %s curves are not convex in bytes (%zu of %zu grid points lie above their lower hull) "
                          "and %zu rise somewhere as the budget grows: neighbouring budgets differ by noise, so the "
                          "allocator follows each curve's lower hull and steps over the points above it.",
                          non_convex, curves.size(), what, above, points, rising);
            curve_notes.push_back(line);
        };
        if (fit_layers) describe_curves(layer_curves, "per-layer");
        if (fit_heads) describe_curves(head_curves, "per-(layer, KV head)");

        // One pass over the held-out set: every method at every target.
        std::vector<ReplayCombo> heldout_combos;
        for (const auto& [target, m] : methods)
            for (ReplayCombo& c : expand_sweep({m.adakv ? ada_entry : entry}, {},
                                               {profile_budget_column(m.name + " @ " + target->label, target->where,
                                                                      m.layer_budgets, m.head_budgets)}))
                heldout_combos.push_back(std::move(c));
        if (run.progress) options.progress = [&](double f) { stage_progress(0, 0.7 + 0.3 * f); };
        const std::vector<ComboResult> confirmed = replay(*heldout_source, heldout_combos, options);
        stage_progress(0, 1.0);

        for (std::size_t i = 0; i < methods.size(); ++i) {
            const auto& [target, m] = methods[i];
            const StreamMetrics& total = confirmed[i].total;
            SearchRecord r;
            r.method = m.name;
            r.fit = m.fit;
            r.target = target->label;
            r.objective = out.objective;
            r.fitting = objective_value(m.fitting_errors, fitting_steps, output_error);
            r.heldout = objective_value(error_sum(total, output_error), step_count(total, output_error), output_error);
            r.heldout_interval = output_error_interval(total);
            if (total.context_tokens > 0) {
                r.bytes_per_token = total.cache_bytes / static_cast<double>(total.context_tokens);
                r.compression_ratio = total.fp16_bytes / total.cache_bytes;
            } else {  // an attention-only trace: the byte model, which the memory metric matches
                r.bytes_per_token = m.model_bytes;
                r.compression_ratio = full_fp16 / r.bytes_per_token;
            }
            r.layer_budgets = m.layer_budgets;
            r.writes_profile = m.name.rfind("fitted", 0) == 0;
            r.head_budgets = m.head_budgets;
            r.adakv = m.adakv;
            out.records.push_back(r);
        }
        stage_done("budgets");
    }

    // Streaming heads with fitted lambdas, at the same targets.
    if (fit_streaming) {
        const TempFolder scratch("search");  // the probe plans streaming_attention reads
        std::vector<StreamingHeadFit> measured;
        if (run.measured_units) measured = combine_streaming_units(*run.measured_units, measured_ranges[3], L, K);
        FitInput input{&spec, fitting_source.get(), heldout_source.get(), out.shape, harness, scratch.path(),
                       [&](double f) { stage_progress(streaming_stage, f); }, run.trace_path, fitting, mixed,
                       &setup.full_outputs};
        if (run.measured_units) input.streaming_measured = &measured;
        fit_streaming_heads(input, out);
        stage_done("streaming");
    }
    // Tier profiles for stratigraphic, at the same targets.
    if (fit_tiers) {
        const TempFolder scratch("search");  // the plans stratigraphic reads
        TierMeasurements measured;
        if (run.measured_units) {
            measured.heldout_bytes =
                combine_units(*run.measured_units, measured_ranges[1], setup.heldout.size(), L, K);
            measured.fitting_errors = combine_units(*run.measured_units, measured_ranges[2], fitting.size(), L, K);
            measured.kept = combine_tier_options(*run.measured_units, measured_ranges[2], L, K);
        }
        FitInput input{&spec, fitting_source.get(), heldout_source.get(), out.shape, harness, scratch.path(),
                       [&](double f) { stage_progress(tiers_stage, f); }, run.trace_path, fitting, mixed,
                       &setup.full_outputs, run.measured_units ? &measured : nullptr};
        input.max_steps = run.max_steps;
        fit_tier_profiles(input, out);
        stage_done("tiers");
    }
    // Ranks of low-rank K/V latents, with grouping at the same bytes.
    if (fit_ranks_) {
        const TempFolder scratch("search");  // the bases and rank plans lowrank reads
        std::vector<ComboResult> measured;
        if (run.measured_units) measured = combine_units(*run.measured_units, measured_ranges[4], fitting.size(), L, K);
        FitInput input{&spec, fitting_source.get(), heldout_source.get(), out.shape, harness, scratch.path(),
                       [&](double f) { stage_progress(ranks_stage, f); }, run.trace_path, fitting, mixed,
                       &setup.full_outputs};
        if (run.measured_units) input.rank_measured = &measured;
        fit_ranks(input, out);
        stage_done("ranks");
    }
    // One method per head, across the families above, at the same targets.
    if (fit_mixed) {
        const TempFolder scratch("search");  // the mixed plans the replays read
        FitInput input{&spec, fitting_source.get(), heldout_source.get(), out.shape, harness, scratch.path(),
                       [&](double f) { stage_progress(mixed_stage, f); }, run.trace_path, fitting, mixed,
                       &setup.full_outputs};
        // The full cache's bytes on the held-out sequences: every token at fp16, with what keeping
        // every token books per slot, as the byte model counts it.
        mixed_tables.full_bytes = ByteModel(heldout_source->shape().last_steps, setup.head_dim,
                                            static_cast<double>(make_keep_all()->bytes_per_slot()))
                                      .bytes_per_token(kMaxBudgetTokens);
        fit_mixed_heads(input, mixed_tables, out);
        stage_done("mixed");
    }

    // One block per target in the tables: the targets in the config's order, methods as they came.
    std::stable_sort(out.records.begin(), out.records.end(), [&](const SearchRecord& a, const SearchRecord& b) {
        auto rank = [&](const std::string& label) {
            for (std::size_t i = 0; i < spec.targets.size(); ++i)
                if (spec.targets[i].label == label) return i;
            return spec.targets.size();
        };
        return rank(a.target) < rank(b.target);
    });

    // Equal bytes hold to within one grid step of one unit; say so where that is more than 1%, once
    // for the methods of a target that hold the same bytes.
    std::vector<std::pair<std::size_t, std::string>> off_target;  // first record, the methods' names
    for (std::size_t i = 0; i < out.records.size(); ++i) {
        const SearchRecord& r = out.records[i];
        const SearchTarget* target = nullptr;
        for (const SearchTarget& t : spec.targets)
            if (t.label == r.target) target = &t;
        if (std::abs(r.bytes_per_token / target->bytes(full_fp16) - 1) <= 0.01) continue;
        auto same = std::find_if(off_target.begin(), off_target.end(), [&](const auto& o) {
            const SearchRecord& f = out.records[o.first];
            return f.target == r.target && f.bytes_per_token == r.bytes_per_token &&
                   f.streaming_heads.empty() == r.streaming_heads.empty() && (f.fit == "ranks") == (r.fit == "ranks") &&
                   (f.fit == "mixed") == (r.fit == "mixed");
        });
        if (same == off_target.end())
            off_target.push_back({i, r.method});
        else
            same->second += "; " + r.method;
    }
    for (const auto& [first, names] : off_target) {
        const SearchRecord& r = out.records[first];
        double wanted = 0;
        for (const SearchTarget& t : spec.targets)
            if (t.label == r.target) wanted = t.bytes(full_fp16);
        char line[300];
        std::snprintf(line, sizeof line, " at %s hold%s %.4g bytes per token, %.1f%% from the target's %.4g: %s",
                      r.target.c_str(), names.find("; ") == std::string::npos ? "s" : "", r.bytes_per_token,
                      100 * (r.bytes_per_token / wanted - 1), wanted,
                      r.fit == "mixed" ? "each head's option moves the bytes in its own steps (a whole head streams "
                                         "or keeps its cache), and the next step would pass the target."
                      : r.fit == "ranks" ? "a rank moves the bytes in steps of a number per token plus its share of "
                                         "the bases, and the next step would pass the target."
                      : r.streaming_heads.empty()
                          ? "at budgets this small one token of one unit is more than 1% of the bytes."
                          : "a head streams whole or not at all, so the bytes move in steps of one head, and the "
                            "next head would pass the target.");
        out.notes.push_back(names + line);
    }

    // Which way the fitted layer profile leans, per target.
    for (const SearchRecord& r : out.records) {
        if (r.method != "fitted layer budgets" || L < 2) continue;
        const int half = L / 2;
        double early = 0, late = 0;
        for (int l = 0; l < half; ++l) early += r.layer_budgets[l];
        for (int l = L - half; l < L; ++l) late += r.layer_budgets[l];
        early /= half;
        late /= half;
        char line[320];
        std::snprintf(line, sizeof line,
                      "At %s the fitted layer budgets give the first %d layer(s) %.1f tokens on average and the last "
                      "%d %.1f: on this model %s layers need more cache (layer by layer: %s).",
                      r.target.c_str(), half, early, half, late, early > late ? "early" : early < late ? "late" : "no",
                      join(r.layer_budgets, ", ").c_str());
        out.notes.push_back(line);
    }
    out.notes.insert(out.notes.end(), curve_notes.begin(), curve_notes.end());

    // The profiles of the fitted methods, every fit's with the same provenance.
    const std::string trace_sha = sha256_file(run.trace_path);
    const std::string config_sha = sha256_file(run.config_file);
    for (const SearchRecord& r : out.records) {
        if (!r.writes_profile) continue;
        Profile p;
        p.model = out.shape;
        p.method = r.method;
        p.target = r.target;
        p.bytes_per_token = r.bytes_per_token;
        p.compression_ratio = r.compression_ratio;
        p.objective = r.objective;
        p.heldout_value = r.heldout;
        p.heldout_sequences = out.heldout_sequences;
        p.trace = run.trace_path;
        p.trace_sha256 = trace_sha;
        p.config = run.config_file;
        p.config_sha256 = config_sha;
        p.deploy = spec.deploy;
        for (int64_t last : setup.heldout_source->shape().last_steps) p.measured_tokens.push_back(last + 1);
        if (!r.prompt_ratios.empty()) {  // kvpress: the press and its per-layer ratios of the prompt
            p.policy = policy->name;
            p.params = params;
            p.prompt = spec.prompt;
            p.prompt_ratios = r.prompt_ratios;
            p.measured_prompts = setup.heldout_prompts;
            const PromptByteModel fitting(setup.fitting_prompts, setup.fitting_source->shape().last_steps, setup.head_dim);
            for (double ratio : r.prompt_ratios)
                p.fitting_bytes_per_token +=
                    fitting.bytes_per_token(static_cast<int>(std::lround((1 - ratio) * 1000))) / L;
            p.fitting_prompts = setup.fitting_prompts;
        } else if (r.fit == "mixed") {  // the policy builds each head's method from the plan
            p.policy = "mixed";
            p.mixed = r.mixed;
        } else if (r.fit == "streaming" || r.fit == "tiers") {
            p.policy = r.fit == "streaming" ? "streaming_attention" : "stratigraphic";
            p.params = r.replay_params;
            if (r.fit == "streaming")
                p.streaming = StreamingHeads{r.streaming_sinks, r.streaming_recent, r.streaming_heads, r.lambda,
                                             r.stateless, r.gates};
            else
                p.tiers = r.tiers;
            if (r.fit == "streaming" && spec.deploy == "duo") p.sparsity_curve = out.sparsity_curve;
        } else {
            p.policy = policy->name;
            p.params = params;
            p.layer_budgets = r.layer_budgets;
            p.head_budgets = r.head_budgets;
            for (int l = 0; l < L; ++l) {
                double kept = 0;
                for (int kv = 0; kv < K; ++kv) {
                    const int b = r.head_budgets.empty() ? r.layer_budgets[l]
                                                         : r.head_budgets[static_cast<std::size_t>(l) * K + kv];
                    kept += heldout_bytes_model->kept_share(b);
                }
                p.layer_kept_fraction.push_back(kept / K);
            }
            const ByteModel fitting(setup.fitting_source->shape().last_steps, setup.head_dim,
                                    heldout_bytes_model->slot_bytes());
            for (int l = 0; l < L; ++l)
                for (int kv = 0; kv < K; ++kv)
                    p.fitting_bytes_per_token += fitting.bytes_per_token(
                        r.head_budgets.empty() ? r.layer_budgets[l] : r.head_budgets[static_cast<std::size_t>(l) * K + kv]) /
                        (L * K);
        }
        if (p.fitting_bytes_per_token > 0) {
            p.fitting_sequences = out.fitting_sequences;
            for (int64_t last : setup.fitting_source->shape().last_steps) p.fitting_tokens.push_back(last + 1);
            p.fitting_compression_ratio = setup.full_fp16 / p.fitting_bytes_per_token;
        }
        p.name = meta.model_name + "-" + (r.fit == "mixed" ? "mixed" : p.policy + "-" + r.fit) + "-" + r.target;
        out.profiles.push_back(p);
    }
    if (spec.sample_steps < 1) {
        char line[600];
        std::snprintf(line, sizeof line,
                      "Output error was measured on %s of each stream's decode steps (at least 2; search.sample, seed "
                      "%llu), one step drawn at random from each run of consecutive steps, the same for every budget "
                      "of a (layer, KV head): each held-out figure is an estimate with its 95%% interval, and the fits "
                      "chose by estimates. `kvsim run` of a profile on the held-out sequences measures its exact figure.",
                      (format_number(100 * spec.sample_steps) + "%").c_str(),
                      static_cast<unsigned long long>(spec.sample_seed));
        out.notes.push_back(line);
    }
    stage_done("notes and profiles");
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::move(out);
}

namespace {

// deploy duo: the held-out figure at each sparsity, for a user choosing DuoAttention's --sparsity.
std::string sparsity_table(const SearchOutcome& o, bool markdown) {
    if (o.sparsity_curve.empty()) return {};
    std::string text = markdown ? "\n## DuoAttention sparsity\n\nThe fitted ranking (the profile's gates) at each "
                                  "sparsity DuoAttention may be given (`--sparsity`), measured on the held-out "
                                  "sequences:\n\n| sparsity | streaming heads | held-out " + o.objective +
                                      " | bytes/token | compression |\n|---|---|---|---|---|\n"
                                : "\nDuoAttention sparsity (the fitted ranking; held out)\n  sparsity  heads  " +
                                      std::string(o.objective == "output_rel_error" ? "rel error" : "retained") +
                                      "  bytes/token  compress\n";
    char line[200];
    for (const SparsityPoint& c : o.sparsity_curve) {
        if (markdown)
            std::snprintf(line, sizeof line, "| %.4g | %d | %.6f | %.3f | %.3fx |\n", c.sparsity, c.streaming_heads,
                          c.heldout, c.bytes_per_token, c.compression_ratio);
        else
            std::snprintf(line, sizeof line, "  %8.4g  %5d  %9.6f  %11.3f  %7.3fx\n", c.sparsity, c.streaming_heads,
                          c.heldout, c.bytes_per_token, c.compression_ratio);
        text += line;
    }
    return text;
}

}  // namespace

std::string format_search_table(const SearchOutcome& o) {
    std::string text = "kvsim search  |  trace " + o.trace + "  |  objective " + o.objective + " (held out: " +
                       std::to_string(o.heldout_sequences.size()) + " sequences; fitted on " +
                       std::to_string(o.fitting_sequences.size()) + ")" +
                       (o.deploy == "kvsim" ? "" : "  |  deploy " + o.deploy) + "\n";
    std::string target;
    std::size_t width = 6;
    for (const SearchRecord& r : o.records) width = std::max(width, r.method.size());
    char line[512];
    const bool sampled = o.sample_steps < 1;  // each held-out figure with its 95% interval
    for (const SearchRecord& r : o.records) {
        if (r.target != target) {
            target = r.target;
            std::snprintf(line, sizeof line, "\ntarget %s\n  %-*s  %*s  %10s  %11s  %10s  %9s  %s\n", target.c_str(),
                          static_cast<int>(width), "method", sampled ? 22 : 12,
                          o.objective == "output_rel_error" ? (sampled ? "rel error (95%)" : "rel error") : "retained",
                          "fitting", "bytes/token", "compress", "ΔPPL", "layer budgets");
            text += line;
        }
        char delta[32] = "-";
        if (std::isfinite(r.delta_ppl)) std::snprintf(delta, sizeof delta, "%+.4f", r.delta_ppl);
        char heldout[64];
        if (sampled)
            std::snprintf(heldout, sizeof heldout, "%12.6f ±%.6f", r.heldout, r.heldout_interval);
        else
            std::snprintf(heldout, sizeof heldout, "%12.6f", r.heldout);
        std::snprintf(line, sizeof line, "  %-*s  %s  %10.6f  %11.3f  %9.3fx  %9s  %s\n", static_cast<int>(width),
                      r.method.c_str(), heldout, r.fitting, r.bytes_per_token, r.compression_ratio, delta,
                      budgets_text(r).c_str());
        text += line;
    }
    return text + sparsity_table(o, false);
}

void write_search_outputs(const SearchOutcome& o, const std::string& dir) {

    Json records = Json::array();
    const bool sampled = o.sample_steps < 1;  // the held-out figures' 95% intervals beside them
    std::string csv = std::string("method,fit,target,objective,bytes_per_token,compression_ratio,heldout,fitting,delta_ppl,"
                                  "layer_budgets") + (sampled ? ",heldout_interval\n" : "\n");
    auto quoted = [](const std::string& s) {
        std::string q = "\"";
        for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
        return q + "\"";
    };
    for (const SearchRecord& r : o.records) {
        Json j = {{"method", r.method}, {"fit", r.fit}, {"target", r.target}, {"objective", r.objective},
                  {"bytes_per_token", r.bytes_per_token}, {"compression_ratio", r.compression_ratio},
                  {"heldout", r.heldout}, {"fitting", r.fitting}};
        if (sampled) j["heldout_interval"] = r.heldout_interval;
        j["delta_ppl"] = std::isfinite(r.delta_ppl) ? Json(r.delta_ppl) : Json(nullptr);
        j["layer_budgets"] = r.layer_budgets;
        if (!r.head_budgets.empty()) j["head_budgets"] = r.head_budgets;
        if (!r.prompt_ratios.empty()) j["prompt_ratios"] = r.prompt_ratios;
        if (!r.streaming_heads.empty()) {
            j["streaming_heads"] = std::vector<int>(r.streaming_heads.begin(), r.streaming_heads.end());
            j["lambda"] = r.lambda;
            if (!r.stateless.empty()) j["stateless"] = std::vector<int>(r.stateless.begin(), r.stateless.end());
            if (!r.gates.empty()) j["gates"] = r.gates;
        }
        if (r.fit == "ranks") {
            j["replay_policy"] = r.replay_policy;
            Json params = Json::object();
            for (const auto& [name, value] : r.replay_params) params[name] = value;
            j["replay_params"] = params;
            if (!r.key_rank.empty()) j["key_rank"] = r.key_rank, j["value_rank"] = r.value_rank;
        }
        if (r.mixed) j["mixed"] = mixed_plan_json(*r.mixed);
        if (r.tiers.num_layers > 0) {
            j["tiers"] = Json::parse(tier_shares_json(r.tiers));
            Json params = Json::object();
            for (const auto& [name, value] : r.replay_params) params[name] = value;
            j["tier_params"] = params;
        }
        records.push_back(j);
        char numbers[200];
        std::snprintf(numbers, sizeof numbers, "%.17g,%.17g,%.17g,%.17g,", r.bytes_per_token, r.compression_ratio,
                      r.heldout, r.fitting);
        csv += quoted(r.method) + "," + r.fit + "," + quoted(r.target) + "," + r.objective + "," + numbers +
               (std::isfinite(r.delta_ppl) ? format_number(r.delta_ppl) : "") + "," + quoted(budgets_text(r)) +
               (sampled ? "," + format_number(r.heldout_interval) : std::string()) + "\n";
    }
    Json search = {{"format", "kvsim-search"},
                   {"version", 1},
                   {"trace", o.trace},
                   {"objective", o.objective},
                   {"model", {{"name", o.shape.name},
                              {"num_layers", o.shape.num_layers},
                              {"num_query_heads", o.shape.num_query_heads},
                              {"num_kv_heads", o.shape.num_kv_heads},
                              {"head_dim", o.shape.head_dim}}},
                   {"fitting_sequences", o.fitting_sequences},
                   {"heldout_sequences", o.heldout_sequences},
                   {"grid", o.grid},
                   {"notes", o.notes},
                   {"seconds", o.seconds},
                   {"records", records}};
    Json stages = Json::array();
    for (const auto& [stage, seconds] : o.stage_seconds) stages.push_back({{"stage", stage}, {"seconds", seconds}});
    search["stage_seconds"] = stages;
    if (o.deploy != "kvsim") search["deploy"] = o.deploy;  // kvsim's own searches read as before
    if (sampled) search["sample"] = {{"steps", o.sample_steps}, {"seed", o.sample_seed}};
    if (!o.sparsity_curve.empty()) {
        Json curve = Json::array();
        for (const SparsityPoint& c : o.sparsity_curve)
            curve.push_back({{"sparsity", c.sparsity},
                             {"streaming_heads", c.streaming_heads},
                             {"heldout", c.heldout},
                             {"bytes_per_token", c.bytes_per_token},
                             {"compression_ratio", c.compression_ratio}});
        search["sparsity_curve"] = curve;
    }

    std::string report = "# kvsim search\n\nTrace `" + o.trace + "`, objective `" + o.objective +
                         "`. Every figure below is measured on the held-out sequences (" +
                         std::to_string(o.heldout_sequences.size()) + ": ";
    for (std::size_t i = 0; i < o.heldout_sequences.size(); ++i) report += (i ? ", " : "") + o.heldout_sequences[i];
    report += "), at the same bytes per token within each target; the fits saw only the other " +
              std::to_string(o.fitting_sequences.size()) + ".\n";
    if (o.deploy == "kvpress")
        report += "\nDeployed in kvpress: each sequence's prompt is compressed once, at its end, by the press at each "
                  "layer's ratio; decoding then appends. The figures and bytes (K and V alone) are those of the "
                  "continuation after the prompt.\n";
    if (o.deploy == "duo")
        report += "\nDeployed in DuoAttention: streaming heads hold their sinks and recent window and nothing else; "
                  "bytes are K and V alone.\n";
    std::string target;
    for (const SearchRecord& r : o.records) {
        if (r.target != target) {
            target = r.target;
            report += "\n## Target " + target + "\n\n| method | held-out " + o.objective + (sampled ? " (95%)" : "") +
                      " | fitting | bytes/token | compression | ΔPPL (held out) | layer budgets |\n|---|---|---|---|---|---|---|\n";
        }
        char delta[32] = "-";
        if (std::isfinite(r.delta_ppl)) std::snprintf(delta, sizeof delta, "%+.4f", r.delta_ppl);
        char heldout[64];
        if (sampled)
            std::snprintf(heldout, sizeof heldout, "%.6f ± %.6f", r.heldout, r.heldout_interval);
        else
            std::snprintf(heldout, sizeof heldout, "%.6f", r.heldout);
        char row[200];
        std::snprintf(row, sizeof row, " | %s | %.6f | %.3f | %.3fx | %s | ", heldout, r.fitting, r.bytes_per_token,
                      r.compression_ratio, delta);
        report += "| " + r.method + row + budgets_text(r) + " |\n";
    }
    report += sparsity_table(o, true);
    if (!o.notes.empty()) {
        report += "\n## Notes\n\n";
        for (const std::string& n : o.notes) report += "- " + n + "\n";
    }

    // Every file is complete under a temporary name before any takes its real name, and they take
    // them together (base/output_folder.h).
    FolderCommit files(dir);
    auto add = [&](const std::string& name, const std::string& contents) { files.add(name, contents); };
    add("search.json", search.dump(2, ' ', false, Json::error_handler_t::replace) + "\n");
    add("search.csv", csv);
    add("report.md", report);
    // profile.json: the first target's finest fit (per head when fitted, else per layer).
    const Profile* primary = nullptr;
    for (const Profile& p : o.profiles) {
        const std::string fit = p.mixed ? "mixed" : p.streaming ? "streaming" : p.tiers ? "tiers" : p.head_budgets.empty() ? "layer_budgets" : "head_budgets";
        std::string name = "profile-" + fit + "-" + p.target + ".json";
        std::replace(name.begin(), name.end(), '/', '_');
        add(name, profile_json(p));
        if (!primary || (p.target == primary->target && !p.head_budgets.empty() && primary->head_budgets.empty()))
            primary = &p;
    }
    if (primary) add("profile.json", profile_json(*primary));
    // fit: ranks: the bases and each fitted method's ranks, for the lowrank policy to read.
    if (o.bases)
        add(o.bases_format == KvBasesFormat::hdf5 ? "bases.h5" : "bases.json", kv_bases_file(*o.bases, o.bases_format));
    for (const SearchRecord& r : o.records) {
        if (r.fit != "ranks" || r.key_rank.empty() || r.method.rfind("fitted", 0) != 0) continue;
        const bool joint = r.replay_params.at("joint") == 1;
        std::string name = std::string("ranks-") + (joint ? "joint-" : "heads-") + r.target + ".json";
        std::replace(name.begin(), name.end(), '/', '_');
        add(name, fitted_ranks_json(FittedRanks{joint, r.key_rank, r.value_rank}, o.shape.num_layers,
                                    o.shape.num_kv_heads, o.shape.head_dim));
    }
    files.commit();
}

}  // namespace kvsim
