// Forward-pass throughput of kvsim::model::LlamaModel on this CPU.
//
//   bench_forward [--runs N] [--threads N] [--decode-tokens N] [--prompt-tokens N] [--chunk N]
//                 [--synthetic-only] [--model PATH]
//
// Measures, each as the median over --runs runs:
//   * this machine's fp32 FMA peak (a register-only FMA loop, 1 thread and all threads),
//   * Eigen's own GEMV / GEMM speed at the 100M model's layer shapes (single thread),
//   * stories260K (if present) and a synthetic ~110M-parameter Llama (dim 768, 12 layers, 12 heads,
//     FFN 2048, vocab 32000, tied classifier; random weights written to /tmp by gguf_writer):
//     single-token decode and chunked prompt processing (forward_batch), in tokens/s and in
//     GFLOP/s of the matrix products (weights + attention), and that as a fraction of the peak.
#include <tbb/global_control.h>
#include <tbb/info.h>

#include <CLI/CLI.hpp>
#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bench/fp32_peak.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "bench/flags.h"

using namespace kvsim::model;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    const size_t n = values.size();
    return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

struct Timing {
    double median, fastest, slowest;  // seconds
};

// Seconds per call of `work` over `runs` calls (after one warm-up call).
Timing time_runs(int runs, const std::function<void()>& work) {
    work();
    std::vector<double> times;
    for (int r = 0; r < runs; ++r) {
        const auto start = Clock::now();
        work();
        times.push_back(seconds_since(start));
    }
    return {median(times), *std::min_element(times.begin(), times.end()), *std::max_element(times.begin(), times.end())};
}

double median_seconds(int runs, const std::function<void()>& work) { return time_runs(runs, work).median; }

std::string cpu_model_name() {
    std::ifstream cpuinfo("/proc/cpuinfo");
    for (std::string line; std::getline(cpuinfo, line);) {
        if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
    }
    return "unknown CPU";
}

// ---------------------------------------------------------------------------------------------
// Eigen's kernels alone, single thread, at a given layer shape.

void bench_eigen_products(int runs) {
    using RowMatrix = LlamaModel::RowMatrix;
    std::printf("\nEigen matrix products alone (1 thread, fp32, W row-major [out][in], Y = X * W^T):\n");
    const struct {
        int out, in;
    } shapes[] = {{768, 768}, {2048, 768}, {32000, 768}};
    for (const auto& shape : shapes) {
        const RowMatrix w = RowMatrix::Random(shape.out, shape.in);
        for (const int n : {1, 64}) {
            const RowMatrix x = RowMatrix::Random(n, shape.in);
            RowMatrix y(n, shape.out);
            const double seconds = median_seconds(runs, [&] {
                const int repeat = n == 1 ? 20 : 2;
                for (int i = 0; i < repeat; ++i) y.noalias() = x * w.transpose();
            }) / (n == 1 ? 20 : 2);
            const double gflops = 2.0 * n * shape.out * shape.in / seconds / 1e9;
            std::printf("  %-5s [%d x %d] x [%d x %d]^T: %8.1f GFLOP/s  (%.3f ms)\n", n == 1 ? "GEMV" : "GEMM", n,
                        shape.in, shape.out, shape.in, gflops, seconds * 1e3);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model

struct ModelResult {
    double decode_tokens_per_second = 0, decode_gflops = 0;
    double prompt_tokens_per_second = 0, prompt_gflops = 0;
};

// FLOPs of attention over the cache for a token at position pos (q·k and weights·v).
double attention_flops(const LlamaConfig& c, int pos) { return 4.0 * c.n_heads * c.head_dim * (pos + 1); }

ModelResult bench_model(const std::string& label, const std::string& path, int runs, int decode_tokens,
                        int prompt_tokens, int chunk, double peak_gflops) {
    const auto load_start = Clock::now();
    LlamaModel model = LlamaModel::load(path, std::max(decode_tokens, prompt_tokens));
    const double load_seconds = seconds_since(load_start);
    const LlamaConfig& c = model.config();
    std::printf("\n%s: %s\n", label.c_str(), path.c_str());
    std::printf("  dim %d, hidden %d, %d layers, %d heads (%d KV, head size %d), vocab %d, %.1fM parameters, "
                "loaded in %.2f s\n",
                c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size,
                static_cast<double>(c.parameter_count(model.tied_output())) / 1e6, load_seconds);

    // Deterministic token stream (not greedy: the same work whatever the weights say).
    std::vector<int> tokens(static_cast<size_t>(std::max(decode_tokens, prompt_tokens)));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = i == 0 ? 1 : static_cast<int>((i * 7919) % c.vocab_size);

    ModelResult result;
    double flops = 0;
    for (int pos = 0; pos < decode_tokens; ++pos) flops += static_cast<double>(c.matmul_flops_per_token()) + attention_flops(c, pos);
    const Timing decode = time_runs(runs, [&] {
        model.reset();
        for (int pos = 0; pos < decode_tokens; ++pos) model.forward(tokens[static_cast<size_t>(pos)], pos);
    });
    result.decode_tokens_per_second = decode_tokens / decode.median;
    result.decode_gflops = flops / decode.median / 1e9;
    const double decode_flops = flops;

    flops = 0;
    for (int pos = 0; pos < prompt_tokens; ++pos) flops += static_cast<double>(c.matmul_flops_per_token()) + attention_flops(c, pos);
    const Timing prompt = time_runs(runs, [&] {
        model.reset();
        for (int start = 0; start < prompt_tokens; start += chunk) {
            const int n = std::min(chunk, prompt_tokens - start);
            model.forward_batch(std::span<const int>(tokens).subspan(static_cast<size_t>(start), static_cast<size_t>(n)), start);
        }
    });
    result.prompt_tokens_per_second = prompt_tokens / prompt.median;
    result.prompt_gflops = flops / prompt.median / 1e9;
    const double prompt_flops = flops;

    const auto percent = [&](double gflops) { return peak_gflops > 0 ? 100.0 * gflops / peak_gflops : 0.0; };
    const auto report = [&](const char* what, int tokens_run, const Timing& timing, double total_flops) {
        const double gflops = total_flops / timing.median / 1e9;
        std::printf("  %-44s %9.1f tokens/s (runs %.1f..%.1f)  %6.1f GFLOP/s  %4.1f%% of peak\n", what,
                    tokens_run / timing.median, tokens_run / timing.slowest, tokens_run / timing.fastest, gflops,
                    percent(gflops));
    };
    const std::string decode_label = "decode, 1 token/call, positions 0.." + std::to_string(decode_tokens - 1) + ":";
    const std::string prompt_label =
        "prompt, " + std::to_string(prompt_tokens) + " tokens in chunks of " + std::to_string(chunk) + ":";
    report(decode_label.c_str(), decode_tokens, decode, decode_flops);
    report(prompt_label.c_str(), prompt_tokens, prompt, prompt_flops);
    const double weight_bytes = 4.0 * static_cast<double>(c.parameter_count(model.tied_output()));
    std::printf("  decode streams the fp32 weights once per token: %.1f GB/s of weights\n",
                weight_bytes * result.decode_tokens_per_second / 1e9);
    return result;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"Forward-pass throughput of kvsim's Llama model (median over runs)"};
    int runs = 5, threads = 0, decode_tokens = 128, prompt_tokens = 512, chunk = 128;
    bool synthetic_only = false;
    std::string model_path = std::string(KVSIM_SHARED_DIR) + "/models/stories260K/stories260K.gguf";
    app.add_option("--runs", runs, "Timed runs per measurement (median reported)")->check(CLI::PositiveNumber);
    app.add_option("--threads", threads, "Worker threads (0: all cores)")->check(CLI::NonNegativeNumber);
    app.add_option("--decode-tokens", decode_tokens, "Tokens decoded one at a time")->check(CLI::PositiveNumber);
    app.add_option("--prompt-tokens", prompt_tokens, "Tokens run through forward_batch")->check(CLI::PositiveNumber);
    app.add_option("--chunk", chunk, "forward_batch chunk size")->check(CLI::PositiveNumber);
    app.add_option("--model", model_path, "stories260K GGUF (skipped when absent)");
    app.add_flag("--synthetic-only", synthetic_only, "Skip stories260K");
    if (const auto status = kvsim::bench::parse_flags(app, argc, argv)) return *status;

    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    const int used_threads = threads > 0 ? threads : tbb::info::default_concurrency();
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(used_threads));

    std::printf("CPU: %s, %d hardware threads; model threads: %d; Eigen SIMD: %s\n", cpu_model_name().c_str(), cores,
                used_threads, Eigen::SimdInstructionSetsInUse());
    // The peak is one core's measured rate times the threads used; the all-threads measurement is
    // printed too, since it falls short when something else is running on the machine.
    const double peak_one = kvsim::bench::measure_fp32_peak_gflops(1);
    const double measured_all = kvsim::bench::measure_fp32_peak_gflops(used_threads);
    const double peak = peak_one * used_threads;
    std::printf("fp32 peak (vector FMA loop): %.1f GFLOP/s per core -> %.1f GFLOP/s for %d threads "
                "(measured together now: %.1f)\n",
                peak_one, peak, used_threads, measured_all);

    bench_eigen_products(runs);

    if (!synthetic_only && std::filesystem::exists(model_path)) {
        bench_model("stories260K", model_path, runs, std::min(decode_tokens * 2, 512), std::min(prompt_tokens, 512), chunk,
                    peak);
    } else if (!synthetic_only) {
        std::printf("\nstories260K: %s is absent, skipped\n", model_path.c_str());
    }

    LlamaConfig config;
    config.dim = 768;
    config.hidden_dim = 2048;
    config.n_layers = 12;
    config.n_heads = 12;
    config.n_kv_heads = 12;
    config.head_dim = 64;
    config.vocab_size = 32000;
    config.context_length = 2048;
    const std::string synthetic_path = (std::filesystem::temp_directory_path() / "kvsim_bench_llama_d768_l12_v32000.gguf").string();
    if (!std::filesystem::exists(synthetic_path)) {
        const auto start = Clock::now();
        write_random_llama(synthetic_path, config, /*seed=*/2024, TensorType::F32, /*tied_output=*/true);
        std::printf("\nwrote %s in %.1f s\n", synthetic_path.c_str(), seconds_since(start));
    }
    bench_model("synthetic ~110M Llama", synthetic_path, runs, decode_tokens, prompt_tokens, chunk, peak);
    return 0;
}
