#include "model/gguf_writer.h"

#include "model/ggml_blocks.h"
#include "model/ggml_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace kvsim::model {

namespace {

// Appends little-endian values to a byte buffer (the host is little-endian: gguf.cpp asserts it).
class ByteSink {
  public:
    template <class T>
    void put(const T& value) {
        put_bytes(&value, sizeof value);
    }
    void put_bytes(const void* bytes, size_t count) {
        const size_t old_size = data_.size();
        data_.resize(old_size + count);
        std::memcpy(data_.data() + old_size, bytes, count);
    }
    void put_string(const std::string& text) {
        put(static_cast<uint64_t>(text.size()));
        put_bytes(text.data(), text.size());
    }
    void pad_to(uint64_t alignment) { data_.resize((data_.size() + alignment - 1) / alignment * alignment, 0); }
    void put_value(const GgufValue& value) {
        std::visit(
            [this](const auto& v) {
                using T = std::decay_t<decltype(v)>;
                if constexpr (std::is_same_v<T, std::string>) {
                    put_string(v);
                } else if constexpr (std::is_same_v<T, GgufArray>) {
                    put(static_cast<uint32_t>(v.element_type));
                    put(static_cast<uint64_t>(v.items.size()));
                    for (const auto& item : v.items) {
                        if (item.type() != v.element_type) throw std::invalid_argument("GgufWriter: mixed-type array");
                        put_value(item);
                    }
                } else if constexpr (std::is_same_v<T, bool>) {
                    put(static_cast<uint8_t>(v ? 1 : 0));
                } else {
                    put(v);
                }
            },
            value.data);
    }
    std::vector<uint8_t>& data() { return data_; }

  private:
    std::vector<uint8_t> data_;
};

// Deterministic, fast, platform-independent pseudo-random numbers (SplitMix64, Steele et al. 2014),
// so a seed gives the same synthetic model everywhere.
class SplitMix64 {
  public:
    explicit SplitMix64(uint64_t seed) : state_(seed) {}
    uint64_t next() {
        uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    // Uniform in [-1, 1).
    float symmetric() { return static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }

  private:
    uint64_t state_;
};

}  // namespace

void GgufWriter::set(const std::string& key, GgufValue value) {
    const auto existing = std::find_if(metadata_.begin(), metadata_.end(), [&](const auto& kv) { return kv.first == key; });
    if (existing != metadata_.end()) {
        existing->second = std::move(value);
    } else {
        metadata_.emplace_back(key, std::move(value));
    }
}

bool GgufWriter::remove(const std::string& key) {
    return std::erase_if(metadata_, [&](const auto& kv) { return kv.first == key; }) > 0;
}

bool GgufWriter::remove_tensor(const std::string& name) {
    return std::erase_if(tensors_, [&](const PendingTensor& tensor) { return tensor.name == name; }) > 0;
}

void GgufWriter::set_string_array(const std::string& key, const std::vector<std::string>& values) {
    GgufArray array{GgufValueType::STRING, {}};
    for (const auto& text : values) array.items.push_back(GgufValue{text});
    set(key, GgufValue{std::move(array)});
}

void GgufWriter::set_float32_array(const std::string& key, const std::vector<float>& values) {
    GgufArray array{GgufValueType::FLOAT32, {}};
    for (const float value : values) array.items.push_back(GgufValue{value});
    set(key, GgufValue{std::move(array)});
}

void GgufWriter::set_int32_array(const std::string& key, const std::vector<int32_t>& values) {
    GgufArray array{GgufValueType::INT32, {}};
    for (const int32_t value : values) array.items.push_back(GgufValue{value});
    set(key, GgufValue{std::move(array)});
}

void GgufWriter::add_tensor(const std::string& name, std::vector<uint64_t> shape, std::span<const float> values,
                            TensorType type) {
    uint64_t elements = 1;
    for (const auto dim : shape) elements *= dim;
    if (elements != values.size()) throw std::invalid_argument("GgufWriter::add_tensor: '" + name + "': shape does not match data");
    std::vector<uint8_t> bytes;
    switch (type) {
        case TensorType::F32:
            bytes.resize(values.size() * 4);
            std::memcpy(bytes.data(), values.data(), bytes.size());
            break;
        case TensorType::F16:
        case TensorType::BF16:
            bytes.resize(values.size() * 2);
            for (size_t i = 0; i < values.size(); ++i) {
                const uint16_t half = type == TensorType::F16 ? float_to_half(values[i]) : float_to_bf16(values[i]);
                std::memcpy(bytes.data() + 2 * i, &half, 2);
            }
            break;
        default: {
            const BlockFormat* format = find_block_format(static_cast<uint32_t>(type));
            if (format == nullptr) throw std::invalid_argument("GgufWriter::add_tensor: '" + name + "': unknown type");
            if (shape.empty() || shape[0] % static_cast<uint64_t>(format->block_elements) != 0)
                throw std::invalid_argument("GgufWriter::add_tensor: '" + name + "': " + format->name +
                                            " rows must be multiples of " + std::to_string(format->block_elements));
            bytes = quantize_blocks(type, values);
            break;
        }
    }
    add_raw_tensor(name, std::move(shape), static_cast<uint32_t>(type), std::move(bytes));
}

void GgufWriter::add_raw_tensor(const std::string& name, std::vector<uint64_t> shape, uint32_t type_id,
                                std::vector<uint8_t> bytes) {
    tensors_.push_back({name, std::move(shape), type_id, std::move(bytes)});
}

void GgufWriter::write(const std::string& path) const {
    uint64_t alignment = 32;
    for (const auto& [key, value] : metadata_) {
        if (key == "general.alignment") alignment = static_cast<uint64_t>(value.as_int());
    }

    ByteSink header;
    header.put_bytes("GGUF", 4);
    header.put(version_);
    header.put(static_cast<uint64_t>(tensors_.size()));
    header.put(static_cast<uint64_t>(metadata_.size()));
    for (const auto& [key, value] : metadata_) {
        header.put_string(key);
        header.put(static_cast<uint32_t>(value.type()));
        header.put_value(value);
    }
    uint64_t offset = 0;  // within the data section
    for (const auto& tensor : tensors_) {
        header.put_string(tensor.name);
        header.put(static_cast<uint32_t>(tensor.shape.size()));
        for (const auto dim : tensor.shape) header.put(dim);
        header.put(tensor.type_id);
        header.put(offset);
        offset = (offset + tensor.bytes.size() + alignment - 1) / alignment * alignment;
    }
    header.pad_to(alignment);

    const std::string temporary = path + ".tmp";
    {
        std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
        if (!out) throw std::runtime_error("GgufWriter: cannot create " + temporary);
        out.write(reinterpret_cast<const char*>(header.data().data()), static_cast<std::streamsize>(header.data().size()));
        static const char zeros[256] = {};
        for (const auto& tensor : tensors_) {
            out.write(reinterpret_cast<const char*>(tensor.bytes.data()), static_cast<std::streamsize>(tensor.bytes.size()));
            const uint64_t padding = (alignment - tensor.bytes.size() % alignment) % alignment;
            for (uint64_t left = padding; left > 0; left -= std::min<uint64_t>(left, sizeof zeros))
                out.write(zeros, static_cast<std::streamsize>(std::min<uint64_t>(left, sizeof zeros)));
        }
        out.flush();
        if (!out) throw std::runtime_error("GgufWriter: write to " + temporary + " failed");
    }
    std::filesystem::rename(temporary, path);
}

void write_random_llama(const std::string& path, const LlamaConfig& config, uint64_t seed, TensorType weight_type,
                        bool tied_output) {
    random_llama_writer(config, seed, weight_type, tied_output).write(path);
}

namespace {

// general.file_type as llama.cpp's converter and llama-quantize name a file whose weight
// matrices are all of one type (LlamaFileType in gguf-py; a k-quant file of one type is its "_S"
// variant). Q8_K has no file type: ggml has no Q8_K weight kernels (it is only the activations'
// format in k-quant dot products), so llama.cpp could not run such a file.
uint32_t llama_file_type(TensorType weight_type) {
    switch (weight_type) {
        case TensorType::F32: return 0;   // ALL_F32
        case TensorType::F16: return 1;   // MOSTLY_F16
        case TensorType::Q4_0: return 2;  // MOSTLY_Q4_0
        case TensorType::Q4_1: return 3;  // MOSTLY_Q4_1
        case TensorType::Q8_0: return 7;  // MOSTLY_Q8_0
        case TensorType::Q5_0: return 8;  // MOSTLY_Q5_0
        case TensorType::Q5_1: return 9;  // MOSTLY_Q5_1
        case TensorType::Q2_K: return 10;  // MOSTLY_Q2_K
        case TensorType::Q3_K: return 11;  // MOSTLY_Q3_K_S
        case TensorType::Q4_K: return 14;  // MOSTLY_Q4_K_S
        case TensorType::Q5_K: return 16;  // MOSTLY_Q5_K_S
        case TensorType::Q6_K: return 18;  // MOSTLY_Q6_K
        case TensorType::BF16: return 32;  // MOSTLY_BF16
        case TensorType::Q8_K: break;
    }
    throw std::invalid_argument(std::string("random_llama_writer: no llama.cpp file type holds ") +
                                tensor_type_name(static_cast<uint32_t>(weight_type)) + " weights");
}

// What llama.cpp (the converter and its loader) can hold of a config; anything else would be a
// file in a dialect only kvsim reads.
void check_convertible(const LlamaConfig& c) {
    const auto refuse = [&](const std::string& why) {
        throw std::invalid_argument("random_llama_writer: " + c.architecture + ": " + why);
    };
    if (c.architecture != "llama" && c.architecture != "qwen2") refuse("not an architecture kvsim reads");
    if (c.vocab_size < 3) refuse("a vocabulary needs at least <unk>, <s> and </s>");
    if (c.architecture == "qwen2") {
        if (!c.qkv_bias) refuse("Qwen2 has biases on Q, K and V (llama.cpp requires them)");
        if (c.q_dim() != c.dim) refuse("llama.cpp's qwen2 needs head_count x head size = embedding_length");
        if (c.rope_scaling.kind != RopeScaling::Kind::none)
            refuse("the converter writes Qwen2's RoPE scaling only as YaRN, which kvsim does not read");
    }
}

}  // namespace

std::vector<float> llama3_rope_freq_divisors(const LlamaConfig& config) {
    // The converter's LlamaModel.generate_extra_tensors, in its arithmetic: float32 tensors, the
    // Python numbers they meet rounded to float32, and `number / tensor` computed by torch as
    // reciprocal(tensor) * number. The divisors equal the converter's to the bit where the C
    // library's powf agrees with torch's float32 pow (which can differ by an ulp).
    const RopeScaling& r = config.rope_scaling;
    const float base = config.rope_theta, factor = static_cast<float>(r.factor);
    const float old_context = static_cast<float>(r.original_context);
    const float low = static_cast<float>(r.low_freq_factor), blend_width = static_cast<float>(r.high_freq_factor - r.low_freq_factor);
    const float low_wavelength = static_cast<float>(r.original_context / r.low_freq_factor);
    const float high_wavelength = static_cast<float>(r.original_context / r.high_freq_factor);
    const float two_pi = static_cast<float>(2.0 * 3.14159265358979323846);
    const auto number_over = [](float number, float tensor) { return (1.0f / tensor) * number; };
    std::vector<float> divisors;
    for (int i = 0; i < config.head_dim; i += 2) {
        const float frequency = number_over(1.0f, std::pow(base, static_cast<float>(i) / static_cast<float>(config.head_dim)));
        const float wavelength = number_over(two_pi, frequency);
        if (wavelength < high_wavelength) {
            divisors.push_back(1.0f);
        } else if (wavelength > low_wavelength) {
            divisors.push_back(factor);
        } else {
            // Stored before the subtraction, so that no compiler fuses it into a multiply-add
            // (-march=native allows that), which would round differently from torch.
            const volatile float scaled_inverse = number_over(old_context, wavelength);
            const float smooth = (scaled_inverse - low) / blend_width;
            divisors.push_back(number_over(1.0f, (1.0f - smooth) / factor + smooth));
        }
    }
    return divisors;
}

GgufWriter random_llama_writer(const LlamaConfig& config, uint64_t seed, TensorType weight_type, bool tied_output) {
    const LlamaConfig& c = config;
    check_convertible(c);
    GgufWriter writer;
    const std::string p = c.architecture + ".";  // the model keys' prefix
    writer.set_string("general.architecture", c.architecture);
    writer.set_string("general.name", "kvsim synthetic " + c.architecture + " (random weights)");
    // The keys convert_hf_to_gguf.py writes for every architecture (Model.set_gguf_parameters)...
    writer.set_uint32(p + "block_count", static_cast<uint32_t>(c.n_layers));
    writer.set_uint32(p + "context_length", static_cast<uint32_t>(c.context_length));
    writer.set_uint32(p + "embedding_length", static_cast<uint32_t>(c.dim));
    writer.set_uint32(p + "feed_forward_length", static_cast<uint32_t>(c.hidden_dim));
    writer.set_uint32(p + "attention.head_count", static_cast<uint32_t>(c.n_heads));
    writer.set_uint32(p + "attention.head_count_kv", static_cast<uint32_t>(c.n_kv_heads));
    writer.set_float32(p + "rope.freq_base", c.rope_theta);
    writer.set_float32(p + "attention.layer_norm_rms_epsilon", c.norm_eps);
    if (c.head_dim * c.n_heads != c.dim) {  // the converter writes them when config.json has head_dim
        writer.set_uint32(p + "attention.key_length", static_cast<uint32_t>(c.head_dim));
        writer.set_uint32(p + "attention.value_length", static_cast<uint32_t>(c.head_dim));
    }
    writer.set_uint32("general.file_type", llama_file_type(weight_type));
    // ... and those its LlamaModel adds. Llama 3.1's scaling is no key but the rope_freqs.weight
    // tensor below; only linear scaling has keys. (Qwen2's converter adds nothing here.)
    if (c.architecture == "llama") {
        writer.set_uint32(p + "vocab_size", static_cast<uint32_t>(c.vocab_size));
        writer.set_uint32(p + "rope.dimension_count", static_cast<uint32_t>(c.head_dim));
        if (c.rope_scaling.kind == RopeScaling::Kind::linear) {
            writer.set_string(p + "rope.scaling.type", "linear");
            writer.set_float32(p + "rope.scaling.factor", static_cast<float>(c.rope_scaling.factor));
        }
    }
    // Not from the converter, which never writes a sliding window for llama or qwen2 (and
    // llama.cpp reads none for them): a file made by other tools may record one.
    if (c.sliding_window > 0) writer.set_uint32(p + "attention.sliding_window", static_cast<uint32_t>(c.sliding_window));

    // A toy SentencePiece vocabulary, written as the converter writes one (a tokenizer is what
    // llama.cpp needs to load a file at all): specials, the 256 byte-fallback pieces when the
    // vocabulary has room for them all, printable ASCII, '▁' + letter, letter pairs, then filler
    // pieces; scores fall with the id, as in real vocabularies.
    {
        std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
        std::vector<int32_t> types = {2, 3, 3};
        for (int byte = 0; byte < 256 && c.vocab_size >= 259; ++byte) {
            char name[8];
            std::snprintf(name, sizeof name, "<0x%02X>", byte);
            pieces.push_back(name);
            types.push_back(6);
        }
        const size_t first_piece = pieces.size();
        std::vector<std::string> candidates = {"\xE2\x96\x81"};
        for (char ch = '!'; ch <= '~'; ++ch) candidates.emplace_back(1, ch);
        for (char ch = 'a'; ch <= 'z'; ++ch) candidates.push_back("\xE2\x96\x81" + std::string(1, ch));
        for (char a = 'a'; a <= 'z'; ++a)
            for (char b = 'a'; b <= 'z'; ++b) candidates.push_back(std::string{a, b});
        for (size_t i = 0; pieces.size() < static_cast<size_t>(c.vocab_size); ++i) {
            pieces.push_back(i < candidates.size() ? candidates[i] : "<filler" + std::to_string(i) + ">");
            types.push_back(i < candidates.size() ? 1 : 5);
        }
        std::vector<float> scores(pieces.size(), 0.0f);
        for (size_t i = first_piece; i < scores.size(); ++i) scores[i] = -static_cast<float>(i - first_piece);
        writer.set_string("tokenizer.ggml.model", "llama");
        writer.set_string("tokenizer.ggml.pre", "default");
        writer.set_string_array("tokenizer.ggml.tokens", pieces);
        writer.set_float32_array("tokenizer.ggml.scores", scores);
        writer.set_int32_array("tokenizer.ggml.token_type", types);
        writer.set_uint32("tokenizer.ggml.unknown_token_id", 0);
        writer.set_uint32("tokenizer.ggml.bos_token_id", 1);
        writer.set_uint32("tokenizer.ggml.eos_token_id", 2);
    }
    writer.set_uint32("general.quantization_version", 2);  // GGML_QUANT_VERSION, as the converter writes

    // Llama 3.1's RoPE scaling as the converter stores it: the frequency divisors as an F32
    // tensor, generated before (so written before) the checkpoint's tensors.
    if (c.rope_scaling.kind == RopeScaling::Kind::llama3) {
        const std::vector<float> divisors = llama3_rope_freq_divisors(c);
        writer.add_tensor("rope_freqs.weight", {divisors.size()}, divisors, TensorType::F32);
    }

    SplitMix64 random(seed);
    // Uniform on [-a, a] has variance a²/3: a = sqrt(3 / fan_in) gives variance 1 / fan_in.
    const auto random_matrix = [&](const std::string& name, int rows, int cols, bool unit_variance = false) {
        std::vector<float> values(static_cast<size_t>(rows) * cols);
        const float bound = std::sqrt(3.0f / (unit_variance ? 1.0f : static_cast<float>(cols)));
        for (auto& value : values) value = bound * random.symmetric();
        writer.add_tensor(name, {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)}, values, weight_type);
    };
    const std::vector<float> ones(static_cast<size_t>(c.dim), 1.0f);
    const auto norm = [&](const std::string& name) {
        writer.add_tensor(name, {static_cast<uint64_t>(c.dim)}, ones, TensorType::F32);  // as llama.cpp keeps norms
    };

    random_matrix("token_embd.weight", c.vocab_size, c.dim, /*unit_variance=*/true);
    for (int l = 0; l < c.n_layers; ++l) {
        const std::string prefix = "blk." + std::to_string(l) + ".";
        norm(prefix + "attn_norm.weight");
        random_matrix(prefix + "attn_q.weight", c.q_dim(), c.dim);
        random_matrix(prefix + "attn_k.weight", c.kv_dim(), c.dim);
        random_matrix(prefix + "attn_v.weight", c.kv_dim(), c.dim);
        if (c.qkv_bias) {  // vectors, F32 as llama.cpp keeps them; unit variance so they matter
            for (const auto& [name, size] : {std::pair{"attn_q.bias", c.q_dim()}, std::pair{"attn_k.bias", c.kv_dim()},
                                             std::pair{"attn_v.bias", c.kv_dim()}}) {
                std::vector<float> bias(static_cast<size_t>(size));
                for (auto& value : bias) value = random.symmetric();
                writer.add_tensor(prefix + name, {static_cast<uint64_t>(size)}, bias, TensorType::F32);
            }
        }
        random_matrix(prefix + "attn_output.weight", c.dim, c.q_dim());
        norm(prefix + "ffn_norm.weight");
        random_matrix(prefix + "ffn_gate.weight", c.hidden_dim, c.dim);
        random_matrix(prefix + "ffn_up.weight", c.hidden_dim, c.dim);
        random_matrix(prefix + "ffn_down.weight", c.dim, c.hidden_dim);
    }
    norm("output_norm.weight");
    if (!tied_output) random_matrix("output.weight", c.vocab_size, c.dim);
    return writer;
}

}  // namespace kvsim::model
