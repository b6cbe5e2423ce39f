// kvsim: replay recorded attention through KV-cache policies, side by side.
#include <malloc.h>
#include <cmath>
#include <tbb/global_control.h>
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>

#include "kvsim_version.h"
#include "policies/adakv.h"
#include "sim/attention_source.h"
#include "cache_math/lowrank.h"
#include "sim/lowrank_fit.h"
#include "sim/synthetic_qkv.h"
#include "sim/trace_store.h"
#include "src/config.h"
#include "base/errors.h"
#include "base/atomic_file.h"
#include "base/output_folder.h"
#include "base/size_limits.h"
#include "src/capture.h"
#include "src/eval.h"
#include "src/generate.h"
#include "src/tokenize.h"
#include "src/experiment.h"
#include "src/report.h"
#include "src/progress.h"
#include "src/shards.h"
#include "search/export.h"
#include "search/search.h"
#include "src/search_confirm.h"
#include "src/report_plots.h"

namespace {

using namespace kvsim;

// What the attention_view key changes, for `kvsim policies` and `kvsim run --help`: a user reading
// "renormalized" might expect retained mass to be 1 at every step.
constexpr const char* kAttentionViewHelp =
    "attention_view (what a policy is shown): raw (default on attention traces), the full softmax restricted to\n"
    "the positions the cache holds; renormalized (default on Q/K/V traces and in eval), those weights divided by\n"
    "what each query head keeps, i.e. the softmax over the kept positions and the current token; cached (Q/K/V\n"
    "traces and eval), that softmax computed from the keys as the cache holds them (at their tiers), all a serving\n"
    "engine can compute and what kvsim's runtime shows a policy. The view changes only what a policy is shown, and\n"
    "so what it keeps: retained mass and recall are measured on the full softmax in every view.";

struct ReplayFlags {
    std::string config;
    std::string format;
    std::string out;
    std::string budgets;
    std::string layout;
    std::vector<std::string> sets;
    int threads = 0;
    bool quiet = false;
    // Beyond one process (run and sweep): a shard of the work units, resuming a checkpoint, or a
    // Slurm script that runs the shards as a job array.
    std::string shard;
    bool resume = false;
    std::string emit_slurm;
    int slurm_shards = 0;
    int slurm_max_running = 0;
};

void add_replay_flags(CLI::App* cmd, ReplayFlags& flags) {
    cmd->add_option("config", flags.config, "experiment config (YAML)")->required();
    cmd->add_option("--format", flags.format, "what to print: table (default), csv or json")
        ->check(CLI::IsMember({"table", "csv", "json"}));
    cmd->add_option("--layout", flags.layout, "table layout: matrix (policies x budgets) or comparison (by memory)")
        ->check(CLI::IsMember({"matrix", "comparison"}));
    cmd->add_option("--out", flags.out, "folder for results.csv and results.json (default: the config's output.dir)")
;
    cmd->add_option("--threads", flags.threads, "worker threads (default: all cores); results do not depend on it")
        ->check(CLI::Range(1, 1024));
    cmd->add_flag("-q,--quiet", flags.quiet, "no progress bar or timing line");
}

// What run, sweep and eval share: the config with the command line's budgets and grid axes, the
// output choices, and the thread limit (held for the whole command).
struct CommandSetup {
    ExperimentConfig config;
    std::vector<GridAxis> axes;
    std::string format, layout, out_dir;
    std::unique_ptr<tbb::global_control> threads;
};

CommandSetup set_up(const ReplayFlags& flags) {
    CommandSetup setup;
    setup.config = load_config(flags.config);
    if (!flags.budgets.empty()) setup.config.budgets = parse_budget_list(flags.budgets, "--budgets");
    for (const std::string& set : flags.sets) setup.axes.push_back(parse_grid_flag(set, "--set"));
    setup.format = flags.format.empty() ? setup.config.output_format : flags.format;
    setup.layout = flags.layout.empty() ? setup.config.output_layout : flags.layout;
    setup.out_dir = flags.out.empty() ? setup.config.output_dir : flags.out;
    if (flags.threads > 0)
        setup.threads =
            std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism, flags.threads);
    return setup;
}

// Prints the records in the chosen format (table, CSV or JSON).
void print_results(const std::vector<ResultRecord>& records, const std::string& trace, const std::string& format,
                   const std::string& layout, const std::vector<std::string>& metrics, const std::string& title) {
    if (format == "table")
        std::cout << (layout == "comparison" ? format_comparison(records, metrics, title)
                                             : format_table(records, metrics, title));
    else if (format == "csv")
        std::cout << format_csv(records);
    else
        std::cout << format_json(records, trace);
    std::cout.flush();
}

// Writes results.csv and results.json (and `more_files` with them), then prints the records in the
// chosen format.
void emit_results(const std::vector<ResultRecord>& records, const std::string& trace, const CommandSetup& setup,
                  const std::vector<std::string>& metrics, const std::string& title,
                  const std::vector<std::pair<std::string, std::string>>& more_files) {
    ExperimentResult result;
    result.trace = trace;
    result.records = records;
    write_outputs(result, setup.out_dir, more_files);
    print_results(records, trace, setup.format, setup.layout, metrics, title);
}

void add_cluster_flags(CLI::App* cmd, ReplayFlags& flags) {
    cmd->add_option("--shard", flags.shard,
                    "run shard I of N (I/N, from 0): the I-th share of the work units (cells x layers; a search's: "
                    "grid budgets, tier plans, streaming fits and rank plans, each x layers); writes partial-I-of-N.json into the output folder for kvsim merge");
    cmd->add_flag("--resume", flags.resume,
                  "keep the work units a previous run of the same shard (or whole run) checkpointed in the output "
                  "folder, and do only the rest");
    cmd->add_option("--emit-slurm", flags.emit_slurm,
                    "write a Slurm batch script (a job array of --shards shards and a merge job) instead of running");
    cmd->add_option("--shards", flags.slurm_shards, "with --emit-slurm: shards in the job array")
        ->check(CLI::Range(1, 1000000));
    cmd->add_option("--max-running", flags.slurm_max_running,
                    "with --emit-slurm: shards running at once (the array's %M; default: all)")
        ->check(CLI::Range(1, 1000000));
}

// Writes the Slurm script of --emit-slurm: `args`, the command and the flags every shard is given,
// and `units`, the work units the shards share, counted by the caller from the checked config.
int emit_slurm_script(const ReplayFlags& flags, const std::string& out_dir, const std::vector<std::string>& args,
                      std::size_t units, const std::string& unit_name, const std::string& outputs) {
    if (!flags.shard.empty() || flags.resume)
        throw InputError("--emit-slurm: the script gives each array task its --shard and --resume; drop them");
    if (flags.slurm_shards < 1) throw InputError("--emit-slurm " + flags.emit_slurm + ": --shards N is required");
    if (static_cast<std::size_t>(flags.slurm_shards) > units)
        throw InputError("--shards " + std::to_string(flags.slurm_shards) + ": more shards than the " + args.front() +
                         "'s " + std::to_string(units) + " work units (" + unit_name + ")");
    SlurmScript script;
    script.path = flags.emit_slurm;
    script.shards = flags.slurm_shards;
    script.max_running = flags.slurm_max_running > 0 ? std::min(flags.slurm_max_running, flags.slurm_shards)
                                                    : flags.slurm_shards;
    script.kvsim = std::filesystem::read_symlink("/proc/self/exe").string();
    script.workdir = std::filesystem::current_path().string();
    script.command_args = args;
    if (flags.threads > 0) script.command_args.insert(script.command_args.end(), {"--threads", std::to_string(flags.threads)});
    script.out_dir = out_dir;
    script.job_name = "kvsim-" + std::filesystem::path(flags.config).stem().string();
    script.outputs = outputs;
    write_slurm_script(script);
    std::printf("wrote %s: %d shards (at most %d at once) of %zu work units; submit it with: bash %s\n",
                script.path.c_str(), script.shards, script.max_running, units, script.path.c_str());
    return 0;
}

int emit_sweep_slurm_script(const ReplayFlags& flags, const CommandSetup& setup, const std::string& command) {
    // The config must be valid before a cluster runs it: expanded and checked against its trace.
    const Experiment experiment(setup.config, setup.axes);
    std::vector<std::string> args = {command, flags.config};
    if (!flags.budgets.empty()) args.insert(args.end(), {"--budgets", flags.budgets});
    for (const std::string& set : flags.sets) args.insert(args.end(), {"--set", set});
    return emit_slurm_script(flags, setup.out_dir, args, experiment.unit_count(), "cells x layers",
                             "results.csv and results.json");
}

int run_replay(const ReplayFlags& flags, bool sweep) {
    const CommandSetup setup = set_up(flags);
    const std::string command = sweep ? "sweep" : "run";
    if (!flags.emit_slurm.empty()) return emit_sweep_slurm_script(flags, setup, command);
    if (flags.slurm_shards > 0 || flags.slurm_max_running > 0)
        throw InputError("--shards and --max-running size the job array of --emit-slurm; to run one shard, give --shard I/N");
    ShardedRun run;
    run.command = command;
    run.config_path = flags.config;
    if (!flags.budgets.empty()) run.identity.push_back("--budgets " + flags.budgets);
    for (const std::string& set : flags.sets) run.identity.push_back("--set " + set);
    if (!flags.shard.empty()) run.shard = parse_shard(flags.shard, "--shard");
    run.resume = flags.resume;
    run.show_progress = !flags.quiet;
    run.out_dir = setup.out_dir;
    run.format = setup.format;
    run.layout = setup.layout;
    const ShardedOutcome outcome = run_sharded(setup.config, setup.axes, run);
    if (!flags.quiet && outcome.units_resumed > 0)
        std::fprintf(stderr, "kvsim: resumed: %zu of %zu work units were done, %zu replayed now\n",
                     outcome.units_resumed, outcome.units, outcome.units_run);
    if (run.shard) {
        if (!flags.quiet)
            std::fprintf(stderr, "kvsim: shard %s: %zu work units; partial results in %s (kvsim merge %s)\n",
                         run.shard->text().c_str(), outcome.units, outcome.partial_path.c_str(), setup.out_dir.c_str());
        return 0;
    }
    const ExperimentResult& result = *outcome.result;
    if (!result.note.empty()) std::fprintf(stderr, "kvsim: note: %s\n", result.note.c_str());
    print_results(result.records, result.trace, setup.format, setup.layout, result.metrics,
                  "kvsim " + command + " " + flags.config + "  |  trace " + result.trace);
    if (!flags.quiet)
        std::fprintf(stderr, "\nkvsim: %lld policy-steps in %.3f s (%.0f per second); results in %s/\n",
                     static_cast<long long>(result.policy_steps), result.seconds,
                     result.policy_steps / std::max(result.seconds, 1e-9), setup.out_dir.c_str());
    return 0;
}

// What run_search needs of a config besides its search: section, checked.
SearchRun search_run_of(const ExperimentConfig& config) {
    if (!config.search) throw InputError(config.file + ": missing key 'search' (what kvsim search fits)");
    if (config.trace.path.empty())
        throw InputError(config.trace.where + ": search needs a trace file (trace: PATH); write a synthetic one with "
                                              "kvsim trace synth");
    if (!config.trace.sequences.empty())
        throw InputError(config.trace.where + ".sequences: search splits the trace itself; give search.split instead");
    if (config.prefill_tokens > 0)
        throw InputError(config.file + ": prefill_tokens: search fits pure-decode budgets; remove it");
    SearchRun run;
    run.config_file = config.file;
    run.trace_path = config.trace.path;
    run.max_steps = config.trace.max_steps;
    run.attention_view = config.attention_view;
    run.group_reduce = config.group_reduce;
    return run;
}

// The end of a search, on one machine or in the merge of its shards: the model in the loop when
// asked, the output files, the tables and notes.
int finish_search(SearchRun run, const ExperimentConfig& config, const ModelInput& confirm, const std::string& out_dir,
                  bool quiet) {
    const OutputFolder folder(out_dir);  // one writer at a time, from before the search to its files
    ProgressBar bar(!quiet);
    run.progress = [&bar](double fraction) { bar.update(fraction); };
    SearchOutcome outcome = run_search(*config.search, run);
    bar.finish();
    if (!confirm.model_path.empty()) {
        choose_mix_in_the_loop(outcome, *config.search, confirm, config.file, !quiet);
        confirm_in_the_loop(outcome, *config.search, confirm, config.file, !quiet);
    }
    write_search_outputs(outcome, out_dir);
    std::cout << format_search_table(outcome);
    if (!outcome.notes.empty()) {
        std::cout << "\nnotes\n";
        for (const std::string& n : outcome.notes) std::cout << "  " << n << "\n";
    }
    std::cout.flush();
    if (!quiet) {
        std::string stages;
        for (const auto& [stage, seconds] : outcome.stage_seconds) {
            char part[80];
            std::snprintf(part, sizeof part, "%s%s %.1f s", stages.empty() ? "" : ", ", stage.c_str(), seconds);
            stages += part;
        }
        std::fprintf(stderr, "\nkvsim: search in %.1f s (%s); results in %s/\n", outcome.seconds, stages.c_str(),
                     out_dir.c_str());
    }
    return 0;
}

struct MergeFlags {
    std::vector<std::string> inputs;
    std::string out, format, layout;
    bool quiet = false;
};

int run_merge(const MergeFlags& flags) {
    const std::vector<std::string> files = partial_files(flags.inputs);
    // Held from before the partials are read: no shard may still be writing into the folder.
    const OutputFolder folder(flags.out.empty() ? flags.inputs.front() : flags.out);
    if (holds_search_partials(files)) {
        // A search's shards: the merge runs the rest of the search, as one machine would.
        if (!flags.format.empty() || !flags.layout.empty())
            throw InputError("--format and --layout: a search prints its own tables; drop them");
        const SearchMerge merged = merge_search_partials(files);
        SearchRun run = search_run_of(merged.config);
        run.measured_units = &merged.units;
        const int status =
            finish_search(run, merged.config, merged.confirm, flags.out.empty() ? flags.inputs.front() : flags.out,
                          flags.quiet);
        if (!flags.quiet)
            std::fprintf(stderr, "kvsim: merged %d search shards (%zu work units)\n", merged.shards, merged.unit_count);
        return status;
    }
    const MergeOutcome merged = merge_partials(files);
    const ExperimentResult& result = merged.result;
    const std::string out_dir = flags.out.empty() ? flags.inputs.front() : flags.out;
    write_outputs(result, out_dir);
    if (!result.note.empty()) std::fprintf(stderr, "kvsim: note: %s\n", result.note.c_str());
    print_results(result.records, result.trace, flags.format.empty() ? merged.format : flags.format,
                  flags.layout.empty() ? merged.layout : flags.layout, result.metrics, merged.title);
    if (!flags.quiet)
        std::fprintf(stderr, "\nkvsim: merged %d shards (%zu work units); results in %s/\n", merged.shards,
                     merged.units, out_dir.c_str());
    return 0;
}

constexpr const char* kNormalizeHelp =
    "Unicode normalisation of the text before it is tokenised: none (the default: its bytes as they are, as llama.cpp "
    "tokenises) or nfc (composed to NFC first, as Hugging Face's Qwen2 tokenizer does; a decomposed 'e' + U+0301 "
    "then reads as 'é')";

void add_normalize_flag(CLI::App* cmd, model::TextNormalization& normalize) {
    cmd->add_option("--normalize", normalize, kNormalizeHelp)
        ->transform(CLI::CheckedTransformer(std::map<std::string, model::TextNormalization>{
                                                {"none", model::TextNormalization::none}, {"nfc", model::TextNormalization::nfc}})
                        .description(""))
        ->type_name("none|nfc");
}

void add_model_flags(CLI::App* cmd, ModelInput& flags) {
    cmd->add_option("--model", flags.model_path, "GGUF model file (llama architecture)")->required();
    cmd->add_option("--text", flags.text_path, "text file the model reads")->required();
    cmd->add_option("--split-on", flags.split_on, "separator between sequences, e.g. '<|endoftext|>'");
    cmd->add_option("--max-tokens", flags.max_tokens, "tokens per sequence, BOS included (default: the context)")
        ->check(CLI::Range(2, 1 << 30));
    cmd->add_option("--context", flags.context,
                    "positions per sequence, at most the model's trained context (default: all of it)")
        ->check(CLI::Range(2, 1 << 30));
    add_normalize_flag(cmd, flags.normalize);
}

int run_capture(const ModelInput& input, const std::string& dtype, const std::vector<int>& layers,
                bool pre_rope_keys, const std::string& out, bool quiet) {
    CaptureOptions options;
    options.show_progress = !quiet;
    options.pre_rope_keys = pre_rope_keys;
    options.input = input;
    options.layers = layers;
    options.dtype = dtype == "float16" ? TensorDtype::float16 : TensorDtype::float32;
    options.output_path = out;
    const CaptureSummary summary = capture_trace(options);
    std::printf("wrote %s: %d sequences, %ld tokens\n", out.c_str(), summary.sequences, summary.tokens);
    return 0;
}

int run_eval_command(const ReplayFlags& flags, const ModelInput& input, int chunk) {
    const CommandSetup setup = set_up(flags);
    const OutputFolder folder(setup.out_dir);  // one writer at a time, from the first token to the files
    EvalOptions options;
    options.input = input;
    options.chunk = chunk;
    options.show_progress = !flags.quiet;
    const EvalResult result = run_eval(setup.config, setup.axes, options);

    // The model in the loop knows every value: a config that names no metrics gets output error
    // and compression beside perplexity when a policy changes values.
    std::vector<std::string> metrics = {"ppl", "delta_ppl"};
    for (const std::string& m : table_metrics(setup.config, /*values_known=*/true))
        if (std::find(metrics.begin(), metrics.end(), m) == metrics.end()) metrics.push_back(m);
    // A perplexity beyond a double (a random-weight model's) is "inf", with the mean NLL beside it.
    char full_ppl[64];
    if (std::isinf(result.full_ppl))
        std::snprintf(full_ppl, sizeof full_ppl, "inf (mean NLL %.4f nats)", result.full_nll);
    else
        std::snprintf(full_ppl, sizeof full_ppl, "%.4f", result.full_ppl);
    char title[512];
    std::snprintf(title, sizeof title, "kvsim eval %s  |  %s, %ld predicted tokens per configuration, full cache PPL %s",
                  flags.config.c_str(), result.description.c_str(), result.tokens, full_ppl);
    const std::size_t configurations = result.configurations;
    nlohmann::ordered_json correlation;
    correlation["full_ppl"] = std::isinf(result.full_ppl) ? nlohmann::ordered_json("inf") : nlohmann::ordered_json(result.full_ppl);
    correlation["full_nll"] = result.full_nll;
    correlation["predicted_tokens"] = result.tokens;
    correlation["configurations"] = configurations;
    correlation["spearman_retained_mass_vs_delta_ppl"] = result.spearman_retained_mass;
    correlation["spearman_heavy_hitter_recall_vs_delta_ppl"] = result.spearman_heavy_hitter_recall;
    emit_results(result.records, result.description, setup, metrics, title,
                 {{"correlation.json", to_json_text(correlation, 2) + "\n"}});
    if (setup.format == "table")
        std::printf("\nSpearman rank correlation with the perplexity rise, across %zu configurations:\n"
                    "  retained_mass        %+.3f\n  heavy_hitter_recall  %+.3f\n"
                    "  (-1: the proxy orders configurations exactly as the model's own perplexity does)\n",
                    configurations, result.spearman_retained_mass, result.spearman_heavy_hitter_recall);
    if (!flags.quiet) std::fprintf(stderr, "\nkvsim: %.1f s; results in %s/\n", result.seconds, setup.out_dir.c_str());
    return 0;
}

int run_search_command(const ReplayFlags& flags, const ModelInput& confirm) {
    const CommandSetup setup = set_up(flags);
    const ExperimentConfig& config = setup.config;
    SearchRun run = search_run_of(config);
    if (!confirm.model_path.empty() || !confirm.text_path.empty()) {
        if (confirm.model_path.empty() || confirm.text_path.empty())
            throw InputError("--model and --text: confirmation in the loop needs both");
    }
    if (!flags.emit_slurm.empty()) {
        const SearchShardWork work(*config.search, run);  // checked before a cluster runs it
        std::vector<std::string> args = {"search", flags.config};
        if (!confirm.model_path.empty()) {
            args.insert(args.end(), {"--model", confirm.model_path, "--text", confirm.text_path});
            if (!confirm.split_on.empty()) args.insert(args.end(), {"--split-on", confirm.split_on});
            if (confirm.max_tokens > 0) args.insert(args.end(), {"--max-tokens", std::to_string(confirm.max_tokens)});
            if (confirm.context > 0) args.insert(args.end(), {"--context", std::to_string(confirm.context)});
        }
        return emit_slurm_script(flags, setup.out_dir, args, work.unit_count(), work.unit_description(),
                                 "search.json, search.csv, report.md and the profiles");
    }
    if (flags.slurm_shards > 0 || flags.slurm_max_running > 0)
        throw InputError("--shards and --max-running size the job array of --emit-slurm; to run one shard, give --shard I/N");
    // The model runs after the search, or in the merge of its shards: its input is checked first
    // (by each shard, on the machines that will load it), so no search's hours end in an error
    // about the text or the model.
    if (!confirm.model_path.empty()) check_confirmation_input(*config.search, run.trace_path, confirm);
    if (flags.shard.empty()) {
        if (flags.resume)
            throw InputError("--resume: a search checkpoints only as shards of its budget grid and tier plans; give --shard I/N");
        return finish_search(run, config, confirm, setup.out_dir, flags.quiet);
    }
    SearchShardRun shard_run;
    shard_run.config_path = flags.config;
    shard_run.confirm = confirm;
    shard_run.shard = parse_shard(flags.shard, "--shard");
    shard_run.resume = flags.resume;
    shard_run.out_dir = setup.out_dir;
    ProgressBar bar(!flags.quiet);
    run.progress = [&bar](double fraction) { bar.update(fraction); };
    const SearchShardOutcome outcome = run_search_shard(*config.search, run, shard_run);
    bar.finish();
    if (!flags.quiet) {
        if (outcome.units_resumed > 0)
            std::fprintf(stderr, "kvsim: resumed: %zu of %zu work units were done, %zu replayed now\n",
                         outcome.units_resumed, outcome.units, outcome.units_run);
        std::fprintf(stderr, "kvsim: search shard %s: %zu work units; partial results in %s (kvsim merge %s)\n",
                     shard_run.shard.text().c_str(), outcome.units, outcome.partial_path.c_str(), setup.out_dir.c_str());
    }
    return 0;
}

int run_export(const std::string& profile_path, const std::string& format, const std::string& out) {
    const Profile profile = load_profile(profile_path);
    const std::string note = format == "duo" ? export_duo_pattern(profile, profile_path, out)
                                             : export_layer_ratios(profile, profile_path, out);
    std::printf("wrote %s (%s): %s\n", out.c_str(), format.c_str(), note.c_str());
    return 0;
}

int trace_info(const std::string& path) {
    TraceReader reader(path);
    const TraceMetadata& m = reader.metadata();
    std::printf("file             %s (%llu bytes)\n", path.c_str(), static_cast<unsigned long long>(reader.file_bytes()));
    std::printf("format           %s version %lld, written by kvsim %s\n", kTraceFormat,
                static_cast<long long>(kTraceFormatVersion), m.kvsim_version.c_str());
    std::printf("kind             %s\n", to_string(m.kind));
    std::printf("model            %s\n", m.model_name.c_str());
    std::printf("shape            %lld layers, %lld query heads, %lld KV heads, head size %lld\n",
                static_cast<long long>(m.num_layers), static_cast<long long>(m.num_query_heads),
                static_cast<long long>(m.num_kv_heads), static_cast<long long>(m.head_dim));
    if (m.source_kind == "synthetic") {
        std::printf("source           synthetic: %s, seed %lld\n", m.source_generator.c_str(),
                    static_cast<long long>(m.source_seed));
    } else {
        std::printf("source           model %s (sha256 %s)\n", m.source_model_file.c_str(),
                    m.source_model_sha256.c_str());
        if (!m.source_text_sha256.empty())
            std::printf("text sha256      %s%s\n", m.source_text_sha256.c_str(),
                        m.source_text_normalization.empty() ? "" : ("; normalised to " + m.source_text_normalization +
                                                                    " before tokenising").c_str());
        if (m.source_sliding_window > 0)
            std::printf("sliding window   %lld positions (the model's; captured with full attention)\n",
                        static_cast<long long>(m.source_sliding_window));
        if (!m.source_layers.empty()) std::printf("model layers     %s\n", m.source_layers.c_str());
    }
    if (m.rope.known())
        std::printf("rope             %s pairs, %zu frequencies from %.6g to %.6g rad/position%s\n",
                    to_string(m.rope.pairing), m.rope.frequencies.size(), m.rope.frequencies.front(),
                    m.rope.frequencies.back(), m.pre_rope_keys ? "; keys also recorded before RoPE" : "");
    int64_t tokens = 0;
    for (const SequenceInfo& s : reader.sequences()) tokens += s.length;
    std::printf("sequences        %zu (%lld tokens)\n", reader.sequences().size(), static_cast<long long>(tokens));
    for (std::size_t i = 0; i < reader.sequences().size(); ++i)
        std::printf("  %-4zu %-24s %lld tokens\n", i, reader.sequences()[i].name.c_str(),
                    static_cast<long long>(reader.sequences()[i].length));
    uint64_t raw = 0, stored = 0;
    const auto sizes = reader.dataset_sizes();
    for (const DatasetSize& d : sizes) {
        raw += d.raw_bytes;
        stored += d.stored_bytes;
    }
    std::printf("datasets         %zu, %.1f MB raw, %.1f MB stored (%.2fx compression)\n", sizes.size(), raw / 1e6,
                stored / 1e6, stored ? static_cast<double>(raw) / stored : 0.0);
    return 0;
}

int trace_synth(const std::string& generator, const std::string& name, const std::string& dtype,
                const std::string& out) {
    if (generator == "policybook") {
        write_policybook_trace(policybook_trace(name.empty() ? "decode-4096" : name, "--name"), out);
    } else if (generator == "qkv") {
        write_synthetic_qkv_trace(synthetic_qkv_trace(name.empty() ? "llama-1b-4096" : name, "--name"), out,
                                  dtype == "float32" ? TensorDtype::float32 : TensorDtype::float16);
    } else {
        throw InputError("trace synth: unknown generator '" + generator + "' (known: policybook, qkv)");
    }
    std::printf("wrote %s\n", out.c_str());
    return 0;
}

// An empty value given for any option (`--out ''`, `--budgets ''`) is a mistake, never "use the
// default": CLI11 stores it as an empty string, so look at what was given, command by command.
void reject_empty_values(const CLI::App& app) {
    for (const CLI::Option* option : app.get_options()) {
        for (const std::string& value : option->results())
            if (value.empty())
                throw CLI::ValidationError(option->get_name(), "an empty value was given");
    }
    for (const CLI::App* sub : app.get_subcommands()) reject_empty_values(*sub);
}

// Standard input, output and error open before anything else is: a closed one's number would go
// to the first file kvsim opens, and what was meant for the terminal into that file. /dev/null
// takes the place of a closed stdin or stderr; a closed standard output is an error, since every
// command's answer goes there. Returns false when standard output was closed.
bool open_standard_streams() {
    bool stdout_open = true;
    for (int fd = 0; fd <= 2; ++fd) {
        if (::fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
        if (fd == STDOUT_FILENO) stdout_open = false;
        const int opened = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
        if (opened >= 0 && opened != fd) ::close(opened);  // cannot happen: open takes the lowest free number
    }
    return stdout_open;
}

// A command's answer that did not reach its reader is a failure, not success: a full disk
// (`kvsim run > file`, /dev/full), a standard output closed or revoked. One line, exit status 2.
int finish_standard_output(int status) {
    errno = 0;
    const bool flushed = std::fflush(stdout) == 0;
    const int error = errno;
    if (flushed && !std::ferror(stdout) && std::cout.good()) return status;
    if (status == 0)
        std::fprintf(stderr, "kvsim: error: standard output: cannot write (%s)\n",
                     error ? std::strerror(error) : "a write failed part-way; what it printed is incomplete");
    return status == 0 ? 2 : status;
}

int run_command(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) {
    if (!open_standard_streams()) {
        std::fprintf(stderr, "kvsim: error: standard output is closed; give kvsim somewhere to write its answer\n");
        return 2;
    }
    return finish_standard_output(run_command(argc, argv));
}

namespace {

int run_command(int argc, char** argv) {
    // A replay's matrix products allocate and free their packing space (megabytes) once per head
    // and block. With glibc's adaptive thresholds those pages went back to the kernel at each free
    // and were faulted in again (about 115,000 page faults in the Llama-1B file replay); fixed
    // thresholds keep them in the process for the next block.
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
    CLI::App app{"kvsim " KVSIM_VERSION ": replay recorded attention through KV-cache policies, side by side"};
    app.set_version_flag("--version", KVSIM_VERSION);
    app.require_subcommand(1);
    app.fallthrough();  // global options (--max-memory) may also follow the subcommand
    std::string max_memory;
    app.add_option("--max-memory", max_memory,
                   "refuse input that implies more memory than this, e.g. 8G (default: 3/4 of this machine's)");

    ReplayFlags run_flags, sweep_flags;
    CLI::App* run = app.add_subcommand("run", "replay a trace through a config's policies and budgets");
    add_replay_flags(run, run_flags);
    add_cluster_flags(run, run_flags);
    run->footer(kAttentionViewHelp);
    CLI::App* sweep = app.add_subcommand("sweep", "a run over a grid of budgets and policy parameters");
    add_replay_flags(sweep, sweep_flags);
    sweep->add_option("--budgets", sweep_flags.budgets, "budgets replacing the config's, e.g. 64,128,256")
;
    sweep->add_option("--set", sweep_flags.sets, "a grid axis, e.g. h2o.recent_window=16,32,64 (repeatable)");
    add_cluster_flags(sweep, sweep_flags);

    MergeFlags merge_flags;
    CLI::App* merge = app.add_subcommand(
        "merge", "combine the partial results of a sweep's shards (--shard I/N) into results.csv and results.json, or "
                 "finish a search from its shards' measurements");
    merge->add_option("dirs", merge_flags.inputs, "folders holding partial-I-of-N.json (or the files)")->required();
    merge->add_option("--out", merge_flags.out, "folder for results.csv and results.json (default: the first folder)");
    merge->add_option("--format", merge_flags.format, "what to print: table (default), csv or json")
        ->check(CLI::IsMember({"table", "csv", "json"}));
    merge->add_option("--layout", merge_flags.layout, "table layout: matrix (policies x budgets) or comparison (by memory)")
        ->check(CLI::IsMember({"matrix", "comparison"}));
    merge->add_flag("-q,--quiet", merge_flags.quiet, "no closing line");

    CLI::App* trace = app.add_subcommand("trace", "make and inspect trace files");
    trace->require_subcommand(1);
    std::string synth_generator, synth_name, synth_dtype = "float16", synth_out, info_path;
    CLI::App* synth = trace->add_subcommand("synth", "write a synthetic trace");
    synth->add_option("generator", synth_generator, "generator: policybook or qkv")->required();
    synth->add_option("--name", synth_name, "trace name (policybook: decode-4096; qkv: llama-1b-4096, tiny-256)");
    synth->add_option("--dtype", synth_dtype, "qkv tensors: float16 (default) or float32")
        ->check(CLI::IsMember({"float16", "float32"}));
    synth->add_option("-o,--output", synth_out, "output file (.h5)")->required();
    CLI::App* info = trace->add_subcommand("info", "print a trace's metadata and size");
    info->add_option("file", info_path, "trace file (.h5)")->required();
    std::string bases_trace, bases_out;
    std::vector<int> bases_sequences;
    CLI::App* bases = trace->add_subcommand("bases", "fit K/V PCA bases and head distances (lowrank, group_heads)");
    bases->add_option("file", bases_trace, "Q/K/V trace file (.h5)")->required();
    bases->add_option("--sequences", bases_sequences, "fit on these sequences (indices; default: every one)")
        ->delimiter(',');
    bases->add_option("-o,--output", bases_out, "output bases file: HDF5 when it ends .h5 or .hdf5, else JSON")->required();
    double bases_rope_theta = 0;
    bool bases_pre_rope = false, bases_no_joint = false;
    bases->add_flag("--no-joint", bases_no_joint,
                    "leave out the joint bases (one per layer over its KV heads; 1,024 wide at 8 KV heads of 128, and "
                    "larger than every per-head basis together): for lowrank with joint = 0 only");
    bases->add_flag("--pre-rope", bases_pre_rope,
                    "fit key bases before RoPE (Palu's way), with the RoPE the trace records (and its keys before RoPE "
                    "where captured with --pre-rope-keys); lowrank then applies RoPE after reconstruction");
    bases->add_option("--pre-rope-theta", bases_rope_theta,
                      "--pre-rope for a trace that records no RoPE: the model's RoPE base (rope freq_base, e.g. 10000; "
                      "adjacent pairs, unscaled)");

    CLI::App* policies = app.add_subcommand("policies", "list the policies and their parameters");

    ModelInput capture_input, eval_input;
    std::string capture_dtype = "float32", capture_out;
    std::vector<int> capture_layers;
    CLI::App* capture = app.add_subcommand("capture", "record a GGUF model's Q/K/V over a text into a trace");
    add_model_flags(capture, capture_input);
    capture->add_option("-o,--output", capture_out, "output trace (.h5)")->required();
    capture->add_option("--dtype", capture_dtype, "stored precision: float32 (default) or float16")
        ->check(CLI::IsMember({"float16", "float32"}));
    capture->add_option("--store", capture_dtype, "stored precision: fp32 (default) or fp16 (as --dtype)")
        ->transform(CLI::CheckedTransformer(std::map<std::string, std::string>{{"fp16", "float16"}, {"fp32", "float32"}}));
    capture->add_option("--layers", capture_layers, "model layers to record, e.g. 0,8,15 (default: all)")
        ->delimiter(',');
    bool capture_pre_rope_keys = false, capture_quiet = false;
    capture->add_flag("-q,--quiet", capture_quiet, "no progress bar (shown only when stderr is a terminal)");
    capture->add_flag("--pre-rope-keys", capture_pre_rope_keys,
                      "also record each layer's keys before RoPE (k_pre_rope), for low-rank keys fitted before RoPE");

    ReplayFlags eval_flags;
    int eval_chunk = 1;
    CLI::App* eval = app.add_subcommand("eval", "perplexity with each policy controlling the model's own cache");
    add_replay_flags(eval, eval_flags);
    add_model_flags(eval, eval_input);
    eval->add_option("--budgets", eval_flags.budgets, "budgets replacing the config's, e.g. 32,64,128")
;
    eval->add_option("--set", eval_flags.sets, "a grid axis, e.g. h2o.recent_window=8,16 (repeatable)");
    eval->add_option("--chunk", eval_chunk,
                     "positions the model runs at once (default 1, token by token; e.g. 256 for long texts: "
                     "the same policy steps, results equal up to float rounding, several times faster)")
        ->check(CLI::Range(1, 4096));

    ReplayFlags search_flags;
    ModelInput search_confirm;
    CLI::App* search = app.add_subcommand("search", "fit per-layer and per-head budgets to a memory target from a trace");
    search->add_option("config", search_flags.config, "config with a search: section (YAML)")->required();
    search->add_option("--out", search_flags.out,
                       "folder for search.json, search.csv, report.md and the profiles (default: the config's output.dir)");
    search->add_option("--threads", search_flags.threads, "worker threads (default: all cores); results do not depend on it")
        ->check(CLI::Range(1, 1024));
    search->add_flag("-q,--quiet", search_flags.quiet, "no progress bar or timing line");
    search->add_option("--model", search_confirm.model_path, "GGUF model: confirm every method's ΔPPL in the loop");
    search->add_option("--text", search_confirm.text_path, "the text the trace was captured from (with --model)");
    search->add_option("--split-on", search_confirm.split_on, "separator between sequences, as at capture");
    search->add_option("--max-tokens", search_confirm.max_tokens, "tokens per sequence, as at capture")
        ->check(CLI::Range(2, 1 << 30));
    search->add_option("--context", search_confirm.context, "the model's trained context, as at capture")
        ->check(CLI::Range(2, 1 << 30));
    add_cluster_flags(search, search_flags);

    GenerateOptions generate_options;
    CLI::App* generate = app.add_subcommand(
        "generate", "the example engine: a GGUF model generating text with kvsim's runtime holding its KV cache");
    generate->add_option("--model", generate_options.model_path, "GGUF model file (llama architecture)")->required();
    generate->add_option("--profile", generate_options.profile_path, "profile.json from kvsim search")->required();
    generate->add_option("--prompt", generate_options.prompt, "text to continue")->required();
    generate->add_option("-n,--tokens", generate_options.new_tokens, "tokens to generate (greedy; default 64)")
        ->check(CLI::Range(0, 1 << 20));
    generate->add_option("--backend", generate_options.backend, "cpu (default) or cuda")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    generate->add_option("--text", generate_options.perplexity.text_path, "also report the perplexity of this text");
    generate->add_option("--split-on", generate_options.perplexity.split_on, "separator between the text's sequences");
    generate->add_option("--max-tokens", generate_options.perplexity.max_tokens, "tokens per sequence, BOS included")
        ->check(CLI::Range(2, 1 << 30));
    generate->add_option("--context", generate_options.perplexity.context, "the model's trained context")
        ->check(CLI::Range(2, 1 << 30));
    add_normalize_flag(generate, generate_options.perplexity.normalize);

    TokenizeOptions tokenize_options;
    bool tokenize_no_bos = false;
    CLI::App* tokenize = app.add_subcommand(
        "tokenize", "print a text's token ids and pieces under a GGUF's tokenizer, as llama.cpp's llama-tokenize does");
    tokenize->add_option("--model", tokenize_options.model_path, "GGUF model file (its tokenizer is read)")->required();
    CLI::Option* tokenize_text_option = tokenize->add_option(
        "--text", tokenize_options.text_path,
        "text file, read as capture and eval read one (surrounding whitespace stripped; default: standard input, "
        "read the same way)");
    tokenize->add_option("--prompt", tokenize_options.prompt, "text to tokenize, exactly as given (as generate's --prompt)")
        ->excludes(tokenize_text_option);
    tokenize->add_flag("--ids", tokenize_options.ids_only, "print only the ids, as [1, 2, 3]");
    tokenize->add_flag("--no-bos", tokenize_no_bos,
                       "no BOS in front (default: BOS where the GGUF adds one, tokenizer.ggml.add_bos_token, as capture, "
                       "eval and generate do)");
    add_normalize_flag(tokenize, tokenize_options.normalize);

    std::string export_profile, export_format, export_out;
    CLI::App* exporter = app.add_subcommand("export", "write a fitted profile in a form other tools load");
    exporter->add_option("profile", export_profile, "profile.json from kvsim search")->required();
    exporter->add_option("--format", export_format, "duo (a DuoAttention pattern folder) or ratios (per-layer JSON list)")
        ->required()
        ->check(CLI::IsMember({"duo", "ratios"}));
    exporter->add_option("-o,--output", export_out, "output folder (duo) or file (ratios)")->required();

    std::string report_dir;
    CLI::App* report = app.add_subcommand("report", "plots (SVG, PNG, report.md) of a results folder, drawn by gnuplot");
    report->add_option("dir", report_dir, "folder with results.json, search.json or profile.json")->required();

    // Each command's help ends with the page of docs/ that explains its task, start to finish.
    app.footer("Guides, one per task, in the repository's docs/ folder: README.md links them all.");
    const std::pair<CLI::App*, const char*> guides[] = {
        {run, "docs/configs-and-policies.md, docs/metrics.md"}, {sweep, "docs/configs-and-policies.md"},
        {merge, "docs/clusters.md"},          {trace, "docs/trace-format.md"},
        {synth, "docs/configs-and-policies.md"}, {info, "docs/trace-format.md"},
        {bases, "docs/lowrank.md"},           {policies, "docs/configs-and-policies.md"},
        {capture, "docs/capture-and-models.md"}, {eval, "docs/capture-and-models.md"},
        {search, "docs/search-and-export.md"}, {generate, "docs/runtime.md"},
        {exporter, "docs/search-and-export.md, docs/profile-format.md"}, {report, "docs/metrics.md"},
        {tokenize, "docs/capture-and-models.md"},
    };
    for (const auto& [command, pages] : guides) {
        const std::string before = command->get_footer();
        command->footer((before.empty() ? "" : before + "\n\n") + "Guide: " + pages);
    }

    try {
        app.parse(argc, argv);
        reject_empty_values(app);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForVersion& e) {
        return app.exit(e);
    } catch (const CLI::ParseError& e) {
        std::fprintf(stderr, "kvsim: %s (see kvsim --help)\n", e.what());
        return 2;
    }

    try {
        if (app.count("--max-memory")) set_memory_limit_bytes(parse_byte_size(max_memory, "--max-memory"));
        if (*run) return run_replay(run_flags, false);
        if (*sweep) return run_replay(sweep_flags, true);
        if (*merge) return run_merge(merge_flags);
        if (*capture) return run_capture(capture_input, capture_dtype, capture_layers, capture_pre_rope_keys, capture_out,
                                         capture_quiet);
        if (*eval) return run_eval_command(eval_flags, eval_input, eval_chunk);
        if (*search) return run_search_command(search_flags, search_confirm);
        if (*exporter) return run_export(export_profile, export_format, export_out);
        if (*generate) {
            const GenerateResult g = run_generate(generate_options);
            std::printf("%s%s\n", generate_options.prompt.c_str(), g.text.c_str());
            std::printf("\nkvsim generate: %d prompt + %d generated tokens; the runtime's cache held %.4g bytes per token "
                        "per (layer, KV head), %.3fx compression against fp16\n",
                        g.prompt_tokens, g.generated_tokens, g.bytes_per_token, g.compression_ratio);
            if (g.ppl_tokens > 0)
                std::printf("perplexity of %s with the runtime in the loop: %.4f over %lld predicted tokens\n",
                            generate_options.perplexity.text_path.c_str(), g.ppl, static_cast<long long>(g.ppl_tokens));
            return 0;
        }
        if (*tokenize) {
            tokenize_options.add_bos = !tokenize_no_bos;
            const model::Tokenizer tokenizer = model::Tokenizer::load(tokenize_options.model_path);
            std::cout << format_tokens(tokenizer, tokenize_input(tokenizer, tokenize_options), tokenize_options.ids_only);
            std::cout.flush();
            return 0;
        }
        if (*synth) return trace_synth(synth_generator, synth_name, synth_dtype, synth_out);
        if (*info) return trace_info(info_path);
        if (*bases) {
            // Given at all, a RoPE base is positive: 0 would quietly fit the keys after RoPE.
            if (bases->count("--pre-rope-theta") && !(bases_rope_theta > 0 && std::isfinite(bases_rope_theta)))
                throw InputError("--pre-rope-theta: must be a positive number (the model's RoPE base, e.g. 10000)");
            for (std::size_t i = 0; i < bases_sequences.size(); ++i)
                if (std::find(bases_sequences.begin(), bases_sequences.begin() + static_cast<std::ptrdiff_t>(i),
                              bases_sequences[i]) != bases_sequences.begin() + static_cast<std::ptrdiff_t>(i))
                    throw InputError("--sequences: sequence " + std::to_string(bases_sequences[i]) +
                                     " is listed twice (a sequence counted twice would weigh the bases toward it)");
            const KeyFrame keys{bases_pre_rope || bases_rope_theta > 0, bases_rope_theta, !bases_no_joint};
            write_kv_bases(bases_out, fit_kv_bases(bases_trace, bases_sequences, keys));
            std::printf("wrote %s\n", bases_out.c_str());
            return 0;
        }
        if (*report) {
            const int figures = write_report_plots(report_dir);
            std::printf("wrote %s/plots/report.md (%d figures)\n", report_dir.c_str(), figures);
            return 0;
        }
        if (*policies) {
            std::vector<const PolicyDescriptor*> listed;
            for (const PolicyDescriptor& p : policy_registry()) listed.push_back(&p);
            listed.push_back(&adakv_descriptor());  // wraps a scored policy: {evict: h2o, adakv: {...}}
            for (const PolicyDescriptor* d : listed) {
                const PolicyDescriptor& p = *d;
                std::printf("%-15s %s\n", p.name.c_str(), p.paper.c_str());
                for (const ParamSpec& s : p.params) {
                    if (s.file)
                        std::printf("  %-17s (a file)       %s\n", s.name.c_str(), s.help.c_str());
                    else
                        std::printf("  %-17s default %-6g %s\n", s.name.c_str(), s.default_value, s.help.c_str());
                }
            }
            std::printf("\n%s\n", kAttentionViewHelp);
            return 0;
        }
    } catch (const InputError& e) {
        std::fprintf(stderr, "kvsim: error: %s\n", e.what());
        return 2;
    } catch (const PolicyError& e) {
        std::fprintf(stderr, "kvsim: policy error: %s\n", e.what());
        return 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kvsim: internal error: %s\n", e.what());
        return 1;
    }
    return 0;
}

}  // namespace
