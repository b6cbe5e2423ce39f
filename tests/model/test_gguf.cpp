// GGUF reader and writer: half-precision conversions, metadata of every type, tensors of every
// supported type (hand-made blocks for Q8_0 and BF16; the other block formats are in
// tests/unit/test_gguf_quants.cpp), and every kind of broken file.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numbers>
#include <random>

#include <sys/stat.h>

#include "base/errors.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "tests/model/test_util.h"

using namespace kvsim::model;
using namespace kvsim::model::testing;

namespace {

std::vector<uint8_t> read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes, size_t count) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(count));
}

// The InputError message GgufFile::open (and reading every tensor) gives for path; fails the
// test when there is none.
std::string open_error(const std::string& path) {
    try {
        const GgufFile file = GgufFile::open(path);
        for (const auto& info : file.tensors()) file.read_tensor(info.name);
    } catch (const kvsim::InputError& error) {
        return error.what();
    }
    FAIL("no InputError for " << path);
    return "";
}

GgufValue array_of(GgufValueType type, std::vector<GgufValue> items) { return GgufValue{GgufArray{type, std::move(items)}}; }

// One key per value type, arrays of every element type, nested string arrays, empty array/string.
std::vector<std::pair<std::string, GgufValue>> every_value_type() {
    using T = GgufValueType;
    return {
        {"test.uint8", GgufValue{uint8_t{200}}},
        {"test.int8", GgufValue{int8_t{-100}}},
        {"test.uint16", GgufValue{uint16_t{60000}}},
        {"test.int16", GgufValue{int16_t{-30000}}},
        {"test.uint32", GgufValue{uint32_t{4000000000u}}},
        {"test.int32", GgufValue{int32_t{-2000000000}}},
        {"test.float32", GgufValue{1.5f}},
        {"test.bool_true", GgufValue{true}},
        {"test.bool_false", GgufValue{false}},
        {"test.string", GgufValue{std::string("h\xC3\xA9llo \xE2\x96\x81 w\xC3\xB6rld")}},
        {"test.empty_string", GgufValue{std::string()}},
        {"test.uint64", GgufValue{uint64_t{(uint64_t{1} << 63) + 5}}},
        {"test.int64", GgufValue{int64_t{-(int64_t{1} << 62)}}},
        {"test.float64", GgufValue{std::numbers::pi}},
        {"test.array.uint8", array_of(T::UINT8, {GgufValue{uint8_t{1}}, GgufValue{uint8_t{255}}})},
        {"test.array.int8", array_of(T::INT8, {GgufValue{int8_t{-1}}, GgufValue{int8_t{127}}})},
        {"test.array.uint16", array_of(T::UINT16, {GgufValue{uint16_t{7}}})},
        {"test.array.int16", array_of(T::INT16, {GgufValue{int16_t{-7}}})},
        {"test.array.uint32", array_of(T::UINT32, {GgufValue{uint32_t{1}}, GgufValue{uint32_t{2}}, GgufValue{uint32_t{3}}})},
        {"test.array.int32", array_of(T::INT32, {GgufValue{int32_t{-5}}})},
        {"test.array.float32", array_of(T::FLOAT32, {GgufValue{0.25f}, GgufValue{-1e30f}})},
        {"test.array.bool", array_of(T::BOOL, {GgufValue{true}, GgufValue{false}})},
        {"test.array.string", array_of(T::STRING, {GgufValue{std::string("a")}, GgufValue{std::string("\xE2\x96\x81" "b")}})},
        {"test.array.uint64", array_of(T::UINT64, {GgufValue{uint64_t{1} << 40}})},
        {"test.array.int64", array_of(T::INT64, {GgufValue{int64_t{-3}}})},
        {"test.array.float64", array_of(T::FLOAT64, {GgufValue{-2.5}})},
        {"test.array.empty", array_of(T::INT32, {})},
        {"test.array.nested_strings",
         array_of(T::ARRAY, {array_of(T::STRING, {GgufValue{std::string("x")}, GgufValue{std::string("yz")}}),
                             array_of(T::STRING, {}),
                             array_of(T::STRING, {GgufValue{std::string("w")}})})},
    };
}

// A small, valid file: a few keys and one tensor per supported type.
GgufWriter small_writer() {
    GgufWriter writer;
    writer.set_string("general.architecture", "llama");
    writer.set_string("general.name", "small");
    writer.set_uint32("llama.block_count", 3);
    const std::vector<float> values(64, 0.5f);
    writer.add_tensor("t.f32", {32, 2}, values, TensorType::F32);
    writer.add_tensor("t.f16", {64}, values, TensorType::F16);
    writer.add_tensor("t.q8_0", {32, 2}, values, TensorType::Q8_0);
    return writer;
}

size_t find_bytes(const std::vector<uint8_t>& haystack, const std::string& needle) {
    const auto it = std::search(haystack.begin(), haystack.end(), needle.begin(), needle.end());
    REQUIRE(it != haystack.end());
    return static_cast<size_t>(it - haystack.begin());
}

}  // namespace

TEST_CASE("half precision: F16 conversions are exact and round to nearest even") {
    CHECK(half_to_float(0x3C00) == 1.0f);
    CHECK(half_to_float(0xC000) == -2.0f);
    CHECK(half_to_float(0x7BFF) == 65504.0f);
    CHECK(half_to_float(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
    CHECK(half_to_float(0x0400) == std::ldexp(1.0f, -14));  // smallest normal
    CHECK(std::isinf(half_to_float(0x7C00)));
    CHECK(std::isnan(half_to_float(0x7E00)));
    CHECK(std::signbit(half_to_float(0x8000)));

    CHECK(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);      // tie: to even (down)
    CHECK(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);  // tie: to even (up)
    CHECK(float_to_half(65519.0f) == 0x7BFF);
    CHECK(float_to_half(65520.0f) == 0x7C00);  // rounds to infinity
    CHECK(float_to_half(std::ldexp(1.0f, -25)) == 0x0000);                    // tie with 0: to even
    CHECK(float_to_half(std::ldexp(1.0f, -25) * 1.0001f) == 0x0001);          // just above: up
    CHECK(float_to_half(std::ldexp(1023.5f, -24)) == 0x0400);                 // subnormal carries into normal
    CHECK(float_to_half(-std::numeric_limits<float>::infinity()) == 0xFC00);
    CHECK((float_to_half(std::numeric_limits<float>::quiet_NaN()) & 0x7FFF) > 0x7C00);

    // Every half survives a round trip (NaNs stay NaN).
    for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
        const auto half = static_cast<uint16_t>(bits);
        const float value = half_to_float(half);
        if (std::isnan(value)) {
            CHECK((float_to_half(value) & 0x7FFF) > 0x7C00);
        } else if (float_to_half(value) != half) {
            FAIL_CHECK("half 0x" << std::hex << bits << " does not round-trip");
        }
    }

#if defined(__FLT16_MAX__)
    // Against the compiler's own conversion (F16C / soft-float), over random floats of every scale.
    std::mt19937 random(1);
    int mismatches = 0;
    for (int i = 0; i < 200000; ++i) {
        const float value = std::bit_cast<float>(static_cast<uint32_t>(random()));
        if (std::isnan(value)) continue;
        const auto expected = std::bit_cast<uint16_t>(static_cast<_Float16>(value));
        mismatches += float_to_half(value) != expected;
        mismatches += half_to_float(expected) != static_cast<float>(static_cast<_Float16>(value));
    }
    CHECK(mismatches == 0);
#endif
}

TEST_CASE("half precision: BF16 conversions") {
    CHECK(bf16_to_float(0x3F80) == 1.0f);
    CHECK(bf16_to_float(0xC040) == -3.0f);
    CHECK(float_to_bf16(1.0f) == 0x3F80);
    CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);      // tie: to even (down)
    CHECK(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);  // tie: to even (up)
    CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
    for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
        const float value = bf16_to_float(static_cast<uint16_t>(bits));
        if (!std::isnan(value) && float_to_bf16(value) != bits) FAIL_CHECK("bf16 0x" << std::hex << bits);
    }
}

TEST_CASE("GGUF writer -> reader round trip of metadata of every type, versions 2 and 3") {
    ScratchDir scratch;
    for (const uint32_t version : {2u, 3u}) {
        CAPTURE(version);
        GgufWriter writer(version);
        for (const auto& [key, value] : every_value_type()) writer.set(key, value);
        const std::string path = scratch.file("meta_v" + std::to_string(version) + ".gguf");
        writer.write(path);
        CHECK_FALSE(std::filesystem::exists(path + ".tmp"));

        const GgufFile file = GgufFile::open(path);
        CHECK(file.version() == version);
        CHECK(file.tensors().empty());
        CHECK(file.metadata().size() == every_value_type().size());
        for (const auto& entry : every_value_type()) {
            const std::string& key = entry.first;  // not a structured binding: clang 14 cannot capture one
            const auto& value = entry.second;
            CAPTURE(key);
            REQUIRE(file.find(key) != nullptr);
            CHECK(file.at(key).type() == value.type());
            CHECK(file.at(key) == value);
        }
        // Typed getters and their conversions.
        CHECK(file.get_int("test.uint8") == 200);
        CHECK(file.get_int("test.int64") == -(int64_t{1} << 62));
        CHECK(file.get_double("test.float32") == 1.5);
        CHECK(file.get_double("test.int16") == -30000.0);
        CHECK(file.get_string("test.string") == "h\xC3\xA9llo \xE2\x96\x81 w\xC3\xB6rld");
        CHECK(file.get_string_array("test.array.string") == std::vector<std::string>{"a", "\xE2\x96\x81" "b"});
        CHECK(file.get_number_array("test.array.uint32") == std::vector<double>{1, 2, 3});
        CHECK(file.get_int("test.absent", 17) == 17);
        CHECK(file.at("test.array.nested_strings").as_array().items[0].as_array().items[1].as_string() == "yz");
    }
}

TEST_CASE("GGUF writer -> reader round trip of F32, F16, BF16 and Q8_0 tensors") {
    ScratchDir scratch;
    std::vector<float> values(2 * 64);
    for (size_t i = 0; i < values.size(); ++i) values[i] = std::ldexp(static_cast<float>(i) - 60.0f, -3);  // exact in F16 and BF16

    GgufWriter writer;
    writer.set_uint32("general.alignment", 64);
    writer.add_tensor("f32", {64, 2}, values, TensorType::F32);
    writer.add_tensor("f16", {64, 2}, values, TensorType::F16);
    writer.add_tensor("bf16", {64, 2}, values, TensorType::BF16);
    writer.add_tensor("q8_0.written", {64, 2}, values, TensorType::Q8_0);
    writer.add_tensor("one_dim", {3}, std::vector<float>{1.0f, -2.0f, 3.5f}, TensorType::F32);

    // BF16 by hand: 1.0, -2.0, 0.15625, 65280.
    const std::vector<uint8_t> bf16_bytes = {0x80, 0x3F, 0x00, 0xC0, 0x20, 0x3E, 0x7F, 0x47};
    writer.add_raw_tensor("bf16.hand", {4}, static_cast<uint32_t>(TensorType::BF16), bf16_bytes);
    // Q8_0 by hand: two blocks; scales 0.5 (fp16 0x3800) and -0.25 (0xB400), quants k - 16.
    std::vector<uint8_t> q8_bytes;
    for (const uint16_t scale : {uint16_t{0x3800}, uint16_t{0xB400}}) {
        q8_bytes.push_back(static_cast<uint8_t>(scale & 0xFF));
        q8_bytes.push_back(static_cast<uint8_t>(scale >> 8));
        for (int k = 0; k < 32; ++k) q8_bytes.push_back(static_cast<uint8_t>(static_cast<int8_t>(k - 16)));
    }
    writer.add_raw_tensor("q8_0.hand", {32, 2}, static_cast<uint32_t>(TensorType::Q8_0), q8_bytes);

    const std::string path = scratch.file("tensors.gguf");
    writer.write(path);
    const GgufFile file = GgufFile::open(path);
    CHECK(file.alignment() == 64);
    CHECK(file.data_offset() % 64 == 0);
    REQUIRE(file.tensors().size() == 7);
    for (const auto& info : file.tensors()) CHECK(info.offset % 64 == 0);

    const GgufTensorInfo& f16 = file.tensor("f16");
    CHECK(f16.shape == std::vector<uint64_t>{64, 2});
    CHECK(f16.type_id == static_cast<uint32_t>(TensorType::F16));
    CHECK(f16.byte_size() == 256);
    CHECK(file.read_tensor("f32") == values);
    CHECK(file.read_tensor("f16") == values);
    CHECK(file.read_tensor("bf16") == values);
    CHECK(file.read_tensor("one_dim") == std::vector<float>{1.0f, -2.0f, 3.5f});
    CHECK(file.read_tensor("bf16.hand") == std::vector<float>{1.0f, -2.0f, 0.15625f, 65280.0f});

    const std::vector<float> q8 = file.read_tensor("q8_0.hand");
    REQUIRE(q8.size() == 64);
    for (int k = 0; k < 32; ++k) {
        CHECK(q8[k] == 0.5f * static_cast<float>(k - 16));
        CHECK(q8[32 + k] == -0.25f * static_cast<float>(k - 16));
    }
    // The writer's quantiser: error at most half a quantisation step per block.
    const std::vector<float> quantised = file.read_tensor("q8_0.written");
    for (size_t block = 0; block < values.size(); block += 32) {
        float max_abs = 0.0f;
        for (int i = 0; i < 32; ++i) max_abs = std::max(max_abs, std::fabs(values[block + i]));
        for (int i = 0; i < 32; ++i)
            CHECK(std::fabs(quantised[block + i] - values[block + i]) <= max_abs / 127.0f * 0.5f * 1.01f);
    }
}

TEST_CASE("GGUF errors: bad magic, unsupported version, missing key or tensor, wrong type") {
    ScratchDir scratch;
    const std::string good = scratch.file("good.gguf");
    small_writer().write(good);
    const std::vector<uint8_t> bytes = read_bytes(good);

    SUBCASE("bad magic") {
        std::vector<uint8_t> bad = bytes;
        bad[0] = 'X';
        const std::string path = scratch.file("magic.gguf");
        write_bytes(path, bad, bad.size());
        const std::string message = open_error(path);
        CHECK(message.find(path + ": not a GGUF file") == 0);
    }
    SUBCASE("bad magic with a newline, as a text file given as the model has: one line") {
        std::vector<uint8_t> bad = bytes;
        bad[0] = 'O', bad[1] = 'n', bad[2] = '\n', bad[3] = 0x01;
        const std::string path = scratch.file("text.gguf");
        write_bytes(path, bad, bad.size());
        CHECK(open_error(path) == path + ": not a GGUF file (bad magic 'On\\x0a\\x01', expected 'GGUF')");
    }
    SUBCASE("version 1") {
        std::vector<uint8_t> bad = bytes;
        bad[4] = 1;
        const std::string path = scratch.file("v1.gguf");
        write_bytes(path, bad, bad.size());
        CHECK(open_error(path).find("unsupported GGUF version 1") != std::string::npos);
    }
    SUBCASE("no such file") {
        CHECK(open_error(scratch.file("absent.gguf")) == scratch.file("absent.gguf") + ": no such file");
    }
    SUBCASE("missing key, wrong type, missing tensor") {
        const GgufFile file = GgufFile::open(good);
        const auto message_of = [](auto&& action) {
            try {
                action();
            } catch (const kvsim::InputError& error) {
                return std::string(error.what());
            }
            return std::string("(no InputError)");
        };
        CHECK(message_of([&] { file.get_int("llama.context_length"); }) ==
              good + ": missing metadata key 'llama.context_length'");
        CHECK(message_of([&] { file.get_int("general.name"); }) ==
              good + ": metadata key 'general.name': expected an integer, found string");
        CHECK(message_of([&] { file.get_string("llama.block_count"); }) ==
              good + ": metadata key 'llama.block_count': expected a string, found uint32");
        CHECK(message_of([&] { file.read_tensor("output.weight"); }) == good + ": missing tensor 'output.weight'");
    }
}

TEST_CASE("GGUF errors: an unsupported tensor type names the tensor and the type") {
    ScratchDir scratch;
    GgufWriter writer = small_writer();
    writer.add_raw_tensor("blk.0.attn_q.weight", {256}, 16, std::vector<uint8_t>(66, 0));  // one IQ2_XXS block
    writer.add_raw_tensor("mystery", {4}, 77, std::vector<uint8_t>(16, 0));
    const std::string path = scratch.file("iq2.gguf");
    writer.write(path);
    const GgufFile file = GgufFile::open(path);  // opening is fine: only reading needs the type
    const std::string supported = "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K";
    CHECK_THROWS_WITH_AS(file.read_tensor("blk.0.attn_q.weight"),
                         (path + ": tensor 'blk.0.attn_q.weight': unsupported type IQ2_XXS (16); " + supported).c_str(),
                         kvsim::InputError);
    CHECK_THROWS_WITH_AS(file.read_tensor("mystery"),
                         (path + ": tensor 'mystery': unsupported type unknown (77); " + supported).c_str(),
                         kvsim::InputError);
}

TEST_CASE("GGUF errors: every truncation of a file gives one-line InputError naming the file") {
    ScratchDir scratch;
    const std::string good = scratch.file("good.gguf");
    small_writer().write(good);
    const std::vector<uint8_t> bytes = read_bytes(good);
    const GgufFile intact = GgufFile::open(good);

    // The data ends with the last tensor's (the writer pads after it, as llama.cpp does).
    const size_t data_end = intact.data_offset() + intact.tensor("t.q8_0").offset + intact.tensor("t.q8_0").byte_size();
    REQUIRE(data_end <= bytes.size());

    const std::string cut = scratch.file("cut.gguf");
    for (size_t size = 0; size < data_end; ++size) {
        write_bytes(cut, bytes, size);
        const std::string message = open_error(cut);
        if (message.find(cut + ": ") != 0 || message.find('\n') != std::string::npos) {
            FAIL_CHECK("cut at " << size << " bytes: " << message);
        }
    }

    // Where the cut falls decides what the message names.
    const size_t name_value = find_bytes(bytes, "general.name") + std::string("general.name").size() + 4 + 8 + 2;
    write_bytes(cut, bytes, name_value);  // inside the value of general.name
    CHECK(open_error(cut) == cut + ": truncated file: it ends inside metadata key 'general.name' (" +
                                 std::to_string(name_value) + " bytes)");

    const size_t tensor_info = find_bytes(bytes, "t.q8_0") + 3;
    write_bytes(cut, bytes, tensor_info);  // inside the name of the last tensor info
    CHECK(open_error(cut).find("it ends inside tensor info #2") != std::string::npos);

    write_bytes(cut, bytes, data_end - 1);  // the last tensor's data is one byte short
    const std::string message = open_error(cut);
    CHECK(message.find(cut + ": tensor 't.q8_0': data") == 0);
    CHECK(message.find("extends past the end of the file") != std::string::npos);
}

TEST_CASE("GGUF errors: corrupt counts and types are rejected without huge allocations") {
    ScratchDir scratch;
    GgufWriter writer;
    writer.set_string_array("tokens", {"a", "b"});
    const std::string good = scratch.file("good.gguf");
    writer.write(good);
    std::vector<uint8_t> bytes = read_bytes(good);

    SUBCASE("absurd array length") {
        const size_t count_at = find_bytes(bytes, "tokens") + 6 + 4 + 4;  // after key, value type, element type
        for (int i = 0; i < 8; ++i) bytes[count_at + i] = 0xFF;
        const std::string path = scratch.file("huge_array.gguf");
        write_bytes(path, bytes, bytes.size());
        CHECK(open_error(path) == path + ": truncated file: it ends inside metadata key 'tokens' (" +
                                      std::to_string(bytes.size()) + " bytes)");
    }
    SUBCASE("unknown value type") {
        const size_t type_at = find_bytes(bytes, "tokens") + 6;
        bytes[type_at] = 42;
        const std::string path = scratch.file("bad_type.gguf");
        write_bytes(path, bytes, bytes.size());
        CHECK(open_error(path) == path + ": metadata key 'tokens': unknown value type 42");
    }
}

TEST_CASE("GGUF errors: a tensor offset near 2^64 does not wrap round to the header") {
    ScratchDir scratch;
    const std::string good = scratch.file("good.gguf");
    small_writer().write(good);
    std::vector<uint8_t> bytes = read_bytes(good);
    const GgufFile intact = GgufFile::open(good);
    // t.q8_0's info: name, u32 n_dims, two u64 dims, u32 type, then the u64 offset.
    const size_t offset_at = find_bytes(bytes, "t.q8_0") + 6 + 4 + 16 + 4;
    const std::string path = scratch.file("wrap.gguf");
    for (const uint64_t offset : {uint64_t{0} - intact.data_offset(), uint64_t{0} - 32, uint64_t{1} << 63}) {
        CAPTURE(offset);
        std::memcpy(bytes.data() + offset_at, &offset, 8);
        write_bytes(path, bytes, bytes.size());
        // data_offset + offset would wrap to 0 (or near it) and the header be read as weights.
        CHECK(open_error(path) == path + ": tensor 't.q8_0': data offset " + std::to_string(offset) +
                                      " is past the end of the file (" + std::to_string(bytes.size()) +
                                      " bytes, data section at " + std::to_string(intact.data_offset()) +
                                      "): truncated or corrupt file");
    }
}

TEST_CASE("GGUF errors: an alignment beyond 2^31 or not a power of two") {
    ScratchDir scratch;
    GgufWriter writer;
    writer.set("general.alignment", GgufValue{uint64_t{32}});
    writer.set_string("general.name", "aligned");
    const std::string good = scratch.file("good.gguf");
    writer.write(good);
    std::vector<uint8_t> bytes = read_bytes(good);
    const size_t value_at = find_bytes(bytes, "general.alignment") + std::string("general.alignment").size() + 4;
    const std::string path = scratch.file("alignment.gguf");
    for (const uint64_t alignment : {uint64_t{1} << 40, uint64_t{1} << 32, uint64_t{48}, uint64_t{0}}) {
        CAPTURE(alignment);
        std::memcpy(bytes.data() + value_at, &alignment, 8);
        write_bytes(path, bytes, bytes.size());
        CHECK(open_error(path) == path + ": key 'general.alignment': " + std::to_string(alignment) +
                                      " is not a power of two from 1 to 2147483648");
    }
}

TEST_CASE("GGUF errors: what the parsed header and a tensor would take in memory is checked first") {
    ScratchDir scratch;
    // 20000 one-byte elements are 20 KB in the file but 20000 GgufValues (~800 KB) in memory.
    GgufWriter writer;
    writer.set("big", GgufValue{GgufArray{GgufValueType::UINT8, std::vector<GgufValue>(20000, GgufValue{uint8_t{1}})}});
    writer.add_tensor("weights", {256, 64}, std::vector<float>(256 * 64, 0.5f), TensorType::F16);
    const std::string path = scratch.file("big.gguf");
    writer.write(path);
    {
        const MemoryLimit limit(256 * 1024);
        const std::string message = open_error(path);
        CHECK(message.find(path + ": metadata key 'big' needs ") == 0);
        CHECK(message.find(", over the memory limit of 262144 bytes (--max-memory)") != std::string::npos);
    }
    {
        // 32 KB of F16 data become 64 KB of floats: 96 KB while reading.
        const MemoryLimit limit(1024 * 1024 + 64 * 1024);
        const GgufFile file = GgufFile::open(path);
        const MemoryLimit tighter(64 * 1024);
        CHECK_THROWS_WITH_AS(file.read_tensor("weights"),
                             (path + ": tensor 'weights' needs 98304 bytes, over the memory limit of 65536 bytes (--max-memory)").c_str(),
                             kvsim::InputError);
    }
}

TEST_CASE("GGUF errors: a model path that is not a regular file is refused before it is opened") {
    ScratchDir scratch;
    std::filesystem::create_directories(scratch.file("folder"));
    CHECK(open_error(scratch.file("folder")) == scratch.file("folder") + ": is a directory, not a file");
    const std::string fifo = scratch.file("fifo");
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    CHECK(open_error(fifo) == fifo + ": is a FIFO, not a regular file");  // opening it would block forever
    const std::string long_name = scratch.file(std::string(300, 'x') + ".gguf");
    CHECK(open_error(long_name) == long_name + ": cannot open (File name too long)");
}
