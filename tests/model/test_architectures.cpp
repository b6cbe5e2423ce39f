// The architectures and options the forward pass reads (llama with Llama 3.1 RoPE scaling, tied
// embeddings, a sliding window in metadata; qwen2 with Q/K/V biases), each a random-weight model
// written by kvsim's GGUF writer and checked against the plain reference forward pass below,
// written from the published descriptions independently of llama.cpp (model); then weights
// kept encoded in memory against the same weights dequantised to F32.
#include <doctest/doctest.h>
#include <tbb/global_control.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "base/errors.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "tests/model/test_util.h"

using namespace kvsim::model;
using namespace kvsim::model::testing;

namespace {

// What the reference needs to know beyond the weights, stated by each test from what it wrote.
struct ReferenceSpec {
    LlamaConfig config;
    bool rotate_halves = false;          // RoPE pairs (i, i + d/2) instead of (2i, 2i + 1)
    std::vector<double> freq_divisors;   // per RoPE pair; empty = all 1
    bool bias = false;
    bool tied = false;
};

// Logits at every position of `tokens`, one token at a time in double precision: loops and sums,
// full causal attention, nothing shared with the model code but the file reader.
std::vector<std::vector<double>> reference_logits(const std::string& path, const ReferenceSpec& spec,
                                                  const std::vector<int>& tokens) {
    const GgufFile file = GgufFile::open(path);
    const LlamaConfig& c = spec.config;
    const auto weights = [&](const std::string& name) {
        const std::vector<float> values = file.read_tensor(name);
        return std::vector<double>(values.begin(), values.end());
    };
    const auto matvec = [](const std::vector<double>& w, const std::vector<double>& x) {
        const size_t cols = x.size(), rows = w.size() / cols;
        std::vector<double> y(rows, 0.0);
        for (size_t r = 0; r < rows; ++r)
            for (size_t k = 0; k < cols; ++k) y[r] += w[r * cols + k] * x[k];
        return y;
    };
    const auto rms_norm = [&](const std::vector<double>& x, const std::vector<double>& gain) {
        double squares = 0.0;
        for (double value : x) squares += value * value;
        const double scale = 1.0 / std::sqrt(squares / static_cast<double>(x.size()) + c.norm_eps);
        std::vector<double> out(x.size());
        for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * scale * gain[i];
        return out;
    };
    const int d = c.head_dim;
    const auto rope = [&](std::vector<double>& x, int pos) {
        for (size_t head = 0; head < x.size(); head += static_cast<size_t>(d)) {
            for (int i = 0; i < d / 2; ++i) {
                const double divisor = spec.freq_divisors.empty() ? 1.0 : spec.freq_divisors[static_cast<size_t>(i)];
                const double angle = pos * std::pow(static_cast<double>(c.rope_theta), -2.0 * i / d) / divisor;
                const size_t a = head + (spec.rotate_halves ? i : 2 * i);
                const size_t b = head + (spec.rotate_halves ? i + d / 2 : 2 * i + 1);
                const double x0 = x[a], x1 = x[b];
                x[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
                x[b] = x0 * std::sin(angle) + x1 * std::cos(angle);
            }
        }
    };

    const std::vector<double> embedding = weights("token_embd.weight");
    std::vector<std::vector<std::vector<double>>> keys(c.n_layers), values(c.n_layers);  // [layer][pos]
    std::vector<std::vector<double>> logits;
    for (int pos = 0; pos < static_cast<int>(tokens.size()); ++pos) {
        std::vector<double> x(embedding.begin() + static_cast<long>(tokens[pos]) * c.dim,
                              embedding.begin() + static_cast<long>(tokens[pos] + 1) * c.dim);
        for (int l = 0; l < c.n_layers; ++l) {
            const std::string b = "blk." + std::to_string(l) + ".";
            const std::vector<double> xn = rms_norm(x, weights(b + "attn_norm.weight"));
            std::vector<double> q = matvec(weights(b + "attn_q.weight"), xn);
            std::vector<double> k = matvec(weights(b + "attn_k.weight"), xn);
            std::vector<double> v = matvec(weights(b + "attn_v.weight"), xn);
            if (spec.bias) {
                const std::vector<double> bq = weights(b + "attn_q.bias"), bk = weights(b + "attn_k.bias"),
                                          bv = weights(b + "attn_v.bias");
                for (size_t i = 0; i < q.size(); ++i) q[i] += bq[i];
                for (size_t i = 0; i < k.size(); ++i) k[i] += bk[i], v[i] += bv[i];
            }
            rope(q, pos);
            rope(k, pos);
            keys[l].push_back(k);
            values[l].push_back(v);
            std::vector<double> attended(q.size(), 0.0);
            for (int h = 0; h < c.n_heads; ++h) {
                const int g = h / (c.n_heads / c.n_kv_heads);
                std::vector<double> scores(static_cast<size_t>(pos) + 1);
                for (int t = 0; t <= pos; ++t) {
                    double dot = 0.0;
                    for (int i = 0; i < d; ++i) dot += q[h * d + i] * keys[l][t][g * d + i];
                    scores[t] = dot / std::sqrt(static_cast<double>(d));
                }
                const double top = *std::max_element(scores.begin(), scores.end());
                double sum = 0.0;
                for (double& s : scores) sum += (s = std::exp(s - top));
                for (int t = 0; t <= pos; ++t)
                    for (int i = 0; i < d; ++i) attended[h * d + i] += scores[t] / sum * values[l][t][g * d + i];
            }
            const std::vector<double> out = matvec(weights(b + "attn_output.weight"), attended);
            for (int i = 0; i < c.dim; ++i) x[i] += out[i];
            const std::vector<double> xf = rms_norm(x, weights(b + "ffn_norm.weight"));
            const std::vector<double> gate = matvec(weights(b + "ffn_gate.weight"), xf);
            const std::vector<double> up = matvec(weights(b + "ffn_up.weight"), xf);
            std::vector<double> hidden(gate.size());
            for (size_t i = 0; i < gate.size(); ++i) hidden[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
            const std::vector<double> down = matvec(weights(b + "ffn_down.weight"), hidden);
            for (int i = 0; i < c.dim; ++i) x[i] += down[i];
        }
        const std::vector<double> xn = rms_norm(x, weights("output_norm.weight"));
        logits.push_back(matvec(spec.tied ? embedding : weights("output.weight"), xn));
    }
    return logits;
}

const std::vector<int> kTokens = {1, 40, 77, 290, 5, 5, 123, 64, 250, 9, 31, 200, 17, 3, 299, 88};

// The model's logits for kTokens (one chunk) against the reference's: the largest difference
// relative to the largest reference logit.
double relative_error(const std::string& path, const ReferenceSpec& spec) {
    LlamaModel model = LlamaModel::load(path);
    const float* logits = model.forward_batch(kTokens, 0);
    const auto expected = reference_logits(path, spec, kTokens);
    double worst = 0.0, scale = 0.0;
    for (size_t pos = 0; pos < kTokens.size(); ++pos)
        for (int i = 0; i < spec.config.vocab_size; ++i) {
            scale = std::max(scale, std::fabs(expected[pos][i]));
            worst = std::max(worst, std::fabs(expected[pos][i] - logits[pos * spec.config.vocab_size + i]));
        }
    REQUIRE(scale > 0.0);
    return worst / scale;
}

// fp32 against double over two layers: a few float roundings of O(1) sums.
constexpr double kTolerance = 1e-4;

// Llama 3.1's frequency divisors, from Meta's description: wavelengths below
// original_context / high_freq_factor unchanged, above original_context / low_freq_factor
// stretched by factor, between them a linear blend in original_context / wavelength.
std::vector<double> llama31_divisors(const LlamaConfig& c, double factor, double low, double high, double original) {
    std::vector<double> divisors;
    for (int i = 0; i < c.head_dim / 2; ++i) {
        const double frequency = std::pow(static_cast<double>(c.rope_theta), -2.0 * i / c.head_dim);
        const double wavelength = 2.0 * std::numbers::pi / frequency;
        double scaled = frequency;
        if (wavelength > original / low) {
            scaled = frequency / factor;
        } else if (wavelength >= original / high) {
            const double smooth = (original / wavelength - low) / (high - low);
            scaled = (1.0 - smooth) * frequency / factor + smooth * frequency;
        }
        divisors.push_back(frequency / scaled);
    }
    return divisors;
}

std::string load_error(const std::string& path) {
    try {
        LlamaModel::load(path);
    } catch (const kvsim::InputError& error) {
        return error.what();
    }
    return "(no error)";
}

}  // namespace

TEST_CASE("architectures: llama with a separate classifier and grouped-query attention matches the reference") {
    ScratchDir scratch;
    ReferenceSpec spec;
    spec.config = tiny_config();
    write_random_llama(scratch.file("llama.gguf"), spec.config, 21);
    CHECK(relative_error(scratch.file("llama.gguf"), spec) < kTolerance);
}

TEST_CASE("architectures: Llama 3.2's tied embeddings (no output.weight) classify with token_embd") {
    ScratchDir scratch;
    ReferenceSpec spec;
    spec.config = tiny_config();
    spec.tied = true;
    write_random_llama(scratch.file("tied.gguf"), spec.config, 22, TensorType::F32, /*tied_output=*/true);
    CHECK(LlamaModel::load(scratch.file("tied.gguf")).tied_output());
    CHECK(relative_error(scratch.file("tied.gguf"), spec) < kTolerance);
}

TEST_CASE("architectures: Llama 3.1 RoPE scaling, as the writer stores it and from metadata, and linear scaling") {
    ScratchDir scratch;
    ReferenceSpec spec;
    spec.config = tiny_config();
    // head_dim 16, theta 10^4: wavelengths 6.3, 20, 63, 199, ...; an original context of 32
    // with factors 1 and 4 keeps pair 0, blends pair 1 and stretches the rest.
    spec.config.rope_scaling = {RopeScaling::Kind::llama3, 8.0, 1.0, 4.0, 32};
    spec.freq_divisors = llama31_divisors(spec.config, 8.0, 1.0, 4.0, 32.0);
    CHECK(spec.freq_divisors[0] == 1.0);
    CHECK(spec.freq_divisors[1] > 1.0);
    CHECK(spec.freq_divisors[1] < 8.0);
    CHECK(spec.freq_divisors[3] == doctest::Approx(8.0));
    // The writer stores the scaling as llama.cpp's converter does, a rope_freqs.weight tensor.
    write_random_llama(scratch.file("llama31.gguf"), spec.config, 23);
    CHECK(GgufFile::open(scratch.file("llama31.gguf")).find_tensor("rope_freqs.weight") != nullptr);
    CHECK(relative_error(scratch.file("llama31.gguf"), spec) < kTolerance);
    // Ignoring the scaling would be caught: the unscaled reference is far off.
    ReferenceSpec unscaled = spec;
    unscaled.freq_divisors.clear();
    CHECK(relative_error(scratch.file("llama31.gguf"), unscaled) > 100 * kTolerance);

    // The metadata kvsim's writer once wrote (rope.scaling.type "llama3", which llama.cpp
    // cannot load) still reads as the same scaling.
    GgufWriter metadata = random_llama_writer(spec.config, 23);
    REQUIRE(metadata.remove_tensor("rope_freqs.weight"));
    metadata.set_string("llama.rope.scaling.type", "llama3");
    metadata.set_float32("llama.rope.scaling.factor", 8.0f);
    metadata.set_float32("llama.rope.scaling.low_freq_factor", 1.0f);
    metadata.set_float32("llama.rope.scaling.high_freq_factor", 4.0f);
    metadata.set_uint32("llama.rope.scaling.original_context_length", 32);
    metadata.write(scratch.file("llama31-metadata.gguf"));
    CHECK(relative_error(scratch.file("llama31-metadata.gguf"), spec) < kTolerance);
    // Both at once: the tensor replaces the metadata rather than scaling twice.
    metadata.add_tensor("rope_freqs.weight", {8}, llama3_rope_freq_divisors(spec.config));
    metadata.write(scratch.file("llama31-both.gguf"));
    CHECK(relative_error(scratch.file("llama31-both.gguf"), spec) < kTolerance);

    spec.config.rope_scaling = {RopeScaling::Kind::linear, 4.0, 1.0, 4.0, 0};
    spec.freq_divisors.assign(static_cast<size_t>(spec.config.head_dim / 2), 4.0);
    write_random_llama(scratch.file("linear.gguf"), spec.config, 24);
    CHECK(relative_error(scratch.file("linear.gguf"), spec) < kTolerance);
    // As in llama.cpp: a factor without rope.scaling.type (or the older rope.scale_linear) is
    // linear scaling, and rope_freqs.weight divides on top of a linear factor.
    GgufWriter untyped = random_llama_writer(spec.config, 24);
    REQUIRE(untyped.remove("llama.rope.scaling.type"));
    untyped.write(scratch.file("untyped.gguf"));
    CHECK(relative_error(scratch.file("untyped.gguf"), spec) < kTolerance);
    REQUIRE(untyped.remove("llama.rope.scaling.factor"));
    untyped.set_float32("llama.rope.scale_linear", 4.0f);
    untyped.write(scratch.file("scale_linear.gguf"));
    CHECK(relative_error(scratch.file("scale_linear.gguf"), spec) < kTolerance);
    GgufWriter both = random_llama_writer(spec.config, 24);
    const std::vector<float> halves(8, 2.0f);
    both.add_tensor("rope_freqs.weight", {8}, halves);
    both.write(scratch.file("linear-freqs.gguf"));
    spec.freq_divisors.assign(8, 8.0);
    CHECK(relative_error(scratch.file("linear-freqs.gguf"), spec) < kTolerance);
}

TEST_CASE("architectures: a rope_freqs.weight tensor divides the frequencies (llama.cpp's Llama 3.1 files)") {
    ScratchDir scratch;
    ReferenceSpec spec;
    spec.config = tiny_config();
    spec.freq_divisors = llama31_divisors(spec.config, 8.0, 1.0, 4.0, 32.0);
    GgufWriter writer = random_llama_writer(spec.config, 25);
    const std::vector<float> divisors(spec.freq_divisors.begin(), spec.freq_divisors.end());
    writer.add_tensor("rope_freqs.weight", {divisors.size()}, divisors);
    writer.write(scratch.file("freqs.gguf"));
    CHECK(relative_error(scratch.file("freqs.gguf"), spec) < kTolerance);

    SUBCASE("a divisor that is not positive, or the wrong length, is refused naming the tensor") {
        std::vector<float> bad = divisors;
        bad[2] = 0.0f;
        writer.remove_tensor("rope_freqs.weight");
        writer.add_tensor("rope_freqs.weight", {bad.size()}, bad);
        writer.write(scratch.file("zero.gguf"));
        CHECK(load_error(scratch.file("zero.gguf")).find("tensor 'rope_freqs.weight': element 2") != std::string::npos);
        writer.remove_tensor("rope_freqs.weight");
        writer.add_tensor("rope_freqs.weight", {3}, std::vector<float>{1, 1, 1});
        writer.write(scratch.file("short.gguf"));
        CHECK(load_error(scratch.file("short.gguf")).find("tensor 'rope_freqs.weight': shape [3], expected [8]") !=
              std::string::npos);
    }
}

TEST_CASE("architectures: qwen2 (keys under qwen2., biases on Q, K and V, RoPE over head halves)") {
    ScratchDir scratch;
    ReferenceSpec spec;
    spec.config = tiny_config();
    spec.config.architecture = "qwen2";
    spec.config.qkv_bias = true;
    spec.config.rope_theta = 1000000.0f;
    spec.bias = spec.rotate_halves = spec.tied = true;
    write_random_llama(scratch.file("qwen2.gguf"), spec.config, 26, TensorType::F32, /*tied_output=*/true);
    const LlamaModel model = LlamaModel::load(scratch.file("qwen2.gguf"));
    CHECK(model.config().architecture == "qwen2");
    CHECK(model.config().qkv_bias);
    CHECK(relative_error(scratch.file("qwen2.gguf"), spec) < kTolerance);
    // Neither the biases nor the pairing is optional: the reference without either is far off.
    ReferenceSpec adjacent = spec;
    adjacent.rotate_halves = false;
    CHECK(relative_error(scratch.file("qwen2.gguf"), adjacent) > 100 * kTolerance);
    ReferenceSpec unbiased = spec;
    unbiased.bias = false;
    CHECK(relative_error(scratch.file("qwen2.gguf"), unbiased) > 100 * kTolerance);

    SUBCASE("a qwen2 file without its biases is refused naming the tensor") {
        GgufWriter writer = random_llama_writer(spec.config, 26, TensorType::F32, true);
        writer.remove_tensor("blk.0.attn_q.bias");
        writer.write(scratch.file("nobias.gguf"));
        CHECK(load_error(scratch.file("nobias.gguf")).find("'blk.0.attn_q.bias'") != std::string::npos);
    }
}

TEST_CASE("architectures: a Mistral-style sliding window is read and recorded; attention stays full") {
    ScratchDir scratch;
    ReferenceSpec spec;
    spec.config = tiny_config();
    spec.config.sliding_window = 4;  // shorter than kTokens: a windowed pass would differ
    write_random_llama(scratch.file("mistral.gguf"), spec.config, 27);
    CHECK(LlamaModel::load(scratch.file("mistral.gguf")).config().sliding_window == 4);
    CHECK(relative_error(scratch.file("mistral.gguf"), spec) < kTolerance);
}

TEST_CASE("architectures: anything else is refused with one line naming it") {
    ScratchDir scratch;
    GgufWriter writer = random_llama_writer(tiny_config(), 28);
    writer.set_string("general.architecture", "phi3");
    writer.write(scratch.file("phi3.gguf"));
    CHECK(load_error(scratch.file("phi3.gguf")) == scratch.file("phi3.gguf") +
                                                       ": metadata key 'general.architecture': unsupported "
                                                       "architecture 'phi3' (supported: llama, qwen2)");
    writer = random_llama_writer(tiny_config(), 28);
    writer.set_string("llama.rope.scaling.type", "yarn");
    writer.write(scratch.file("yarn.gguf"));
    const std::string message = load_error(scratch.file("yarn.gguf"));
    CHECK(message.find("metadata key 'llama.rope.scaling.type': RoPE scaling 'yarn' is not supported") !=
          std::string::npos);
    CHECK(message.find('\n') == std::string::npos);
}

TEST_CASE("weights in memory: a Q4_K model holds its blocks, equals its F32 twin bit for bit, at any thread count") {
    ScratchDir scratch;
    LlamaConfig config = tiny_config();
    config.dim = 256;  // every row a whole number of 256-weight super-blocks
    config.hidden_dim = 512;
    config.head_dim = 64;
    const std::string q4k = scratch.file("q4k.gguf"), f32 = scratch.file("f32.gguf");
    write_random_llama(q4k, config, 29, TensorType::Q4_K);
    {
        const GgufFile file = GgufFile::open(q4k);
        GgufWriter writer;
        for (const auto& [key, value] : file.metadata()) writer.set(key, value);
        for (const auto& info : file.tensors()) writer.add_tensor(info.name, info.shape, file.read_tensor(info.name));
        writer.write(f32);
    }
    LlamaModel quantised = LlamaModel::load(q4k);
    LlamaModel exact = LlamaModel::load(f32);
    // Weights: 4.5 bits against 32 (norms and the KV cache are fp32 in both).
    const uint64_t weights = static_cast<uint64_t>(config.parameter_count(false));
    CHECK(exact.memory_bytes() - quantised.memory_bytes() > weights * 4 * 3 / 4);

    const std::vector<int> tokens(kTokens.begin(), kTokens.end());
    const auto logits = [&](LlamaModel& model, int threads) {
        tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(threads));
        model.reset();
        const float* out = model.forward_batch(tokens, 0);
        std::vector<float> all(out, out + tokens.size() * static_cast<size_t>(config.vocab_size));
        const float* single = model.forward(tokens.back(), static_cast<int>(tokens.size()) - 1);  // a matrix-vector product
        all.insert(all.end(), single, single + config.vocab_size);
        return all;
    };
    const std::vector<float> reference = logits(exact, 1);
    CHECK(logits(quantised, 1) == reference);
    CHECK(logits(quantised, 2) == reference);
    CHECK(logits(exact, 2) == reference);
}
