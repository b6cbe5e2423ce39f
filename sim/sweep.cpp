#include "sim/sweep.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <cstdio>
#include <set>

#include "base/errors.h"

namespace kvsim {

std::string format_param(double value) {
    char text[32];
    if (value == std::floor(value) && std::fabs(value) < 1e15)
        std::snprintf(text, sizeof text, "%.0f", value);
    else
        std::snprintf(text, sizeof text, "%g", value);
    return text;
}

std::string policy_label(const PolicyDescriptor& policy, const std::map<std::string, double>& given) {
    std::string label = policy.name;
    std::string args;
    for (const ParamSpec& spec : policy.params) {
        const auto it = given.find(spec.name);
        if (it != given.end() && it->second != spec.default_value) args += (args.empty() ? "" : ",") + spec.name + "=" + format_param(it->second);
    }
    return args.empty() ? label : label + "(" + args + ")";
}

int budget_for_compression(double ratio, int64_t sequence_length) {
    // held(B) = sum over steps t = 1..T-1 of min(t, B) + 1 falls as B shrinks: bisect for the
    // largest B whose ratio sum(t + 1) / held(B) still reaches the target.
    const int64_t T = sequence_length;
    auto held = [T](int64_t b) {
        const int64_t m = std::min(b, T - 1);
        return m * (m + 1) / 2 + (T - 1 - m) * b + (T - 1);  // sum of min(t, b) plus one per step
    };
    const double full = static_cast<double>(T - 1) * T / 2.0 + (T - 1);
    int64_t lo = 1, hi = std::max<int64_t>(1, T);
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (full / held(mid) >= ratio) lo = mid; else hi = mid - 1;
    }
    return static_cast<int>(lo);
}

std::vector<ReplayCombo> expand_sweep(const std::vector<PolicyEntry>& policies, const std::vector<GridAxis>& grid,
                                      const std::vector<int>& budgets) {
    std::vector<BudgetColumn> columns;
    for (int b : budgets) columns.push_back({std::to_string(b), b, {}, "budgets", 0, {}});
    return expand_sweep(policies, grid, columns);
}

std::vector<ReplayCombo> expand_sweep(const std::vector<PolicyEntry>& policies, const std::vector<GridAxis>& grid,
                                      const std::vector<BudgetColumn>& budgets) {
    for (const GridAxis& axis : grid) {
        bool used = false;
        for (const PolicyEntry& entry : policies) used |= entry.name == axis.policy;
        if (!used) throw InputError(axis.where + ": policy '" + axis.policy + "' is not among the config's policies");
    }

    std::vector<ReplayCombo> combos;
    std::set<std::string> labels;
    for (const PolicyEntry& entry : policies) {
        const PolicyDescriptor* policy = find_policy(entry.name);
        if (!policy && entry.name == adakv_descriptor().name)
            throw InputError(entry.where + ": adakv shares a layer's budget among its KV heads by a scored policy's "
                                           "scores: write {evict: h2o, adakv: {floor: 0.2}}");
        if (!policy)
            throw InputError(entry.where + ": unknown policy '" + entry.name + "' (known: " + known_policy_names() + ")");
        std::vector<const GridAxis*> axes;
        for (const GridAxis& axis : grid)
            if (axis.policy == entry.name) axes.push_back(&axis);

        // Walk the grid points like an odometer, the last axis fastest.
        std::vector<std::size_t> index(axes.size(), 0);
        while (true) {
            std::map<std::string, double> given = entry.params;
            std::string where = entry.where;
            std::map<std::string, std::string> param_where;  // a grid axis names its own values
            for (std::size_t a = 0; a < axes.size(); ++a) {
                given[axes[a]->param] = axes[a]->values[index[a]];
                where = axes[a]->where;
                param_where[axes[a]->param] = axes[a]->where;
            }
            const ParamValues values = resolve_params(*policy, given, axes.empty() ? entry.where : where);
            check_file_params(*policy, entry.files, axes.empty() ? entry.where : where, given);
            std::optional<QuantizeRule> quantize;
            if (entry.quantized) quantize = resolve_quantize(entry.quantize, entry.where + ".quantize");
            if (policy->prompt_press && (entry.quantized || entry.adakv || !entry.project.empty()))
                throw InputError(entry.where + ": " + entry.name + " compresses a prompt once, as kvpress does; it "
                                               "composes with no quantisation, Ada-KV or projection");
            std::optional<AdaKvRule> adakv;
            if (entry.adakv) {
                if (!policy->scored)
                    throw InputError(entry.where + ": adakv selects by a scored eviction policy's scores (h2o, "
                                                   "scissorhands, tova, snapkv, pyramidkv); " + entry.name + " has none");
                adakv = resolve_adakv(entry.adakv_params, entry.adakv_where);
            }
            std::string label = policy_label(*policy, given);
            for (const auto& [name, path] : entry.files) {  // files name the row too
                const std::string file = name + "=" + std::filesystem::path(path).filename().string();
                label = label.back() == ')' ? label.substr(0, label.size() - 1) + "," + file + ")" : label + "(" + file + ")";
            }
            const PolicyDescriptor* project = nullptr;
            ParamValues project_values;
            if (!entry.project.empty()) {
                project = find_policy(entry.project);
                if (!project || !project->projection)
                    throw InputError(entry.project_where + ": '" + entry.project +
                                     "' is not a projection (known: lowrank, group_heads)");
                project_values = resolve_params(*project, entry.project_params, entry.project_where);
                check_file_params(*project, entry.project_files, entry.project_where, entry.project_params);
                std::string projected = policy_label(*project, entry.project_params);
                for (const auto& [name, path] : entry.project_files) {
                    const std::string file = name + "=" + std::filesystem::path(path).filename().string();
                    projected = projected.back() == ')' ? projected.substr(0, projected.size() - 1) + "," + file + ")"
                                                        : projected + "(" + file + ")";
                }
                label += "+" + projected;
            }
            if (adakv) label += "+" + adakv_label(*adakv);
            if (quantize) label += "+" + quantize_label(*quantize);
            // A profile's row is named by the profile, and holds at its own budgets only.
            const bool profile = !entry.profile_budgets.empty();
            if (profile) label += " [" + entry.profile_budgets.front().label + "]";
            const std::vector<BudgetColumn>& columns = profile ? entry.profile_budgets : budgets;
            if (!labels.insert(label).second) throw InputError(entry.where + ": " + label + " is listed twice");
            if (policy->keeps_everything) {  // budgets do not apply: one row that fills every column
                if (policy->check_budget) {
                    const std::string problem = policy->check_budget(values, std::numeric_limits<int>::max());
                    if (!problem.empty()) throw InputError(entry.where + ": " + label + ": " + problem);
                }
                combos.push_back({policy, values, 0, {}, 0, kEveryBudget, label, quantize, entry.files, entry.where,
                                  param_where, {}, {}, project, project_values, entry.project_files,
                                  entry.project_where, entry.prompt, {}, entry.bookkeeping});
            } else for (const BudgetColumn& column : columns) {
                // A profile must suit its smallest layer budget.
                const std::vector<int>& per = column.head_budgets.empty() ? column.layer_budgets : column.head_budgets;
                const int tightest = per.empty() ? column.budget : *std::min_element(per.begin(), per.end());
                // A ratio budget is only known per sequence; the harness reports one that does not fit.
                if (policy->check_budget && column.compression == 0) {
                    const std::string problem = policy->check_budget(values, tightest);
                    if (!problem.empty())
                        throw InputError(entry.where + ": " + label + ": " + problem +
                                         (per.empty() ? "" : " (profile " + column.label + ")"));
                }
                if (!column.prompt_ratios.empty() && !policy->prompt_press)
                    throw InputError(entry.where + ": " + label + ": per-layer compression ratios (" + column.label +
                                     ") are kvpress's, for a press that compresses a prompt (snapkv_press, ...)");
                combos.push_back({policy, values, column.budget, column.layer_budgets, column.compression,
                                  profile ? std::string("profile") : column.label, label, quantize, entry.files,
                                  entry.where, param_where, column.head_budgets, adakv, project, project_values,
                                  entry.project_files, entry.project_where, entry.prompt, column.prompt_ratios,
                                  entry.bookkeeping});
            }
            std::size_t a = axes.size();
            while (a > 0 && ++index[a - 1] == axes[a - 1]->values.size()) index[--a] = 0;
            if (a == 0) break;
        }
    }
    return combos;
}

}  // namespace kvsim
