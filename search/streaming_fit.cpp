#include "search/streaming_fit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "policies/policy.h"
#include "search/golden_section.h"
#include "sim/replay.h"
#include "cache_math/streaming_heads.h"
#include "sim/sweep.h"

namespace kvsim {

StreamingPlanFile::StreamingPlanFile(const std::string& folder, const std::string& name, int num_layers,
                                     int num_kv_heads, const std::vector<uint8_t>& streaming,
                                     const std::vector<double>& lambda, const std::vector<uint8_t>& stateless)
    : path_(folder + "/" + name + ".yaml") {
    auto gate_rows = [&](const char* key, const std::vector<uint8_t>& gates) {
        std::string text = std::string(key) + ":\n";
        for (int l = 0; l < num_layers; ++l) {
            text += "  - [";
            for (int kv = 0; kv < num_kv_heads; ++kv)
                text += (kv ? ", " : "") + std::to_string(gates[static_cast<std::size_t>(l) * num_kv_heads + kv]);
            text += "]\n";
        }
        return text;
    };
    std::string text = gate_rows("streaming", streaming);
    text += "lambda:\n";
    char value[32];
    for (int l = 0; l < num_layers; ++l) {
        text += "  - [";
        for (int kv = 0; kv < num_kv_heads; ++kv) {
            std::snprintf(value, sizeof value, "%.17g", lambda[static_cast<std::size_t>(l) * num_kv_heads + kv]);
            text += (kv ? ", " : "") + std::string(value);
        }
        text += "]\n";
    }
    if (!stateless.empty()) text += gate_rows("stateless", stateless);
    write_file_atomically(path_, text);
}

StreamingPlanFile::~StreamingPlanFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
}

namespace {

constexpr int kGoldenSteps = 16;                 // the bracket shrinks to 0.618^16 < 5e-4
constexpr int kStreamingLambdaPasses = kGoldenSteps + 2;  // fit_lambdas' passes and the calibrated lambdas'

struct Plan {
    std::string name;
    std::vector<uint8_t> streaming;
    std::vector<double> lambda;
    std::vector<uint8_t> stateless;  // empty: every streaming head keeps its state
    const ParamValues* params = nullptr;  // its sinks and recent window; nullptr: the PlanReplay's
};

struct PlanResult {
    std::vector<double> head_error;  // mean output error per (layer, KV head)
    std::vector<double> head_error_sum;  // ... summed over its steps
    std::vector<double> head_bytes;  // bytes per token of context per (layer, KV head)
    double error = 0, bytes_per_token = 0, compression_ratio = 0;  // over every head
    double interval = 0;  // search.sample: the error's 95% half-width
};

class PlanReplay {
public:
    // `passes`: how many replays the fit makes in all, for progress; `bookkeeping`: whether the
    // bytes count the policy's bookkeeping (kvsim's runtime holds it, DuoAttention does not).
    PlanReplay(const FitInput& in, const ParamValues& params, int& passes, int total_passes, bool bookkeeping,
               std::vector<int> layers = {})
        : in_(in),
          params_(params),
          passes_(passes),
          total_passes_(total_passes),
          bookkeeping_(bookkeeping),
          layers_(std::move(layers)) {}

    // Every plan side by side in one lockstep pass over `source`.
    std::vector<PlanResult> run(AttentionSource& source, const std::vector<Plan>& plans) {
        if (in_.progress) in_.progress(static_cast<double>(++passes_) / total_passes_);
        std::vector<std::unique_ptr<StreamingPlanFile>> files;
        std::vector<PolicyEntry> entries;
        for (const Plan& plan : plans) {
            files.push_back(std::make_unique<StreamingPlanFile>(in_.scratch_folder, plan.name, in_.shape.num_layers,
                                                                in_.shape.num_kv_heads, plan.streaming, plan.lambda,
                                                                plan.stateless));
            const ParamValues& params = plan.params ? *plan.params : params_;
            PolicyEntry e;
            e.name = "streaming_attention";
            e.params = {{"sinks", params.at("sinks")}, {"recent", params.at("recent")}};
            e.files = {{"profile", files.back()->path()}};
            e.where = in_.spec->where + ".streaming";
            entries.push_back(e);
        }
        ReplayOptions options = search_replay_options(*in_.spec, in_.harness, true, true);
        options.full_outputs = in_.full_outputs;
        options.harness.bookkeeping = bookkeeping_;
        options.harness.attention_metrics = false;  // the fit reads output error and bytes alone
        options.layers = layers_;
        const std::vector<ReplayCombo> combos = expand_sweep(entries, {}, std::vector<int>{1});
        const std::vector<ComboResult> results = replay(source, combos, options);
        std::vector<PlanResult> out;
        for (const ComboResult& r : results) {
            PlanResult p;
            for (const StreamMetrics& m : r.by_head) {
                p.head_error.push_back(m.output_steps ? m.output_rel_error / m.output_steps : 0.0);
                p.head_error_sum.push_back(m.output_rel_error);
                p.head_bytes.push_back(m.context_tokens ? m.cache_bytes / m.context_tokens : 0.0);
            }
            p.error = r.total.output_steps ? r.total.output_rel_error / r.total.output_steps : 0.0;
            p.interval = output_error_interval(r.total);
            p.bytes_per_token = r.total.cache_bytes / r.total.context_tokens;
            p.compression_ratio = r.total.fp16_bytes / r.total.cache_bytes;
            out.push_back(p);
        }
        return out;
    }

private:
    const FitInput& in_;
    ParamValues params_;
    int& passes_;  // shared by the fit's replays, for progress
    int total_passes_;
    bool bookkeeping_;
    std::vector<int> layers_;  // empty: every layer
};

std::string format_lambda(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3f", x);
    return text;
}

struct LambdaFit {
    std::vector<double> lambda, error;  // per (layer, KV head): the lambda, and the error at it
    std::vector<double> error_sum;      // ... summed over its steps
};

// Golden-section searches (GoldenSections) of every head's lambda at once, one search per entry of
// `searches` (its sinks and recent window), each head streaming; then each bracket's middle against
// its ends (a unimodal search never probes 0 or 1). After the first pass a step measures one new
// lambda a head, on its left for some heads and its right for others, all in one plan (a plan
// gives each head its own lambda). The searches share their passes: a plan's result is what it
// would be alone, so two searches take kGoldenSteps + 1 passes, not twice that. `extra` are
// measured in the last pass, beside the candidates (their results follow).
std::vector<LambdaFit> fit_lambdas(PlanReplay& plans, AttentionSource& source, std::size_t units,
                                   const std::vector<const ParamValues*>& searches, const std::vector<Plan>& extra,
                                   std::vector<PlanResult>& extra_results) {
    const std::vector<uint8_t> every_head(units, 1);
    const std::size_t n = searches.size();
    std::vector<GoldenSections> sections(n, GoldenSections(units));
    auto probe = [&](std::size_t search, const std::string& name, std::vector<double> lambda) {
        return Plan{"search" + std::to_string(search) + "-" + name, every_head, std::move(lambda), {}, searches[search]};
    };
    std::vector<Plan> pass;  // the first: per search, its left probe, then its right one
    for (std::size_t i = 0; i < n; ++i) {
        pass.push_back(probe(i, "left", sections[i].left()));
        pass.push_back(probe(i, "right", sections[i].right()));
    }
    std::vector<PlanResult> r = plans.run(source, pass);
    for (std::size_t i = 0; i < n; ++i) sections[i].first_errors(r[2 * i].head_error, r[2 * i + 1].head_error);
    for (int step = 0; step < kGoldenSteps; ++step) {
        pass.clear();
        for (std::size_t i = 0; i < n; ++i) pass.push_back(probe(i, "probe", sections[i].shrink()));
        if (step + 1 == kGoldenSteps) break;  // the last bracket is final: its middle is measured below
        r = plans.run(source, pass);
        for (std::size_t i = 0; i < n; ++i) sections[i].new_errors(r[i].head_error);
    }
    std::vector<Plan> last;  // per search: its middle, 0 and 1; then the extra plans
    for (std::size_t i = 0; i < n; ++i) {
        const std::vector<double>& low = sections[i].low();
        const std::vector<double>& high = sections[i].high();
        std::vector<double> middle(units);
        for (std::size_t u = 0; u < units; ++u) middle[u] = (low[u] + high[u]) / 2;
        last.push_back(probe(i, "middle", std::move(middle)));
        last.push_back(probe(i, "zero", std::vector<double>(units, 0.0)));
        last.push_back(probe(i, "one", std::vector<double>(units, 1.0)));
    }
    last.insert(last.end(), extra.begin(), extra.end());
    const std::vector<PlanResult> ends = plans.run(source, last);
    extra_results.assign(ends.begin() + static_cast<std::ptrdiff_t>(3 * n), ends.end());
    std::vector<LambdaFit> fits;
    for (std::size_t i = 0; i < n; ++i) {
        LambdaFit fit{std::vector<double>(units), std::vector<double>(units), std::vector<double>(units)};
        for (std::size_t u = 0; u < units; ++u) {
            std::size_t best = 3 * i;
            for (std::size_t c = 3 * i + 1; c < 3 * i + 3; ++c)
                if (ends[c].head_error[u] < ends[best].head_error[u]) best = c;
            fit.lambda[u] = last[best].lambda[u];
            fit.error[u] = ends[best].head_error[u];
            fit.error_sum[u] = ends[best].head_error_sum[u];
        }
        fits.push_back(std::move(fit));
    }
    return fits;
}

// The heads that stream to bring the cache to `wanted` bytes per token, taken in `order`; each
// head holds `streaming` bytes when it streams and `full` when it keeps its cache.
std::vector<uint8_t> heads_for_target(const std::vector<std::size_t>& order, const std::vector<double>& streaming,
                                      const std::vector<double>& full, double wanted, const SearchTarget& target,
                                      const std::string& why) {
    const std::size_t units = order.size();
    std::vector<uint8_t> streams(units, 0);
    double sum = std::accumulate(full.begin(), full.end(), 0.0);
    for (std::size_t u : order) {
        if (sum <= wanted * static_cast<double>(units)) break;
        streams[u] = 1;
        sum += streaming[u] - full[u];
    }
    if (sum > wanted * static_cast<double>(units) * (1 + 1e-9)) {
        char detail[200];
        std::snprintf(detail, sizeof detail,
                      "%.4g bytes per token, but every head streaming holds %.4g (its sinks, recent window and state)",
                      wanted, sum / static_cast<double>(units));
        throw InputError(target.where + ": " + target.label + " with streaming heads: " + detail + why);
    }
    return streams;
}

// Head order by a per-head key, ascending, ties by index.
std::vector<std::size_t> ascending_order(const std::vector<double>& key) {
    std::vector<std::size_t> order(key.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return key[a] < key[b]; });
    return order;
}

// "layer 0: heads 1, 3; layer 2: head 0": the heads where `pick` holds.
std::string list_heads(const std::vector<uint8_t>& pick, int num_kv_heads) {
    std::string text;
    int layer = -1;
    for (std::size_t u = 0; u < pick.size(); ++u) {
        if (!pick[u]) continue;
        const int l = static_cast<int>(u) / num_kv_heads, kv = static_cast<int>(u) % num_kv_heads;
        if (l != layer) {
            text += (text.empty() ? "" : "; ") + std::string("layer ") + std::to_string(l) + ": " + std::to_string(kv);
            layer = l;
        } else {
            text += ", " + std::to_string(kv);
        }
    }
    return text.empty() ? "none" : text;
}

// A method's plan at one target, and what its fitting figure sums.
struct Chosen {
    Plan plan;
    const SearchTarget* target;
    std::string method;
    std::vector<double> fitting_error;  // per head, on the fitting sequences, when it streams
    bool writes_profile = false;
};

// Records of the chosen plans, confirmed in one pass over the held-out sequences.
void confirm_plans(PlanReplay& plans, const FitInput& in, const ParamValues& params, const std::vector<Chosen>& chosen,
                   SearchOutcome& out) {
    std::vector<Plan> chosen_plans;
    for (const Chosen& c : chosen) chosen_plans.push_back(c.plan);
    const std::vector<PlanResult> confirmed = plans.run(*in.heldout, chosen_plans);
    const std::size_t units = static_cast<std::size_t>(in.shape.num_layers) * in.shape.num_kv_heads;
    for (std::size_t i = 0; i < chosen.size(); ++i) {
        const Chosen& c = chosen[i];
        SearchRecord r;
        r.method = c.method;
        r.fit = "streaming";
        r.target = c.target->label;
        r.objective = "output_rel_error";
        double fitting = 0;
        for (std::size_t u = 0; u < units; ++u)
            if (c.plan.streaming[u]) fitting += c.fitting_error[u];
        r.fitting = fitting / static_cast<double>(units);
        r.heldout = confirmed[i].error;
        r.heldout_interval = confirmed[i].interval;
        r.bytes_per_token = confirmed[i].bytes_per_token;
        r.compression_ratio = confirmed[i].compression_ratio;
        r.streaming_heads = c.plan.streaming;
        r.lambda = c.plan.lambda;
        r.stateless = c.plan.stateless;
        r.streaming_sinks = static_cast<int>(params.at("sinks"));
        r.streaming_recent = static_cast<int>(params.at("recent"));
        r.replay_params = params;
        r.writes_profile = c.writes_profile;
        out.records.push_back(r);
    }
}

// deploy duo: every streaming head stateless, K and V alone; ranked by stateless error.
void fit_duo_heads(const FitInput& in, SearchOutcome& out) {
    const SearchSpec& spec = *in.spec;
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    const PolicyDescriptor* policy = find_policy("streaming_attention");
    const ParamValues params =
        resolve_params(*policy, {{"sinks", spec.streaming_sinks}, {"recent", spec.streaming_recent}, {"stateless", 1}},
                       spec.streaming_where);
    int passes = 0;
    PlanReplay plans(in, params, passes, 4, /*bookkeeping=*/false);
    const std::vector<uint8_t> every_head(units, 1), no_head(units, 0);
    const std::vector<double> no_lambda(units, 0.0);

    std::vector<std::size_t> pattern_order;
    if (!spec.streaming_pattern.empty()) {
        try {
            pattern_order = ascending_order(load_duo_attention_gates(spec.streaming_pattern, L, K));
        } catch (const InputError& e) {
            throw InputError(spec.streaming_where + ".pattern: " + e.what());
        }
    }
    // Bytes on the held-out sequences, each head streaming and not; a target no set of streaming
    // heads reaches is refused before anything is fitted.
    const std::vector<PlanResult> bytes = plans.run(
        *in.heldout, {Plan{"bytes-streaming", every_head, no_lambda, every_head}, Plan{"bytes-full", no_head, no_lambda, {}}});
    const double full_fp16 = 4.0 * in.shape.head_dim;
    const std::string why = "; lower search.streaming.recent or drop streaming from search.fit";
    std::vector<std::size_t> every_unit(units);
    std::iota(every_unit.begin(), every_unit.end(), std::size_t{0});
    for (const SearchTarget& target : spec.targets)
        heads_for_target(every_unit, bytes[0].head_bytes, bytes[1].head_bytes, target.bytes(full_fp16), target, why);

    // Each head's error when it streams, on the fitting sequences: the ranking.
    const std::vector<double> error =
        plans.run(*in.fitting, {Plan{"fit-stateless", every_head, no_lambda, every_head}})[0].head_error;
    const std::vector<std::size_t> order = ascending_order(error);

    std::vector<Chosen> chosen;
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(full_fp16);
        const std::vector<uint8_t> streams =
            heads_for_target(order, bytes[0].head_bytes, bytes[1].head_bytes, wanted, target, why);
        chosen.push_back({{"fitted-" + target.label, streams, no_lambda, every_head}, &target,
                          "streaming heads, fitted ranking", error, true});
        // The same number of heads in every layer (each layer's lowest errors first): what the
        // fit's freedom across layers buys.
        const std::size_t count = static_cast<std::size_t>(std::count(streams.begin(), streams.end(), uint8_t{1}));
        std::vector<uint8_t> per_layer(units, 0);
        std::size_t placed = 0;
        for (std::size_t round = 0; placed < count && round < static_cast<std::size_t>(K); ++round)
            for (int l = 0; l < L && placed < count; ++l) {
                std::vector<double> layer_error(error.begin() + static_cast<std::ptrdiff_t>(l) * K,
                                                error.begin() + static_cast<std::ptrdiff_t>(l + 1) * K);
                const std::size_t kv = ascending_order(layer_error)[round];
                per_layer[static_cast<std::size_t>(l) * K + kv] = 1;
                ++placed;
            }
        chosen.push_back({{"per-layer-" + target.label, per_layer, no_lambda, every_head}, &target,
                          "streaming heads, the same number per layer", error, false});
        if (!pattern_order.empty())
            chosen.push_back({{"duo-" + target.label,
                               heads_for_target(pattern_order, bytes[0].head_bytes, bytes[1].head_bytes, wanted, target, why),
                               no_lambda, every_head},
                              &target, "streaming heads from the DuoAttention pattern", error, false});
    }
    confirm_plans(plans, in, params, chosen, out);
    // Each fitted record's gates: the ranking, with its own heads below 0.5.
    for (SearchRecord& r : out.records)
        if (r.fit == "streaming" && r.writes_profile)
            r.gates = duo_gates(order, static_cast<std::size_t>(std::count(r.streaming_heads.begin(),
                                                                            r.streaming_heads.end(), uint8_t{1})));

    // The ranking at every 5% of sparsity: the table a user chooses DuoAttention's --sparsity from.
    std::vector<std::size_t> counts;
    for (int step = 0; step <= 20; ++step) {
        const auto m = static_cast<std::size_t>(std::lround(step * 0.05 * static_cast<double>(units)));
        if (counts.empty() || counts.back() != m) counts.push_back(m);
    }
    std::vector<Plan> curve;
    for (std::size_t m : counts) {
        std::vector<uint8_t> streams(units, 0);
        for (std::size_t i = 0; i < m; ++i) streams[order[i]] = 1;
        curve.push_back({"sparsity-" + std::to_string(m), streams, no_lambda, every_head});
    }
    const std::vector<PlanResult> measured = plans.run(*in.heldout, curve);
    for (std::size_t i = 0; i < counts.size(); ++i)
        out.sparsity_curve.push_back({duo_sparsity(counts[i], units), static_cast<int>(counts[i]), measured[i].error,
                                      measured[i].bytes_per_token, measured[i].compression_ratio});

    char line[400];
    std::snprintf(line, sizeof line,
                  "Streaming heads for DuoAttention (sinks %d, recent %d, no linear state; K and V bytes alone): "
                  "each head's fitting-set error when it streams ranges %.4f to %.4f; heads stream in that order, "
                  "and the gates written with the profile rank them so, for DuoAttention's --sparsity.",
                  static_cast<int>(params.at("sinks")), static_cast<int>(params.at("recent")), error[order.front()],
                  error[order.back()]);
    out.notes.push_back(line);
}

}  // namespace

std::vector<double> duo_gates(const std::vector<std::size_t>& order, std::size_t streaming) {
    const std::size_t n = order.size();
    if (streaming > n) throw std::logic_error("duo_gates: more streaming heads than heads");
    std::vector<double> gates(n);
    for (std::size_t i = 0; i < n; ++i) {
        const bool streams = i < streaming;
        const double rank = static_cast<double>(streams ? i + 1 : i - streaming + 1);
        const double count = static_cast<double>(streams ? streaming + 1 : n - streaming + 1);
        gates[order[i]] = (streams ? 0.0 : 0.5) + 0.5 * rank / count;
    }
    return gates;
}

double duo_sparsity(std::size_t streaming, std::size_t heads) {
    return static_cast<double>(streaming) / static_cast<double>(heads);
}

namespace {

const char* const kStreamingWhy = "; lower search.streaming.recent or drop streaming from search.fit";

// streaming_attention's parameters with the config's sinks and recent window.
ParamValues streaming_params(const SearchSpec& spec) {
    return resolve_params(*find_policy("streaming_attention"),
                          {{"sinks", spec.streaming_sinks}, {"recent", spec.streaming_recent}}, spec.streaming_where);
}

// What each head holds on the held-out sequences when it streams (with its state, and with none)
// and when it keeps its cache: its sinks, window and state, whatever its lambda. InputError for a
// target that no set of streaming heads reaches.
std::vector<PlanResult> streaming_bytes(const FitInput& in, PlanReplay& plans, std::size_t units) {
    const std::vector<uint8_t> every_head(units, 1), no_head(units, 0);
    std::vector<PlanResult> bytes =
        plans.run(*in.heldout, {Plan{"bytes-streaming", every_head, std::vector<double>(units, 0.99), {}},
                                Plan{"bytes-full", no_head, std::vector<double>(units, 0.99), {}},
                                Plan{"bytes-stateless", every_head, std::vector<double>(units, 0.99), every_head}});
    const double full_fp16 = 4.0 * in.shape.head_dim;
    std::vector<std::size_t> every_unit(units);
    std::iota(every_unit.begin(), every_unit.end(), std::size_t{0});
    std::vector<double> cheapest(units);
    for (std::size_t u = 0; u < units; ++u) cheapest[u] = std::min(bytes[0].head_bytes[u], bytes[2].head_bytes[u]);
    for (const SearchTarget& target : in.spec->targets)  // throws unless every head streaming reaches it
        heads_for_target(every_unit, cheapest, bytes[1].head_bytes, target.bytes(full_fp16), target, kStreamingWhy);
    return bytes;
}

// The lambda searches on the fitting sequences, with `plans` (restricted to `layers` when it was
// made so); per (layer, KV head), those of layers not replayed hold nothing.
std::vector<StreamingHeadFit> fit_streaming_lambdas(const FitInput& in, PlanReplay& plans) {
    const SearchSpec& spec = *in.spec;
    const std::size_t units = static_cast<std::size_t>(in.shape.num_layers) * in.shape.num_kv_heads;
    const PolicyDescriptor* policy = find_policy("streaming_attention");
    const ParamValues params = streaming_params(spec);
    const std::vector<uint8_t> every_head(units, 1);
    // The published calibration: each head's lambda fitted against the full softmax output with
    // nothing kept exactly (no sinks, no window: the state must reproduce every token), then
    // deployed with the sinks and window. Its lambdas are measured beside the fitted ones below.
    const ParamValues calibration_params = resolve_params(*policy, {{"sinks", 0}, {"recent", 0}}, spec.streaming_where);

    // Each head's own lambda with its sinks and window, on the fitting sequences, beside the
    // calibration's search; 0.99 and no state at all measured in their last pass, the calibrated
    // lambdas (known only then) in one more.
    std::vector<PlanResult> baselines;
    const std::vector<LambdaFit> searched =
        fit_lambdas(plans, *in.fitting, units, {&calibration_params, &params},
                    {Plan{"probe-0.99", every_head, std::vector<double>(units, 0.99), {}},
                     Plan{"probe-stateless", every_head, std::vector<double>(units, 0.99), every_head}},
                    baselines);
    const LambdaFit& calibrated = searched[0];
    const LambdaFit& fitted = searched[1];
    baselines.insert(baselines.begin() + 1,
                     plans.run(*in.fitting, {Plan{"probe-calibrated", every_head, calibrated.lambda, {}}}).front());
    std::vector<StreamingHeadFit> heads(units);
    for (std::size_t u = 0; u < units; ++u)
        heads[u] = {fitted.lambda[u],           fitted.error[u],           fitted.error_sum[u],
                    calibrated.lambda[u],       baselines[0].head_error[u], baselines[1].head_error[u],
                    baselines[2].head_error[u], baselines[2].head_error_sum[u]};
    return heads;
}

}  // namespace

std::vector<StreamingHeadFit> fit_streaming_layer(const FitInput& in, int layer) {
    int passes = 0;
    PlanReplay plans(in, streaming_params(*in.spec), passes, kStreamingLambdaPasses, /*bookkeeping=*/true, {layer});
    const std::vector<StreamingHeadFit> all = fit_streaming_lambdas(in, plans);
    const auto K = static_cast<std::size_t>(in.shape.num_kv_heads);
    return {all.begin() + static_cast<std::ptrdiff_t>(layer * K), all.begin() + static_cast<std::ptrdiff_t>((layer + 1) * K)};
}

void refuse_unreachable_streaming_targets(const FitInput& in) {
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    int passes = 0;
    PlanReplay plans(in, streaming_params(*in.spec), passes, 1, /*bookkeeping=*/true);
    (void)streaming_bytes(in, plans, units);
}

void fit_streaming_heads(const FitInput& in, SearchOutcome& out) {
    const SearchSpec& spec = *in.spec;
    if (spec.deploy == "duo") return fit_duo_heads(in, out);
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    const ParamValues params = streaming_params(spec);
    int passes = 0;
    // Two golden-section searches sharing kGoldenSteps + 1 passes, the calibrated lambdas' pass,
    // then the bytes and the confirmation.
    const int total_passes = kGoldenSteps + 1 + 1 + 2;
    PlanReplay plans(in, params, passes, total_passes, /*bookkeeping=*/true);
    const std::vector<uint8_t> every_head(units, 1), no_head(units, 0);

    // DuoAttention's gates rank its heads, the lowest gate streaming first: read before any pass.
    std::vector<std::size_t> duo_order;
    if (!spec.streaming_pattern.empty()) {
        try {
            duo_order = ascending_order(load_duo_attention_gates(spec.streaming_pattern, L, K));
        } catch (const InputError& e) {  // the file's own line, and the config key that named it
            throw InputError(spec.streaming_where + ".pattern: " + e.what());
        }
    }

    // What each head holds on the held-out sequences when it streams (with its state, and with
    // none) and when it keeps its cache: its sinks, window and state, whatever its lambda.
    // Measured first, so that a target no set of streaming heads reaches is refused before the
    // lambdas are fitted, not after.
    const std::vector<PlanResult> bytes = streaming_bytes(in, plans, units);
    const std::vector<double>& state_bytes = bytes[0].head_bytes;
    const std::vector<double>& full_bytes = bytes[1].head_bytes;
    const std::vector<double>& stateless_bytes = bytes[2].head_bytes;
    const double full_fp16 = 4.0 * in.shape.head_dim;
    const std::string why = kStreamingWhy;

    // The lambda searches on the fitting sequences, or what shards measured of them.
    std::vector<StreamingHeadFit> heads;
    if (in.streaming_measured) {
        heads = *in.streaming_measured;
        if (heads.size() != units) throw std::logic_error("streaming fit: measured heads missing");
    } else {
        heads = fit_streaming_lambdas(in, plans);
    }
    std::vector<double> lambda(units), fitted_error(units), error_099(units), error_calibrated(units),
        error_stateless(units), calibrated_lambda(units);
    for (std::size_t u = 0; u < units; ++u) {
        lambda[u] = heads[u].lambda;
        fitted_error[u] = heads[u].error;
        calibrated_lambda[u] = heads[u].calibrated_lambda;
        error_099[u] = heads[u].error_099;
        error_calibrated[u] = heads[u].error_calibrated;
        error_stateless[u] = heads[u].error_stateless;
    }

    // Per head, the better of its fitted lambda and no state (no state when they tie: it holds less).
    std::vector<uint8_t> chose_stateless(units, 0);
    std::vector<double> chosen_error(units), chosen_bytes(units);
    for (std::size_t u = 0; u < units; ++u) {
        chose_stateless[u] = error_stateless[u] <= fitted_error[u];
        chosen_error[u] = chose_stateless[u] ? error_stateless[u] : fitted_error[u];
        chosen_bytes[u] = chose_stateless[u] ? stateless_bytes[u] : state_bytes[u];
    }

    if (in.mixed) {  // fit: mixed: each head streaming as chosen here, with its bytes and summed error
        in.mixed->sinks = static_cast<int>(params.at("sinks"));
        in.mixed->recent = static_cast<int>(params.at("recent"));
        in.mixed->lambda = lambda;
        in.mixed->stateless = chose_stateless;
        in.mixed->streaming.assign(units, {});
        for (std::size_t u = 0; u < units; ++u)
            in.mixed->streaming[u] = {{chosen_bytes[u]},
                                      {chose_stateless[u] ? heads[u].error_stateless_sum : heads[u].error_sum}};
    }
    const std::vector<std::size_t> order = ascending_order(chosen_error);
    const std::vector<std::size_t> state_order = ascending_order(fitted_error);
    const std::vector<std::size_t> stateless_order = ascending_order(error_stateless);
    std::vector<Chosen> chosen;
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(full_fp16);
        const std::vector<uint8_t> streams = heads_for_target(order, chosen_bytes, full_bytes, wanted, target, why);
        chosen.push_back({{"fitted-" + target.label, streams, lambda, chose_stateless}, &target,
                          "streaming heads, fitted lambda or stateless", chosen_error, true});
        // The baselines keep a state in every streaming head: the heads the fitted lambdas rank
        // first, at the bytes a state holds.
        const std::vector<uint8_t> state_streams =
            heads_for_target(state_order, state_bytes, full_bytes, wanted, target, why);
        chosen.push_back({{"published-" + target.label, state_streams, std::vector<double>(units, 0.99), {}}, &target,
                          "streaming heads, lambda 0.99", error_099});
        chosen.push_back({{"calibrated-" + target.label, state_streams, calibrated_lambda, {}}, &target,
                          "streaming heads, lambda calibrated on the full softmax", error_calibrated});
        // DuoAttention's own streaming heads: no state, ranked by that error.
        chosen.push_back({{"stateless-" + target.label,
                           heads_for_target(stateless_order, stateless_bytes, full_bytes, wanted, target, why),
                           lambda, every_head},
                          &target, "streaming heads, stateless", error_stateless});
        if (!duo_order.empty())
            chosen.push_back({{"duo-" + target.label,
                               heads_for_target(duo_order, chosen_bytes, full_bytes, wanted, target, why), lambda,
                               chose_stateless},
                              &target, "streaming heads from the DuoAttention pattern, fitted lambda or stateless",
                              chosen_error});
    }
    confirm_plans(plans, in, params, chosen, out);

    // What the fitted lambdas are, and what they buy against 0.99 head by head.
    double mean_fitted = 0, mean_099 = 0, mean_calibrated = 0;
    int better = 0;
    for (std::size_t u = 0; u < units; ++u) {
        mean_fitted += fitted_error[u];
        mean_099 += error_099[u];
        mean_calibrated += error_calibrated[u];
        better += fitted_error[u] < error_099[u];
    }
    std::vector<double> sorted = lambda, sorted_calibrated = calibrated_lambda;
    std::sort(sorted.begin(), sorted.end());
    std::sort(sorted_calibrated.begin(), sorted_calibrated.end());
    char line[800];
    std::snprintf(line, sizeof line,
                  "Streaming heads (sinks %d, recent %d): fitted lambdas range %s to %s (median %s); calibrated on the "
                  "full softmax (no token kept exactly) they range %s to %s (median %s). Every head streaming, the "
                  "fitting-set output error is %.4f at the fitted lambdas, %.4f at the calibrated ones and %.4f at "
                  "0.99 (%d of %zu heads do better with their own than with 0.99).",
                  static_cast<int>(params.at("sinks")), static_cast<int>(params.at("recent")),
                  format_lambda(sorted.front()).c_str(), format_lambda(sorted.back()).c_str(),
                  format_lambda(sorted[sorted.size() / 2]).c_str(), format_lambda(sorted_calibrated.front()).c_str(),
                  format_lambda(sorted_calibrated.back()).c_str(),
                  format_lambda(sorted_calibrated[sorted_calibrated.size() / 2]).c_str(), mean_fitted / units,
                  mean_calibrated / units, mean_099 / units, better, units);
    out.notes.push_back(line);
    // Which heads chose no state, and which of them stream at each target.
    const auto stateless_count = std::count(chose_stateless.begin(), chose_stateless.end(), uint8_t{1});
    std::string choice = "Stateless streaming heads (sinks and window only) err less than, or as little as, the best "
                         "lambda on " + std::to_string(stateless_count) + " of " + std::to_string(units) +
                         " heads (" + list_heads(chose_stateless, K) + "), which the fit streams without a state.";
    for (const SearchRecord& r : out.records) {
        if (r.fit != "streaming" || !r.writes_profile) continue;
        std::vector<uint8_t> with_state(units, 0), without(units, 0);
        for (std::size_t u = 0; u < units; ++u)
            if (r.streaming_heads[u]) (r.stateless[u] ? without : with_state)[u] = 1;
        choice += " At " + r.target + ": stateless " + list_heads(without, K) + "; with a state " +
                  list_heads(with_state, K) + ".";
    }
    out.notes.push_back(choice);
}

}  // namespace kvsim
