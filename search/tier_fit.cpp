#include "search/tier_fit.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "policies/policy.h"
#include "search/allocation.h"
#include "sim/attention_source.h"
#include "sim/replay.h"
#include "sim/sweep.h"

namespace kvsim {

std::string write_tier_plan(const std::string& folder, const std::string& name, const TierShares& shares) {
    const std::string path = folder + "/" + name + ".json";
    write_file_atomically(path, "{\"tiers\": " + tier_shares_json(shares) + "}\n");
    return path;
}

namespace {

// Candidate zone shares (FP16, INT8, INT4) of one head: every mix of these that sums to at most 1.
// Coarse on purpose: each is one combination of a lockstep pass, and the allocation picks among
// them per head.
std::vector<std::array<double, 3>> candidate_shares() {
    std::vector<std::array<double, 3>> out;
    for (double f : {0.0, 0.1, 0.2, 0.35, 0.5})
        for (double e : {0.0, 0.15, 0.3, 0.5})
            for (double q : {0.0, 0.2, 0.4})
                if (f + e + q <= 1 + 1e-12) out.push_back({f, e, q});
    return out;
}

// The published shape scaled by `scale`: stratigraphic's own per-layer FP16 share (surface, less
// by the depth slope toward the first layer) and its INT8 and INT4 shares, each times the scale.
TierShares published_shares(const ParamValues& p, double scale, int L, int K) {
    TierShares s;
    s.num_layers = L;
    s.num_kv_heads = K;
    const double slope = p.at("slope");
    for (int l = 0; l < L; ++l) {
        const double depth = L > 1 ? static_cast<double>(l) / (L - 1) : 1.0;
        for (int kv = 0; kv < K; ++kv) {
            s.fp16.push_back(scale * p.at("surface") * ((1 - slope) + slope * depth));
            s.int8.push_back(scale * p.at("int8_share"));
            s.int4.push_back(scale * p.at("int4_share"));
        }
    }
    return s;
}

TierShares uniform_shares(const std::array<double, 3>& c, int L, int K) {
    const std::size_t units = static_cast<std::size_t>(L) * K;
    return TierShares{L, K, std::vector<double>(units, c[0]), std::vector<double>(units, c[1]),
                      std::vector<double>(units, c[2])};
}

struct TierResult {
    std::vector<double> head_error;  // summed output error per (layer, KV head)
    std::vector<double> head_bytes;  // bytes per token of context per (layer, KV head)
    double error_sum = 0, steps = 0, bytes_per_token = 0, compression_ratio = 0;
    double interval = 0;  // search.sample: the error's 95% half-width
};

TierResult tier_result(const ComboResult& r) {
    TierResult t;
    for (const StreamMetrics& m : r.by_head) {
        t.head_error.push_back(m.output_rel_error);
        t.head_bytes.push_back(m.context_tokens ? m.cache_bytes / static_cast<double>(m.context_tokens) : 0.0);
    }
    t.error_sum = r.total.output_rel_error;
    t.steps = static_cast<double>(r.total.output_steps);
    t.interval = output_error_interval(r.total);
    t.bytes_per_token = r.total.cache_bytes / static_cast<double>(r.total.context_tokens);
    t.compression_ratio = r.total.fp16_bytes / r.total.cache_bytes;
    return t;
}

std::vector<TierResult> tier_results(const std::vector<ComboResult>& results) {
    std::vector<TierResult> out;
    for (const ComboResult& r : results) out.push_back(tier_result(r));
    return out;
}

// The fit's progress over one of its passes: `done` of it before the pass, `share` of it the pass.
std::function<void(double)> pass_progress(const FitInput& in, double done, double share) {
    if (!in.progress) return nullptr;
    return [&in, done, share](double f) { in.progress(done + f * share); };
}

// Every plan side by side in one lockstep pass over every layer.
std::vector<TierResult> replay_plans(const FitInput& in, const ParamValues& params, AttentionSource& source,
                                     const std::vector<TierShares>& plans, bool output_error,
                                     const std::function<void(double)>& progress) {
    return tier_results(replay_tier_plans(in, params, source, plans, output_error, {}, progress));
}

}  // namespace

TierFitPlans tier_fit_plans(const SearchSpec& spec, int L, int K) {
    TierFitPlans out;
    const PolicyDescriptor* policy = find_policy("stratigraphic");
    out.params = resolve_params(*policy, spec.tier_params, spec.tiers_where);
    if (const std::string problem = policy->check_budget(out.params, 1); !problem.empty())
        throw InputError(spec.tiers_where + ": " + problem);
    out.candidates = candidate_shares();
    out.published_sum = out.params.at("surface") + out.params.at("int8_share") + out.params.at("int4_share");
    const double published_sum = out.published_sum;
    for (int i = 1; i <= 40; ++i) {
        const double s = 0.05 * i;
        if (s * published_sum > 1 + 1e-12) break;
        out.scales.push_back(s);
    }
    if (published_sum > 0 && std::find(out.scales.begin(), out.scales.end(), 1.0) == out.scales.end())
        out.scales.push_back(1.0);
    for (const auto& c : out.candidates) out.plans.push_back(uniform_shares(c, L, K));
    for (double s : out.scales) out.plans.push_back(published_shares(out.params, s, L, K));
    return out;
}

std::vector<ComboResult> replay_tier_plans(const FitInput& in, const ParamValues& params, AttentionSource& source,
                                           const std::vector<TierShares>& plans, bool output_error,
                                           const std::vector<int>& layers, const std::function<void(double)>& progress) {
    std::vector<PolicyEntry> entries;
    for (std::size_t i = 0; i < plans.size(); ++i) {
        PolicyEntry e;
        e.name = "stratigraphic";
        e.params = params;
        e.files = {{"profile", write_tier_plan(in.scratch_folder, "tiers-" + std::to_string(i), plans[i])}};
        e.where = in.spec->tiers_where;
        entries.push_back(e);
    }
    ReplayOptions options = search_replay_options(*in.spec, in.harness, output_error, true);
    options.full_outputs = in.full_outputs;
    options.layers = layers;
    options.progress = progress;
    return replay(source, expand_sweep(entries, {}, std::vector<int>{1}), options);
}

std::size_t tier_option_count(const SearchSpec& spec, const TierFitPlans& plans) {
    const std::size_t count = plans.candidates.size();
    return spec.screen_steps > 0 ? std::min(count, static_cast<std::size_t>(spec.screen_keep)) : count;
}

namespace {

// The plans that measure options `kept` (per (layer, KV head), as TierOptions::kept): the k-th
// gives every head its k-th option; then the scales' plans.
std::vector<TierShares> screened_plans(const TierFitPlans& plans, const std::vector<std::vector<std::size_t>>& kept,
                                       int num_layers, int num_kv_heads) {
    const std::size_t units = static_cast<std::size_t>(num_layers) * num_kv_heads;
    const std::size_t keep = kept.empty() ? 0 : kept.front().size();
    if (kept.size() != units) throw std::logic_error("tier fit: options of every head wanted");
    std::vector<TierShares> out;
    for (std::size_t k = 0; k < keep; ++k) {
        TierShares plan{num_layers, num_kv_heads, {}, {}, {}};
        for (std::size_t u = 0; u < units; ++u) {
            const std::array<double, 3>& c = plans.candidates.at(kept[u].at(k));
            plan.fp16.push_back(c[0]), plan.int8.push_back(c[1]), plan.int4.push_back(c[2]);
        }
        out.push_back(std::move(plan));
    }
    out.insert(out.end(), plans.plans.begin() + static_cast<std::ptrdiff_t>(plans.candidates.size()), plans.plans.end());
    return out;
}

}  // namespace

TierOptions tier_options(const FitInput& in, const TierFitPlans& plans, const std::vector<int>& layers,
                         const std::function<void(double)>& progress) {
    const SearchSpec& spec = *in.spec;
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K, count = plans.candidates.size();
    const std::size_t keep = tier_option_count(spec, plans);
    TierOptions out;
    std::vector<std::size_t> first(keep);
    std::iota(first.begin(), first.end(), std::size_t{0});
    out.kept.assign(units, first);  // unscreened: every candidate; screened: the layers not asked for
    if (keep == count) {  // every candidate, uniform over the heads: the fit's own plans
        out.plans = plans.plans;
        return out;
    }
    out.screen_steps = in.max_steps > 0 ? std::min(in.max_steps, spec.screen_steps) : spec.screen_steps;
    // A merge: each layer's shard screened it, and its partial names the options (a head's figures
    // do not depend on the other layers replayed beside it), so no layer is screened again.
    if (in.tier_measured && !in.tier_measured->kept.empty()) {
        out.kept = in.tier_measured->kept;
        out.plans = screened_plans(plans, out.kept, L, K);
        return out;
    }
    // Every candidate on the first steps of each fitting sequence; then per head the options
    // that best describe the lower hull of their bytes and error there. Every share 0 stays:
    // the first plan is then the fit's cheapest, which decides whether a target is reachable.
    const std::unique_ptr<AttentionSource> prefix =
        open_trace_source(in.trace_path, out.screen_steps, in.fitting_indices);
    FitInput prefix_input = in;
    prefix_input.full_outputs = nullptr;  // the memo keeps whole sequences' outputs, on their own sampled steps
    const std::vector<TierShares> candidate_plans(plans.plans.begin(),
                                                  plans.plans.begin() + static_cast<std::ptrdiff_t>(count));
    const std::vector<TierResult> results = tier_results(
        replay_tier_plans(prefix_input, plans.params, *prefix, candidate_plans, true, layers, progress));
    for (int l = 0; l < L; ++l) {
        if (!layers.empty() && std::find(layers.begin(), layers.end(), l) == layers.end()) continue;
        for (int kv = 0; kv < K; ++kv) {
            const std::size_t u = static_cast<std::size_t>(l) * K + kv;
            UnitOptions o;
            for (const TierResult& r : results) o.bytes.push_back(r.head_bytes[u]), o.error.push_back(r.head_error[u]);
            out.kept[u] = screen_options(o, keep, 0);
        }
    }
    out.plans = screened_plans(plans, out.kept, L, K);
    return out;
}

namespace {

// InputError naming the target when even every share 0 (its result on the held-out sequences)
// holds more bytes than the target allows.
void check_tier_targets(const SearchSpec& spec, const ComboResult& every_share_zero, double full_fp16) {
    double cheapest = 0;
    for (const double b : tier_result(every_share_zero).head_bytes) cheapest += b;
    cheapest /= static_cast<double>(every_share_zero.by_head.size());
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(full_fp16);
        if (cheapest > wanted * (1 + 1e-9)) {
            char detail[240];
            std::snprintf(detail, sizeof detail,
                          "%.4g bytes per token is below the %.4g stratigraphic holds with every share 0 (its sinks, "
                          "recent window and anchors at FP16)",
                          wanted, cheapest);
            throw InputError(target.where + ": " + target.label + " for fit: tiers (" + detail +
                             "); lower search.tiers.recent or drop tiers from search.fit");
        }
    }
}

}  // namespace

ComboResult refuse_unreachable_tier_targets(const FitInput& in, const TierFitPlans& plans) {
    std::vector<ComboResult> cheapest = replay_tier_plans(in, plans.params, *in.heldout, {plans.plans.front()}, false, {}, nullptr);
    check_tier_targets(*in.spec, cheapest.front(), 4.0 * in.shape.head_dim);
    return std::move(cheapest.front());
}

void fit_tier_profiles(const FitInput& in, SearchOutcome& out) {
    const SearchSpec& spec = *in.spec;
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    const TierFitPlans fit_plans = tier_fit_plans(spec, L, K);
    const ParamValues& params = fit_plans.params;
    const std::vector<std::array<double, 3>>& candidates = fit_plans.candidates;
    const std::vector<double>& scales = fit_plans.scales;
    const double published_sum = fit_plans.published_sum;
    const double full_fp16 = 4.0 * in.shape.head_dim;
    // The passes' shares of the fit's progress: the screen (where asked) a quarter, then bytes,
    // errors and the held-out confirmation in equal shares.
    const std::size_t option_count = tier_option_count(spec, fit_plans);
    const bool screening = option_count < candidates.size();
    const double first_pass = screening ? 0.25 : 0.0, pass_share = (1 - first_pass) / 3;

    // Each head's options, and the plans that measure them: the k-th plan gives every head its
    // k-th option (unscreened: the k-th candidate, uniform over the heads); then the scales'.
    // With shards, each screened its layers alone and the merge takes their options.
    const TierOptions screen = tier_options(in, fit_plans, {}, pass_progress(in, 0, first_pass));
    const std::vector<TierShares>& plans = screen.plans;
    if (in.tier_measured &&
        (in.tier_measured->heldout_bytes.size() != plans.size() || in.tier_measured->fitting_errors.size() != option_count))
        throw std::logic_error("tier fit: measured plans missing");

    // Bytes on the held-out sequences (what the target holds them to), errors on the fitting ones.
    // The first candidate (every share 0) is each head's cheapest, since a zone only adds tokens
    // kept: it alone decides whether a target is reachable, so an unreachable one is refused
    // before the pass over every plan.
    std::vector<TierResult> bytes;
    if (in.tier_measured) {
        check_tier_targets(spec, in.tier_measured->heldout_bytes.front(), full_fp16);
        bytes = tier_results(in.tier_measured->heldout_bytes);
    } else {
        bytes = {tier_result(refuse_unreachable_tier_targets(in, fit_plans))};
        const std::vector<TierShares> rest(plans.begin() + 1, plans.end());
        std::vector<TierResult> more =
            replay_plans(in, params, *in.heldout, rest, false, pass_progress(in, first_pass, pass_share));
        bytes.insert(bytes.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    }
    const std::vector<TierShares> option_plans(plans.begin(), plans.begin() + static_cast<std::ptrdiff_t>(option_count));

    struct Chosen {
        std::string method;
        const SearchTarget* target;
        TierShares shares;
        double fitting_error = 0;  // summed over the fitting steps (baselines: set by the fitting pass)
    };
    std::vector<Chosen> chosen;
    std::vector<TierShares> baselines;  // measured on the fitting set below
    std::vector<std::size_t> baseline_of;
    std::vector<std::string> lines;
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(full_fp16);
        // The published shape: the scale whose bytes meet the target, between two measured ones.
        const std::size_t first_scale = option_count;
        std::size_t below = scales.size();
        for (std::size_t i = 0; i < scales.size(); ++i)
            if (bytes[first_scale + i].bytes_per_token <= wanted) below = i;
        if (below == scales.size() || below + 1 == scales.size()) {
            char line[300];
            std::snprintf(line, sizeof line,
                          "At %s the published shares and slope have no baseline: scaled from %.2f to %.2f they hold "
                          "%.4g to %.4g bytes per token, which does not bracket the target's %.4g.",
                          target.label.c_str(), scales.front(), scales.back(), bytes[first_scale].bytes_per_token,
                          bytes[first_scale + scales.size() - 1].bytes_per_token, wanted);
            lines.push_back(line);
            continue;
        }
        const double b0 = bytes[first_scale + below].bytes_per_token, b1 = bytes[first_scale + below + 1].bytes_per_token;
        const double scale = scales[below] + (b1 > b0 ? (wanted - b0) / (b1 - b0) : 0.0) * (scales[below + 1] - scales[below]);
        baselines.push_back(published_shares(params, scale, L, K));
        baseline_of.push_back(chosen.size());
        chosen.push_back({"published shares and slope (scaled x" + format_three_digits(scale) + ")", &target,
                          baselines.back(), 0});
    }

    // Errors: every candidate and each target's scaled baseline, on the fitting sequences.
    // (Measured by shards, the candidates' are read and the baselines alone replayed.)
    std::vector<TierResult> errors;
    if (in.tier_measured) {
        errors = tier_results(in.tier_measured->fitting_errors);
        std::vector<TierResult> more;
        if (!baselines.empty())
            more = replay_plans(in, params, *in.fitting, baselines, true, pass_progress(in, first_pass + pass_share, pass_share));
        errors.insert(errors.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    } else {
        std::vector<TierShares> fitting_plans = option_plans;
        fitting_plans.insert(fitting_plans.end(), baselines.begin(), baselines.end());
        errors = replay_plans(in, params, *in.fitting, fitting_plans, true, pass_progress(in, first_pass + pass_share, pass_share));
    }
    const double fitting_steps = errors.front().steps;
    for (std::size_t b = 0; b < baselines.size(); ++b)
        chosen[baseline_of[b]].fitting_error = errors[option_count + b].error_sum;

    // Every head's options: each one's held-out bytes and fitting error.
    std::vector<UnitOptions> options(units);
    for (std::size_t u = 0; u < units; ++u)
        for (std::size_t k = 0; k < option_count; ++k) {
            options[u].bytes.push_back(bytes[k].head_bytes[u]);
            options[u].error.push_back(errors[k].head_error[u]);
        }
    if (in.mixed) {  // fit: mixed chooses among them beside the other families'
        in.mixed->tier_params = params;
        in.mixed->tier_shares.assign(units, {});
        for (std::size_t u = 0; u < units; ++u)
            for (const std::size_t c : screen.kept[u]) in.mixed->tier_shares[u].push_back(candidates[c]);
        in.mixed->tiers = options;
    }
    if (screen.screen_steps > 0) {
        char line[400];
        std::snprintf(line, sizeof line,
                      "The tier fit screened its %zu candidates on the first %lld decode steps of each fitting "
                      "sequence (search.screen) and replayed %zu per head in full: those that best describe the lower "
                      "hull of the head's bytes and error there.",
                      candidates.size(), static_cast<long long>(screen.screen_steps), option_count);
        lines.push_back(line);
    }
    // The fitted profile per target: one candidate per head by marginal gain.
    for (const SearchTarget& target : spec.targets) {
        const std::vector<std::size_t> pick = choose_by_marginal_gain(options, target.bytes(full_fp16));
        TierShares shares{L, K, {}, {}, {}};
        double fitting_error = 0;
        for (std::size_t u = 0; u < units; ++u) {
            const std::array<double, 3>& c = candidates[screen.kept[u][pick[u]]];
            shares.fp16.push_back(c[0]);
            shares.int8.push_back(c[1]);
            shares.int4.push_back(c[2]);
            fitting_error += errors[pick[u]].head_error[u];
        }
        chosen.push_back({"fitted tier profile", &target, shares, fitting_error});
    }
    // Targets in the config's order, the fitted profile first.
    std::stable_sort(chosen.begin(), chosen.end(), [&](const Chosen& a, const Chosen& b) {
        if (a.target != b.target) return a.target < b.target;  // both point into spec.targets: config order
        return a.method == "fitted tier profile" && b.method != "fitted tier profile";
    });

    // Every method on the held-out sequences, and the published shares unscaled for the notes.
    std::vector<TierShares> confirm_plans;
    for (const Chosen& c : chosen) confirm_plans.push_back(c.shares);
    const bool has_published = published_sum > 0 && published_sum <= 1 + 1e-12;
    if (has_published) confirm_plans.push_back(published_shares(params, 1.0, L, K));
    const std::vector<TierResult> confirmed =
        replay_plans(in, params, *in.heldout, confirm_plans, true, pass_progress(in, first_pass + 2 * pass_share, pass_share));

    for (std::size_t i = 0; i < chosen.size(); ++i) {
        const Chosen& c = chosen[i];
        SearchRecord r;
        r.method = c.method;
        r.fit = "tiers";
        r.target = c.target->label;
        r.objective = "output_rel_error";
        r.fitting = fitting_steps > 0 ? c.fitting_error / fitting_steps : 0.0;
        r.heldout = confirmed[i].steps > 0 ? confirmed[i].error_sum / confirmed[i].steps : 0.0;
        r.heldout_interval = confirmed[i].interval;
        r.bytes_per_token = confirmed[i].bytes_per_token;
        r.compression_ratio = confirmed[i].compression_ratio;
        r.replay_params = params;
        r.tiers = c.shares;
        r.writes_profile = c.method == "fitted tier profile";
        out.records.push_back(r);
        if (!r.writes_profile) continue;

        // Where the fitted profile spends its bytes, layer by layer.
        std::string per_layer;
        for (int l = 0; l < L; ++l) {
            double f = 0, e = 0, q = 0;
            for (int kv = 0; kv < K; ++kv) {
                const std::size_t u = r.tiers.index(l, kv);
                f += r.tiers.fp16[u], e += r.tiers.int8[u], q += r.tiers.int4[u];
            }
            per_layer += (l ? "; " : "") + std::to_string(l) + ": " + format_three_digits(f / K) + "/" +
                         format_three_digits(e / K) + "/" + format_three_digits(q / K);
        }
        lines.push_back("At " + r.target + " the fitted tier profile's mean FP16/INT8/INT4 shares per layer are " +
                        per_layer + ".");
    }
    if (has_published) {
        const TierResult& p = confirmed.back();
        char line[400];
        std::snprintf(line, sizeof line,
                      "The published shares unscaled (surface %s, slope %s, INT8 %s, INT4 %s) hold %.4g bytes per "
                      "token (%.2fx) on the held-out sequences, output error %.4f.",
                      format_three_digits(params.at("surface")).c_str(),
                      format_three_digits(params.at("slope")).c_str(),
                      format_three_digits(params.at("int8_share")).c_str(),
                      format_three_digits(params.at("int4_share")).c_str(),
                      p.bytes_per_token, p.compression_ratio, p.steps > 0 ? p.error_sum / p.steps : 0.0);
        lines.push_back(line);
    }
    out.notes.insert(out.notes.end(), lines.begin(), lines.end());
}

}  // namespace kvsim
