#include "search/rank_fit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>

#include "base/errors.h"
#include "policies/policy.h"
#include "search/allocation.h"
#include "cache_math/lowrank.h"
#include "sim/lowrank_fit.h"
#include "sim/replay.h"
#include "sim/sweep.h"

namespace kvsim {

std::vector<int> rank_ladder(int n) {
    std::vector<int> ladder;
    for (int r = 1; r <= std::min(n, 8); ++r) ladder.push_back(r);
    for (int r = 8; r < n;) {
        r = std::min(n, (r * 4 + 2) / 3);
        ladder.push_back(r);
    }
    return ladder;
}

namespace {

struct RankPair {
    int key, value;
};

// A method of the fit: how the held-out replay (and kvsim eval) runs it.
struct RankMethod {
    std::string name;
    const SearchTarget* target = nullptr;
    std::string policy;           // lowrank or group_heads
    ParamValues params;           // joint, group, fitted
    FittedRanks ranks;            // lowrank: per unit
    double fitting_error = 0;     // summed over the fitting steps
};

// Bytes per token of context one (layer, KV head) holds at the given ranks, every token kept:
// the latents at fp16 and the up-projections held at each step, by the memory metric's arithmetic.
double head_bytes(const KvProjection& p, int layer, int kv, int num_kv_heads, int head_dim, double steps_per_context) {
    const double per_token = p.share(num_kv_heads) * 2.0 *
                             (p.stored_key_dim(layer, kv, head_dim) + p.stored_value_dim(layer, kv, head_dim));
    return per_token + p.basis_bytes(layer, kv, num_kv_heads, head_dim) * steps_per_context;
}

// The ladders' (key rank, value rank) pairs: per KV head, then joint.
void rank_pairs(int d, int K, std::vector<RankPair>& head_pairs, std::vector<RankPair>& joint_pairs) {
    const std::vector<int> head_ladder = rank_ladder(d), joint_ladder = rank_ladder(K * d);
    for (int k : head_ladder)
        for (int v : head_ladder) head_pairs.push_back({k, v});
    for (int k : joint_ladder)
        for (int v : joint_ladder) joint_pairs.push_back({k, v});
}

PolicyEntry lowrank_entry(const SearchSpec& spec, const std::string& bases_path, int key, int value, int joint) {
    PolicyEntry e;
    e.name = "lowrank";
    e.params = {{"key_rank", key}, {"value_rank", value}, {"joint", joint}};
    e.files = {{"bases", bases_path}};
    e.where = spec.fits_where;
    return e;
}

}  // namespace

std::size_t rank_fit_plan_count(int head_dim, int num_kv_heads) {
    std::vector<RankPair> head_pairs, joint_pairs;
    rank_pairs(head_dim, num_kv_heads, head_pairs, joint_pairs);
    return head_pairs.size() + joint_pairs.size();
}

std::shared_ptr<KvBases> fit_rank_bases(const FitInput& in, const std::string& path) {
    auto bases = std::make_shared<KvBases>(fit_kv_bases(in.trace_path, in.fitting_indices,
                                                        KeyFrame{in.spec->ranks_pre_rope, in.spec->ranks_pre_rope_theta}));
    write_kv_bases(path, *bases);
    return bases;
}

std::vector<ComboResult> replay_rank_plans(const FitInput& in, const std::string& bases_path,
                                           const std::vector<std::size_t>& plans, const std::vector<int>& layers,
                                           const std::function<void(double)>& progress) {
    std::vector<RankPair> head_pairs, joint_pairs;
    rank_pairs(in.shape.head_dim, in.shape.num_kv_heads, head_pairs, joint_pairs);
    std::vector<PolicyEntry> entries;
    for (std::size_t i : plans) {
        const bool joint = i >= head_pairs.size();
        const RankPair& p = joint ? joint_pairs.at(i - head_pairs.size()) : head_pairs[i];
        entries.push_back(lowrank_entry(*in.spec, bases_path, p.key, p.value, joint ? 1 : 0));
    }
    ReplayOptions options = search_replay_options(*in.spec, in.harness, true, false);
    options.full_outputs = in.full_outputs;
    options.layers = layers;
    options.progress = progress;
    return replay(*in.fitting, expand_sweep(entries, {}, std::vector<int>{1}), options);
}

void fit_ranks(const FitInput& in, SearchOutcome& out) {
    const SearchSpec& spec = *in.spec;
    const int L = in.shape.num_layers, K = in.shape.num_kv_heads, d = in.shape.head_dim;
    const double full_fp16 = 4.0 * d;
    const std::size_t heads = static_cast<std::size_t>(L) * K;

    // Bases from the fitting sequences only: the held-out figures never saw them.
    const std::string bases_path = in.scratch_folder + "/bases.h5";
    const std::shared_ptr<KvBases> bases = fit_rank_bases(in, bases_path);
    out.bases = bases;
    out.bases_format = spec.ranks_bases_format == "hdf5"   ? KvBasesFormat::hdf5
                       : spec.ranks_bases_format == "json" ? KvBasesFormat::json
                       : kv_bases_numbers(*bases) > kAutoHdf5BasesNumbers ? KvBasesFormat::hdf5
                                                                          : KvBasesFormat::json;
    const auto loaded = load_kv_bases(bases_path, L, K, d);

    double steps = 0, context = 0;  // on the held-out sequences: how bases amortise
    for (int64_t last : in.heldout->shape().last_steps)
        for (int64_t t = 1; t <= last; ++t) steps += 1, context += static_cast<double>(t + 1);
    const double steps_per_context = context > 0 ? steps / context : 0.0;

    // Every (key rank, value rank) pair of the ladders, per KV head and joint, in one fitting pass
    // (or its units, measured by shards).
    std::vector<RankPair> head_pairs, joint_pairs;
    rank_pairs(d, K, head_pairs, joint_pairs);
    auto lowrank_entry = [&](int key, int value, int joint) {
        return kvsim::lowrank_entry(spec, bases_path, key, value, joint);
    };
    ReplayOptions options = search_replay_options(*in.spec, in.harness, true, false);
    options.full_outputs = in.full_outputs;
    std::vector<ComboResult> fitting;
    if (in.rank_measured) {
        fitting = *in.rank_measured;
        if (fitting.size() != head_pairs.size() + joint_pairs.size()) throw std::logic_error("rank fit: measured plans missing");
    } else {
        std::vector<std::size_t> every_plan(head_pairs.size() + joint_pairs.size());
        std::iota(every_plan.begin(), every_plan.end(), std::size_t{0});
        std::function<void(double)> progress;
        if (in.progress) progress = [&in](double f) { in.progress(0.7 * f); };
        fitting = replay_rank_plans(in, bases_path, every_plan, {}, progress);
    }
    const double fitting_steps = static_cast<double>(fitting.front().total.output_steps);

    // Per unit: every pair's bytes (closed form) and fitting error.
    auto projection_of = [&](bool joint, int key, int value) {
        KvProjection p;
        p.kind = joint ? KvProjection::Kind::joint_low_rank : KvProjection::Kind::low_rank;
        p.bases = loaded;
        p.key_rank.assign(joint ? L : heads, key);
        p.value_rank.assign(joint ? L : heads, value);
        return p;
    };
    std::vector<UnitOptions> head_options(heads), layer_options(L);
    for (std::size_t i = 0; i < head_pairs.size(); ++i) {
        const KvProjection p = projection_of(false, head_pairs[i].key, head_pairs[i].value);
        for (std::size_t u = 0; u < heads; ++u) {
            head_options[u].bytes.push_back(head_bytes(p, static_cast<int>(u / K), static_cast<int>(u % K), K, d,
                                                       steps_per_context));
            head_options[u].error.push_back(fitting[i].by_head[u].output_rel_error);
        }
    }
    for (std::size_t i = 0; i < joint_pairs.size(); ++i) {
        const KvProjection p = projection_of(true, joint_pairs[i].key, joint_pairs[i].value);
        const ComboResult& r = fitting[head_pairs.size() + i];
        for (int l = 0; l < L; ++l) {
            layer_options[l].bytes.push_back(head_bytes(p, l, 0, K, d, steps_per_context));
            layer_options[l].error.push_back(r.by_layer[l].output_rel_error);
        }
    }
    auto uniform_error = [&](std::size_t combo) { return fitting[combo].total.output_rel_error; };

    std::vector<RankMethod> methods;
    std::vector<std::string> lines;
    for (const SearchTarget& target : spec.targets) {
        const double wanted = target.bytes(full_fp16);
        // Uniform ranks: the same key and value ranks in every unit, as many numbers as fit, per
        // KV head and joint; key and value ranks equal or the key's one more, so the baseline
        // lands within one number per token of the target rather than two.
        for (int joint = 0; joint < 2; ++joint) {
            const int n = joint ? K * d : d;
            int best_key = 0, best_value = 0;
            for (int sum = 2; sum <= 2 * n; ++sum) {  // no break: a full-rank unit stores no bases
                const int key = (sum + 1) / 2, value = sum / 2;
                if (head_bytes(projection_of(joint, key, value), 0, 0, K, d, steps_per_context) <= wanted * (1 + 1e-9))
                    best_key = key, best_value = value;
            }
            if (best_key == 0) {
                lines.push_back("At " + target.label + " no uniform " + (joint ? "joint latent" : "rank") +
                                " fits: rank 1 with its bases holds more.");
                continue;
            }
            const std::vector<RankPair>& pairs = joint ? joint_pairs : head_pairs;
            RankMethod m;
            const std::string ranks = best_key == best_value ? std::to_string(best_key) + " (K and V)"
                                                             : std::to_string(best_key) + " (K), " +
                                                                   std::to_string(best_value) + " (V)";
            m.name = joint ? "uniform joint latent, rank " + ranks + " per layer" : "uniform rank " + ranks;
            m.target = &target;
            m.policy = "lowrank";
            m.params = {{"joint", joint}};
            m.ranks.joint = joint;
            m.ranks.key_rank.assign(joint ? L : heads, best_key);
            m.ranks.value_rank.assign(joint ? L : heads, best_value);
            // On the ladder its fitting error is already measured; off it (a joint rank between
            // rungs), it is measured below with grouping.
            m.fitting_error = -1;
            for (std::size_t combo = 0; combo < pairs.size(); ++combo)
                if (pairs[combo].key == best_key && pairs[combo].value == best_value)
                    m.fitting_error = uniform_error(joint ? head_pairs.size() + combo : combo);
            methods.push_back(m);
        }
        // Fitted ranks: one pair per unit by marginal gain.
        for (int joint = 0; joint < 2; ++joint) {
            const std::vector<UnitOptions>& units = joint ? layer_options : head_options;
            const std::vector<RankPair>& pairs = joint ? joint_pairs : head_pairs;
            double cheapest = 0;
            for (const UnitOptions& u : units) cheapest += *std::min_element(u.bytes.begin(), u.bytes.end());
            if (cheapest > wanted * static_cast<double>(units.size()) * (1 + 1e-9)) {
                lines.push_back("At " + target.label + " fitted " + (joint ? "joint latent ranks" : "ranks") +
                                " cannot meet the target: rank 1 everywhere, with its bases, holds more.");
                continue;
            }
            const std::vector<std::size_t> pick = choose_by_marginal_gain(units, wanted);
            RankMethod m;
            m.name = joint ? "fitted joint latent ranks per layer" : "fitted ranks per (layer, KV head)";
            m.target = &target;
            m.policy = "lowrank";
            m.params = {{"joint", joint}};
            m.ranks.joint = joint;
            for (std::size_t u = 0; u < units.size(); ++u) {
                m.ranks.key_rank.push_back(pairs[pick[u]].key);
                m.ranks.value_rank.push_back(pairs[pick[u]].value);
                m.fitting_error += units[u].error[pick[u]];
            }
            methods.push_back(m);
        }
        // Grouping: the smallest group of KV heads whose bytes fit.
        int group = 0;
        for (int g = 1; g <= K && !group; ++g)
            if (K % g == 0 && full_fp16 / g <= wanted * (1 + 1e-9)) group = g;
        if (group <= 1) {
            lines.push_back("At " + target.label + " no grouping of the " + std::to_string(K) +
                            " KV heads per layer fits" + (group == 1 ? " (the target is at or above the full cache)" : "") +
                            ".");
            continue;
        }
        for (int fitted = 0; fitted < 2; ++fitted) {
            RankMethod m;
            m.name = "KV heads grouped by " + std::to_string(group) + (fitted ? ", by fitted similarity" : ", contiguous");
            m.target = &target;
            m.policy = "group_heads";
            m.params = {{"group", group}, {"fitted", fitted}};
            methods.push_back(m);
        }
    }

    // Every method on the fitting set where its error is not read off the ladder (grouping), and
    // on the held-out set, each in one pass.
    auto method_entry = [&](const RankMethod& m, std::size_t i) {
        PolicyEntry e;
        e.name = m.policy;
        e.where = spec.fits_where;
        e.files = {{"bases", bases_path}};
        if (m.policy == "lowrank") {
            e.params = {{"joint", m.params.at("joint")}};
            const std::string path = in.scratch_folder + "/ranks-" + std::to_string(i) + ".json";
            write_fitted_ranks(path, m.ranks, L, K, d);
            e.files["ranks"] = path;
        } else {
            e.params = m.params;
        }
        return e;
    };
    std::vector<PolicyEntry> confirm_entries, grouping_entries;
    std::vector<std::size_t> grouping_methods;
    std::vector<PolicyEntry> off_ladder_entries;  // uniform ranks between the ladder's rungs
    std::vector<std::size_t> off_ladder_methods;
    for (std::size_t i = 0; i < methods.size(); ++i) {
        confirm_entries.push_back(method_entry(methods[i], i));
        if (methods[i].policy == "lowrank" && methods[i].fitting_error < 0) {
            const PolicyEntry e = lowrank_entry(methods[i].ranks.key_rank.front(), methods[i].ranks.value_rank.front(),
                                                methods[i].ranks.joint ? 1 : 0);
            // One row per configuration: the same ranks at two targets are measured once.
            if (std::none_of(off_ladder_entries.begin(), off_ladder_entries.end(),
                             [&](const PolicyEntry& o) { return o.params == e.params; }))
                off_ladder_entries.push_back(e);
            off_ladder_methods.push_back(i);
        }
        if (methods[i].policy == "group_heads") {
            PolicyEntry e = method_entry(methods[i], i);
            // One row per configuration: the same grouping at two targets is measured once.
            const bool seen = std::any_of(grouping_entries.begin(), grouping_entries.end(),
                                          [&](const PolicyEntry& g) { return g.params == e.params; });
            if (!seen) grouping_entries.push_back(e);
            grouping_methods.push_back(i);
        }
    }
    if (!grouping_entries.empty()) {
        ReplayOptions fit_options = options;
        fit_options.progress = nullptr;
        const std::vector<ComboResult> measured =
            replay(*in.fitting, expand_sweep(grouping_entries, {}, std::vector<int>{1}), fit_options);
        for (std::size_t i : grouping_methods)
            for (std::size_t g = 0; g < grouping_entries.size(); ++g)
                if (grouping_entries[g].params == methods[i].params)
                    methods[i].fitting_error = measured[g].total.output_rel_error;
    }
    if (!off_ladder_entries.empty()) {
        ReplayOptions fit_options = options;
        fit_options.progress = nullptr;
        const std::vector<ComboResult> measured =
            replay(*in.fitting, expand_sweep(off_ladder_entries, {}, std::vector<int>{1}), fit_options);
        for (std::size_t i : off_ladder_methods) {
            const PolicyEntry e = lowrank_entry(methods[i].ranks.key_rank.front(), methods[i].ranks.value_rank.front(),
                                                methods[i].ranks.joint ? 1 : 0);
            for (std::size_t j = 0; j < off_ladder_entries.size(); ++j)
                if (off_ladder_entries[j].params == e.params) methods[i].fitting_error = measured[j].total.output_rel_error;
        }
    }
    // Rows are labelled by their files; a ranks file per method keeps them apart.
    std::vector<PolicyEntry> unique_entries;
    std::vector<std::size_t> row_of(methods.size());
    for (std::size_t i = 0; i < confirm_entries.size(); ++i) {
        std::size_t row = unique_entries.size();
        for (std::size_t u = 0; u < unique_entries.size(); ++u)
            if (unique_entries[u].name == confirm_entries[i].name && unique_entries[u].params == confirm_entries[i].params &&
                confirm_entries[i].name == "group_heads")
                row = u;
        if (row == unique_entries.size()) unique_entries.push_back(confirm_entries[i]);
        row_of[i] = row;
    }
    ReplayOptions confirm_options = options;
    confirm_options.memory = true;
    if (in.progress) confirm_options.progress = [&in](double f) { in.progress(0.7 + 0.3 * f); };
    const std::vector<ComboResult> confirmed =
        replay(*in.heldout, expand_sweep(unique_entries, {}, std::vector<int>{1}), confirm_options);

    for (std::size_t i = 0; i < methods.size(); ++i) {
        const RankMethod& m = methods[i];
        SearchRecord r = output_error_record(m.name, "ranks", m.target->label, m.fitting_error, fitting_steps,
                                             confirmed[row_of[i]].total);
        r.replay_policy = m.policy;
        r.replay_params = m.params;
        r.key_rank = m.ranks.key_rank;
        r.value_rank = m.ranks.value_rank;
        out.records.push_back(r);
        if (m.name.rfind("fitted", 0) != 0) continue;
        double key = 0, value = 0;
        for (std::size_t u = 0; u < m.ranks.key_rank.size(); ++u) key += m.ranks.key_rank[u], value += m.ranks.value_rank[u];
        const double n = static_cast<double>(m.ranks.key_rank.size());
        lines.push_back("At " + r.target + " the " + m.name + " average key rank " + format_three_digits(key / n) +
                        " and value rank " + format_three_digits(value / n) + " (of " +
                        std::to_string(m.ranks.joint ? K * d : d) + ").");
    }
    out.notes.insert(out.notes.end(), lines.begin(), lines.end());
}

}  // namespace kvsim
