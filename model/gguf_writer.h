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

// A writer holding a GGUF of config.architecture (keys under its prefix; Q/K/V biases when
// config.qkv_bias, the sliding window and RoPE scaling metadata when set) with the shapes of
// `config` and deterministic pseudo-random
// weights (uniform, variance 1/fan_in, so activations stay O(1)), RMSNorm weights 1, and a toy
// SentencePiece vocabulary (<unk>, <s>, </s>, 256 byte tokens, then ASCII pieces) when
// vocab_size >= 259. Without tied_output an output.weight tensor is added. Tests edit the writer
// before writing it to make broken variants.
GgufWriter random_llama_writer(const LlamaConfig& config, uint64_t seed, TensorType weight_type = TensorType::F32,
                               bool tied_output = false);

// random_llama_writer(...).write(path).
void write_random_llama(const std::string& path, const LlamaConfig& config, uint64_t seed,
                        TensorType weight_type = TensorType::F32, bool tied_output = false);

}  // namespace kvsim::model
