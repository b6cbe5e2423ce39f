#include "model/llama.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "base/errors.h"
#include "base/size_limits.h"
#include "model/gguf.h"

namespace kvsim::model {

using RowMatrix = LlamaModel::RowMatrix;

namespace {

// Attention over fewer multiply-adds than this stays on the calling thread: below it, handing
// work to the second core costs more than it saves.
constexpr int64_t kParallelMinMacs = int64_t{1} << 18;

void linear(const Eigen::Ref<const RowMatrix>& x, const WeightMatrix& w, Eigen::Ref<RowMatrix> y) { w.multiply(x, y); }
void linear_add(const Eigen::Ref<const RowMatrix>& x, const WeightMatrix& w, Eigen::Ref<RowMatrix> y) {
    w.multiply_add(x, y);
}

// RMSNorm (Zhang & Sennrich 2019), one row per token: out = x / sqrt(mean(x²) + eps) ⊙ weight.
void rms_norm(const Eigen::Ref<const RowMatrix>& x, const Eigen::VectorXf& weight, float eps, Eigen::Ref<RowMatrix> out) {
    for (Eigen::Index i = 0; i < x.rows(); ++i) {
        const float inv_rms = 1.0f / std::sqrt(x.row(i).squaredNorm() / static_cast<float>(x.cols()) + eps);
        out.row(i) = (x.row(i) * inv_rms).cwiseProduct(weight.transpose());
    }
}

// RoPE (cache_math/rope.h) on a chunk's rows, from the per-position cos/sin tables.
void apply_rope(Eigen::Ref<RowMatrix> x, int head_dim, int start_pos, RopePairing pairing, const RowMatrix& cos,
                const RowMatrix& sin) {
    for (Eigen::Index i = 0; i < x.rows(); ++i) {
        float* row = x.row(i).data();
        const float* c = cos.row(start_pos + i).data();
        const float* s = sin.row(start_pos + i).data();
        for (Eigen::Index head_start = 0; head_start < x.cols(); head_start += head_dim)
            rotate_head(row + head_start, head_dim, pairing, c, s);
    }
}

// In place over one row of scores: exp(score - max) / sum over kept positions; masked positions
// (score -inf) get exactly 0. A row with no kept position becomes all zeros. Returns false when a
// kept score is NaN or infinite (or all are -inf): the sum it already takes shows it at no cost.
template <class Row>
bool softmax_in_place(Row&& row, const uint8_t* kept) {
    float max_score = -std::numeric_limits<float>::infinity();
    bool any_kept = false;
    for (Eigen::Index t = 0; t < row.size(); ++t) {
        if (kept && !kept[t]) continue;
        any_kept = true;
        max_score = std::max(max_score, row[t]);  // a NaN leaves max_score as it is; the sum sees it
    }
    if (!any_kept) {
        row.setZero();
        return true;
    }
    if (max_score == -std::numeric_limits<float>::infinity()) return false;
    row.array() = (row.array() - max_score).exp();
    if (kept) {
        for (Eigen::Index t = 0; t < row.size(); ++t) {
            if (!kept[t]) row[t] = 0.0f;
        }
    }
    // Finite scores give a sum in [1, row.size()]; a NaN or +inf score makes it NaN.
    const float sum = row.sum();
    if (!(sum >= 1.0f && sum <= std::numeric_limits<float>::max())) return false;
    row /= sum;
    return true;
}

// Index of the first element that is not finite, or -1; vectorised for the common all-finite case.
Eigen::Index first_non_finite(const float* values, Eigen::Index count) {
    if (Eigen::Map<const Eigen::ArrayXf>(values, count).allFinite()) return -1;
    for (Eigen::Index i = 0; i < count; ++i)
        if (!std::isfinite(values[i])) return i;
    return -1;
}

// A metadata integer as an int in [minimum, INT_MAX]; InputError naming the file and key otherwise.
int checked_int(const GgufFile& file, const std::string& key, int64_t value, int64_t minimum) {
    if (value < minimum || value > std::numeric_limits<int>::max()) {
        throw InputError(file.path() + ": metadata key '" + key + "': value " + std::to_string(value) +
                         " is out of range [" + std::to_string(minimum) + ", " +
                         std::to_string(std::numeric_limits<int>::max()) + "]");
    }
    return static_cast<int>(value);
}

int required_int(const GgufFile& file, const std::string& key) {
    return checked_int(file, key, file.get_int(key), 1);
}

// A metadata number as a positive, finite float (a double beyond float's range would not convert).
float positive_float(const GgufFile& file, const std::string& key, double value) {
    if (!(value > 0.0) || !(value <= std::numeric_limits<float>::max()) ||
        !(static_cast<float>(value) > 0.0f)) {
        throw InputError(file.path() + ": metadata key '" + key + "': " + std::to_string(value) +
                         " is not a positive finite float32");
    }
    return static_cast<float>(value);
}

// A weight tensor the model reads: a matrix [rows][cols] (GGUF ne = [cols, rows], ne0 being the
// row length) or, with cols == 0, a vector of `rows`.
struct WeightShape {
    std::string name;
    int rows, cols;
};

std::vector<WeightShape> weight_shapes(const LlamaConfig& c, bool tied_output) {
    std::vector<WeightShape> shapes = {{"token_embd.weight", c.vocab_size, c.dim}};
    for (int l = 0; l < c.n_layers; ++l) {
        const std::string prefix = "blk." + std::to_string(l) + ".";
        shapes.push_back({prefix + "attn_norm.weight", c.dim, 0});
        shapes.push_back({prefix + "attn_q.weight", c.q_dim(), c.dim});
        shapes.push_back({prefix + "attn_k.weight", c.kv_dim(), c.dim});
        shapes.push_back({prefix + "attn_v.weight", c.kv_dim(), c.dim});
        if (c.qkv_bias) {
            shapes.push_back({prefix + "attn_q.bias", c.q_dim(), 0});
            shapes.push_back({prefix + "attn_k.bias", c.kv_dim(), 0});
            shapes.push_back({prefix + "attn_v.bias", c.kv_dim(), 0});
        }
        shapes.push_back({prefix + "attn_output.weight", c.dim, c.q_dim()});
        shapes.push_back({prefix + "ffn_norm.weight", c.dim, 0});
        shapes.push_back({prefix + "ffn_gate.weight", c.hidden_dim, c.dim});
        shapes.push_back({prefix + "ffn_up.weight", c.hidden_dim, c.dim});
        shapes.push_back({prefix + "ffn_down.weight", c.dim, c.hidden_dim});
    }
    shapes.push_back({"output_norm.weight", c.dim, 0});
    if (!tied_output) shapes.push_back({"output.weight", c.vocab_size, c.dim});
    return shapes;
}

const GgufTensorInfo& checked_tensor(const GgufFile& file, const std::string& architecture, const WeightShape& weight) {
    const GgufTensorInfo& info = file.tensor(weight.name);
    const std::vector<uint64_t> expected =
        weight.cols == 0 ? std::vector<uint64_t>{static_cast<uint64_t>(weight.rows)}
                         : std::vector<uint64_t>{static_cast<uint64_t>(weight.cols), static_cast<uint64_t>(weight.rows)};
    if (info.shape != expected) {
        const auto text = [](const std::vector<uint64_t>& dims) {
            std::string out;
            for (const auto dim : dims) out += (out.empty() ? "" : ", ") + std::to_string(dim);
            return "[" + out + "]";
        };
        throw InputError(file.path() + ": tensor '" + weight.name + "': shape " + text(info.shape) + ", expected " +
                         text(expected) + " from the " + architecture + ".* metadata");
    }
    return info;
}

// A tensor the forward pass reads, whose weights must all be finite: a NaN weight would only
// surface later as NaN attention, far from its cause.
void check_finite(const GgufFile& file, const std::string& name, int64_t bad, float value) {
    if (bad >= 0)
        throw InputError(file.path() + ": tensor '" + name + "': element " + std::to_string(bad) + " is " +
                         (std::isnan(value) ? "NaN" : "infinite") + " (weights must be finite)");
}

// F32 as an Eigen matrix; any other type kept in the file's encoding (weight_matrix.h).
WeightMatrix load_matrix(const GgufFile& file, const std::string& architecture, const WeightShape& weight) {
    const GgufTensorInfo& info = checked_tensor(file, architecture, weight);
    WeightMatrix matrix;
    if (info.type_id == static_cast<uint32_t>(TensorType::F32)) {
        const std::vector<float> values = file.read_tensor(weight.name);
        matrix = WeightMatrix::from_floats(Eigen::Map<const RowMatrix>(values.data(), weight.rows, weight.cols));
    } else {
        const BlockFormat* format = find_block_format(info.type_id);
        if (format == nullptr) file.read_tensor_bytes(weight.name);  // throws, naming the tensor and type
        matrix = WeightMatrix::from_blocks(*format, weight.rows, weight.cols, file.read_tensor_bytes(weight.name));
    }
    if (const int64_t bad = matrix.first_non_finite(); bad >= 0) {
        std::vector<float> row(static_cast<size_t>(weight.cols));
        matrix.decode_row(static_cast<int>(bad / weight.cols), row.data());
        check_finite(file, weight.name, bad, row[static_cast<size_t>(bad % weight.cols)]);
    }
    return matrix;
}

Eigen::VectorXf load_vector(const GgufFile& file, const std::string& architecture, const WeightShape& weight) {
    checked_tensor(file, architecture, weight);
    const std::vector<float> values = file.read_tensor(weight.name);
    const Eigen::Index bad = first_non_finite(values.data(), static_cast<Eigen::Index>(values.size()));
    if (bad >= 0) check_finite(file, weight.name, bad, values[static_cast<size_t>(bad)]);
    return Eigen::Map<const Eigen::VectorXf>(values.data(), weight.rows);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// LlamaConfig

int64_t LlamaConfig::parameter_count(bool tied_output) const {
    const int64_t per_layer = int64_t{2} * dim                      // two RMSNorm gains
                              + int64_t{dim} * (q_dim() + 2 * kv_dim())  // Wq, Wk, Wv
                              + int64_t{q_dim()} * dim                // Wo
                              + int64_t{3} * dim * hidden_dim;        // gate, up, down
    const int64_t embedding = int64_t{vocab_size} * dim;
    return embedding + n_layers * per_layer + dim + (tied_output ? 0 : embedding);
}

int64_t LlamaConfig::matmul_flops_per_token() const {
    const int64_t per_layer = int64_t{dim} * (q_dim() + 2 * kv_dim()) + int64_t{q_dim()} * dim +
                              int64_t{3} * dim * hidden_dim;
    return 2 * (n_layers * per_layer + int64_t{vocab_size} * dim);
}

double LlamaConfig::chunk_flops(int start_pos, int tokens, bool logits) const {
    const double classifier = logits ? 0.0 : 2.0 * vocab_size * dim;
    const double n = tokens, first = start_pos + 1.0, last = static_cast<double>(start_pos) + tokens;
    const double positions_seen = n * (first + last) / 2;  // token i attends to start_pos + i + 1 positions
    return (static_cast<double>(matmul_flops_per_token()) - classifier) * n +
           2.0 * 2.0 * n_heads * head_dim * n_layers * positions_seen;
}

std::vector<double> LlamaConfig::rope_frequencies() const {
    std::vector<double> frequencies = rope_base_frequencies(rope_theta, head_dim);
    const double pi = std::acos(-1.0);
    for (double& frequency : frequencies) {
        switch (rope_scaling.kind) {
            case RopeScaling::Kind::none: break;
            case RopeScaling::Kind::linear: frequency /= rope_scaling.factor; break;
            case RopeScaling::Kind::llama3: {
                // Llama 3.1: wavelengths shorter than original_context / high_freq_factor keep their
                // frequency, those longer than original_context / low_freq_factor are divided by
                // factor, and those between blend the two linearly in original_context / wavelength.
                const RopeScaling& r = rope_scaling;
                const double wavelength = 2.0 * pi / frequency;
                const double context = r.original_context;
                if (wavelength > context / r.low_freq_factor) {
                    frequency /= r.factor;
                } else if (wavelength >= context / r.high_freq_factor) {
                    const double smooth =
                        (context / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
                    frequency = (1.0 - smooth) * frequency / r.factor + smooth * frequency;
                }
                break;
            }
        }
    }
    return frequencies;
}

LlamaConfig LlamaConfig::from_gguf(const GgufFile& file) {
    const std::string architecture = file.get_string("general.architecture");
    if (architecture != "llama" && architecture != "qwen2") {
        throw InputError(file.path() + ": metadata key 'general.architecture': unsupported architecture '" +
                         architecture + "' (supported: llama, qwen2)");
    }
    const auto fail = [&](const std::string& key, const std::string& why) {
        throw InputError(file.path() + ": metadata key '" + key + "': " + why);
    };
    const std::string p = architecture + ".";  // every model key's prefix
    LlamaConfig config;
    config.architecture = architecture;
    config.dim = required_int(file, p + "embedding_length");
    config.hidden_dim = required_int(file, p + "feed_forward_length");
    config.n_layers = required_int(file, p + "block_count");
    config.n_heads = required_int(file, p + "attention.head_count");
    config.n_kv_heads = checked_int(file, p + "attention.head_count_kv",
                                    file.get_int(p + "attention.head_count_kv", config.n_heads), 1);
    if (!file.find(p + "attention.key_length") && config.dim % config.n_heads != 0)
        fail(p + "embedding_length", std::to_string(config.dim) + " is not a multiple of head_count " +
                                         std::to_string(config.n_heads) + " (and key_length is absent)");
    config.head_dim = checked_int(file, p + "attention.key_length",
                                  file.get_int(p + "attention.key_length", config.dim / config.n_heads), 2);
    config.context_length = required_int(file, p + "context_length");
    config.rope_theta = positive_float(file, p + "rope.freq_base", file.get_double(p + "rope.freq_base", 10000.0));
    config.norm_eps = positive_float(file, p + "attention.layer_norm_rms_epsilon",
                                     file.get_double(p + "attention.layer_norm_rms_epsilon"));
    config.rope_pairing = architecture == "qwen2" ? RopePairing::halves : RopePairing::adjacent;
    if (file.find(p + "attention.sliding_window"))
        config.sliding_window = checked_int(file, p + "attention.sliding_window",
                                            file.get_int(p + "attention.sliding_window"), 0);

    if (config.n_kv_heads > config.n_heads || config.n_heads % config.n_kv_heads != 0)
        fail(p + "attention.head_count_kv", "head_count " + std::to_string(config.n_heads) +
                                                " is not a multiple of head_count_kv " +
                                                std::to_string(config.n_kv_heads));
    if (config.head_dim % 2 != 0) fail(p + "attention.key_length", "head size must be even for RoPE");
    // Q and K widths are ints everywhere (Eigen indices, hook spans): their products must fit.
    if (int64_t{config.n_heads} * config.head_dim > std::numeric_limits<int>::max())
        fail(p + "attention.key_length", "head size " + std::to_string(config.head_dim) + " x head_count " +
                                             std::to_string(config.n_heads) + " overflows an int");
    if (file.get_int(p + "attention.value_length", config.head_dim) != config.head_dim)
        fail(p + "attention.value_length", "differs from key_length (not supported)");
    if (file.get_int(p + "rope.dimension_count", config.head_dim) != config.head_dim)
        fail(p + "rope.dimension_count", "partial rotary embedding is not supported (must equal the head size)");

    // RoPE scaling: none, linear (every frequency divided by factor) or Llama 3.1's (the dialect
    // kvsim's writer once wrote; llama.cpp's converter writes a rope_freqs.weight tensor instead,
    // which LlamaModel::load reads). As in llama.cpp, a file without rope.scaling.type but with
    // a factor (rope.scaling.factor, or the older rope.scale_linear) is scaled linearly.
    const bool has_factor = file.find(p + "rope.scaling.factor") || file.find(p + "rope.scale_linear");
    const std::string scaling_type = file.find(p + "rope.scaling.type") ? file.get_string(p + "rope.scaling.type")
                                     : has_factor                       ? "linear"
                                                                        : "none";
    RopeScaling& scaling = config.rope_scaling;
    const auto scaling_number = [&](const std::string& key, double fallback) -> double {
        return positive_float(file, p + "rope.scaling." + key, file.get_double(p + "rope.scaling." + key, fallback));
    };
    if (scaling_type == "linear") {
        scaling.kind = RopeScaling::Kind::linear;
        const std::string factor_key = file.find(p + "rope.scaling.factor") ? p + "rope.scaling.factor"
                                       : file.find(p + "rope.scale_linear") ? p + "rope.scale_linear"
                                                                            : std::string();
        scaling.factor = factor_key.empty() ? 1.0 : positive_float(file, factor_key, file.get_double(factor_key));
    } else if (scaling_type == "llama3") {
        scaling.kind = RopeScaling::Kind::llama3;
        scaling.factor = scaling_number("factor", 8.0);
        scaling.low_freq_factor = scaling_number("low_freq_factor", 1.0);
        scaling.high_freq_factor = scaling_number("high_freq_factor", 4.0);
        scaling.original_context = required_int(file, p + "rope.scaling.original_context_length");
        if (!(scaling.high_freq_factor > scaling.low_freq_factor))
            fail(p + "rope.scaling.high_freq_factor", "must be greater than low_freq_factor");
    } else if (scaling_type != "none") {
        fail(p + "rope.scaling.type", "RoPE scaling '" + scaling_type + "' is not supported (supported: none, linear, llama3)");
    }

    // The vocabulary size is the embedding's row count (<arch>.vocab_size is optional in GGUF).
    const GgufTensorInfo& embedding = file.tensor("token_embd.weight");
    if (embedding.shape.size() != 2 || embedding.shape[1] > static_cast<uint64_t>(std::numeric_limits<int>::max()))
        throw InputError(file.path() + ": tensor 'token_embd.weight': expected a matrix [dim, vocab]");
    config.vocab_size = static_cast<int>(embedding.shape[1]);
    if (file.find(p + "vocab_size") && file.get_int(p + "vocab_size") != config.vocab_size)
        fail(p + "vocab_size", std::to_string(file.get_int(p + "vocab_size")) + " differs from the " +
                                   std::to_string(config.vocab_size) + " rows of tensor 'token_embd.weight'");

    // Q/K/V biases: Qwen2 has them; a llama file may too (llama.cpp reads them when present).
    const bool has_bias = file.find_tensor("blk.0.attn_q.bias") != nullptr;
    if (architecture == "qwen2" && !has_bias) file.tensor("blk.0.attn_q.bias");  // throws, naming it
    config.qkv_bias = has_bias;

    // Every weight the forward pass reads, with the shape the metadata implies: checked here, so
    // nothing later sizes a buffer by metadata that the tensors do not back. Each block has nine
    // tensors: a block_count the file's tensors cannot hold is refused before the list is built.
    if (int64_t{config.n_layers} > static_cast<int64_t>(file.tensors().size() / 9))
        fail(p + "block_count", std::to_string(config.n_layers) + " blocks need " +
                                    std::to_string(9 * int64_t{config.n_layers}) + " tensors, the file has " +
                                    std::to_string(file.tensors().size()));
    for (const WeightShape& weight : weight_shapes(config, file.find_tensor("output.weight") == nullptr))
        checked_tensor(file, architecture, weight);
    return config;
}

// ---------------------------------------------------------------------------------------------
// Loading

LlamaModel LlamaModel::load(const std::string& path, int max_context) { return load(GgufFile::open(path), max_context); }

LlamaModel LlamaModel::load(const GgufFile& file, int max_context) {
    const std::string& path = file.path();
    LlamaModel model;
    model.path_ = path;
    model.config_ = LlamaConfig::from_gguf(file);
    const LlamaConfig& c = model.config_;
    model.tied_output_ = file.find_tensor("output.weight") == nullptr;
    model.max_positions_ = (max_context > 0 && max_context < c.context_length) ? max_context : c.context_length;

    // The whole plan is checked before anything is allocated: the weights as held (F32 as floats,
    // other types as their file bytes), plus the largest tensor while it is being read (an F32
    // tensor's bytes and floats, another's bytes and a tile decoded to check it), then the KV
    // cache and RoPE tables for max_positions_.
    const std::vector<WeightShape> weights = weight_shapes(c, model.tied_output_);
    uint64_t weight_bytes = 0, reading_bytes = 0;
    for (const WeightShape& weight : weights) {
        const GgufTensorInfo& info = file.tensor(weight.name);
        const uint64_t floats = checked_mul(info.element_count(), sizeof(float), path + ": weights");
        const bool as_floats = weight.cols == 0 || info.type_id == static_cast<uint32_t>(TensorType::F32);
        weight_bytes = checked_add(weight_bytes, as_floats ? floats : info.byte_size(), path + ": weights");
        const uint64_t tile = static_cast<uint64_t>(WeightMatrix::tile_rows_for(weight.rows, weight.cols)) * static_cast<uint64_t>(weight.cols) * sizeof(float);
        reading_bytes = std::max(reading_bytes, checked_add(as_floats ? floats : tile, info.byte_size(), path + ": weights"));
    }
    check_memory(checked_add(weight_bytes, reading_bytes, path),
                 path + ": weights (" + std::to_string(weights.size()) + " tensors)");
    const std::string positions_what =
        path + (model.max_positions_ == c.context_length ? ": metadata key '" + c.architecture + ".context_length'" : "") +
        ": weights and a KV cache of " + std::to_string(model.max_positions_) + " positions";
    const uint64_t cache_floats = checked_mul(
        checked_mul(checked_mul(static_cast<uint64_t>(c.n_layers), static_cast<uint64_t>(c.n_kv_heads), positions_what),
                    static_cast<uint64_t>(model.max_positions_), positions_what),
        static_cast<uint64_t>(c.head_dim), positions_what);
    const uint64_t state_bytes = checked_mul(
        checked_add(checked_mul(cache_floats, 2, positions_what),
                    static_cast<uint64_t>(model.max_positions_) * static_cast<uint64_t>(c.head_dim), positions_what),
        sizeof(float), positions_what);  // K and V caches, cos and sin tables of head_dim / 2 each
    check_memory(checked_add(checked_add(weight_bytes, reading_bytes, positions_what), state_bytes, positions_what),
                 positions_what);

    size_t next_weight = 0;
    const auto matrix = [&] { return load_matrix(file, c.architecture, weights[next_weight++]); };
    const auto vector = [&] { return load_vector(file, c.architecture, weights[next_weight++]); };
    model.token_embedding_ = matrix();
    model.layers_.reserve(static_cast<size_t>(c.n_layers));
    for (int l = 0; l < c.n_layers; ++l) {  // in weight_shapes' order
        Layer layer;
        layer.attn_norm = vector();
        layer.wq = matrix();
        layer.wk = matrix();
        layer.wv = matrix();
        if (c.qkv_bias) {
            layer.bq = vector().transpose();
            layer.bk = vector().transpose();
            layer.bv = vector().transpose();
        }
        layer.wo = matrix();
        layer.ffn_norm = vector();
        layer.w_gate = matrix();
        layer.w_up = matrix();
        layer.w_down = matrix();
        model.layers_.push_back(std::move(layer));
    }
    model.output_norm_ = vector();
    if (!model.tied_output_) model.output_ = matrix();

    // Per-pair frequencies from the metadata, further divided by a rope_freqs.weight tensor when
    // the file has one (llama.cpp's converter writes Llama 3.1's scaling so). llama.cpp applies
    // such divisors together with a linear factor; they replace kvsim's older llama3 metadata,
    // which describes the same scaling.
    std::vector<double> frequencies = c.rope_frequencies();
    if (file.find_tensor("rope_freqs.weight")) {
        const WeightShape shape{"rope_freqs.weight", c.head_dim / 2, 0};
        const Eigen::VectorXf divisors = load_vector(file, c.architecture, shape);
        if (c.rope_scaling.kind == RopeScaling::Kind::llama3) {
            LlamaConfig unscaled = c;
            unscaled.rope_scaling = RopeScaling{};
            frequencies = unscaled.rope_frequencies();
        }
        for (int i = 0; i < c.head_dim / 2; ++i) {
            if (!(divisors[i] > 0.0f))
                throw InputError(path + ": tensor 'rope_freqs.weight': element " + std::to_string(i) + " is " +
                                 std::to_string(divisors[i]) + " (frequency divisors must be positive)");
            frequencies[static_cast<size_t>(i)] /= divisors[i];
        }
    }
    const int pairs = c.head_dim / 2;
    model.rope_cos_.resize(model.max_positions_, pairs);
    model.rope_sin_.resize(model.max_positions_, pairs);
    for (int pos = 0; pos < model.max_positions_; ++pos)
        rope_cos_sin(frequencies, pos, model.rope_cos_.row(pos).data(), model.rope_sin_.row(pos).data());
    model.rope_ = Rope{c.rope_pairing, frequencies};

    model.cached_positions_.assign(static_cast<size_t>(c.n_layers), 0);
    return model;
}

size_t LlamaModel::cache_floats() const {
    return static_cast<size_t>(config_.n_layers) * config_.n_kv_heads * max_positions_ * config_.head_dim;
}

uint64_t LlamaModel::weight_bytes() const {
    uint64_t bytes = token_embedding_.memory_bytes() + output_.memory_bytes();
    for (const Layer& layer : layers_)
        for (const WeightMatrix* w : {&layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.w_gate, &layer.w_up, &layer.w_down})
            bytes += w->memory_bytes();
    return bytes;
}

uint64_t LlamaModel::memory_bytes() const {
    uint64_t floats = static_cast<uint64_t>(output_norm_.size()) + rope_cos_.size() + rope_sin_.size() + 2 * cache_floats();
    for (const Layer& layer : layers_)
        floats += layer.attn_norm.size() + layer.ffn_norm.size() + layer.bq.size() + layer.bk.size() + layer.bv.size();
    return weight_bytes() + floats * sizeof(float);
}

NonFiniteError::NonFiniteError(const std::string& model_path, const std::string& quantity, int layer, int position)
    : InputError(model_path + ": " + (layer >= 0 ? "layer " + std::to_string(layer) + ", " : std::string()) +
                 "position " + std::to_string(position) + ": non-finite " + quantity + " (NaN or infinity)"),
      model_path_(model_path), quantity_(quantity), layer_(layer), position_(position) {}

InputError NonFiniteError::in_sequence(const std::string& sequence) const {
    return InputError(model_path_ + ": " + sequence + ", " +
                      (layer_ >= 0 ? "layer " + std::to_string(layer_) + ", " : std::string()) + "position " +
                      std::to_string(position_) + ": non-finite " + quantity_ + " (NaN or infinity)");
}

// ---------------------------------------------------------------------------------------------
// Forward pass

void LlamaModel::reset() {
    next_pos_ = 0;
    std::fill(cached_positions_.begin(), cached_positions_.end(), 0);
}

size_t LlamaModel::cache_offset(int layer, int kv_head, int pos) const {
    return ((static_cast<size_t>(layer) * config_.n_kv_heads + kv_head) * max_positions_ + pos) * config_.head_dim;
}

const float* LlamaModel::cached_key(int layer, int kv_head, int pos) const {
    if (layer < 0 || layer >= config_.n_layers || kv_head < 0 || kv_head >= config_.n_kv_heads || pos < 0 ||
        pos >= cached_positions_[static_cast<size_t>(layer)])
        throw std::out_of_range("LlamaModel::cached_key: no such layer, KV head or cached position");
    return key_cache_.data() + cache_offset(layer, kv_head, pos);
}

const float* LlamaModel::cached_value(int layer, int kv_head, int pos) const {
    if (layer < 0 || layer >= config_.n_layers || kv_head < 0 || kv_head >= config_.n_kv_heads || pos < 0 ||
        pos >= cached_positions_[static_cast<size_t>(layer)])
        throw std::out_of_range("LlamaModel::cached_value: no such layer, KV head or cached position");
    return value_cache_.data() + cache_offset(layer, kv_head, pos);
}

int LlamaModel::score_slots() const {
    return std::max(1, std::min(config_.n_heads, tbb::this_task_arena::max_concurrency()));
}

void LlamaModel::ensure_chunk_capacity(int n_tokens, int slots) {
    if (n_tokens <= chunk_capacity_ && static_cast<std::size_t>(slots) <= scores_.size()) return;
    n_tokens = std::max(n_tokens, chunk_capacity_);
    slots = std::max(slots, static_cast<int>(scores_.size()));
    const LlamaConfig& c = config_;
    // Activations per token, and per score slot and per KV head (masks are bytes, counted as
    // floats) a row over every cached position. The sum of ints cannot wrap; the products are checked.
    const std::string what = path_ + ": activations for a chunk of " + std::to_string(n_tokens) + " tokens";
    const uint64_t per_token = checked_add(
        2ull * c.dim + 3ull * c.q_dim() + 2ull * c.kv_dim() + 2ull * c.hidden_dim + static_cast<uint64_t>(c.vocab_size),
        checked_mul(static_cast<uint64_t>(slots) + c.n_kv_heads, static_cast<uint64_t>(max_positions_), what), what);
    check_memory(checked_add(memory_bytes(), checked_mul(checked_mul(per_token, sizeof(float), what),
                                                         static_cast<uint64_t>(n_tokens), what), what),
                 what);
    chunk_capacity_ = n_tokens;
    x_.resize(n_tokens, c.dim);
    xb_.resize(n_tokens, c.dim);
    q_.resize(n_tokens, c.q_dim());
    k_.resize(n_tokens, c.kv_dim());
    v_.resize(n_tokens, c.kv_dim());
    attn_out_.resize(n_tokens, c.q_dim());
    gate_.resize(n_tokens, c.hidden_dim);
    up_.resize(n_tokens, c.hidden_dim);
    scores_.resize(static_cast<std::size_t>(slots));
    for (auto& scores : scores_) scores.resize(n_tokens, max_positions_);
}

const float* LlamaModel::forward(int token, int pos, ForwardHooks* hooks) {
    return forward_batch(std::span<const int>(&token, 1), pos, hooks);
}

const float* LlamaModel::forward_batch(std::span<const int> tokens, int start_pos, ForwardHooks* hooks, bool logits) {
    const LlamaConfig& c = config_;
    const int n = static_cast<int>(tokens.size());
    if (n == 0) throw std::invalid_argument("LlamaModel::forward_batch: no tokens");
    if (start_pos < 0 || start_pos > next_pos_) {
        throw std::out_of_range("LlamaModel::forward: position " + std::to_string(start_pos) +
                                " skips uncached positions (next is " + std::to_string(next_pos_) + ")");
    }
    if (start_pos + n > max_positions_) {
        throw std::out_of_range("LlamaModel::forward: position " + std::to_string(start_pos + n - 1) +
                                " is past the KV cache (" + std::to_string(max_positions_) + " positions)");
    }
    for (const int token : tokens) {
        if (token < 0 || token >= c.vocab_size)
            throw std::out_of_range("LlamaModel::forward: token id " + std::to_string(token) + " is not in the vocabulary");
    }
    ensure_chunk_capacity(n, score_slots());
    if (key_cache_.empty()) {  // the plan was checked against the memory limit at load
        key_cache_.assign(cache_floats(), 0.0f);
        value_cache_.assign(cache_floats(), 0.0f);
    }
    next_pos_ = start_pos;  // a rewind drops the positions after start_pos
    for (int& cached : cached_positions_) cached = std::min(cached, start_pos);

    auto x = x_.topRows(n);    // residual stream, one row per token
    auto xb = xb_.topRows(n);  // normalised input / block output
    auto q = q_.topRows(n), k = k_.topRows(n), v = v_.topRows(n);
    auto gate = gate_.topRows(n), up = up_.topRows(n);
    for (int i = 0; i < n; ++i) token_embedding_.decode_row(tokens[i], x.row(i).data());

    for (int l = 0; l < c.n_layers; ++l) {
        const Layer& layer = layers_[l];

        // Attention block: x += Wo · attention(rope(Wq·xb), rope(Wk·xb), Wv·xb), xb = rmsnorm(x).
        rms_norm(x, layer.attn_norm, c.norm_eps, xb);
        linear(xb, layer.wq, q);
        linear(xb, layer.wk, k);
        linear(xb, layer.wv, v);
        if (c.qkv_bias) {
            q.rowwise() += layer.bq;
            k.rowwise() += layer.bk;
            v.rowwise() += layer.bv;
        }
        if (hooks)
            for (int i = 0; i < n; ++i) hooks->before_rope(l, start_pos + i, k.row(i).data());
        apply_rope(q, c.head_dim, start_pos, c.rope_pairing, rope_cos_, rope_sin_);
        apply_rope(k, c.head_dim, start_pos, c.rope_pairing, rope_cos_, rope_sin_);
        attention(l, n, start_pos, hooks);  // writes attn_out_
        linear_add(attn_out_.topRows(n), layer.wo, x);

        // SwiGLU feed-forward block: x += W_down · (silu(W_gate·xb) ⊙ W_up·xb), xb = rmsnorm(x).
        rms_norm(x, layer.ffn_norm, c.norm_eps, xb);
        linear(xb, layer.w_gate, gate);
        linear(xb, layer.w_up, up);
        gate.array() = gate.array() / (1.0f + (-gate.array()).exp()) * up.array();  // silu(g) = g·sigmoid(g)
        linear_add(gate, layer.w_down, x);
    }

    if (!logits) {
        next_pos_ = start_pos + n;
        return nullptr;
    }
    if (logits_.rows() < n) logits_.resize(n, c.vocab_size);  // only when asked for: 0.5 MB a token for 128K words
    rms_norm(x, output_norm_, c.norm_eps, xb);
    linear(xb, classifier(), logits_.topRows(n));
    for (int i = 0; i < n; ++i)
        if (first_non_finite(logits_.row(i).data(), c.vocab_size) >= 0)
            throw NonFiniteError(path_, "logits", -1, start_pos + i);
    next_pos_ = start_pos + n;
    return logits_.data();
}

// Grouped-query attention (Ainslie et al. 2023) for the chunk's rows of q_/k_/v_ at this layer:
// query head h reads KV head h / (n_heads / n_kv_heads). Stores K/V in the cache, writes attn_out_.
void LlamaModel::attention(int layer, int n, int start_pos, ForwardHooks* hooks) {
    const LlamaConfig& c = config_;
    const int head_dim = c.head_dim;
    const int heads_per_kv_head = c.n_heads / c.n_kv_heads;
    const int end = start_pos + n;  // the chunk's last token sees positions 0..end-1

    // Token by token, in position order: hooks see (and may change) q/k/v, the cache stores k/v,
    // then the hooks' masks for this position are copied (their pointers live only until the next call).
    has_mask_.assign(static_cast<size_t>(c.n_kv_heads) * n, 0);
    for (int i = 0; i < n; ++i) {
        const int pos = start_pos + i;
        // Before any hook sees them: a capture must never record a non-finite Q, K or V, and a
        // policy must never be shown attention computed from one.
        if (first_non_finite(q_.row(i).data(), c.q_dim()) >= 0) throw NonFiniteError(path_, "query", layer, pos);
        if (first_non_finite(k_.row(i).data(), c.kv_dim()) >= 0) throw NonFiniteError(path_, "key", layer, pos);
        if (first_non_finite(v_.row(i).data(), c.kv_dim()) >= 0) throw NonFiniteError(path_, "value", layer, pos);
        if (hooks) hooks->after_qkv(layer, pos, q_.row(i).data(), k_.row(i).data(), v_.row(i).data());
        if (hooks && hooks->holds_the_cache()) continue;
        for (int g = 0; g < c.n_kv_heads; ++g) {
            std::memcpy(key_cache_.data() + cache_offset(layer, g, pos), k_.row(i).data() + g * head_dim,
                        sizeof(float) * head_dim);
            std::memcpy(value_cache_.data() + cache_offset(layer, g, pos), v_.row(i).data() + g * head_dim,
                        sizeof(float) * head_dim);
        }
        cached_positions_[static_cast<size_t>(layer)] = pos + 1;
        if (!hooks) continue;
        for (int g = 0; g < c.n_kv_heads; ++g) {
            if (const uint8_t* mask = hooks->attention_mask(layer, g, pos)) {
                // Sized when a hook first masks: a capture, which masks nothing, holds none.
                masks_.resize(std::max(masks_.size(), static_cast<size_t>(c.n_kv_heads) * n * end));
                const size_t row = static_cast<size_t>(g) * n + i;
                std::memcpy(masks_.data() + row * end, mask, static_cast<size_t>(pos) + 1);
                has_mask_[row] = 1;
            }
        }
    }

    if (hooks && hooks->holds_the_cache()) {  // the hook attends over its own cache
        const int group_width = heads_per_kv_head * head_dim;
        for (int i = 0; i < n; ++i)
            for (int g = 0; g < c.n_kv_heads; ++g)
                if (!hooks->attention_output(layer, g, start_pos + i, q_.row(i).data() + g * group_width,
                                             attn_out_.row(i).data() + g * group_width))
                    throw std::logic_error("a hook that holds the cache gave no attention output");
        return;
    }
    // Per query head: scores = q·Kᵀ/√head_dim, causal and hook masks, softmax, output = weights·V.
    // Finite q and k can still overflow to an infinite score; each head notes its first such row
    // (threads write only their own head's entry) and the error is thrown after the loop.
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    first_bad_row_.assign(static_cast<size_t>(c.n_heads), n);
    const auto attend_head = [&](int h, RowMatrix& scores_buffer) {
        const int g = h / heads_per_kv_head;
        const Eigen::Map<const RowMatrix> keys(key_cache_.data() + cache_offset(layer, g, 0), end, head_dim);
        const Eigen::Map<const RowMatrix> values(value_cache_.data() + cache_offset(layer, g, 0), end, head_dim);
        auto scores = scores_buffer.topLeftCorner(n, end);
        scores.noalias() = (q_.block(0, h * head_dim, n, head_dim) * keys.transpose()) * scale;
        for (int i = 0; i < n; ++i) {
            const int visible = start_pos + i + 1;  // causal: positions 0..pos
            const size_t mask_row = static_cast<size_t>(g) * n + i;
            const uint8_t* kept = has_mask_[mask_row] ? masks_.data() + mask_row * end : nullptr;
            if (!softmax_in_place(scores.row(i).head(visible), kept) && first_bad_row_[h] == n) first_bad_row_[h] = i;
            scores.row(i).tail(end - visible).setZero();
        }
        attn_out_.block(0, h * head_dim, n, head_dim).noalias() = scores * values;
    };
    // Scores are scratch held per slot, not per head (32 heads' scores of a 1B model were 134 MB
    // at 4,096 positions; two slots hold 8 MB): each slot's task takes the next head not yet
    // taken until none is left, so a thread the machine holds back leaves its heads to the
    // others. Every slot's buffer has the same shape, so which slot a head lands in changes no value.
    const int slots = static_cast<int>(scores_.size());
    const int64_t macs = int64_t{2} * n * end * head_dim * c.n_heads;
    if (macs < kParallelMinMacs || slots == 1) {
        for (int h = 0; h < c.n_heads; ++h) attend_head(h, scores_[0]);
    } else {
        std::atomic<int> next_head{0};
        // One task per slot (simple_partitioner), so that every slot can run beside the others.
        tbb::parallel_for(
            tbb::blocked_range<int>(0, slots, 1),
            [&](const tbb::blocked_range<int>& range) {
                for (int s = range.begin(); s < range.end(); ++s)
                    for (int h = next_head++; h < c.n_heads; h = next_head++) attend_head(h, scores_[static_cast<size_t>(s)]);
            },
            tbb::simple_partitioner());
    }
    if (const int bad = *std::min_element(first_bad_row_.begin(), first_bad_row_.end()); bad < n)
        throw NonFiniteError(path_, "attention scores", layer, start_pos + bad);
    if (!hooks) return;
    const int group_width = heads_per_kv_head * head_dim;
    for (int i = 0; i < n; ++i)
        for (int g = 0; g < c.n_kv_heads; ++g)
            hooks->attention_output(layer, g, start_pos + i, q_.row(i).data() + g * group_width,
                                    attn_out_.row(i).data() + g * group_width);
}

// ---------------------------------------------------------------------------------------------
// Teacher-forced likelihood

double LlamaModel::sequence_nll(const std::vector<int>& tokens, ForwardHooks* hooks, int chunk_size,
                                std::vector<double>* token_nll) {
    if (chunk_size < 1) throw std::invalid_argument("LlamaModel::sequence_nll: chunk_size must be at least 1");
    for (const int token : tokens) {
        if (token < 0 || token >= config_.vocab_size)
            throw std::out_of_range("LlamaModel::sequence_nll: token id " + std::to_string(token) +
                                    " is not in the vocabulary");
    }
    reset();
    if (token_nll) token_nll->clear();
    double total_nll = 0.0;
    const int predicted = static_cast<int>(tokens.size()) - 1;  // the last token is never input
    for (int start = 0; start < predicted; start += chunk_size) {
        const int n = std::min(chunk_size, predicted - start);
        const float* logits = forward_batch(std::span<const int>(tokens).subspan(start, n), start, hooks);
        for (int i = 0; i < n; ++i) {
            const float* row = logits + static_cast<size_t>(i) * config_.vocab_size;
            // -log softmax(row)[target] = logsumexp(row) - row[target], in double.
            const double max_logit = *std::max_element(row, row + config_.vocab_size);
            double sum = 0.0;
            for (int t = 0; t < config_.vocab_size; ++t) sum += std::exp(static_cast<double>(row[t]) - max_logit);
            const double nll = max_logit + std::log(sum) - row[tokens[start + i + 1]];
            total_nll += nll;
            if (token_nll) token_nll->push_back(nll);
        }
    }
    return total_nll;
}

}  // namespace kvsim::model
