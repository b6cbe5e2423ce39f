// Capture of sequences longer than one forward chunk: Q/K/V streamed into the trace chunk by
// chunk, the model's sliding window recorded, --context held to the trained context, fp16 storage.
#include <doctest/doctest.h>

#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <malloc.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/errors.h"
#include "cache_math/lowrank.h"
#include "sim/lowrank_fit.h"
#include "sim/trace_store.h"
#include "src/capture.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "tests/model/test_util.h"

using namespace kvsim;
using kvsim::model::testing::ScratchDir;

namespace {

// Records every layer's Q, K and V of every position, running the model one token at a time.
struct AllQkv : model::ForwardHooks {
    std::vector<QkvLayer> layers;
    const model::LlamaConfig* config;
    AllQkv(const model::LlamaConfig& c, int tokens) : layers(c.n_layers), config(&c) {
        for (QkvLayer& layer : layers) {
            layer.tokens = tokens;
            layer.q.resize(static_cast<size_t>(tokens) * c.q_dim());
            layer.k.resize(static_cast<size_t>(tokens) * c.kv_dim());
            layer.v.resize(static_cast<size_t>(tokens) * c.kv_dim());
        }
    }
    void after_qkv(int layer, int pos, float* q, float* k, float* v) override {
        std::memcpy(layers[layer].q.data() + static_cast<size_t>(pos) * config->q_dim(), q, config->q_dim() * sizeof(float));
        std::memcpy(layers[layer].k.data() + static_cast<size_t>(pos) * config->kv_dim(), k, config->kv_dim() * sizeof(float));
        std::memcpy(layers[layer].v.data() + static_cast<size_t>(pos) * config->kv_dim(), v, config->kv_dim() * sizeof(float));
    }
};

float worst_difference(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    float worst = 0.0f;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
    return worst;
}

}  // namespace

TEST_CASE("capture: a sequence of several chunks is streamed into the trace position by position") {
    ScratchDir scratch;
    model::LlamaConfig config = model::testing::tiny_config();
    config.context_length = 1024;
    config.sliding_window = 96;
    const std::string model_path = scratch.file("long.gguf"), text = scratch.file("long.txt");
    model::write_random_llama(model_path, config, 31);
    {
        std::ofstream out(text);
        for (int i = 0; i < 60; ++i) out << "the cat sat on the mat " << i << ". ";
    }
    CaptureOptions options;
    options.input = {model_path, text, "", 0, 0};
    options.output_path = scratch.file("long.h5");
    const CaptureSummary summary = capture_trace(options);
    REQUIRE(summary.sequences == 1);
    CHECK(summary.tokens > 600);  // more than two of capture's 256-token chunks

    const TraceReader trace(options.output_path);
    CHECK(trace.metadata().source_sliding_window == 96);
    const std::vector<int32_t> stored = trace.read_tokens(0);
    const std::vector<int> tokens(stored.begin(), stored.end());
    model::LlamaModel llama = model::LlamaModel::load(model_path, static_cast<int>(tokens.size()));
    AllQkv expected(llama.config(), static_cast<int>(tokens.size()));
    for (size_t pos = 0; pos < tokens.size(); ++pos) llama.forward(tokens[pos], static_cast<int>(pos), &expected);
    for (int layer = 0; layer < config.n_layers; ++layer) {
        CAPTURE(layer);
        const QkvLayer captured = trace.read_qkv(0, layer);
        // Chunked against token by token: float summation order only (a misplaced row is O(1) off).
        CHECK(worst_difference(captured.q, expected.layers[layer].q) < 1e-4f);
        CHECK(worst_difference(captured.k, expected.layers[layer].k) < 1e-4f);
        CHECK(worst_difference(captured.v, expected.layers[layer].v) < 1e-4f);
    }

    SUBCASE("--layers records a subset, and the trace names the model's layers") {
        options.layers = {1};
        options.output_path = scratch.file("layer1.h5");
        capture_trace(options);
        const TraceReader subset(options.output_path);
        CHECK(subset.metadata().num_layers == 1);
        CHECK(subset.metadata().source_layers == "1");
        const QkvLayer a = subset.read_qkv(0, 0), b = trace.read_qkv(0, 1);
        CHECK(a.q == b.q);
        CHECK(a.k == b.k);
        CHECK(a.v == b.v);
        for (const std::vector<int>& bad : {std::vector<int>{2}, std::vector<int>{1, 0}, std::vector<int>{1, 1}}) {
            options.layers = bad;
            options.output_path = scratch.file("bad.h5");
            CHECK_THROWS_AS(capture_trace(options), InputError);
            CHECK_FALSE(std::filesystem::exists(options.output_path));
        }
    }
    SUBCASE("the trace does not depend on the thread count") {
        // One thread attends head after head in one score buffer; three take the four heads
        // into three buffers in whatever order they come. Either way each value is the same.
        for (const int threads : {1, 3}) {
            CAPTURE(threads);
            options.output_path = scratch.file("threads" + std::to_string(threads) + ".h5");
            // The arena has `threads` slots even on a machine with fewer cores: workers up to it allowed.
            const tbb::global_control workers(tbb::global_control::max_allowed_parallelism, threads);
            tbb::task_arena(threads).execute([&] { capture_trace(options); });
            const TraceReader other(options.output_path);
            CHECK(other.read_tokens(0) == stored);
            for (int layer = 0; layer < config.n_layers; ++layer) {
                const QkvLayer a = other.read_qkv(0, layer), b = trace.read_qkv(0, layer);
                CHECK(a.q == b.q);
                CHECK(a.k == b.k);
                CHECK(a.v == b.v);
            }
        }
    }
    SUBCASE("fp16 storage holds the fp32 capture rounded to half precision") {
        options.dtype = TensorDtype::float16;
        options.output_path = scratch.file("long16.h5");
        capture_trace(options);
        const TraceReader half(options.output_path);
        CHECK(std::filesystem::file_size(options.output_path) < std::filesystem::file_size(scratch.file("long.h5")));
        for (int layer = 0; layer < config.n_layers; ++layer) {
            const QkvLayer a = half.read_qkv(0, layer), b = trace.read_qkv(0, layer);
            std::vector<float> rounded(b.k.size());
            for (size_t i = 0; i < b.k.size(); ++i) rounded[i] = static_cast<float>(Eigen::half(b.k[i]));
            CHECK(a.k == rounded);
        }
    }
}

TEST_CASE("capture: --context beyond the trained context is one line naming the key, and no trace is written") {
    ScratchDir scratch;
    const model::LlamaConfig config = model::testing::tiny_config();  // context 64
    const std::string model_path = scratch.file("m.gguf"), text = scratch.file("t.txt");
    model::write_random_llama(model_path, config, 32);
    std::ofstream(text) << "the cat sat on the mat";
    CaptureOptions options;
    options.input = {model_path, text, "", 0, 65};
    options.output_path = scratch.file("t.h5");
    try {
        capture_trace(options);
        FAIL("no error");
    } catch (const InputError& error) {
        CHECK(std::string(error.what()) == model_path + ": --context 65 is beyond the model's trained context of 64 "
                                                        "positions (metadata key 'llama.context_length')");
    }
    CHECK_FALSE(std::filesystem::exists(options.output_path));
    options.input.context = 64;
    CHECK(capture_trace(options).sequences == 1);
}

TEST_CASE("capture --pre-rope-keys: the model's RoPE recorded, and the keys before it, which RoPE turns into k") {
    ScratchDir scratch;
    // Llama with Llama 3.1 frequency scaling (adjacent pairs), and qwen2 (halves): a replay that
    // rotated by theta alone, or by adjacent pairs, would not give back the recorded keys.
    model::LlamaConfig llama31 = model::testing::tiny_config();
    llama31.rope_scaling = {model::RopeScaling::Kind::llama3, 8.0, 1.0, 4.0, 32};
    model::LlamaConfig qwen2 = model::testing::tiny_config();
    qwen2.architecture = "qwen2";
    qwen2.qkv_bias = true;
    qwen2.rope_theta = 1000000.0f;
    for (const model::LlamaConfig& config : {llama31, qwen2}) {
        CAPTURE(config.architecture);
        const std::string model_path = scratch.file(config.architecture + ".gguf"), text = scratch.file("t.txt");
        model::write_random_llama(model_path, config, 41);
        std::ofstream(text) << "the cat sat on the mat. the dog ran to the park and back again.";
        CaptureOptions options;
        options.input = {model_path, text, "", 0, 0};
        options.output_path = scratch.file(config.architecture + ".h5");
        options.pre_rope_keys = true;
        capture_trace(options);

        const TraceReader trace(options.output_path);
        const model::LlamaModel llama = model::LlamaModel::load(model_path);
        const TraceMetadata& m = trace.metadata();
        CHECK(m.pre_rope_keys);
        CHECK(m.rope == llama.rope());
        CHECK(m.rope.pairing == (config.architecture == "qwen2" ? RopePairing::halves : RopePairing::adjacent));
        const std::vector<double> expected = config.rope_frequencies();
        REQUIRE(m.rope.frequencies.size() == expected.size());
        for (std::size_t i = 0; i < expected.size(); ++i) CHECK(m.rope.frequencies[i] == doctest::Approx(expected[i]));
        for (int layer = 0; layer < config.n_layers; ++layer) {
            CAPTURE(layer);
            const QkvLayer recorded = trace.read_qkv(0, layer);
            std::vector<float> before;
            trace.read_pre_rope_keys(0, layer, before);
            REQUIRE(before.size() == recorded.k.size());
            CHECK(before != recorded.k);
            // The same tables and the same float arithmetic as the forward pass: exactly k.
            apply_rope_rows(before.data(), 0, recorded.tokens, config.n_kv_heads, config.head_dim, m.rope, false);
            CHECK(before == recorded.k);
        }
    }
    SUBCASE("without the flag the RoPE is still recorded, the keys before it not") {
        CaptureOptions options;
        options.input = {scratch.file("qwen2.gguf"), scratch.file("t.txt"), "", 0, 0};
        options.output_path = scratch.file("plain.h5");
        capture_trace(options);
        const TraceReader trace(options.output_path);
        CHECK_FALSE(trace.metadata().pre_rope_keys);
        CHECK(trace.metadata().rope.pairing == RopePairing::halves);
        std::vector<float> out;
        CHECK_THROWS_WITH_AS(trace.read_pre_rope_keys(0, 0, out), doctest::Contains("records no keys before RoPE"),
                             InputError);
        // Key bases before RoPE: from the recorded pre-RoPE keys, or from this trace's keys rotated
        // back by its recorded RoPE; the same keys up to float rounding, so the same bases.
        KeyFrame before;
        before.pre_rope = true;
        const KvBases recorded = fit_kv_bases(scratch.file("qwen2.h5"), {}, before);
        const KvBases rotated_back = fit_kv_bases(options.output_path, {}, before);
        REQUIRE(recorded.key.size() == rotated_back.key.size());
        for (std::size_t u = 0; u < recorded.key.size(); ++u) {
            CHECK((recorded.key[u].mean - rotated_back.key[u].mean).norm() <= 1e-5 * recorded.key[u].mean.norm());
            CHECK((recorded.key[u].energy - rotated_back.key[u].energy).norm() <= 1e-5 * recorded.key[u].energy.norm());
        }
    }
}

namespace {

// This process's resident memory, now (VmRSS) or at its peak since the last reset (VmHWM), in bytes.
uint64_t status_bytes(const std::string& key) {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
        if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;  // "... kB"
    return 0;
}

}  // namespace

TEST_CASE("capture: peak memory is the model, its KV cache and one layer's chunk, not a score buffer per head") {
    // Resident memory is what this guards, so it is measured, not computed; a sanitizer build
    // keeps freed memory in quarantine and shadows every byte, so there it means nothing.
    if (std::getenv("KVSIM_SANITIZER_BUILD")) {
        MESSAGE("skipped: resident memory is not meaningful under a sanitizer build");
        return;
    }
    // Writing 5 resets VmHWM (Linux 4.0 and later).
    if (!std::ofstream("/proc/self/clear_refs") || status_bytes("VmHWM") == 0) {
        MESSAGE("skipped: this kernel cannot reset or report the peak resident memory");
        return;
    }
    ScratchDir scratch;
    // Many query heads and layers, each small: the working set the capture used to hold (a
    // [256 x positions] score buffer per query head, 16.8 MB here; every layer's Q/K/V of a chunk,
    // 10.5 MB) is as large as the model (10.3 MB with its cache at 512 positions) or larger.
    model::LlamaConfig config = model::testing::tiny_config();
    config.n_layers = 16;
    config.n_heads = 32;
    config.n_kv_heads = 4;
    config.head_dim = 16;
    config.context_length = 512;
    const std::string model_path = scratch.file("heads.gguf"), text = scratch.file("heads.txt");
    model::write_random_llama(model_path, config, 5);
    {
        std::ofstream out(text);
        for (int i = 0; i < 60; ++i) out << "the cat sat on the mat " << i << ". ";
    }
    CaptureOptions options;
    options.input = {model_path, text, "", 512, 0};  // cut at 512 tokens: two chunks
    options.output_path = scratch.file("heads.h5");
    const uint64_t model_bytes = model::LlamaModel::load(model_path, 512).memory_bytes();

    malloc_trim(0);  // memory freed by earlier tests goes back, so the capture's own is counted
    std::ofstream("/proc/self/clear_refs") << "5";
    const uint64_t before = status_bytes("VmRSS");
    // Two worker slots, as on the 2-core CI machine, whatever this machine has.
    tbb::task_arena(2).execute([&] { CHECK(capture_trace(options).tokens == 512); });
    const uint64_t grown = status_bytes("VmHWM") - before;
    MESSAGE("capture's peak resident growth " << grown / 1e6 << " MB; model with its KV cache " << model_bytes / 1e6
                                              << " MB");
    // Beside the model: the chunk's activations (1.8 MB), two score buffers (1 MB), one layer's
    // chunk (0.7 MB), HDF5's chunk caches and the allocator's slack: 8.8 MB measured when run
    // alone (5.2 MB after the other tests), in 12 MB. Either old working set does not fit: a score
    // buffer per head measured 24.5 MB beside the model, every layer's chunk held to the chunk's
    // end 19.1 MB (15.1 MB after the other capture tests).
    CHECK(grown < model_bytes + 12'000'000);
}
