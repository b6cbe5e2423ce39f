// A small GGUF writer (version 3 by default, 2 on request): metadata of any type plus F32, F16,
// BF16 and every block format kvsim reads (quantised by ggml_quantize.h), or raw bytes of any
// tensor type id. Used by tests and benchmarks to make synthetic Llama-shaped models and
// deliberately broken files.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "model/gguf.h"
#include "model/llama.h"

namespace kvsim::model {

class GgufWriter {
  public:
    explicit GgufWriter(uint32_t version = 3) : version_(version) {}

    // Adds or replaces a metadata key; keys are written in the order first added.
    void set(const std::string& key, GgufValue value);
    void set_uint32(const std::string& key, uint32_t value) { set(key, GgufValue{value}); }
    void set_float32(const std::string& key, float value) { set(key, GgufValue{value}); }
    void set_string(const std::string& key, std::string value) { set(key, GgufValue{std::move(value)}); }
    void set_string_array(const std::string& key, const std::vector<std::string>& values);
    void set_float32_array(const std::string& key, const std::vector<float>& values);
    void set_int32_array(const std::string& key, const std::vector<int32_t>& values);
    bool remove(const std::string& key);  // false when absent

    // shape is ne order (shape[0] = row length, a multiple of a block format's block size).
    // values are converted to `type`.
    void add_tensor(const std::string& name, std::vector<uint64_t> shape, std::span<const float> values,
                    TensorType type = TensorType::F32);
    // Data written exactly as given, under any type id (for hand-made blocks and unsupported types).
    void add_raw_tensor(const std::string& name, std::vector<uint64_t> shape, uint32_t type_id,
                        std::vector<uint8_t> bytes);
    bool remove_tensor(const std::string& name);  // false when absent

    // Writes to "<path>.tmp" and renames it to path once complete, so a reader never sees half a file.
    void write(const std::string& path) const;

  private:
    struct PendingTensor {
        std::string name;
        std::vector<uint64_t> shape;
        uint32_t type_id;
        std::vector<uint8_t> bytes;
    };
    uint32_t version_;
    std::vector<std::pair<std::string, GgufValue>> metadata_;
    std::vector<PendingTensor> tensors_;
};

// A writer holding a GGUF of config.architecture in the dialect llama.cpp's converter
// (convert_hf_to_gguf.py) writes, so that llama.cpp loads it: the keys the converter writes for
// that architecture, Llama 3.1's RoPE scaling as a rope_freqs.weight tensor of frequency divisors
// (linear scaling as rope.scaling.type/factor), Q/K/V biases when config.qkv_bias (F32, as every
// vector), the classifier omitted when tied_output (the converter writes output.weight only when
// the checkpoint has one), plus the sliding window key when config.sliding_window is set (the
// converter never writes one; llama.cpp ignores it). Shapes from `config`; deterministic
// pseudo-random weights (uniform, variance 1/fan_in, so activations stay O(1)), RMSNorm weights
// 1, and a toy SentencePiece vocabulary (<unk>, <s>, </s>, the 256 byte tokens when vocab_size >=
// 259, then ASCII pieces). Throws std::invalid_argument for what llama.cpp could not load: qwen2
// without biases, with head_count x head size != embedding_length or with RoPE scaling, a
// vocabulary under 3 tokens, Q8_K weights. Tests edit the writer before writing it to make
// broken variants.
GgufWriter random_llama_writer(const LlamaConfig& config, uint64_t seed, TensorType weight_type = TensorType::F32,
                               bool tied_output = false);

// The rope_freqs.weight values convert_hf_to_gguf.py writes for Llama 3.1's RoPE scaling
// (config.rope_scaling, kind llama3): per RoPE pair, the divisor of its frequency, computed in
// float32 as the converter computes it.
std::vector<float> llama3_rope_freq_divisors(const LlamaConfig& config);

// random_llama_writer(...).write(path).
void write_random_llama(const std::string& path, const LlamaConfig& config, uint64_t seed,
                        TensorType weight_type = TensorType::F32, bool tied_output = false);

}  // namespace kvsim::model
