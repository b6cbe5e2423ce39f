// kvsim: replay recorded attention through KV-cache policies, side by side.
#include <tbb/global_control.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <memory>

#include "kvsim_version.h"
#include "sim/attention_source.h"
#include "sim/synthetic_qkv.h"
#include "sim/trace_store.h"
#include "src/config.h"
#include "src/errors.h"
#include "src/experiment.h"

namespace {

using namespace kvsim;

struct ReplayFlags {
    std::string config;
    std::string format;
    std::string out;
    std::string budgets;
    std::vector<std::string> sets;
    int threads = 0;
    bool quiet = false;
};

void add_replay_flags(CLI::App* cmd, ReplayFlags& flags) {
    cmd->add_option("config", flags.config, "experiment config (YAML)")->required();
    cmd->add_option("--format", flags.format, "what to print: table (default), csv or json")
        ->check(CLI::IsMember({"table", "csv", "json"}));
    cmd->add_option("--out", flags.out, "folder for results.csv and results.json (default: the config's output.dir)");
    cmd->add_option("--threads", flags.threads, "worker threads (default: all cores); results do not depend on it")
        ->check(CLI::Range(1, 1024));
    cmd->add_flag("-q,--quiet", flags.quiet, "no progress bar or timing line");
}

int run_replay(const ReplayFlags& flags, bool sweep) {
    ExperimentConfig config = load_config(flags.config);
    std::vector<GridAxis> axes;
    if (sweep) {
        if (!flags.budgets.empty()) config.budgets = parse_budget_list(flags.budgets, "--budgets");
        for (const std::string& set : flags.sets) axes.push_back(parse_grid_flag(set, "--set"));
    }
    const std::string format = flags.format.empty() ? config.output_format : flags.format;
    const std::string out_dir = flags.out.empty() ? config.output_dir : flags.out;

    std::unique_ptr<tbb::global_control> threads;
    if (flags.threads > 0)
        threads = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism, flags.threads);

    const ExperimentResult result = run_experiment(config, axes, !flags.quiet);
    write_outputs(result, out_dir);

    if (format == "table") {
        std::string title = "kvsim " + std::string(sweep ? "sweep " : "run ") + flags.config + "  |  trace " + result.trace;
        std::cout << format_table(result.records, config.metrics, title);
    } else if (format == "csv") {
        std::cout << format_csv(result.records);
    } else {
        std::cout << format_json(result.records, result.trace);
    }
    std::cout.flush();
    if (!flags.quiet)
        std::fprintf(stderr, "\nkvsim: %lld policy-steps in %.3f s (%.0f per second); results in %s/\n",
                     static_cast<long long>(result.policy_steps), result.seconds,
                     result.policy_steps / std::max(result.seconds, 1e-9), out_dir.c_str());
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
        if (!m.source_text_sha256.empty()) std::printf("text sha256      %s\n", m.source_text_sha256.c_str());
    }
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

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"kvsim " KVSIM_VERSION ": replay recorded attention through KV-cache policies, side by side"};
    app.set_version_flag("--version", KVSIM_VERSION);
    app.require_subcommand(1);

    ReplayFlags run_flags, sweep_flags;
    CLI::App* run = app.add_subcommand("run", "replay a trace through a config's policies and budgets");
    add_replay_flags(run, run_flags);
    CLI::App* sweep = app.add_subcommand("sweep", "a run over a grid of budgets and policy parameters");
    add_replay_flags(sweep, sweep_flags);
    sweep->add_option("--budgets", sweep_flags.budgets, "budgets replacing the config's, e.g. 64,128,256");
    sweep->add_option("--set", sweep_flags.sets, "a grid axis, e.g. h2o.recent_window=16,32,64 (repeatable)");

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

    CLI::App* policies = app.add_subcommand("policies", "list the policies and their parameters");

    try {
        app.parse(argc, argv);
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
        if (*run) return run_replay(run_flags, false);
        if (*sweep) return run_replay(sweep_flags, true);
        if (*synth) return trace_synth(synth_generator, synth_name, synth_dtype, synth_out);
        if (*info) return trace_info(info_path);
        if (*policies) {
            for (const PolicyDescriptor& p : policy_registry()) {
                std::printf("%-15s %s\n", p.name.c_str(), p.paper.c_str());
                for (const ParamSpec& s : p.params)
                    std::printf("  %-14s default %-6g %s\n", s.name.c_str(), s.default_value, s.help.c_str());
            }
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
