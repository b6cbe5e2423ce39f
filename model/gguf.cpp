#include "model/gguf.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>

#include "base/errors.h"
#include "base/input_file.h"
#include "base/size_limits.h"
#include "model/ggml_blocks.h"

namespace kvsim::model {

static_assert(std::endian::native == std::endian::little, "GGUF is little-endian; this reader copies bytes as is");

namespace {

constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};
constexpr uint32_t kMaxDims = 4;         // GGML_MAX_DIMS
constexpr int kMaxArrayNesting = 8;      // deeper nesting is a corrupt file, not a real model
// GGUF stores the alignment as a u32; llama.cpp's files use 32. A larger one is a corrupt file.
constexpr int64_t kMaxAlignment = int64_t{1} << 31;

// What a parsed header costs in memory beyond the bytes it was read from: every metadata value
// (array elements included) is a GgufValue, and a map node or tensor info holds more besides.
// Counting this bounds the header's memory by the memory limit, not by 40x the file size.
constexpr uint64_t kValueBytes = sizeof(GgufValue);
constexpr uint64_t kNodeBytes = sizeof(GgufValue) + sizeof(std::string) + 64;

// Reads the header with bounds checks against the file size, so a truncated or corrupt file
// gives an InputError that says what was being read, never a huge allocation or garbage.
class HeaderReader {
  public:
    HeaderReader(const std::string& path, std::ifstream& in, uint64_t file_size)
        : path_(path), in_(in), file_size_(file_size) {}

    // What is being read now, for the truncation message ("metadata key 'llama.block_count'").
    void set_context(std::string context) { context_ = std::move(context); }
    uint64_t position() const { return position_; }
    uint64_t remaining() const { return file_size_ - position_; }

    void read_bytes(void* destination, uint64_t count) {
        if (count > remaining()) fail_truncated();
        in_.read(static_cast<char*>(destination), static_cast<std::streamsize>(count));
        if (!in_) throw InputError(path_ + ": read error in " + context_);
        position_ += count;
    }

    template <class T>
    T read() {
        T value;
        read_bytes(&value, sizeof value);
        return value;
    }

    // Adds `bytes` to what the parsed header will hold in memory and checks the total against the
    // memory limit, naming what is being read.
    void account(uint64_t bytes) {
        held_bytes_ = checked_add(held_bytes_, bytes, path_ + ": " + context_);
        check_memory(held_bytes_, path_ + ": " + context_);
    }

    std::string read_string() {
        const auto length = read<uint64_t>();
        if (length > remaining()) fail_truncated();
        account(length);
        std::string text(length, '\0');
        read_bytes(text.data(), length);
        return text;
    }

    GgufValue read_value(GgufValueType type, int depth = 0) {
        GgufValue value;
        switch (type) {
            case GgufValueType::UINT8: value.data = read<uint8_t>(); break;
            case GgufValueType::INT8: value.data = read<int8_t>(); break;
            case GgufValueType::UINT16: value.data = read<uint16_t>(); break;
            case GgufValueType::INT16: value.data = read<int16_t>(); break;
            case GgufValueType::UINT32: value.data = read<uint32_t>(); break;
            case GgufValueType::INT32: value.data = read<int32_t>(); break;
            case GgufValueType::FLOAT32: value.data = read<float>(); break;
            case GgufValueType::BOOL: {
                const auto byte = read<uint8_t>();
                if (byte > 1) fail("bool value " + std::to_string(byte) + " is neither 0 nor 1");
                value.data = byte == 1;
                break;
            }
            case GgufValueType::STRING: value.data = read_string(); break;
            case GgufValueType::ARRAY: value.data = read_array(depth); break;
            case GgufValueType::UINT64: value.data = read<uint64_t>(); break;
            case GgufValueType::INT64: value.data = read<int64_t>(); break;
            case GgufValueType::FLOAT64: value.data = read<double>(); break;
            default: fail("unknown value type " + std::to_string(static_cast<uint32_t>(type)));
        }
        return value;
    }

    [[noreturn]] void fail(const std::string& what) const { throw InputError(path_ + ": " + context_ + ": " + what); }

    [[noreturn]] void fail_truncated() const {
        throw InputError(path_ + ": truncated file: it ends inside " + context_ + " (" + std::to_string(file_size_) +
                         " bytes)");
    }

  private:
    GgufArray read_array(int depth) {
        if (depth >= kMaxArrayNesting) fail("arrays nested more than " + std::to_string(kMaxArrayNesting) + " deep");
        GgufArray array;
        array.element_type = static_cast<GgufValueType>(read<uint32_t>());
        const auto count = read<uint64_t>();
        if (static_cast<uint32_t>(array.element_type) > static_cast<uint32_t>(GgufValueType::FLOAT64))
            fail("unknown array element type " + std::to_string(static_cast<uint32_t>(array.element_type)));
        // Every element takes at least one byte, so a larger count cannot fit in what is left.
        if (count > remaining()) fail_truncated();
        account(count * kValueBytes);  // count <= the file size, so no overflow
        array.items.reserve(count);
        for (uint64_t i = 0; i < count; ++i) array.items.push_back(read_value(array.element_type, depth + 1));
        return array;
    }

    const std::string& path_;
    std::ifstream& in_;
    uint64_t file_size_;
    uint64_t position_ = 0;
    uint64_t held_bytes_ = 0;
    std::string context_ = "header";
};

std::string quoted(const std::string& text) { return "'" + text + "'"; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Type names

const char* value_type_name(GgufValueType type) {
    static const char* const names[] = {"uint8", "int8",   "uint16", "int16",  "uint32", "int32", "float32",
                                        "bool",  "string", "array",  "uint64", "int64",  "float64"};
    const auto id = static_cast<uint32_t>(type);
    return id < std::size(names) ? names[id] : "unknown";
}

const char* tensor_type_name(uint32_t type_id) {
    // ggml's type ids (ggml.h, enum ggml_type); the gaps are ids ggml has retired.
    switch (type_id) {
        case 0: return "F32";
        case 1: return "F16";
        case 2: return "Q4_0";
        case 3: return "Q4_1";
        case 6: return "Q5_0";
        case 7: return "Q5_1";
        case 8: return "Q8_0";
        case 9: return "Q8_1";
        case 10: return "Q2_K";
        case 11: return "Q3_K";
        case 12: return "Q4_K";
        case 13: return "Q5_K";
        case 14: return "Q6_K";
        case 15: return "Q8_K";
        case 16: return "IQ2_XXS";
        case 17: return "IQ2_XS";
        case 18: return "IQ3_XXS";
        case 19: return "IQ1_S";
        case 20: return "IQ4_NL";
        case 21: return "IQ3_S";
        case 22: return "IQ2_S";
        case 23: return "IQ4_XS";
        case 24: return "I8";
        case 25: return "I16";
        case 26: return "I32";
        case 27: return "I64";
        case 28: return "F64";
        case 29: return "IQ1_M";
        case 30: return "BF16";
        case 34: return "TQ1_0";
        case 35: return "TQ2_0";
        case 39: return "MXFP4";
        default: return "unknown";
    }
}

bool is_supported_tensor_type(uint32_t type_id) { return find_block_format(type_id) != nullptr; }

// ---------------------------------------------------------------------------------------------
// GgufValue

bool GgufValue::is_integer() const {
    switch (type()) {
        case GgufValueType::UINT8:
        case GgufValueType::INT8:
        case GgufValueType::UINT16:
        case GgufValueType::INT16:
        case GgufValueType::UINT32:
        case GgufValueType::INT32:
        case GgufValueType::UINT64:
        case GgufValueType::INT64: return true;
        default: return false;
    }
}

int64_t GgufValue::as_int() const {
    if (!is_integer()) throw std::invalid_argument(std::string("expected an integer, found ") + value_type_name(type()));
    if (const auto* u64 = std::get_if<uint64_t>(&data)) {
        if (*u64 > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
            throw std::invalid_argument("uint64 value " + std::to_string(*u64) + " is too large");
        return static_cast<int64_t>(*u64);
    }
    return std::visit(
        [](const auto& v) -> int64_t {
            using T = std::decay_t<decltype(v)>;
            if constexpr (std::is_integral_v<T>) return static_cast<int64_t>(v);
            else return 0;  // unreachable: checked above
        },
        data);
}

double GgufValue::as_double() const {
    if (const auto* f32 = std::get_if<float>(&data)) return *f32;
    if (const auto* f64 = std::get_if<double>(&data)) return *f64;
    if (is_integer()) {
        if (const auto* u64 = std::get_if<uint64_t>(&data)) return static_cast<double>(*u64);
        return static_cast<double>(as_int());
    }
    throw std::invalid_argument(std::string("expected a number, found ") + value_type_name(type()));
}

const std::string& GgufValue::as_string() const {
    if (const auto* text = std::get_if<std::string>(&data)) return *text;
    throw std::invalid_argument(std::string("expected a string, found ") + value_type_name(type()));
}

const GgufArray& GgufValue::as_array() const {
    if (const auto* array = std::get_if<GgufArray>(&data)) return *array;
    throw std::invalid_argument(std::string("expected an array, found ") + value_type_name(type()));
}

// ---------------------------------------------------------------------------------------------
// Tensor infos

uint64_t GgufTensorInfo::element_count() const {
    // GgufFile::open bounds every shape it reads (2^40 elements); a hand-made info still may not wrap.
    uint64_t count = 1;
    for (const auto dim : shape)
        if (__builtin_mul_overflow(count, dim, &count))
            throw InputError("tensor " + quoted(name) + ": element count overflows 64 bits");
    return count;
}

uint64_t GgufTensorInfo::byte_size() const {
    const BlockFormat* format = find_block_format(type_id);
    if (format == nullptr) return 0;
    if (shape.empty() || shape[0] % static_cast<uint64_t>(format->block_elements) != 0)
        throw InputError("tensor " + quoted(name) + ": " + format->name + " row length " +
                         std::to_string(shape.empty() ? 0 : shape[0]) + " is not a multiple of " +
                         std::to_string(format->block_elements) + " (its block size)");
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(element_count() / static_cast<uint64_t>(format->block_elements),
                               static_cast<uint64_t>(format->block_bytes), &bytes))
        throw InputError("tensor " + quoted(name) + ": byte size overflows 64 bits");
    return bytes;
}

namespace {
// "2 Q4_K blocks of 144 bytes (256 weights each)" or "64 F32 weights of 4 bytes": how a tensor's
// byte size follows from its shape, for the messages about data that does not fit.
std::string size_description(const GgufTensorInfo& info) {
    const BlockFormat& format = *find_block_format(info.type_id);
    const uint64_t blocks = info.element_count() / static_cast<uint64_t>(format.block_elements);
    if (format.block_elements == 1)
        return std::to_string(blocks) + " " + format.name + " weights of " + std::to_string(format.block_bytes) + " bytes";
    return std::to_string(blocks) + " " + format.name + " blocks of " + std::to_string(format.block_bytes) + " bytes (" +
           std::to_string(format.block_elements) + " weights each)";
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Half precision

float half_to_float(uint16_t bits) {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
    const uint32_t exponent = (bits >> 10) & 0x1f;
    const uint32_t mantissa = bits & 0x3ff;
    if (exponent == 0) {
        // Zero or subnormal: mantissa * 2^-24, exact in float.
        const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
    return std::bit_cast<float>(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

uint16_t float_to_half(float value) {
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
    const int exponent = static_cast<int>((bits >> 23) & 0xff);
    uint32_t mantissa = bits & 0x7fffff;
    if (exponent == 255) return sign | 0x7c00 | (mantissa ? 0x200 | (mantissa >> 13) : 0);  // inf / quiet NaN
    const int half_exponent = exponent - 127 + 15;
    if (half_exponent >= 31) return sign | 0x7c00;  // overflow
    if (half_exponent <= 0) {
        if (half_exponent < -10) return sign;  // below half the smallest subnormal: rounds to zero
        mantissa |= 0x800000;                  // make the implicit bit explicit
        const int shift = 14 - half_exponent;
        uint32_t half_mantissa = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1);
        const uint32_t halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (half_mantissa & 1))) ++half_mantissa;
        return sign | static_cast<uint16_t>(half_mantissa);  // a carry turns it into the smallest normal
    }
    uint32_t half = (static_cast<uint32_t>(half_exponent) << 10) | (mantissa >> 13);
    const uint32_t rest = mantissa & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // a carry may round up to inf: correct
    return sign | static_cast<uint16_t>(half);
}

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bf16(float value) {
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
    return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// ---------------------------------------------------------------------------------------------
// GgufFile

GgufFile GgufFile::open(const std::string& path) {
    require_regular_file(path);  // a FIFO would block the open below forever, a directory fail oddly
    std::ifstream in(path, std::ios::binary);
    if (!in) throw InputError(path + ": cannot open file");
    in.seekg(0, std::ios::end);
    const auto end = in.tellg();
    if (end < 0) throw InputError(path + ": cannot determine file size");
    in.seekg(0);

    GgufFile file;
    file.path_ = path;
    file.file_size_ = static_cast<uint64_t>(end);
    HeaderReader reader(file.path_, in, file.file_size_);

    reader.set_context("header");
    char magic[4];
    reader.read_bytes(magic, 4);
    if (std::memcmp(magic, kMagic, 4) != 0) {
        // A text file's first bytes may hold a newline or a control byte: shown as \xNN, so the
        // error stays one line.
        std::string shown;
        for (const char c : magic) {
            const auto byte = static_cast<unsigned char>(c);
            if (byte >= 0x20 && byte < 0x7f && c != '\\') {
                shown += c;
            } else {
                char escaped[5];
                std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
                shown += escaped;
            }
        }
        throw InputError(path + ": not a GGUF file (bad magic '" + shown + "', expected 'GGUF')");
    }
    file.version_ = reader.read<uint32_t>();
    if (file.version_ != 2 && file.version_ != 3) {
        throw InputError(path + ": unsupported GGUF version " + std::to_string(file.version_) + " (only 2 and 3)");
    }
    const auto tensor_count = reader.read<uint64_t>();
    const auto kv_count = reader.read<uint64_t>();

    for (uint64_t i = 0; i < kv_count; ++i) {
        reader.set_context("metadata key #" + std::to_string(i));
        std::string key = reader.read_string();
        reader.set_context("metadata key " + quoted(key));
        reader.account(kNodeBytes + key.size());
        const auto type = static_cast<GgufValueType>(reader.read<uint32_t>());
        GgufValue value = reader.read_value(type);
        if (!file.metadata_.emplace(key, std::move(value)).second) reader.fail("duplicate key");
    }

    if (const GgufValue* alignment = file.find("general.alignment")) {
        try {
            const auto value = alignment->as_int();
            if (value <= 0 || value > kMaxAlignment || (value & (value - 1)) != 0)
                throw std::invalid_argument(std::to_string(value) + " is not a power of two from 1 to " +
                                            std::to_string(kMaxAlignment));
            file.alignment_ = static_cast<uint64_t>(value);
        } catch (const std::invalid_argument& error) {
            throw InputError(path + ": key 'general.alignment': " + error.what());
        }
    }

    file.tensors_.reserve(tensor_count < 65536 ? tensor_count : 65536);
    for (uint64_t i = 0; i < tensor_count; ++i) {
        reader.set_context("tensor info #" + std::to_string(i));
        GgufTensorInfo info;
        info.name = reader.read_string();
        reader.set_context("tensor info " + quoted(info.name));
        reader.account(kNodeBytes + info.name.size() + kMaxDims * sizeof(uint64_t));
        const auto n_dims = reader.read<uint32_t>();
        if (n_dims == 0 || n_dims > kMaxDims) reader.fail(std::to_string(n_dims) + " dimensions (expected 1 to 4)");
        uint64_t elements = 1;
        for (uint32_t d = 0; d < n_dims; ++d) {
            const auto dim = reader.read<uint64_t>();
            if (dim == 0 || dim > (uint64_t{1} << 40) / elements) reader.fail("implausible shape");
            elements *= dim;
            info.shape.push_back(dim);
        }
        info.type_id = reader.read<uint32_t>();
        info.offset = reader.read<uint64_t>();
        if (!file.tensor_index_.emplace(info.name, file.tensors_.size()).second) reader.fail("duplicate tensor name");
        file.tensors_.push_back(std::move(info));
    }

    // The data section starts at the next multiple of the alignment (at most 2^31 past the
    // header, so this cannot wrap); every tensor must lie inside the file, checked without sums
    // that could wrap (an offset near 2^64 must not come back round to the header).
    file.data_offset_ = (reader.position() + file.alignment_ - 1) / file.alignment_ * file.alignment_;
    for (const auto& info : file.tensors_) {
        const std::string where = path + ": tensor " + quoted(info.name) + ": ";
        if (info.offset % file.alignment_ != 0) {
            throw InputError(where + "data offset " + std::to_string(info.offset) + " is not a multiple of the alignment " +
                             std::to_string(file.alignment_));
        }
        // A row is a whole number of blocks; otherwise the shape cannot say how many bytes it takes.
        const BlockFormat* format = find_block_format(info.type_id);
        if (format != nullptr && info.shape[0] % static_cast<uint64_t>(format->block_elements) != 0) {
            throw InputError(where + format->name + " row length " + std::to_string(info.shape[0]) +
                             " is not a multiple of " + std::to_string(format->block_elements) + " (its block size)");
        }
        if (file.data_offset_ > file.file_size_ || info.offset > file.file_size_ - file.data_offset_) {
            throw InputError(where + "data offset " + std::to_string(info.offset) + " is past the end of the file (" +
                             std::to_string(file.file_size_) + " bytes, data section at " +
                             std::to_string(file.data_offset_) + "): truncated or corrupt file");
        }
        // Types this reader cannot size are only checked for their start; reading them fails anyway.
        const uint64_t begin = file.data_offset_ + info.offset;
        const uint64_t size = info.byte_size();
        if (size > file.file_size_ - begin) {
            throw InputError(where + "data (bytes " + std::to_string(begin) + ".." +
                             std::to_string(checked_add(begin, size, where + "data end")) + ", " +
                             size_description(info) + ") extends past the end of the file (" +
                             std::to_string(file.file_size_) + " bytes): truncated file");
        }
    }
    // Tensors do not share bytes: one whose shape claims more blocks than lie before the next
    // tensor's data was cut short (or the table is inconsistent), even when the file is long enough.
    std::vector<const GgufTensorInfo*> by_offset;
    for (const auto& info : file.tensors_)
        if (info.byte_size() > 0) by_offset.push_back(&info);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
    for (size_t i = 0; i + 1 < by_offset.size(); ++i) {
        const GgufTensorInfo& info = *by_offset[i];
        const GgufTensorInfo& next = *by_offset[i + 1];
        if (info.byte_size() > next.offset - info.offset) {
            throw InputError(path + ": tensor " + quoted(info.name) + ": data (offset " + std::to_string(info.offset) +
                             ", " + size_description(info) + ") runs into the data of tensor " + quoted(next.name) +
                             " (offset " + std::to_string(next.offset) + "): truncated or inconsistent tensor");
        }
    }
    return file;
}

const GgufValue* GgufFile::find(const std::string& key) const {
    const auto it = metadata_.find(key);
    return it == metadata_.end() ? nullptr : &it->second;
}

const GgufValue& GgufFile::at(const std::string& key) const {
    if (const GgufValue* value = find(key)) return *value;
    throw InputError(path_ + ": missing metadata key " + quoted(key));
}

namespace {
// Runs a GgufValue conversion and turns its std::invalid_argument into an InputError naming the key.
template <class Convert>
auto convert_value(const GgufFile& file, const std::string& key, Convert&& convert) {
    const GgufValue& value = file.at(key);
    try {
        return convert(value);
    } catch (const std::invalid_argument& error) {
        throw InputError(file.path() + ": metadata key " + quoted(key) + ": " + error.what());
    }
}
}  // namespace

int64_t GgufFile::get_int(const std::string& key) const {
    return convert_value(*this, key, [](const GgufValue& v) { return v.as_int(); });
}

int64_t GgufFile::get_int(const std::string& key, int64_t fallback) const {
    return find(key) ? get_int(key) : fallback;
}

double GgufFile::get_double(const std::string& key) const {
    return convert_value(*this, key, [](const GgufValue& v) { return v.as_double(); });
}

double GgufFile::get_double(const std::string& key, double fallback) const {
    return find(key) ? get_double(key) : fallback;
}

std::string GgufFile::get_string(const std::string& key) const {
    return convert_value(*this, key, [](const GgufValue& v) { return v.as_string(); });
}

std::vector<std::string> GgufFile::get_string_array(const std::string& key) const {
    return convert_value(*this, key, [](const GgufValue& v) {
        std::vector<std::string> strings;
        for (const auto& item : v.as_array().items) strings.push_back(item.as_string());
        return strings;
    });
}

std::vector<double> GgufFile::get_number_array(const std::string& key) const {
    return convert_value(*this, key, [](const GgufValue& v) {
        std::vector<double> numbers;
        for (const auto& item : v.as_array().items) numbers.push_back(item.as_double());
        return numbers;
    });
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
    const auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensorInfo& GgufFile::tensor(const std::string& name) const {
    if (const GgufTensorInfo* info = find_tensor(name)) return *info;
    throw InputError(path_ + ": missing tensor " + quoted(name));
}

std::vector<uint8_t> GgufFile::read_tensor_bytes(const std::string& name) const {
    const GgufTensorInfo& info = tensor(name);
    if (find_block_format(info.type_id) == nullptr) {
        throw InputError(path_ + ": tensor " + quoted(name) + ": unsupported type " + tensor_type_name(info.type_id) +
                         " (" + std::to_string(info.type_id) + "); supported: " + supported_type_names());
    }
    check_memory(info.byte_size(), path_ + ": tensor " + quoted(name));
    std::vector<uint8_t> bytes(info.byte_size());
    std::ifstream in(path_, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(data_offset_ + info.offset));
    in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!in) throw InputError(path_ + ": tensor " + quoted(name) + ": cannot read its data (file changed or truncated?)");
    return bytes;
}

std::vector<float> GgufFile::read_tensor(const std::string& name) const {
    const GgufTensorInfo& info = tensor(name);
    const BlockFormat* format = find_block_format(info.type_id);
    if (format == nullptr) {
        throw InputError(path_ + ": tensor " + quoted(name) + ": unsupported type " + tensor_type_name(info.type_id) +
                         " (" + std::to_string(info.type_id) + "); supported: " + supported_type_names());
    }
    check_memory(checked_add(info.byte_size(), checked_mul(info.element_count(), sizeof(float), path_), path_),
                 path_ + ": tensor " + quoted(name));
    const std::vector<uint8_t> bytes = read_tensor_bytes(name);
    std::vector<float> values(info.element_count());
    format->dequantize(bytes.data(), values.size() / static_cast<size_t>(format->block_elements), values.data());
    return values;
}

}  // namespace kvsim::model
