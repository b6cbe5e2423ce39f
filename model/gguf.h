// GGUF reader (format versions 2 and 3), as written by llama.cpp's converters.
//
// Layout (all little-endian; spec: ggml/docs/gguf.md):
//   magic "GGUF", u32 version, u64 tensor_count, u64 kv_count,
//   kv_count x (string key, u32 value_type, value),
//   tensor_count x (string name, u32 n_dims, u64 ne[n_dims], u32 tensor_type, u64 offset),
//   padding to `general.alignment` (default 32), then the tensor data section.
// Strings are u64 length + bytes (no terminator). ne[0] is the innermost dimension (row length);
// a tensor's offset is relative to the aligned start of the data section.
//
// Every problem with a file throws kvsim::InputError with one line naming the file and the key
// or tensor concerned.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace kvsim::model {

// Metadata value type ids. They equal the alternative index of GgufValue::data.
enum class GgufValueType : uint32_t {
    UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
    BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
const char* value_type_name(GgufValueType type);

// ggml tensor type ids this reader can turn into float (block layouts: ggml_blocks.h).
enum class TensorType : uint32_t {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, BF16 = 30,
};
// ggml's name for any tensor type id ("Q4_K" for 12), or "unknown".
const char* tensor_type_name(uint32_t type_id);
bool is_supported_tensor_type(uint32_t type_id);

struct GgufValue;
struct GgufArray {
    GgufValueType element_type = GgufValueType::UINT8;
    std::vector<GgufValue> items;  // arrays may nest (element_type ARRAY)
    friend bool operator==(const GgufArray&, const GgufArray&) = default;
};

struct GgufValue {
    // Alternative i holds GGUF value type i, so data.index() is the type id.
    std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool, std::string,
                 GgufArray, uint64_t, int64_t, double>
        data;

    GgufValueType type() const { return static_cast<GgufValueType>(data.index()); }
    bool is_integer() const;
    bool is_float() const { return type() == GgufValueType::FLOAT32 || type() == GgufValueType::FLOAT64; }
    // Checked conversions; they throw std::invalid_argument on a type mismatch (GgufFile's getters
    // turn that into an InputError naming the file and key).
    int64_t as_int() const;     // any integer type (uint64 above INT64_MAX throws)
    double as_double() const;   // float32/float64 or any integer
    const std::string& as_string() const;
    const GgufArray& as_array() const;

    friend bool operator==(const GgufValue&, const GgufValue&) = default;  // same type and value
};

struct GgufTensorInfo {
    std::string name;
    std::vector<uint64_t> shape;  // ne: shape[0] is the row length
    uint32_t type_id = 0;
    uint64_t offset = 0;          // relative to the data section

    uint64_t element_count() const;
    // Bytes the data occupies (blocks x block bytes), or 0 when the type is not one this reader
    // supports. A row length that is not a whole number of blocks is an InputError.
    uint64_t byte_size() const;
};

// Half-precision conversions (IEEE 754 binary16 and bfloat16), bit exact; float_to_* round to
// nearest even. Needed for F16/BF16 tensors and the block formats' fp16 scales.
float half_to_float(uint16_t bits);
uint16_t float_to_half(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float value);


class GgufFile {
  public:
    // Reads and checks the header, metadata and tensor table; tensor data is read on demand.
    static GgufFile open(const std::string& path);

    const std::string& path() const { return path_; }
    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }
    uint64_t data_offset() const { return data_offset_; }  // absolute start of the data section
    uint64_t file_size() const { return file_size_; }

    const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
    const GgufValue* find(const std::string& key) const;  // nullptr when absent
    const GgufValue& at(const std::string& key) const;     // throws InputError when absent

    // Typed getters; they throw InputError naming the file and key when the key is missing or
    // has the wrong type. The two-argument forms return `fallback` when the key is absent.
    int64_t get_int(const std::string& key) const;
    int64_t get_int(const std::string& key, int64_t fallback) const;
    double get_double(const std::string& key) const;
    double get_double(const std::string& key, double fallback) const;
    std::string get_string(const std::string& key) const;
    std::vector<std::string> get_string_array(const std::string& key) const;
    std::vector<double> get_number_array(const std::string& key) const;

    const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
    const GgufTensorInfo* find_tensor(const std::string& name) const;  // nullptr when absent
    const GgufTensorInfo& tensor(const std::string& name) const;       // throws InputError when absent

    // The tensor's elements as float (F16/BF16 and the block formats dequantised), in file order
    // (shape[0] fastest). Throws InputError for a missing tensor or an unsupported type.
    std::vector<float> read_tensor(const std::string& name) const;
    // The tensor's data as the file stores it (byte_size() bytes), for a type this reader supports.
    std::vector<uint8_t> read_tensor_bytes(const std::string& name) const;

    // One line "<path>: <what>" for InputError messages.
    std::string error_prefix() const { return path_ + ": "; }

  private:
    std::string path_;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32;
    uint64_t data_offset_ = 0;
    uint64_t file_size_ = 0;
    std::map<std::string, GgufValue> metadata_;
    std::vector<GgufTensorInfo> tensors_;
    std::map<std::string, size_t> tensor_index_;
};

}  // namespace kvsim::model
