#include "src/search_confirm.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "search/streaming_fit.h"
#include "search/tier_fit.h"
#include "search/mixed_fit.h"
#include "cache_math/lowrank.h"
#include "sim/trace_store.h"
#include "src/eval.h"

namespace kvsim {
namespace {

// The eval of some of the trace's sequences (the held-out ones, or the fitting ones), each
// expected to tokenize to the trace's own tokens.
EvalOptions confirmation_options(const SearchSpec& spec, const TraceReader& reader, const std::vector<int>& sequences,
                                 const ModelInput& input, const std::string& which = "held-out sequences") {
    EvalOptions options;
    options.input = input;
    // The text is tokenised as the capture tokenised it (normalised or not), so that its tokens match.
    options.input.normalize = model::text_normalization_named(reader.metadata().source_text_normalization)
                                  .value_or(model::TextNormalization::none);
    options.sequences = sequences;
    options.sequences_where = spec.split_where + " (" + which + ")";
    for (int s : sequences) options.expected_tokens.push_back(reader.read_tokens(s));
    return options;
}

// The row of a mixed plan's eval: "mixed (profile=NAME.json)" -> "NAME".
std::string plan_name_of(const std::string& label) {
    const std::size_t open = label.find("profile="), close = label.find(".json", open);
    if (open == std::string::npos || close == std::string::npos) return "";
    return label.substr(open + 8, close - open - 8);
}

}  // namespace

void check_confirmation_input(const SearchSpec& spec, const std::string& trace_path, const ModelInput& input) {
    const TraceReader reader(trace_path);
    const std::vector<int> heldout =
        search_heldout_indices(spec, static_cast<int>(reader.sequences().size()), trace_path);
    const EvalOptions options = confirmation_options(spec, reader, heldout, input);
    const LoadedInput loaded = load_model_input(options.input);
    const TraceMetadata& meta = reader.metadata();
    const model::LlamaConfig& mc = loaded.model.config();
    const ModelShape traced{meta.model_name, static_cast<int>(meta.num_layers), static_cast<int>(meta.num_query_heads),
                            static_cast<int>(meta.num_kv_heads), static_cast<int>(meta.head_dim)};
    const ModelShape model{input.model_path, mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.head_dim};
    if (!traced.same_as(model))
        throw InputError(input.model_path + ": the model has " + model.describe() + ", but the trace " + trace_path +
                         " records " + traced.describe() + " (" + traced.name +
                         "): confirmation in the loop needs a trace of every layer and head of this model");
    std::vector<std::size_t> original;
    select_eval_sequences(loaded.text, options, original);
}

void choose_mix_in_the_loop(SearchOutcome& outcome, const SearchSpec& spec, const ModelInput& input,
                            const std::string& config_file, bool show_progress) {
    // A target's mixes: the allocation over every family and over each pair of them.
    std::map<std::string, std::vector<std::size_t>> mixes_of;  // target -> records
    for (std::size_t i = 0; i < outcome.records.size(); ++i)
        if (outcome.records[i].mixed) mixes_of[outcome.records[i].target].push_back(i);
    bool choice = false;
    for (const auto& [target, mixes] : mixes_of) choice = choice || mixes.size() > 1;
    if (!choice) return;

    EvalOptions options =
        confirmation_options(spec, TraceReader(outcome.trace), outcome.fitting_indices, input, "fitting sequences");
    options.show_progress = show_progress;
    ExperimentConfig config;
    config.file = config_file;
    config.attention_view = outcome.attention_view;
    config.metrics = {"ppl", "delta_ppl"};
    const TempFolder scratch("choose-mix");
    std::map<std::string, std::size_t> record_of;  // plan name -> record
    for (const auto& [target, mixes] : mixes_of)
        for (std::size_t i : mixes) {
            const std::string name = "mix-" + std::to_string(i);
            PolicyEntry entry;
            entry.name = "mixed";
            entry.files = {{"profile", write_mixed_plan(scratch.path(), name, *outcome.records[i].mixed)}};
            entry.where = spec.fits_where;
            config.policies.push_back(entry);
            record_of[name] = i;
        }
    const EvalResult result = run_eval(config, {}, options);
    std::vector<double> fitting_rise(outcome.records.size(), std::numeric_limits<double>::quiet_NaN());
    for (const ResultRecord& r : result.records) {
        if (r.label == "full") continue;
        const auto it = record_of.find(plan_name_of(r.label));
        if (it == record_of.end()) throw std::logic_error("choose_mix_in_the_loop: no record for " + r.label);
        fitting_rise[it->second] = r.delta_ppl;
    }

    // Per target, the mix whose perplexity rose least on the fitting sequences is the profile; the
    // held-out sequences stay unseen until confirm_in_the_loop measures every row on them.
    std::vector<std::string> lines;
    for (const auto& [target, mixes] : mixes_of) {
        std::size_t best = mixes.front(), was = mixes.front();
        for (std::size_t i : mixes) {
            if (fitting_rise[i] < fitting_rise[best]) best = i;
            if (outcome.records[i].writes_profile) was = i;
        }
        std::string rises;
        for (std::size_t i : mixes) {
            char part[200];
            std::snprintf(part, sizeof part, "%s%s %+.4f", rises.empty() ? "" : ", ", outcome.records[i].method.c_str(),
                          fitting_rise[i]);
            rises += part;
        }
        std::string line = "At " + target + " the mixes' rise in perplexity on the fitting sequences, with " +
                           input.model_path + " in the loop: " + rises + ". ";
        if (best == was) {
            line += "The profile is the " + outcome.records[was].method + ", as the proxy chose.";
        } else {
            // The profile carries the chosen plan; its figures are that record's.
            const SearchRecord& chosen = outcome.records[best];
            outcome.records[was].writes_profile = false;
            outcome.records[best].writes_profile = true;
            for (Profile& p : outcome.profiles) {
                if (p.policy != "mixed" || p.target != target) continue;
                p.method = chosen.method;
                p.mixed = chosen.mixed;
                p.bytes_per_token = chosen.bytes_per_token;
                p.compression_ratio = chosen.compression_ratio;
                p.heldout_value = chosen.heldout;
            }
            line += "The profile is the " + chosen.method + ", which the model prefers, not the " +
                    outcome.records[was].method + " the proxy chose.";
        }
        lines.push_back(line);
    }
    outcome.notes.insert(outcome.notes.end(), lines.begin(), lines.end());
}

void confirm_in_the_loop(SearchOutcome& outcome, const SearchSpec& spec, const ModelInput& input,
                         const std::string& config_file, bool show_progress) {
    EvalOptions options = confirmation_options(spec, TraceReader(outcome.trace), outcome.heldout_indices, input);
    options.show_progress = show_progress;

    // One policy entry per method and target, each at its own budgets.
    ExperimentConfig config;
    config.file = config_file;
    config.attention_view = outcome.attention_view;
    config.metrics = {"ppl", "delta_ppl"};
    std::map<std::string, std::size_t> record_of;  // column label -> record
    // Streaming plans are files streaming_attention reads; they live until the eval is done.
    const TempFolder scratch("confirm");
    std::vector<std::unique_ptr<StreamingPlanFile>> plans;
    std::string bases_path;  // fit: ranks: the bases lowrank and a fitted grouping read
    if (outcome.bases) {
        bases_path = scratch.path() + "/bases.h5";  // HDF5: the same numbers, a fraction of JSON's cost
        write_kv_bases(bases_path, *outcome.bases);
    }
    for (std::size_t i = 0; i < outcome.records.size(); ++i) {
        const SearchRecord& r = outcome.records[i];
        if (r.mixed) {  // a mixed plan: the mixed policy reads each head's method from it
            const std::string name = "confirm-" + std::to_string(i);
            PolicyEntry entry;
            entry.name = "mixed";
            entry.files = {{"profile", write_mixed_plan(scratch.path(), name, *r.mixed)}};
            entry.where = spec.fits_where;
            config.policies.push_back(entry);
            record_of["profile=" + name + ".json"] = i;
            continue;
        }
        if (r.fit == "ranks") {  // lowrank reads its ranks from a plan; a grouping is its parameters
            const std::string name = "confirm-" + std::to_string(i) + ".json";
            PolicyEntry entry;
            entry.name = r.replay_policy;
            entry.where = spec.fits_where;
            if (r.replay_policy == "lowrank") {
                const bool joint = r.replay_params.at("joint") == 1;
                entry.params = {{"joint", joint ? 1.0 : 0.0}};
                write_fitted_ranks(scratch.path() + "/" + name, FittedRanks{joint, r.key_rank, r.value_rank},
                                   outcome.shape.num_layers, outcome.shape.num_kv_heads, outcome.shape.head_dim);
                entry.files = {{"bases", bases_path}, {"ranks", scratch.path() + "/" + name}};
                record_of["ranks=" + name] = i;
            } else {
                entry.params = r.replay_params;
                const std::string bases_name = "confirm-" + std::to_string(i) + ".h5";
                write_kv_bases(scratch.path() + "/" + bases_name, *outcome.bases);  // names the row apart
                entry.files = {{"bases", scratch.path() + "/" + bases_name}};
                record_of["bases=" + bases_name] = i;
            }
            config.policies.push_back(entry);
            continue;
        }
        if (!r.streaming_heads.empty()) {
            const std::string name = "confirm-" + std::to_string(i);
            plans.push_back(std::make_unique<StreamingPlanFile>(scratch.path(), name, outcome.shape.num_layers,
                                                                outcome.shape.num_kv_heads, r.streaming_heads, r.lambda,
                                                                r.stateless));
            PolicyEntry entry;
            entry.name = "streaming_attention";
            entry.params = {{"sinks", r.streaming_sinks}, {"recent", r.streaming_recent}};
            entry.files = {{"profile", plans.back()->path()}};
            entry.where = spec.streaming_where;
            entry.bookkeeping = outcome.deploy == "kvsim";  // DuoAttention holds K and V alone
            config.policies.push_back(entry);
            record_of["profile=" + name + ".yaml"] = i;
            continue;
        }
        if (r.tiers.num_layers > 0) {  // a tier profile: stratigraphic reads its shares from a plan
            const std::string name = "confirm-" + std::to_string(i);
            PolicyEntry entry;
            entry.name = "stratigraphic";
            entry.params = r.replay_params;
            entry.files = {{"profile", write_tier_plan(scratch.path(), name, r.tiers)}};
            entry.where = spec.tiers_where;
            config.policies.push_back(entry);
            record_of["profile=" + name + ".json"] = i;
            continue;
        }
        if (!r.prompt_ratios.empty()) {  // deploy kvpress: the press at its ratios of each prompt, once
            PolicyEntry entry = spec.policy;
            BudgetColumn column;
            column.label = r.method + " @ " + r.target;
            column.where = spec.where;
            column.prompt_ratios = r.prompt_ratios;
            entry.profile_budgets = {column};
            entry.profile_shape = outcome.shape;
            entry.prompt = spec.prompt;
            entry.bookkeeping = false;  // kvpress holds K and V alone
            config.policies.push_back(entry);
            record_of[column.label] = i;
            continue;
        }
        PolicyEntry entry = spec.policy;
        const BudgetColumn column =
            profile_budget_column(r.method + " @ " + r.target, spec.where, r.layer_budgets, r.head_budgets);
        entry.profile_budgets = {column};
        entry.profile_shape = outcome.shape;
        if (r.adakv) {  // Ada-KV at the uniform budgets: its row in the loop too
            entry.adakv = true;
            entry.adakv_params = {{"floor", kSearchAdaKvFloor}};
            entry.adakv_where = spec.where;
        }
        config.policies.push_back(entry);
        record_of[column.label] = i;
    }
    const EvalResult result = run_eval(config, {}, options);
    for (const ResultRecord& r : result.records) {
        if (r.label == "full") continue;
        // A budget row is labelled "policy [column]"; a streaming row names its plan file.
        std::string key;
        const auto mark = r.label.find("=confirm-");
        if (mark != std::string::npos) {  // "name=confirm-N.json": the file parameter that names the row
            const std::size_t plan = r.label.find_last_of("(,", mark) + 1;
            const std::size_t end = std::min(r.label.find(".yaml", mark), r.label.find(".json", mark));
            key = r.label.substr(plan, end + 5 - plan);
        } else if (const auto open = r.label.rfind(" ["); open != std::string::npos) {
            key = r.label.substr(open + 2, r.label.size() - open - 3);
        }
        const auto it = record_of.find(key);
        if (it == record_of.end()) throw std::logic_error("confirm_in_the_loop: no record for " + r.label);
        outcome.records[it->second].delta_ppl = r.delta_ppl;
    }

    // Per target: did the proxy order the methods as the model's own perplexity does? With deploy
    // kvpress every method is scored on the held-out continuations, and so is the full cache.
    const bool continuations = outcome.deploy == "kvpress";
    double full_ppl = result.full_ppl;
    if (continuations)
        for (const ResultRecord& r : result.records)
            if (r.label != "full") full_ppl = std::exp(r.nll) - r.delta_ppl;
    std::vector<std::string> lines;
    for (const SearchTarget& target : spec.targets) {
        std::vector<double> proxy, delta;
        const SearchRecord *best_proxy = nullptr, *best_delta = nullptr;
        const bool lower_better = outcome.objective == "output_rel_error";
        for (const SearchRecord& r : outcome.records) {
            if (r.target != target.label) continue;
            proxy.push_back(lower_better ? r.heldout : -r.heldout);  // both: lower is better
            delta.push_back(r.delta_ppl);
            if (!best_proxy || proxy.back() < (lower_better ? best_proxy->heldout : -best_proxy->heldout)) best_proxy = &r;
            if (!best_delta || r.delta_ppl < best_delta->delta_ppl) best_delta = &r;
        }
        const double rho = spearman(proxy, delta);
        char line[600];
        std::snprintf(line, sizeof line,
                      "At %s with %s in the loop (full-cache PPL %.4f on the held-out %s): the proxy's best is "
                      "%s (ΔPPL %+.4f), the model's best is %s (ΔPPL %+.4f); Spearman rank correlation between held-out "
                      "%s and ΔPPL across the %zu methods %+.3f: the proxy's ranking %s.",
                      target.label.c_str(), input.model_path.c_str(), full_ppl,
                      continuations ? ("sequences' continuations; prompt: " + spec.prompt.describe()).c_str() : "sequences",
                      best_proxy->method.c_str(),
                      best_proxy->delta_ppl, best_delta->method.c_str(), best_delta->delta_ppl, outcome.objective.c_str(),
                      proxy.size(), rho,
                      best_proxy == best_delta && rho >= 0.8 ? "held"
                      : best_proxy == best_delta             ? "held for the winner but not throughout"
                                                             : "did not hold");
        lines.push_back(line);
    }
    outcome.notes.insert(outcome.notes.begin(), lines.begin(), lines.end());
}

}  // namespace kvsim
