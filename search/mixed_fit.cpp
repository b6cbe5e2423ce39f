#include "search/mixed_fit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "base/atomic_file.h"
#include "sim/replay.h"
#include "sim/sweep.h"

namespace kvsim {
namespace {

// One option of one head: its method and which of its family's options it is.
struct HeadOption {
    HeadMethod method;
    std::size_t index;  // grid budget, tier candidate; 0 for streaming and full
};

// A family set the allocation may choose from (the full cache always among them).
struct FamilySet {
    std::string name;
    bool evict, tiers, streaming;
};

struct Chosen {
    std::string method;
    const SearchTarget* target;
    MixedPlan plan;
    double fitting_error = 0;  // the options' errors summed: what the allocation read
    std::vector<double> head_error;  // ... per head
    std::vector<double> head_bytes;  // each head's option's bytes per token
    double estimated_bytes = 0;      // the options' bytes, averaged over heads
    bool fitted = false;
};

// "layer 0: 1, 3; layer 2: 0": the heads whose method is `m`.
std::string heads_with(const MixedPlan& plan, HeadMethod m) {
    std::string text;
    for (int l = 0; l < plan.num_layers; ++l) {
        std::string row;
        for (int kv = 0; kv < plan.num_kv_heads; ++kv)
            if (plan.method[plan.index(l, kv)] == m) row += (row.empty() ? "" : ", ") + std::to_string(kv);
        if (!row.empty()) text += (text.empty() ? "" : "; ") + std::string("layer ") + std::to_string(l) + ": " + row;
    }
    return text.empty() ? "none" : text;
}

}  // namespace

std::string write_mixed_plan(const std::string& folder, const std::string& name, const MixedPlan& plan) {
    const std::string path = folder + "/" + name + ".json";
    nlohmann::ordered_json file;
    file["mixed"] = mixed_plan_json(plan);
    write_file_atomically(path, file.dump() + "\n");
    return path;
}

void fit_mixed_heads(const FitInput& in, const MixedTables& t, SearchOutcome& out) {
    const SearchSpec& spec = *in.spec;
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    const double full_fp16 = 4.0 * in.shape.head_dim;
    const bool has_evict = !t.evict.empty(), has_tiers = !t.tiers.empty(), has_streaming = !t.streaming.empty();

    // The allocations: every family, and each pair of them (the baselines a two-method system could fit).
    std::vector<FamilySet> sets = {{"fitted mix per head", has_evict, has_tiers, has_streaming}};
    if (has_evict && has_tiers) sets.push_back({"mix of eviction and tiers per head", true, true, false});
    if (has_evict && has_streaming) sets.push_back({"mix of eviction and streaming per head", true, false, true});
    if (has_tiers && has_streaming) sets.push_back({"mix of tiers and streaming per head", false, true, true});

    std::vector<Chosen> chosen;
    std::vector<std::string> lines;
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(full_fp16);
        for (const FamilySet& set : sets) {
            std::vector<UnitOptions> options(units);
            std::vector<std::vector<HeadOption>> meaning(units);
            double cheapest = 0;
            for (std::size_t u = 0; u < units; ++u) {
                auto add = [&](const UnitOptions& family, HeadMethod m) {
                    for (std::size_t i = 0; i < family.bytes.size(); ++i) {
                        options[u].bytes.push_back(family.bytes[i]);
                        options[u].error.push_back(family.error[i]);
                        meaning[u].push_back({m, i});
                    }
                };
                if (set.evict) add(t.evict[u], HeadMethod::evict);
                if (set.tiers) add(t.tiers[u], HeadMethod::tiers);
                if (set.streaming) add(t.streaming[u], HeadMethod::streaming);
                add(UnitOptions{{t.full_bytes}, {0.0}}, HeadMethod::full);
                cheapest += *std::min_element(options[u].bytes.begin(), options[u].bytes.end());
            }
            if (cheapest > wanted * static_cast<double>(units) * (1 + 1e-9)) {
                char line[300];
                std::snprintf(line, sizeof line, "At %s the %s cannot meet the target: its cheapest option everywhere "
                              "holds %.4g bytes per token.", target.label.c_str(), set.name.c_str(),
                              cheapest / static_cast<double>(units));
                lines.push_back(line);
                continue;
            }
            const std::vector<std::size_t> pick = choose_by_marginal_gain(options, wanted);
            Chosen c{set.name, &target, MixedPlan{}, 0, {}, {}, 0, set.name == sets.front().name};
            MixedPlan& plan = c.plan;
            plan.num_layers = L;
            plan.num_kv_heads = K;
            plan.budgets.assign(units, 0);
            plan.fp16.assign(units, 0), plan.int8.assign(units, 0), plan.int4.assign(units, 0);
            plan.lambda.assign(units, 0);
            plan.stateless.assign(units, 0);
            for (std::size_t u = 0; u < units; ++u) {
                const HeadOption o = meaning[u][pick[u]];
                plan.method.push_back(o.method);
                c.head_error.push_back(options[u].error[pick[u]]);
                c.head_bytes.push_back(options[u].bytes[pick[u]]);
                c.fitting_error += options[u].error[pick[u]];
                c.estimated_bytes += options[u].bytes[pick[u]] / static_cast<double>(units);
                if (o.method == HeadMethod::evict) plan.budgets[u] = t.evict_budgets[u][o.index];
                if (o.method == HeadMethod::tiers) {
                    plan.fp16[u] = t.tier_shares[u][o.index][0];
                    plan.int8[u] = t.tier_shares[u][o.index][1];
                    plan.int4[u] = t.tier_shares[u][o.index][2];
                }
                if (o.method == HeadMethod::streaming) plan.lambda[u] = t.lambda[u], plan.stateless[u] = t.stateless[u];
            }
            if (plan.count(HeadMethod::evict)) plan.evict_policy = t.evict_policy, plan.evict_params = t.evict_params;
            if (plan.count(HeadMethod::tiers)) plan.tier_params = t.tier_params;
            if (plan.count(HeadMethod::streaming)) plan.sinks = t.sinks, plan.recent = t.recent;
            chosen.push_back(std::move(c));
        }
    }

    // Each plan as the mixed policy runs it: once over the fitting sequences (the check that
    // heads are independent: every head's replayed error must be the option's it was chosen by)
    // and once over the held-out ones (the figures reported).
    std::vector<PolicyEntry> entries;
    for (std::size_t i = 0; i < chosen.size(); ++i) {
        const std::string path = write_mixed_plan(in.scratch_folder, "mixed-" + std::to_string(i), chosen[i].plan);
        PolicyEntry e;
        e.name = "mixed";
        e.files = {{"profile", path}};
        e.where = spec.fits_where;
        entries.push_back(e);
    }
    ReplayOptions options = search_replay_options(*in.spec, in.harness, true, true);
    options.full_outputs = in.full_outputs;
    const std::vector<ReplayCombo> combos = expand_sweep(entries, {}, std::vector<int>{1});
    if (in.progress) options.progress = [&in](double f) { in.progress(0.5 * f); };
    const std::vector<ComboResult> fitting = replay(*in.fitting, combos, options);
    if (in.progress) options.progress = [&in](double f) { in.progress(0.5 + 0.5 * f); };
    const std::vector<ComboResult> heldout = replay(*in.heldout, combos, options);

    double worst = 0;  // the largest relative difference between a replayed head and its option
    std::size_t worst_plan = 0, worst_head = 0;
    for (std::size_t i = 0; i < chosen.size(); ++i)
        for (std::size_t u = 0; u < units; ++u) {
            const double replayed = fitting[i].by_head[u].output_rel_error, option = chosen[i].head_error[u];
            const double diff = std::abs(replayed - option) / std::max(std::abs(option), 1e-300);
            if (replayed != option && diff > worst) worst = diff, worst_plan = i, worst_head = u;
        }

    for (std::size_t i = 0; i < chosen.size(); ++i) {
        const Chosen& c = chosen[i];
        SearchRecord r = output_error_record(c.method, "mixed", c.target->label, c.fitting_error,
                                             static_cast<double>(fitting[i].total.output_steps), heldout[i].total);
        r.mixed = c.plan;
        r.writes_profile = c.fitted;
        out.records.push_back(r);
        if (!c.fitted) continue;

        // What the mix chose: heads per method, where each went, and why it is worth its bytes.
        const MixedPlan& p = c.plan;
        std::string line = "At " + r.target + " the fitted mix per head chose: " +
                           std::to_string(p.count(HeadMethod::evict)) + " heads evicting" +
                           (p.count(HeadMethod::evict) ? " (" + p.evict_policy + "), " : ", ") +
                           std::to_string(p.count(HeadMethod::tiers)) + " on tiers, " +
                           std::to_string(p.count(HeadMethod::streaming)) + " streaming, " +
                           std::to_string(p.count(HeadMethod::full)) + " full, of " + std::to_string(units) + ".";
        std::string full_layers;
        for (int l = 0; l < L; ++l) {
            int full = 0;
            for (int kv = 0; kv < K; ++kv) full += p.method[p.index(l, kv)] == HeadMethod::full;
            if (full == K) full_layers += (full_layers.empty() ? "" : ", ") + std::to_string(l);
        }
        line += " Layers wholly at full cache: " + (full_layers.empty() ? std::string("none") : full_layers) +
                ". Full heads: " + heads_with(p, HeadMethod::full) + ". Streaming heads: " +
                heads_with(p, HeadMethod::streaming) + ". Tier heads: " + heads_with(p, HeadMethod::tiers) +
                ". Evicting heads: " + heads_with(p, HeadMethod::evict) + ".";
        if (p.count(HeadMethod::evict)) {
            double mean = 0;
            for (std::size_t u = 0; u < units; ++u) mean += p.budgets[u];
            line += " Evicting heads keep " +
                    format_three_digits(mean / static_cast<double>(p.count(HeadMethod::evict))) +
                    " tokens on average.";
        }
        // Why: where the bytes went, and where the error that remains sits.
        double bytes_of[kHeadMethods] = {}, error_of[kHeadMethods] = {}, bytes_sum = 0;
        for (std::size_t u = 0; u < units; ++u) {
            bytes_of[static_cast<int>(p.method[u])] += c.head_bytes[u];
            error_of[static_cast<int>(p.method[u])] += c.head_error[u];
            bytes_sum += c.head_bytes[u];
        }
        std::string shares;
        for (int m = 0; m < kHeadMethods; ++m) {
            if (!p.count(static_cast<HeadMethod>(m))) continue;
            char part[160];
            std::snprintf(part, sizeof part, "%s%s heads %.0f%% of the bytes and %.0f%% of the fitting error",
                          shares.empty() ? "" : "; ", std::string(head_method_name(static_cast<HeadMethod>(m))).c_str(),
                          100 * bytes_of[m] / bytes_sum, c.fitting_error > 0 ? 100 * error_of[m] / c.fitting_error : 0.0);
            shares += part;
        }
        char bytes[200];
        std::snprintf(bytes, sizeof bytes, " The options' bytes sum to %.4g per token; the replay holds %.4g.",
                      c.estimated_bytes, r.bytes_per_token);
        out.notes.push_back(line + " Each head took the option that cut the most error per byte: " + shares + "." +
                            bytes);
    }
    char line[500];
    if (worst == 0)
        std::snprintf(line, sizeof line,
                      "Heads are independent on the trace: replayed on the fitting sequences as the mixed policy runs "
                      "them, every head of the %zu mixed plans errs exactly as the option it was chosen by, so each "
                      "plan's fitting figure is the sum of its options'.", chosen.size());
    else
        std::snprintf(line, sizeof line,
                      "Replayed on the fitting sequences, the mixed plans' heads err as their options did to within "
                      "a relative %.3g (largest: plan %zu, layer %zu, KV head %zu), so the allocation read their sum.",
                      worst, worst_plan, worst_head / K, worst_head % K);
    out.notes.push_back(line);
    out.notes.insert(out.notes.end(), lines.begin(), lines.end());
}

}  // namespace kvsim
