// kvsim against llama.cpp (ggerganov/llama.cpp c392e509, 2025-02-20; its converter
// convert_hf_to_gguf.py and its loader): the dialect kvsim's writer writes, then the logits.
//
// The dialect: what the converter writes for each architecture, from its source (file:line in
// that commit): the keys of Model.set_gguf_parameters (:217-262) for every architecture, plus
// vocab_size and rope.dimension_count for llama (LlamaModel, :1603-1614); Llama 3.1's RoPE
// scaling as no key but a rope_freqs.weight tensor (generate_extra_tensors, :1671-1698), F32 as
// every vector (:311-331) and so are Qwen2's Q/K/V biases; output.weight only when the checkpoint
// has one (a tied model has none). llama.cpp's loader aborts on a rope.scaling.type it does not
// know ("llama3" among them) and refuses a file with a tensor it does not create.
//
// The logits: kvsim's forward pass against llama.cpp's, on the files kvsim's writer makes: a small
// random-weight model of each architecture kvsim reads (Llama 3.2-shaped with Llama 3.1 RoPE
// scaling, Qwen2 with its biases, a Mistral-shaped file), each in F32, F16, Q4_K and Q6_K,
// written here with fixed seeds, run here, and compared with the logits llama.cpp computed for
// the same files (tests/model/llama_cpp_logits.json: the full logit vector at three positions).
//
// How the numbers were recorded (by hand; no test needs llama.cpp): llama.cpp commit c392e509
// (ggerganov/llama.cpp, 2025-02-20), built for the CPU (AVX2, FMA, F16C; -march=native), run by a
// small program that loads a GGUF, evaluates kTokens teacher-forced in one llama_decode (F32 KV
// cache, flash attention off, 2 threads) and prints every position's logits. For each model this
// test writes (KVSIM_WRITE_LLAMA_CPP_MODELS=DIR build/tests/model_tests -tc='llama.cpp logits*'
// writes them into DIR), a script kept beside that program, outside the repository
// (`record_llama_cpp_logits.py WORKTREE`, which runs the command above, then the program on each
// file, and writes the JSON), recorded
// - "<model>/<type>": llama.cpp on the file itself, its own kernels;
// - "<model>/<type> as F32" (types other than F32): llama.cpp on a copy of the file with every
//   tensor decoded to F32 by llama.cpp's gguf-py (F16 up-cast exactly; the block formats by
//   gguf-py's own decoders, not kvsim's), so that llama.cpp computes the same weights in fp32.
//
// Tolerances, as the largest difference over a position's logits relative to the largest
// llama.cpp logit at the compared positions:
// - same float weights (F32, and every "as F32"): kTightTolerance. Both sides compute in fp32;
//   they differ in summation order (llama.cpp's 8-lane FMA tiles, Eigen's), in exp and SiLU
//   (ggml's vectorised approximations against the C library's) and in RoPE's angles (ggml
//   multiplies theta_scale up pair by pair in float, kvsim computes each frequency in double).
//   Over two layers that stays near 1e-6 (measured at most 8.5e-7); a misread option is off
//   by more than 1e-2 (measured: RoPE scaling ignored 5e-2, Qwen2's pairing as Llama's 8e-2, its
//   key bias dropped 2.5e-2, the Mistral-shaped file's window applied, checked below).
// - llama.cpp's own kernels: before each matrix product llama.cpp rounds the activations to
//   fp16 (F16 weights, relative error 2^-11 per element) or quantises them to 8 bits per block
//   of 256 (Q8_K, for k-quant weights: an error up to the block's largest magnitude / 254 per
//   element, i.e. about 0.7% rms for activations whose block maximum is 3 standard deviations,
//   against fp16's 0.03%), while kvsim multiplies fp32 activations by the decoded weights. That
//   rounding, compounded through two layers and the classifier, is what native_tolerance
//   allows: a few times the measured gaps (F16 1.0e-4 to 4.8e-4, the k-quants 3.5e-3 to 1.7e-2
//   of the largest logit; about 30 times F16's, as the rounding is). The gap is the
//   activations' and not the weights': Q4_K and Q6_K weights, about 8% and 2% off the written
//   values, give the same gap per model (same Q8_K activations), and on the decoded weights
//   ("as F32") both sides agree to 1e-6. A misread block layout is off by O(1).
// The greedy token (first maximum) must agree wherever llama.cpp's top two logits are further
// apart than the tolerance allows the two sides to differ.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/gguf_writer.h"
#include "model/llama.h"
#include "tests/model/test_util.h"

using namespace kvsim::model;
using namespace kvsim::model::testing;

namespace {

// Teacher-forced ids (BOS first), and the positions whose logits were recorded.
const std::vector<int> kTokens = {1, 17, 42, 5, 63, 8, 29, 33, 12, 50, 3, 61, 24, 7, 45, 38};
const std::vector<int> kPositions = {5, 10, 15};

constexpr double kTightTolerance = 1e-5;
double native_tolerance(TensorType type) { return type == TensorType::F16 ? 2e-3 : 5e-2; }

struct GoldenModel {
    std::string name;
    LlamaConfig config;
    uint64_t seed;
    bool tied;
};

// Each with every row a whole number of 256-weight k-quant super-blocks, a vocabulary of 64, two
// layers and grouped-query attention; shapes and options after the real models they stand for.
std::vector<GoldenModel> golden_models() {
    LlamaConfig base;
    base.dim = 256;
    base.hidden_dim = 512;
    base.n_layers = 2;
    base.vocab_size = 64;
    base.context_length = 64;

    // Llama 3.2 1B: 4 query heads per KV head, head size 64, theta 500000, Llama 3.1 scaling
    // (factor 32) as rope_freqs.weight, tied classifier. An original context of 32 (8192 in
    // the real model) puts most pairs in the scaled and blended ranges within 16 positions.
    LlamaConfig llama = base;
    llama.n_heads = 4;
    llama.n_kv_heads = 1;
    llama.head_dim = 64;
    llama.rope_theta = 500000.0f;
    llama.rope_scaling = {RopeScaling::Kind::llama3, 32.0, 1.0, 4.0, 32};

    // Qwen2.5 0.5B: biases on Q, K and V, RoPE over head halves, theta 10^6, tied classifier.
    LlamaConfig qwen2 = base;
    qwen2.architecture = "qwen2";
    qwen2.n_heads = 4;
    qwen2.n_kv_heads = 2;
    qwen2.head_dim = 64;
    qwen2.rope_theta = 1000000.0f;
    qwen2.norm_eps = 1e-6f;
    qwen2.qkv_bias = true;

    // Mistral Nemo: head size 64 x 8 heads wider than the embedding (key_length written), 4
    // query heads per KV head, theta 10^6, a separate classifier, and a sliding window of 4
    // recorded in the file, which neither llama.cpp nor kvsim applies.
    LlamaConfig mistral = base;
    mistral.n_heads = 8;
    mistral.n_kv_heads = 2;
    mistral.head_dim = 64;
    mistral.rope_theta = 1000000.0f;
    mistral.sliding_window = 4;

    return {{"llama3.2-scaled", llama, 101, true}, {"qwen2", qwen2, 102, true}, {"mistral-nemo-shaped", mistral, 103, false}};
}

const std::vector<TensorType> kTypes = {TensorType::F32, TensorType::F16, TensorType::Q4_K, TensorType::Q6_K};

const nlohmann::json& goldens() {
    static const nlohmann::json data = [] {
        const std::filesystem::path path =
            std::filesystem::path(KVSIM_SOURCE_DIR) / "tests" / "model" / "llama_cpp_logits.json";
        std::ifstream in(path);
        REQUIRE_MESSAGE(in.good(), "cannot read " << path.string());
        return nlohmann::json::parse(in);
    }();
    return data;
}

struct Comparison {
    double relative_difference = 0;  // max |kvsim - llama.cpp| / max |llama.cpp|, over the positions
    int greedy_agree = 0;            // positions whose greedy tokens agree
    int greedy_decided = 0, decided_agree = 0;  // positions whose top two the tolerance separates
};

// kvsim's logits (all positions) against one golden set, allowing `tolerance`.
Comparison compare(const std::vector<float>& logits, int vocab, const nlohmann::json& golden, double tolerance) {
    REQUIRE(golden.size() == kPositions.size());
    double scale = 0, worst = 0;
    for (const auto& row : golden)
        for (const auto& value : row) scale = std::max(scale, std::fabs(value.get<double>()));
    REQUIRE(scale > 0);
    Comparison result;
    for (size_t i = 0; i < kPositions.size(); ++i) {
        const std::vector<double> expected = golden[i].get<std::vector<double>>();
        REQUIRE(expected.size() == static_cast<size_t>(vocab));
        const float* ours = logits.data() + static_cast<size_t>(kPositions[i]) * vocab;
        for (int t = 0; t < vocab; ++t) worst = std::max(worst, std::fabs(ours[t] - expected[t]));
        const auto best = static_cast<int>(std::max_element(expected.begin(), expected.end()) - expected.begin());
        const bool agree = static_cast<int>(std::max_element(ours, ours + vocab) - ours) == best;
        result.greedy_agree += agree;
        // Decided when llama.cpp's best beats its runner-up by more than the two sides may differ.
        double runner_up = -INFINITY;
        for (int t = 0; t < vocab; ++t)
            if (t != best) runner_up = std::max(runner_up, expected[t]);
        if (expected[best] - runner_up > 2 * tolerance * scale) {
            ++result.greedy_decided;
            result.decided_agree += agree;
        }
    }
    result.relative_difference = worst / scale;
    return result;
}

// Attention limited to the last `window` positions (the current one included), as llama.cpp
// masks its sliding-window models (a key at distance >= window is hidden).
struct WindowMask : ForwardHooks {
    int window;
    std::vector<uint8_t> mask;
    explicit WindowMask(int w) : window(w) {}
    const uint8_t* attention_mask(int, int, int pos) override {
        mask.assign(static_cast<size_t>(pos) + 1, 0);
        for (int j = std::max(0, pos - window + 1); j <= pos; ++j) mask[static_cast<size_t>(j)] = 1;
        return mask.data();
    }
};

std::string file_name(const GoldenModel& model, TensorType type) {
    return model.name + "-" + tensor_type_name(static_cast<uint32_t>(type)) + ".gguf";
}

}  // namespace

TEST_CASE("llama.cpp logits: kvsim's forward pass equals llama.cpp's on the files kvsim writes") {
    // The recording script's way to the models: written before anything is compared.
    if (const char* copy_to = std::getenv("KVSIM_WRITE_LLAMA_CPP_MODELS"))
        for (const GoldenModel& model : golden_models())
            for (const TensorType type : kTypes)
                write_random_llama((std::filesystem::path(copy_to) / file_name(model, type)).string(), model.config,
                                   model.seed, type, model.tied);

    ScratchDir scratch;
    REQUIRE(goldens().at("tokens").get<std::vector<int>>() == kTokens);
    REQUIRE(goldens().at("positions").get<std::vector<int>>() == kPositions);
    const nlohmann::json& logits = goldens().at("logits");
    for (const GoldenModel& model : golden_models()) {
        for (const TensorType type : kTypes) {
            const std::string name = model.name + "/" + tensor_type_name(static_cast<uint32_t>(type));
            CAPTURE(name);
            const std::string path = scratch.file(file_name(model, type));
            write_random_llama(path, model.config, model.seed, type, model.tied);
            LlamaModel llama = LlamaModel::load(path);
            const float* out = llama.forward_batch(kTokens, 0);
            const std::vector<float> ours(out, out + kTokens.size() * static_cast<size_t>(model.config.vocab_size));

            // The same weights in fp32 on both sides: the file itself for F32, else its F32 copy.
            const std::string same_weights = type == TensorType::F32 ? name : name + " as F32";
            const Comparison tight = compare(ours, model.config.vocab_size, logits.at(same_weights), kTightTolerance);
            MESSAGE(same_weights << ": max |kvsim - llama.cpp| / max |logit| = " << tight.relative_difference
                                 << ", greedy token agrees at " << tight.greedy_agree << "/" << kPositions.size());
            CHECK(tight.relative_difference < kTightTolerance);
            CHECK(tight.greedy_decided == static_cast<int>(kPositions.size()));
            CHECK(tight.decided_agree == tight.greedy_decided);
            if (model.config.sliding_window > 0 && type == TensorType::F32) {
                // The window the file records, applied, is far from what llama.cpp computed:
                // llama.cpp attends over the whole context, as kvsim does.
                llama.reset();
                WindowMask window(model.config.sliding_window);
                const float* windowed = llama.forward_batch(kTokens, 0, &window);
                const Comparison applied =
                    compare(std::vector<float>(windowed, windowed + ours.size()), model.config.vocab_size,
                            logits.at(same_weights), kTightTolerance);
                MESSAGE(name << " with its sliding window applied: " << applied.relative_difference);
                CHECK(applied.relative_difference > 1000 * kTightTolerance);
            }
            if (type == TensorType::F32) continue;

            // llama.cpp's own kernels on the file, rounding its activations.
            const Comparison native = compare(ours, model.config.vocab_size, logits.at(name), native_tolerance(type));
            MESSAGE(name << " (llama.cpp's kernels): max |kvsim - llama.cpp| / max |logit| = " << native.relative_difference
                         << ", greedy token agrees at " << native.greedy_agree << "/" << kPositions.size());
            CHECK(native.relative_difference < native_tolerance(type));
            CHECK(native.decided_agree == native.greedy_decided);
        }
    }
}

TEST_CASE("llama.cpp dialect: the writer writes the keys and tensors llama.cpp's converter writes") {
    ScratchDir scratch;
    for (const GoldenModel& model : golden_models()) {
        CAPTURE(model.name);
        const LlamaConfig& c = model.config;
        const bool llama = c.architecture == "llama";
        const std::string path = scratch.file(model.name + ".gguf");
        write_random_llama(path, c, model.seed, TensorType::Q4_K, model.tied);
        const GgufFile file = GgufFile::open(path);
        const std::string p = c.architecture + ".";
        for (const char* key : {"block_count", "context_length", "embedding_length", "feed_forward_length",
                                "attention.head_count", "attention.head_count_kv", "rope.freq_base",
                                "attention.layer_norm_rms_epsilon"})
            CHECK_MESSAGE(file.find(p + key) != nullptr, p << key);
        CHECK(file.get_int("general.file_type") == 14);  // MOSTLY_Q4_K_S
        CHECK(file.get_int("general.quantization_version") == 2);
        CHECK((file.find(p + "vocab_size") != nullptr) == llama);
        CHECK((file.find(p + "rope.dimension_count") != nullptr) == llama);
        CHECK((file.find(p + "attention.key_length") != nullptr) == (c.q_dim() != c.dim));
        CHECK(file.find(p + "rope.scaling.type") == nullptr);  // Llama 3.1's scaling is a tensor
        CHECK(file.get_string("tokenizer.ggml.model") == "llama");
        CHECK(file.get_string_array("tokenizer.ggml.tokens").size() == static_cast<size_t>(c.vocab_size));

        // Exactly the tensors llama.cpp's loader creates for the architecture.
        std::set<std::string> expected = {"token_embd.weight", "output_norm.weight"};
        if (!model.tied) expected.insert("output.weight");
        if (c.rope_scaling.kind == RopeScaling::Kind::llama3) expected.insert("rope_freqs.weight");
        for (int l = 0; l < c.n_layers; ++l)
            for (const char* name : {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                     "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                                     "ffn_down.weight"})
                expected.insert("blk." + std::to_string(l) + "." + name);
        if (c.qkv_bias)
            for (int l = 0; l < c.n_layers; ++l)
                for (const char* name : {"attn_q.bias", "attn_k.bias", "attn_v.bias"})
                    expected.insert("blk." + std::to_string(l) + "." + name);
        std::set<std::string> written;
        for (const GgufTensorInfo& info : file.tensors()) {
            written.insert(info.name);
            const bool vector = info.shape.size() == 1;
            CHECK_MESSAGE(info.type_id == static_cast<uint32_t>(vector ? TensorType::F32 : TensorType::Q4_K), info.name);
        }
        CHECK(written == expected);
        if (const GgufTensorInfo* freqs = file.find_tensor("rope_freqs.weight"))
            CHECK(freqs->shape == std::vector<uint64_t>{static_cast<uint64_t>(c.head_dim / 2)});
    }
}

TEST_CASE("llama.cpp dialect: rope_freqs.weight holds the converter's numbers, and what llama.cpp cannot load is refused") {
    // The converter's own generate_extra_tensors run on config.json files of these shapes
    // (/work/oracles/llama_logits/tools/llama3_rope_freqs.py, printed with %.9g): Llama 3.2 1B
    // (head size 64, theta 500000, factor 32, low 1, high 4, original context 8192), the test
    // model above (the same with an original context of 32), and head size 128, theta 10^4,
    // factor 8, original context 1000, whose ten blended pairs come out an ulp off if any
    // step is rounded differently from torch's float32 (a direct division where torch
    // multiplies by a reciprocal, or a fused multiply-add).
    LlamaConfig config;
    config.head_dim = 64;
    config.rope_theta = 500000.0f;
    config.rope_scaling = {RopeScaling::Kind::llama3, 32.0, 1.0, 4.0, 8192};
    std::vector<float> converter(32, 32.0f);
    std::fill(converter.begin(), converter.begin() + 15, 1.0f);
    converter[15] = 1.65132928f;
    converter[16] = 3.29226279f;
    converter[17] = 9.66673088f;
    CHECK(llama3_rope_freq_divisors(config) == converter);
    config.rope_scaling.original_context = 32;
    converter.assign(32, 32.0f);
    converter[0] = 1.0f;
    converter[1] = 1.25048053f;
    converter[2] = 2.31181407f;
    converter[3] = 5.29292202f;
    CHECK(llama3_rope_freq_divisors(config) == converter);
    config.head_dim = 128;
    config.rope_theta = 10000.0f;
    config.rope_scaling = {RopeScaling::Kind::llama3, 8.0, 1.0, 4.0, 1000};
    converter.assign(64, 8.0f);
    std::fill(converter.begin(), converter.begin() + 26, 1.0f);
    const std::vector<float> blended = {1.07051539f, 1.27132058f, 1.51787877f, 1.82425106f, 2.21064544f,
                                        2.70720029f, 3.36094642f, 4.24961185f, 5.51159525f, 7.41963434f};
    std::copy(blended.begin(), blended.end(), converter.begin() + 26);
    CHECK(llama3_rope_freq_divisors(config) == converter);

    LlamaConfig qwen2 = golden_models()[1].config;
    REQUIRE(qwen2.architecture == "qwen2");
    CHECK_NOTHROW(random_llama_writer(qwen2, 1));
    qwen2.qkv_bias = false;  // llama.cpp requires Qwen2's biases
    CHECK_THROWS_AS(random_llama_writer(qwen2, 1), std::invalid_argument);
    qwen2.qkv_bias = true;
    qwen2.head_dim = 32;  // llama.cpp's qwen2 needs heads x head size = embedding width
    CHECK_THROWS_AS(random_llama_writer(qwen2, 1), std::invalid_argument);
    LlamaConfig llama = golden_models()[0].config;
    CHECK_THROWS_AS(random_llama_writer(llama, 1, TensorType::Q8_K), std::invalid_argument);  // no ggml kernel
    llama.vocab_size = 2;  // no room for <unk>, <s>, </s>
    CHECK_THROWS_AS(random_llama_writer(llama, 1), std::invalid_argument);
}
