#include "search/streaming_fit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "policies/policy.h"
#include "sim/replay.h"
#include "cache_math/streaming_heads.h"
#include "sim/sweep.h"

namespace kvsim {

StreamingPlanFile::StreamingPlanFile(const std::string& folder, const std::string& name, int num_layers,
                                     int num_kv_heads, const std::vector<uint8_t>& streaming,
                                     const std::vector<double>& lambda)
    : path_(folder + "/" + name + ".yaml") {
    std::string text = "streaming:\n";
    for (int l = 0; l < num_layers; ++l) {
        text += "  - [";
        for (int kv = 0; kv < num_kv_heads; ++kv)
            text += (kv ? ", " : "") + std::to_string(streaming[static_cast<std::size_t>(l) * num_kv_heads + kv]);
        text += "]\n";
    }
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
    write_file_atomically(path_, text);
}

StreamingPlanFile::~StreamingPlanFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
}

namespace {

constexpr double kGolden = 0.6180339887498949;  // (sqrt(5) - 1) / 2
constexpr int kGoldenSteps = 16;                 // the bracket shrinks to 0.618^16 < 5e-4

struct Plan {
    std::string name;
    std::vector<uint8_t> streaming;
    std::vector<double> lambda;
};

struct PlanResult {
    std::vector<double> head_error;  // mean output error per (layer, KV head)
    std::vector<double> head_bytes;  // bytes per token of context per (layer, KV head)
    double error = 0, bytes_per_token = 0, compression_ratio = 0;  // over every head
};

class PlanReplay {
public:
    PlanReplay(const FitInput& in, const ParamValues& params, int& passes) : in_(in), params_(params), passes_(passes) {}

    // Every plan side by side in one lockstep pass over `source`.
    std::vector<PlanResult> run(AttentionSource& source, const std::vector<Plan>& plans) {
        // Every pass counts alike: two golden-section searches of kGoldenSteps + 1 passes, then
        // the bytes and the confirmation.
        if (in_.progress) in_.progress(static_cast<double>(++passes_) / (2 * (kGoldenSteps + 1) + 2));
        std::vector<std::unique_ptr<StreamingPlanFile>> files;
        std::vector<PolicyEntry> entries;
        for (const Plan& plan : plans) {
            files.push_back(std::make_unique<StreamingPlanFile>(in_.scratch_folder, plan.name, in_.shape.num_layers,
                                                                in_.shape.num_kv_heads, plan.streaming, plan.lambda));
            PolicyEntry e;
            e.name = "streaming_attention";
            e.params = {{"sinks", params_.at("sinks")}, {"recent", params_.at("recent")}};
            e.files = {{"profile", files.back()->path()}};
            e.where = in_.spec->where + ".streaming";
            entries.push_back(e);
        }
        ReplayOptions options;
        options.harness = in_.harness;
        options.output_error = true;
        options.memory = true;
        const std::vector<ReplayCombo> combos = expand_sweep(entries, {}, std::vector<int>{1});
        const std::vector<ComboResult> results = replay(source, combos, options);
        std::vector<PlanResult> out;
        for (const ComboResult& r : results) {
            PlanResult p;
            for (const StreamMetrics& m : r.by_head) {
                p.head_error.push_back(m.output_steps ? m.output_rel_error / m.output_steps : 0.0);
                p.head_bytes.push_back(m.context_tokens ? m.cache_bytes / m.context_tokens : 0.0);
            }
            p.error = r.total.output_steps ? r.total.output_rel_error / r.total.output_steps : 0.0;
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
};

std::string format_lambda(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3f", x);
    return text;
}

}  // namespace

namespace {

struct LambdaFit {
    std::vector<double> lambda, error;  // per (layer, KV head): the lambda, and the error at it
};

// Golden-section search of every head's lambda at once, every head streaming under `plans`' sinks
// and recent window; then the bracket's middle against its ends (a unimodal search never probes
// 0 or 1). `extra` are measured in the last pass, beside the candidates (their results follow).
LambdaFit fit_lambdas(PlanReplay& plans, AttentionSource& source, std::size_t units, const std::vector<Plan>& extra,
                      std::vector<PlanResult>& extra_results) {
    const std::vector<uint8_t> every_head(units, 1);
    std::vector<double> low(units, 0.0), high(units, 1.0);
    for (int step = 0; step < kGoldenSteps; ++step) {
        Plan left{"probe-left", every_head, {}}, right{"probe-right", every_head, {}};
        for (std::size_t u = 0; u < units; ++u) {
            left.lambda.push_back(high[u] - kGolden * (high[u] - low[u]));
            right.lambda.push_back(low[u] + kGolden * (high[u] - low[u]));
        }
        const std::vector<PlanResult> r = plans.run(source, {left, right});
        for (std::size_t u = 0; u < units; ++u) {  // keep the part of the bracket around the lower probe
            if (r[0].head_error[u] <= r[1].head_error[u])
                high[u] = right.lambda[u];
            else
                low[u] = left.lambda[u];
        }
    }
    Plan middle{"probe-middle", every_head, {}};
    for (std::size_t u = 0; u < units; ++u) middle.lambda.push_back((low[u] + high[u]) / 2);
    std::vector<Plan> last = {middle, Plan{"probe-zero", every_head, std::vector<double>(units, 0.0)},
                              Plan{"probe-one", every_head, std::vector<double>(units, 1.0)}};
    last.insert(last.end(), extra.begin(), extra.end());
    const std::vector<PlanResult> ends = plans.run(source, last);
    extra_results.assign(ends.begin() + 3, ends.end());
    LambdaFit fit{std::vector<double>(units), std::vector<double>(units)};
    for (std::size_t u = 0; u < units; ++u) {
        std::size_t best = 0;
        for (std::size_t c = 1; c < 3; ++c)
            if (ends[c].head_error[u] < ends[best].head_error[u]) best = c;
        fit.lambda[u] = last[best].lambda[u];
        fit.error[u] = ends[best].head_error[u];
    }
    return fit;
}

// The heads that stream to bring the cache to `wanted` bytes per token, taken in `order`.
std::vector<uint8_t> heads_for_target(const std::vector<std::size_t>& order, const PlanResult& streaming,
                                      const PlanResult& full, double wanted, const SearchTarget& target,
                                      const std::string& why) {
    const std::size_t units = order.size();
    std::vector<uint8_t> streams(units, 0);
    double sum = std::accumulate(full.head_bytes.begin(), full.head_bytes.end(), 0.0);
    for (std::size_t u : order) {
        if (sum <= wanted * static_cast<double>(units)) break;
        streams[u] = 1;
        sum += streaming.head_bytes[u] - full.head_bytes[u];
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

}  // namespace

void fit_streaming_heads(const FitInput& in, SearchOutcome& out) {
    const SearchSpec& spec = *in.spec;
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    const PolicyDescriptor* policy = find_policy("streaming_attention");
    const ParamValues params = resolve_params(
        *policy, {{"sinks", spec.streaming_sinks}, {"recent", spec.streaming_recent}}, spec.streaming_where);
    int passes = 0;
    PlanReplay plans(in, params, passes);
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

    // What each head holds on the held-out sequences when it streams and when it keeps its cache:
    // its sinks, window and state, whatever its lambda. Measured first, so that a target no set of
    // streaming heads reaches is refused before the lambdas are fitted, not after.
    const std::vector<PlanResult> bytes =
        plans.run(*in.heldout, {Plan{"bytes-streaming", every_head, std::vector<double>(units, 0.99)},
                                Plan{"bytes-full", no_head, std::vector<double>(units, 0.99)}});
    const double full_fp16 = 4.0 * in.shape.head_dim;
    const std::string why = "; lower search.streaming.recent or drop streaming from search.fit";
    std::vector<std::size_t> every_unit(units);
    std::iota(every_unit.begin(), every_unit.end(), std::size_t{0});
    for (const SearchTarget& target : spec.targets)  // throws unless every head streaming reaches it
        heads_for_target(every_unit, bytes[0], bytes[1], target.bytes(full_fp16), target, why);

    // The published calibration: each head's lambda fitted against the full softmax output with
    // nothing kept exactly (no sinks, no window: the state must reproduce every token), then
    // deployed with the sinks and window. Its lambdas are measured beside the fitted ones below.
    const ParamValues calibration_params = resolve_params(*policy, {{"sinks", 0}, {"recent", 0}}, spec.streaming_where);
    PlanReplay calibration_plans(in, calibration_params, passes);
    std::vector<PlanResult> unused;
    const LambdaFit calibrated = fit_lambdas(calibration_plans, *in.fitting, units, {}, unused);

    // Each head's own lambda with its sinks and window, on the fitting sequences; 0.99 and the
    // calibrated lambdas measured in the same last pass.
    std::vector<PlanResult> baselines;
    const LambdaFit fitted = fit_lambdas(plans, *in.fitting, units,
                                         {Plan{"probe-0.99", every_head, std::vector<double>(units, 0.99)},
                                          Plan{"probe-calibrated", every_head, calibrated.lambda}},
                                         baselines);
    const std::vector<double>& lambda = fitted.lambda;
    const std::vector<double>& fitted_error = fitted.error;
    const std::vector<double>& error_099 = baselines[0].head_error;
    const std::vector<double>& error_calibrated = baselines[1].head_error;

    const std::vector<std::size_t> order = ascending_order(fitted_error);
    struct Chosen {
        Plan plan;
        const SearchTarget* target;
        std::string method;
        const std::vector<double>* fitting_error;  // per head, on the fitting sequences
    };
    std::vector<Chosen> chosen;
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(full_fp16);
        const std::vector<uint8_t> streams = heads_for_target(order, bytes[0], bytes[1], wanted, target, why);
        chosen.push_back({{"fitted-" + target.label, streams, lambda}, &target, "streaming heads, fitted lambdas",
                          &fitted_error});
        chosen.push_back({{"published-" + target.label, streams, std::vector<double>(units, 0.99)}, &target,
                          "streaming heads, lambda 0.99", &error_099});
        chosen.push_back({{"calibrated-" + target.label, streams, calibrated.lambda}, &target,
                          "streaming heads, lambda calibrated on the full softmax", &error_calibrated});
        if (!duo_order.empty())
            chosen.push_back({{"duo-" + target.label, heads_for_target(duo_order, bytes[0], bytes[1], wanted, target, why),
                               lambda},
                              &target, "streaming heads from the DuoAttention pattern, fitted lambdas", &fitted_error});
    }
    std::vector<Plan> chosen_plans;
    for (const Chosen& c : chosen) chosen_plans.push_back(c.plan);
    const std::vector<PlanResult> confirmed = plans.run(*in.heldout, chosen_plans);

    for (std::size_t i = 0; i < chosen.size(); ++i) {
        const Chosen& c = chosen[i];
        const bool fitted_method = c.plan.name.rfind("fitted-", 0) == 0;
        SearchRecord r;
        r.method = c.method;
        r.fit = "streaming";
        r.target = c.target->label;
        r.objective = "output_rel_error";
        double fitting = 0;
        for (std::size_t u = 0; u < units; ++u)
            if (c.plan.streaming[u]) fitting += (*c.fitting_error)[u];
        r.fitting = fitting / static_cast<double>(units);
        r.heldout = confirmed[i].error;
        r.bytes_per_token = confirmed[i].bytes_per_token;
        r.compression_ratio = confirmed[i].compression_ratio;
        r.streaming_heads = c.plan.streaming;
        r.lambda = c.plan.lambda;
        r.streaming_sinks = static_cast<int>(params.at("sinks"));
        r.streaming_recent = static_cast<int>(params.at("recent"));
        r.replay_params = params;
        r.writes_profile = fitted_method;
        out.records.push_back(r);
    }

    // What the fitted lambdas are, and what they buy against 0.99 head by head.
    double mean_fitted = 0, mean_099 = 0, mean_calibrated = 0;
    int better = 0;
    for (std::size_t u = 0; u < units; ++u) {
        mean_fitted += fitted_error[u];
        mean_099 += error_099[u];
        mean_calibrated += error_calibrated[u];
        better += fitted_error[u] < error_099[u];
    }
    std::vector<double> sorted = lambda, sorted_calibrated = calibrated.lambda;
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
}

}  // namespace kvsim
