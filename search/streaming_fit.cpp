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
    PlanReplay(const StreamingFitInput& in, const ParamValues& params) : in_(in), params_(params) {}

    // Every plan side by side in one lockstep pass over `source`.
    std::vector<PlanResult> run(AttentionSource& source, const std::vector<Plan>& plans) {
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
    const StreamingFitInput& in_;
    ParamValues params_;
};

std::string format_lambda(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3f", x);
    return text;
}

}  // namespace

void fit_streaming_heads(const StreamingFitInput& in, SearchOutcome& out) {
    const SearchSpec& spec = *in.spec;
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    const PolicyDescriptor* policy = find_policy("streaming_attention");
    const ParamValues params = resolve_params(
        *policy, {{"sinks", spec.streaming_sinks}, {"recent", spec.streaming_recent}}, spec.streaming_where);
    PlanReplay plans(in, params);
    const std::vector<uint8_t> every_head(units, 1), no_head(units, 0);

    // Golden-section search of every head's lambda at once, on the fitting sequences.
    std::vector<double> low(units, 0.0), high(units, 1.0);
    for (int step = 0; step < kGoldenSteps; ++step) {
        Plan left{"probe-left", every_head, {}}, right{"probe-right", every_head, {}};
        for (std::size_t u = 0; u < units; ++u) {
            left.lambda.push_back(high[u] - kGolden * (high[u] - low[u]));
            right.lambda.push_back(low[u] + kGolden * (high[u] - low[u]));
        }
        const std::vector<PlanResult> r = plans.run(*in.fitting, {left, right});
        for (std::size_t u = 0; u < units; ++u) {  // keep the part of the bracket around the lower probe
            if (r[0].head_error[u] <= r[1].head_error[u])
                high[u] = right.lambda[u];
            else
                low[u] = left.lambda[u];
        }
    }
    // The bracket's middle against its ends (a unimodal search never probes 0 or 1) and 0.99.
    Plan middle{"probe-middle", every_head, {}};
    for (std::size_t u = 0; u < units; ++u) middle.lambda.push_back((low[u] + high[u]) / 2);
    const Plan zero{"probe-zero", every_head, std::vector<double>(units, 0.0)};
    const Plan one{"probe-one", every_head, std::vector<double>(units, 1.0)};
    const Plan published{"probe-0.99", every_head, std::vector<double>(units, 0.99)};
    const std::vector<PlanResult> ends = plans.run(*in.fitting, {middle, zero, one, published});
    std::vector<double> lambda(units), fitted_error(units), error_099 = ends[3].head_error;
    for (std::size_t u = 0; u < units; ++u) {
        const double candidates[3] = {middle.lambda[u], 0.0, 1.0};
        std::size_t best = 0;
        for (std::size_t c = 1; c < 3; ++c)
            if (ends[c].head_error[u] < ends[best].head_error[u]) best = c;
        lambda[u] = candidates[best];
        fitted_error[u] = ends[best].head_error[u];
    }

    // What each head holds on the held-out sequences when it streams and when it keeps its cache.
    const std::vector<PlanResult> bytes = plans.run(*in.heldout, {Plan{"bytes-streaming", every_head, lambda},
                                                                  Plan{"bytes-full", no_head, lambda}});
    const double full_fp16 = 4.0 * in.shape.head_dim;
    std::vector<std::size_t> order(units);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return fitted_error[a] < fitted_error[b]; });

    std::vector<Plan> chosen;
    std::vector<const SearchTarget*> chosen_target;
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(full_fp16);
        std::vector<uint8_t> streams(units, 0);
        double sum = std::accumulate(bytes[1].head_bytes.begin(), bytes[1].head_bytes.end(), 0.0);
        for (std::size_t u : order) {
            if (sum <= wanted * static_cast<double>(units)) break;
            streams[u] = 1;
            sum += bytes[0].head_bytes[u] - bytes[1].head_bytes[u];
        }
        if (sum > wanted * static_cast<double>(units) * (1 + 1e-9)) {
            char detail[200];
            std::snprintf(detail, sizeof detail,
                          "%.4g bytes per token, but every head streaming holds %.4g (its sinks, recent window and state)",
                          wanted, sum / static_cast<double>(units));
            throw InputError(target.where + ": " + target.label + " with streaming heads: " + detail +
                             "; lower search.streaming.recent or drop streaming from search.fit");
        }
        chosen.push_back({"fitted-" + target.label, streams, lambda});
        chosen.push_back({"published-" + target.label, streams, std::vector<double>(units, 0.99)});
        chosen_target.push_back(&target);
        chosen_target.push_back(&target);
    }
    const std::vector<PlanResult> confirmed = plans.run(*in.heldout, chosen);

    for (std::size_t i = 0; i < chosen.size(); ++i) {
        const bool fitted = i % 2 == 0;
        SearchRecord r;
        r.method = fitted ? "streaming heads, fitted lambdas" : "streaming heads, lambda 0.99";
        r.fit = "streaming";
        r.target = chosen_target[i]->label;
        r.objective = "output_rel_error";
        double fitting = 0;
        for (std::size_t u = 0; u < units; ++u)
            if (chosen[i].streaming[u]) fitting += fitted ? fitted_error[u] : error_099[u];
        r.fitting = fitting / static_cast<double>(units);
        r.heldout = confirmed[i].error;
        r.bytes_per_token = confirmed[i].bytes_per_token;
        r.compression_ratio = confirmed[i].compression_ratio;
        r.streaming_heads = chosen[i].streaming;
        r.lambda = chosen[i].lambda;
        r.streaming_sinks = static_cast<int>(params.at("sinks"));
        r.streaming_recent = static_cast<int>(params.at("recent"));
        out.records.push_back(r);
        if (!fitted) continue;
        Profile p;
        p.name = in.shape.name + "-streaming_attention-streaming-" + r.target;
        p.model = in.shape;
        p.policy = "streaming_attention";
        p.params = params;
        p.method = r.method;
        p.target = r.target;
        p.streaming = StreamingHeads{r.streaming_sinks, r.streaming_recent, r.streaming_heads, r.lambda};
        p.bytes_per_token = r.bytes_per_token;
        p.compression_ratio = r.compression_ratio;
        p.objective = r.objective;
        p.heldout_value = r.heldout;
        p.heldout_sequences = out.heldout_sequences;
        out.profiles.push_back(p);
    }

    // What the fitted lambdas are, and what they buy against 0.99 head by head.
    double mean_fitted = 0, mean_099 = 0;
    int better = 0;
    for (std::size_t u = 0; u < units; ++u) {
        mean_fitted += fitted_error[u];
        mean_099 += error_099[u];
        better += fitted_error[u] < error_099[u];
    }
    std::vector<double> sorted = lambda;
    std::sort(sorted.begin(), sorted.end());
    char line[500];
    std::snprintf(line, sizeof line,
                  "Streaming heads (sinks %d, recent %d): fitted lambdas range %s to %s (median %s); every head "
                  "streaming, the fitting-set output error is %.4f at the fitted lambdas and %.4f at 0.99 (%d of %zu "
                  "heads do better with their own).",
                  static_cast<int>(params.at("sinks")), static_cast<int>(params.at("recent")),
                  format_lambda(sorted.front()).c_str(), format_lambda(sorted.back()).c_str(),
                  format_lambda(sorted[sorted.size() / 2]).c_str(), mean_fitted / units, mean_099 / units, better, units);
    out.notes.push_back(line);
}

}  // namespace kvsim
