// `kvsim capture` of a long sequence through a synthetic 1B-shaped quantised model on this CPU.
//
//   bench_capture [--tokens 4096] [--sequences 1] [--type Q4_K] [--layers 16] [--store fp32|fp16] [--dir /tmp]
//                 [--model-only]
//
// Writes (once, in a child process, so its memory is not counted) a random-weight GGUF with
// Llama 3.2 1B's shape (dim 2048, 16 layers, 32 query / 8 KV heads of 64, FFN 8192, vocab
// 128256, tied classifier, Llama 3.1 RoPE scaling with factor 32) in the given type, in the
// dialect llama.cpp loads, then captures --sequences sequences of --tokens tokens each into a
// trace and reports: prompt-processing tokens/s, GFLOP/s of the matrix products
// (weights and attention) against this machine's measured fp32 peak, this process's peak
// resident memory, and the trace's size.
#include <sys/resource.h>
#include <sys/wait.h>
#include <tbb/info.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "bench/fp32_peak.h"
#include "sim/trace_store.h"
#include "src/capture.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "bench/flags.h"

using namespace kvsim;

namespace {

double peak_rss_gib() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return static_cast<double>(usage.ru_maxrss) * 1024.0 / (1024.0 * 1024.0 * 1024.0);  // ru_maxrss is KiB
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"capture throughput and memory of a synthetic 1B-shaped quantised model"};
    int tokens = 4096, layers = 16, sequences = 1;
    std::string type_name = "Q4_K", store = "fp32", dir = std::filesystem::temp_directory_path().string();
    app.add_option("--tokens", tokens, "tokens captured (BOS included)")->check(CLI::Range(2, 1 << 20));
    app.add_option("--sequences", sequences, "sequences captured, each of --tokens tokens")->check(CLI::Range(1, 1024));
    app.add_option("--type", type_name, "weight type")->check(CLI::IsMember({"F32", "Q8_0", "Q4_K", "Q6_K"}));
    app.add_option("--layers", layers, "blocks (16 for the 1B shape; fewer for a quick look)")->check(CLI::Range(1, 64));
    app.add_option("--store", store, "trace precision")->check(CLI::IsMember({"fp32", "fp16"}));
    app.add_option("--dir", dir, "where the model, text and trace go");
    bool model_only = false;
    app.add_flag("--model-only", model_only,
                 "write the model and the text (sequences split by a line @@@), print their paths, stop");
    if (const auto status = kvsim::bench::parse_flags(app, argc, argv)) return *status;
    const std::map<std::string, model::TensorType> types = {{"F32", model::TensorType::F32},
                                                            {"Q8_0", model::TensorType::Q8_0},
                                                            {"Q4_K", model::TensorType::Q4_K},
                                                            {"Q6_K", model::TensorType::Q6_K}};

    model::LlamaConfig config;
    config.dim = 2048;
    config.hidden_dim = 8192;
    config.n_layers = layers;
    config.n_heads = 32;
    config.n_kv_heads = 8;
    config.head_dim = 64;
    config.vocab_size = 128256;
    config.context_length = 131072;
    config.rope_theta = 500000.0f;
    config.rope_scaling = {model::RopeScaling::Kind::llama3, 32.0, 1.0, 4.0, 8192};
    const std::string stem = dir + "/kvsim_bench_1b_" + type_name + "_l" + std::to_string(layers);
    const std::string model_path = stem + ".gguf", text_path = stem + ".txt", trace_path = stem + ".h5";

    // A file kept from before kvsim's writer wrote llama.cpp's dialect (Llama 3.1's scaling as
    // metadata, which llama.cpp cannot load) is written again.
    const auto written_by_this_writer = [&] {
        try {
            return model::GgufFile::open(model_path).find_tensor("rope_freqs.weight") != nullptr;
        } catch (const std::exception&) {
            return false;
        }
    };
    if (!std::filesystem::exists(model_path) || !written_by_this_writer()) {
        const auto start = std::chrono::steady_clock::now();
        const pid_t child = fork();
        if (child == 0) {
            model::write_random_llama(model_path, config, 2024, types.at(type_name), /*tied_output=*/true);
            _exit(0);
        }
        int status = 0;
        waitpid(child, &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            std::fprintf(stderr, "writing %s failed\n", model_path.c_str());
            return 1;
        }
        std::printf("wrote %s (%.2f GB) in %.0f s\n", model_path.c_str(),
                    std::filesystem::file_size(model_path) / 1e9,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    const std::string separator = "\n@@@\n";
    {
        // The toy vocabulary spells most characters as one token: enough words for each sequence,
        // which the capture cuts at --tokens (with a warning), and sequences that differ.
        std::ofstream text(text_path);
        for (int s = 0; s < sequences; ++s) {
            if (s > 0) text << separator;
            for (int i = 0; i < tokens; ++i) text << "the cat " << (7 * i + s) % 97 << " sat. ";
        }
    }

    if (model_only) {
        std::printf("model %s\ntext %s\n", model_path.c_str(), text_path.c_str());
        return 0;
    }

    const int threads = tbb::info::default_concurrency();
    const double peak = kvsim::bench::measure_fp32_peak_gflops(1) * threads;

    CaptureOptions options;
    options.input = {model_path, text_path, separator, tokens, 0};
    options.dtype = store == "fp16" ? TensorDtype::float16 : TensorDtype::float32;
    options.output_path = trace_path;
    const auto start = std::chrono::steady_clock::now();
    const CaptureSummary summary = capture_trace(options);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    // Weight products per token, plus attention: q·k and weights·v over the positions seen. A
    // capture runs no classifier (it records Q, K and V, not logits), so its product is not counted.
    const double n = static_cast<double>(summary.tokens);
    const double flops = config.chunk_flops(0, tokens, /*logits=*/false) * summary.sequences;
    std::printf("model %s: %d layers, %s weights, %.2f GB file\n", model_path.c_str(), layers, type_name.c_str(),
                std::filesystem::file_size(model_path) / 1e9);
    std::printf("captured %d x %d tokens in %.1f s (load, forward, trace writing): %.1f tokens/s\n", summary.sequences,
                tokens, seconds, n / seconds);
    std::printf("matrix products %.1f GFLOP/s = %.1f%% of the fp32 peak (%.1f GFLOP/s, %d threads)\n",
                flops / seconds / 1e9, 100.0 * flops / seconds / 1e9 / peak, peak, threads);
    std::printf("peak resident memory %.2f GiB; trace (%s) %.2f GB\n", peak_rss_gib(), store.c_str(),
                std::filesystem::file_size(trace_path) / 1e9);
    std::filesystem::remove(trace_path);
    return 0;
}
