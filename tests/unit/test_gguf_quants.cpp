// GGUF block formats (model/ggml_blocks.h): hand-made blocks checked element by element against
// values worked out from the format descriptions, round trips through kvsim's quantisers with a
// stated error bound per type, malformed tensors, and a Q4_K model through capture and eval.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "base/errors.h"
#include "src/capture.h"
#include "src/config.h"
#include "src/eval.h"
#include "model/ggml_blocks.h"
#include "model/ggml_quantize.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "sim/trace_store.h"
#include "tests/model/test_util.h"

using namespace kvsim;
using namespace kvsim::model;
using kvsim::model::testing::ScratchDir;

namespace {

// The tensor `name` of a one-tensor file holding `bytes` under `type`, read back as floats.
std::vector<float> read_hand_tensor(TensorType type, uint64_t elements, const std::vector<uint8_t>& bytes) {
    ScratchDir scratch;
    GgufWriter writer;
    writer.add_raw_tensor("hand", {elements}, static_cast<uint32_t>(type), bytes);
    const std::string path = scratch.file("hand.gguf");
    writer.write(path);
    return GgufFile::open(path).read_tensor("hand");
}

void put_u16(std::vector<uint8_t>& bytes, size_t at, uint16_t value) { std::memcpy(bytes.data() + at, &value, 2); }

// Compares every element, naming the first few that differ.
void check_elements(const std::vector<float>& got, const std::vector<float>& expected) {
    REQUIRE(got.size() == expected.size());
    int reported = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != expected[i] && reported++ < 8) FAIL_CHECK("weight " << i << ": got " << got[i] << ", expected " << expected[i]);
    }
    CHECK(reported == 0);
}

// fp16 bit patterns used below.
constexpr uint16_t kHalfQuarter = 0x3400, kHalfHalf = 0x3800, kHalfOne = 0x3C00, kHalfTwo = 0x4000,
                   kHalfMinusOne = 0xBC00;

}  // namespace

TEST_CASE("gguf blocks: every format's size and name, and the type ids GGUF defines") {
    const std::map<uint32_t, std::tuple<std::string, int, int>> expected = {
        {2, {"Q4_0", 32, 18}},   {3, {"Q4_1", 32, 20}},   {6, {"Q5_0", 32, 22}},   {7, {"Q5_1", 32, 24}},
        {8, {"Q8_0", 32, 34}},   {10, {"Q2_K", 256, 84}}, {11, {"Q3_K", 256, 110}}, {12, {"Q4_K", 256, 144}},
        {13, {"Q5_K", 256, 176}}, {14, {"Q6_K", 256, 210}}, {15, {"Q8_K", 256, 292}},
    };
    for (const auto& [id, format] : expected) {
        const BlockFormat* found = find_block_format(id);
        REQUIRE(found != nullptr);
        CHECK(found->name == std::get<0>(format));
        CHECK(std::string(tensor_type_name(id)) == std::get<0>(format));
        CHECK(found->block_elements == std::get<1>(format));
        CHECK(found->block_bytes == std::get<2>(format));
    }
    CHECK(find_block_format(9) == nullptr);   // Q8_1: an intermediate format, not stored in models
    CHECK(find_block_format(16) == nullptr);  // IQ2_XXS
}

// Each hand-made block: a default quant everywhere (so every weight checks its sub-block's
// scale), a few weights set apart in chosen bytes and bits, the expected values worked out by hand
// from the format description.

TEST_CASE("gguf blocks: Q4_0 by hand (low nibbles are weights 0-15, high nibbles 16-31)") {
    std::vector<uint8_t> block(18, 0x88);  // every nibble 8: weight 0
    put_u16(block, 0, kHalfHalf);          // d = 0.5
    block[2 + 0] = 0x8F;                   // weight 0: (15 - 8) * 0.5
    block[2 + 3] = 0x18;                   // weight 19: (1 - 8) * 0.5
    block[2 + 15] = 0x0A;                  // weight 15: (10 - 8) * 0.5, weight 31: (0 - 8) * 0.5
    std::vector<float> expected(32, 0.0f);
    expected[0] = 3.5f;
    expected[19] = -3.5f;
    expected[15] = 1.0f;
    expected[31] = -4.0f;
    check_elements(read_hand_tensor(TensorType::Q4_0, 32, block), expected);
}

TEST_CASE("gguf blocks: Q4_1 by hand (d * q + m)") {
    std::vector<uint8_t> block(20, 0x00);
    put_u16(block, 0, kHalfQuarter);   // d = 0.25
    put_u16(block, 2, kHalfMinusOne);  // m = -1
    block[4 + 1] = 0x4C;               // weight 1: 12 * 0.25 - 1, weight 17: 4 * 0.25 - 1
    block[4 + 14] = 0xF0;              // weight 14: -1, weight 30: 15 * 0.25 - 1
    std::vector<float> expected(32, -1.0f);
    expected[1] = 2.0f;
    expected[17] = 0.0f;
    expected[30] = 2.75f;
    check_elements(read_hand_tensor(TensorType::Q4_1, 32, block), expected);
}

TEST_CASE("gguf blocks: Q5_0 by hand (bit j of the little-endian qh is weight j's fifth bit)") {
    std::vector<uint8_t> block(22, 0x00);
    put_u16(block, 0, kHalfOne);  // d = 1
    // qh = 0x7FFFFFFB: every fifth bit set (q = 16: weight 0) except weights 2 and 31.
    block[2] = 0xFB;
    block[3] = 0xFF;
    block[4] = 0xFF;
    block[5] = 0x7F;
    block[6 + 4] = 0x70;   // weight 20: 16 + 7 - 16
    block[6 + 9] = 0x05;   // weight 9: 16 + 5 - 16
    block[6 + 15] = 0xF0;  // weight 31: no fifth bit, 15 - 16
    std::vector<float> expected(32, 0.0f);
    expected[2] = -16.0f;  // no fifth bit, low nibble 0
    expected[20] = 7.0f;
    expected[9] = 5.0f;
    expected[31] = -1.0f;
    check_elements(read_hand_tensor(TensorType::Q5_0, 32, block), expected);
}

TEST_CASE("gguf blocks: Q5_1 by hand") {
    std::vector<uint8_t> block(24, 0x00);
    put_u16(block, 0, kHalfHalf);  // d = 0.5
    put_u16(block, 2, kHalfTwo);   // m = 2
    block[4] = 0x01;               // qh bits 0 and 16: weights 0 and 16
    block[6] = 0x01;
    block[8 + 0] = 0x01;   // weight 0: (16 + 1) * 0.5 + 2; weight 16: 16 * 0.5 + 2
    block[8 + 11] = 0x30;  // weight 27: 3 * 0.5 + 2
    std::vector<float> expected(32, 2.0f);
    expected[0] = 10.5f;
    expected[16] = 10.0f;
    expected[27] = 3.5f;
    check_elements(read_hand_tensor(TensorType::Q5_1, 32, block), expected);
}

TEST_CASE("gguf blocks: Q2_K by hand (4-bit scale and min per 16 weights, 2-bit quants)") {
    std::vector<uint8_t> block(84, 0x00);  // every quant 0: weight = -dmin * m
    // Sub-block s: scale 1 + s % 8 (low nibble), min s (high nibble).
    for (int s = 0; s < 16; ++s) block[s] = static_cast<uint8_t>((1 + s % 8) | (s << 4));
    put_u16(block, 80, kHalfOne);   // d = 1
    put_u16(block, 82, kHalfHalf);  // dmin = 0.5
    uint8_t* qs = block.data() + 16;
    qs[0] = 0x03;   // weight 0 (sub 0: scale 1, min 0): 1 * 3 - 0
    qs[5] = 0x08;   // bits 2-3 of qs[5]: weight 32 + 5 = 37 (sub 2: scale 3, min 2): 3 * 2 - 1
    qs[17] = 0x40;  // bits 6-7 of qs[17]: weight 96 + 17 = 113 (sub 7: scale 8, min 7): 8 * 1 - 3.5
    qs[40] = 0x10;  // bits 4-5 of qs[32 + 8]: weight 128 + 64 + 8 = 200 (sub 12: scale 5, min 12): 5 - 6
    qs[63] = 0xC0;  // bits 6-7 of qs[32 + 31]: weight 255 (sub 15: scale 8, min 15): 8 * 3 - 7.5
    std::vector<float> expected(256);
    for (int i = 0; i < 256; ++i) expected[i] = -0.5f * static_cast<float>(i / 16);
    expected[0] = 3.0f;
    expected[37] = 5.0f;
    expected[113] = 4.5f;
    expected[200] = -1.0f;
    expected[255] = 16.5f;
    check_elements(read_hand_tensor(TensorType::Q2_K, 256, block), expected);
}

TEST_CASE("gguf blocks: Q3_K by hand (6-bit scales split over 12 bytes, hmask's high bits)") {
    // Stored scales (scale + 32) per sub-block, chosen so that every pair of high bits occurs:
    //   0 17 34 51 63 46 29 12 | 5 20 40 60 33 1 48 31
    // Low nibbles: scales[j] = low(j) | low(j + 8) << 4; high pairs: scales[8 + i] holds those of
    // sub-blocks i, i + 4, i + 8, i + 12 at bits 0, 2, 4, 6. Worked out by hand:
    const uint8_t packed_scales[12] = {0x50, 0x41, 0x82, 0xC3, 0x1F, 0x1E, 0x0D, 0xFC, 0x8C, 0x19, 0xE6, 0x73};
    const int scale[16] = {-32, -15, 2, 19, 31, 14, -3, -20, -27, -12, 8, 28, 1, -31, 16, -1};
    std::vector<uint8_t> block(110, 0x00);
    uint8_t* hmask = block.data();
    uint8_t* qs = block.data() + 32;
    std::memcpy(block.data() + 96, packed_scales, 12);
    put_u16(block, 108, kHalfHalf);  // d = 0.5
    // Every quant stored as 5 (low bits 01, high bit 1): q = 1, so weight = 0.5 * scale.
    std::memset(hmask, 0xFF, 32);
    std::memset(qs, 0x55, 64);
    qs[5] = 0x57;      // weight 5 (sub 0): low bits 3, q = 3: 0.5 * -32 * 3
    qs[18] = 0x51;     // weight 32 + 18 = 50 (sub 3): low bits 0 ...
    hmask[18] = 0xFD;  // ... and high bit (bit 1 = 4*0 + 1) clear: q = -4: 0.5 * 19 * -4
    qs[4] = 0x95;      // weight 96 + 4 = 100 (sub 6): low bits 2 at bits 6-7, q = 2: 0.5 * -3 * 2
    qs[12] = 0x75;     // weight 64 + 12 = 76 (sub 4): low bits 3 at bits 4-5, q = 3: 0.5 * 31 * 3
    qs[32 + 22] = 0x56;  // weight 128 + 22 = 150 (sub 9): low bits 2 ...
    hmask[22] = 0xEF;    // ... high bit (bit 4 = 4*1 + 0) clear: q = -2: 0.5 * -12 * -2
    qs[32 + 8] = 0x75;   // weight 128 + 64 + 8 = 200 (sub 12): low bits 3 at bits 4-5 ...
    hmask[8] = 0xBF;     // ... high bit (bit 6 = 4*1 + 2) clear: q = -1: 0.5 * 1 * -1
    qs[32 + 6] = 0xD5;   // weight 128 + 96 + 6 = 230 (sub 14): low bits 3 at bits 6-7, q = 3: 0.5 * 16 * 3
    std::vector<float> expected(256);
    for (int i = 0; i < 256; ++i) expected[i] = 0.5f * static_cast<float>(scale[i / 16]);
    expected[5] = -48.0f;
    expected[50] = -38.0f;
    expected[100] = -3.0f;
    expected[76] = 46.5f;
    expected[150] = 12.0f;
    expected[200] = -0.5f;
    expected[230] = 24.0f;
    check_elements(read_hand_tensor(TensorType::Q3_K, 256, block), expected);
}

namespace {
// Q4_K and Q5_K share the 12 scale bytes: sub-block scales 1 10 33 63 17 40 5 50 and mins
// 2 60 7 31 48 3 36 21, packed by hand: bytes 0-3 hold scales 0-3 and the high 2 bits of scales
// 4-7 at the top; bytes 4-7 mins 0-3 and the high bits of mins 4-7; bytes 8-11 the low nibbles
// of scale (low) and min (high) 4-7.
const uint8_t kK4PackedScales[12] = {0x41, 0x8A, 0x21, 0xFF, 0xC2, 0x3C, 0x87, 0x5F, 0x01, 0x38, 0x45, 0x52};
// With d = 0.5, dmin = 0.25 and q = 1, sub-block s's weights are 0.5 * scale - 0.25 * min:
const float kK4WeightOfQ1[8] = {0.0f, -10.0f, 14.75f, 23.75f, -3.5f, 19.25f, -6.5f, 19.75f};
}  // namespace

TEST_CASE("gguf blocks: Q4_K by hand (the 6-bit packed scales and mins of all 8 sub-blocks)") {
    std::vector<uint8_t> block(144, 0x00);
    put_u16(block, 0, kHalfHalf);     // d = 0.5
    put_u16(block, 2, kHalfQuarter);  // dmin = 0.25
    std::memcpy(block.data() + 4, kK4PackedScales, 12);
    uint8_t* qs = block.data() + 16;
    std::memset(qs, 0x11, 128);  // q = 1 everywhere
    qs[3] = 0x1F;   // weight 3 (sub 0, low nibble): 0.5 * 1 * 15 - 0.25 * 2
    qs[8] = 0x01;   // weight 32 + 8 = 40 (sub 1, high nibble 0): -0.25 * 60
    qs[52] = 0x21;  // weight 64 + 32 + 20 = 116 (sub 3, high nibble 2): 0.5 * 63 * 2 - 0.25 * 31
    qs[95] = 0x17;  // weight 128 + 31 = 159 (sub 4, low nibble 7): 0.5 * 17 * 7 - 0.25 * 48
    qs[96] = 0x91;  // weight 192 + 32 = 224 (sub 7, high nibble 9): 0.5 * 50 * 9 - 0.25 * 21
    std::vector<float> expected(256);
    for (int i = 0; i < 256; ++i) expected[i] = kK4WeightOfQ1[i / 32];
    expected[3] = 7.0f;
    expected[40] = -15.0f;
    expected[116] = 55.25f;
    expected[159] = 47.5f;
    expected[224] = 219.75f;
    check_elements(read_hand_tensor(TensorType::Q4_K, 256, block), expected);
}

TEST_CASE("gguf blocks: Q5_K by hand (Q4_K's scales, qh's fifth bits)") {
    std::vector<uint8_t> block(176, 0x00);
    put_u16(block, 0, kHalfHalf);
    put_u16(block, 2, kHalfQuarter);
    std::memcpy(block.data() + 4, kK4PackedScales, 12);
    uint8_t* qh = block.data() + 16;
    uint8_t* qs = block.data() + 48;
    std::memset(qs, 0x11, 128);  // q = 1 everywhere (no fifth bits)
    qh[3] = 0x01;   // weight 3 (sub 0): bit 0, q = 17: 0.5 * 1 * 17 - 0.5
    qh[8] = 0x02;   // weight 32 + 8 = 40 (sub 1): bit 1, q = 17: 0.5 * 10 * 17 - 15
    qh[1] = 0x08;   // weight 64 + 32 + 1 = 97 (sub 3): bit 3, q = 17: 0.5 * 63 * 17 - 7.75
    qh[31] = 0x10;  // weight 128 + 31 = 159 (sub 4): bit 4 ...
    qs[95] = 0x1F;  // ... low nibble 15, q = 31: 0.5 * 17 * 31 - 12
    qh[0] = 0x80;   // weight 192 + 32 = 224 (sub 7): bit 7 ...
    qs[96] = 0x01;  // ... high nibble 0, q = 16: 0.5 * 50 * 16 - 5.25
    std::vector<float> expected(256);
    for (int i = 0; i < 256; ++i) expected[i] = kK4WeightOfQ1[i / 32];
    expected[3] = 8.0f;
    expected[40] = 70.0f;
    expected[97] = 527.75f;
    expected[159] = 251.5f;
    expected[224] = 394.75f;
    check_elements(read_hand_tensor(TensorType::Q5_K, 256, block), expected);
}

TEST_CASE("gguf blocks: Q6_K by hand (ql nibbles, qh bit pairs, int8 scales)") {
    const int8_t scale[16] = {1, -2, 3, -4, 5, -6, 7, -8, 16, -32, 64, -128, 127, 0, 2, -1};
    std::vector<uint8_t> block(210, 0x00);
    uint8_t* ql = block.data();
    uint8_t* qh = block.data() + 128;
    std::memcpy(block.data() + 192, scale, 16);
    put_u16(block, 208, kHalfQuarter);  // d = 0.25
    // Every quant stored as 33 (low 4 bits 1, high 2 bits 2): q = 1, weight = 0.25 * scale.
    std::memset(ql, 0x11, 128);
    std::memset(qh, 0xAA, 64);
    ql[0] = 0x1F;       // weight 0 (sub 0): low 15 ...
    qh[0] = 0xAB;       // ... high 3 (bits 0-1): q = 31: 0.25 * 1 * 31
    ql[45] = 0x10;      // weight 32 + 13 = 45 (sub 2): low nibble of ql[32 + 13] 0 ...
    qh[13] = 0xA2;      // ... high 0 (bits 2-3): q = -32: 0.25 * 3 * -32
    ql[26] = 0x81;      // weight 64 + 26 = 90 (sub 5): high nibble of ql[26] 8, high 2: q = 8: 0.25 * -6 * 8
    ql[63] = 0x01;      // weight 96 + 31 = 127 (sub 7): high nibble of ql[32 + 31] 0 ...
    qh[31] = 0x6A;      // ... high 1 (bits 6-7): q = -16: 0.25 * -8 * -16
    ql[113] = 0x12;     // weight 128 + 32 + 17 = 177 (sub 11): low nibble of ql[64 + 32 + 17] 2: q = 2: 0.25 * -128 * 2
    ql[101] = 0x41;     // weight 128 + 96 + 5 = 229 (sub 14): high nibble of ql[64 + 32 + 5] 4 ...
    qh[32 + 5] = 0x6A;  // ... high 1 (bits 6-7 of qh[32 + 5]): q = -12: 0.25 * 2 * -12
    ql[72] = 0x01;      // weight 128 + 64 + 8 = 200 (sub 12): high nibble of ql[64 + 8] 0, high 2: q = 0
    std::vector<float> expected(256);
    for (int i = 0; i < 256; ++i) expected[i] = 0.25f * static_cast<float>(scale[i / 16]);
    expected[0] = 7.75f;
    expected[45] = -24.0f;
    expected[90] = -12.0f;
    expected[127] = 32.0f;
    expected[177] = -64.0f;
    expected[229] = -6.0f;
    expected[200] = 0.0f;
    check_elements(read_hand_tensor(TensorType::Q6_K, 256, block), expected);
}

TEST_CASE("gguf blocks: Q8_K by hand (an f32 scale; the block sums play no part)") {
    std::vector<uint8_t> block(292, 0x7F);  // bsums: junk
    const float d = 0.125f;
    std::memcpy(block.data(), &d, 4);
    for (int j = 0; j < 256; ++j) block[4 + j] = static_cast<uint8_t>(static_cast<int8_t>(j - 128));
    std::vector<float> expected(256);
    for (int j = 0; j < 256; ++j) expected[j] = 0.125f * static_cast<float>(j - 128);
    CHECK(expected[0] == -16.0f);
    CHECK(expected[255] == 15.875f);
    check_elements(read_hand_tensor(TensorType::Q8_K, 256, block), expected);
}

TEST_CASE("gguf blocks: a tensor of several blocks and rows is read block after block") {
    // Two rows of two Q4_0 blocks, each block constant: d = 1 and every nibble 8 + b.
    std::vector<uint8_t> bytes;
    for (int b = 0; b < 4; ++b) {
        bytes.push_back(0x00);
        bytes.push_back(0x3C);
        for (int i = 0; i < 16; ++i) bytes.push_back(static_cast<uint8_t>((8 + b) * 0x11));
    }
    ScratchDir scratch;
    GgufWriter writer;
    writer.add_raw_tensor("rows", {64, 2}, static_cast<uint32_t>(TensorType::Q4_0), bytes);
    writer.write(scratch.file("rows.gguf"));
    const std::vector<float> values = GgufFile::open(scratch.file("rows.gguf")).read_tensor("rows");
    REQUIRE(values.size() == 128);
    for (int i = 0; i < 128; ++i) CHECK(values[i] == static_cast<float>(i / 32));
}

namespace {

struct QuantBound {
    TensorType type;
    double max_relative_rms;  // the bound checked; the measured value is in the comment
};

// Relative RMS error sqrt(sum (x - y)^2 / sum x^2) of kvsim's quantisers on Gaussian weights
// (16 rows of 512), measured then bounded with margin. Round-to-nearest with the scales from the
// extremes; ggml's searches do somewhat better at 2-4 bits.
const QuantBound kQuantBounds[] = {
    {TensorType::Q8_0, 0.010},  // measured 0.0054
    {TensorType::Q8_K, 0.010},  // 0.0068
    {TensorType::Q6_K, 0.030},  // 0.0184
    {TensorType::Q5_0, 0.060},  // 0.0428
    {TensorType::Q5_1, 0.060},  // 0.0379
    {TensorType::Q5_K, 0.060},  // 0.0369
    {TensorType::Q4_0, 0.120},  // 0.0857
    {TensorType::Q4_1, 0.120},  // 0.0788
    {TensorType::Q4_K, 0.110},  // 0.0765
    {TensorType::Q3_K, 0.220},  // 0.1501
    {TensorType::Q2_K, 0.420},  // 0.3120
};

std::vector<float> gaussian_weights(size_t count, uint32_t seed) {
    std::mt19937 random(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(count);
    for (float& value : values) value = normal(random);
    return values;
}

double relative_rms_error(const std::vector<float>& exact, const std::vector<float>& approximate) {
    double error = 0.0, norm = 0.0;
    for (size_t i = 0; i < exact.size(); ++i) {
        error += (static_cast<double>(exact[i]) - approximate[i]) * (static_cast<double>(exact[i]) - approximate[i]);
        norm += static_cast<double>(exact[i]) * exact[i];
    }
    return std::sqrt(error / norm);
}

}  // namespace

TEST_CASE("gguf quantisers: each type round-trips through kvsim's writer and reader within its error bound") {
    ScratchDir scratch;
    const std::vector<float> values = gaussian_weights(16 * 512, 20261130);
    GgufWriter writer;
    for (const QuantBound& bound : kQuantBounds)
        writer.add_tensor(tensor_type_name(static_cast<uint32_t>(bound.type)), {512, 16}, values, bound.type);
    // The first 256 weights zero, then runs of 256 scaled by 16 and 1/16 in turn: scales follow
    // each run (the error stays relative in every run) and zeros stay zero.
    std::vector<float> shifted = values;
    for (size_t i = 0; i < shifted.size(); ++i) shifted[i] = i < 256 ? 0.0f : std::ldexp(values[i], (i / 256) % 2 ? 4 : -4);
    for (const QuantBound& bound : kQuantBounds)
        writer.add_tensor(std::string("shifted.") + tensor_type_name(static_cast<uint32_t>(bound.type)), {512, 16}, shifted,
                          bound.type);
    const std::string path = scratch.file("quants.gguf");
    writer.write(path);

    const GgufFile file = GgufFile::open(path);
    for (const QuantBound& bound : kQuantBounds) {
        const std::string name = tensor_type_name(static_cast<uint32_t>(bound.type));
        CAPTURE(name);
        const BlockFormat& format = *find_block_format(static_cast<uint32_t>(bound.type));
        const GgufTensorInfo& info = file.tensor(name);
        CHECK(info.type_id == static_cast<uint32_t>(bound.type));
        CHECK(info.byte_size() == values.size() / format.block_elements * format.block_bytes);
        const double error = relative_rms_error(values, file.read_tensor(name));
        MESSAGE(name << ": relative RMS error " << error << " (bound " << bound.max_relative_rms << ")");
        CHECK(error < bound.max_relative_rms);
        CHECK(error > 0.0);

        const std::vector<float> shifted_back = file.read_tensor("shifted." + name);
        for (int i = 0; i < 256; ++i) CHECK(shifted_back[i] == 0.0f);
        double worst_run = 0.0;
        for (size_t run = 256; run < shifted.size(); run += 256) {
            worst_run = std::max(worst_run, relative_rms_error(std::vector<float>(&shifted[run], &shifted[run] + 256),
                                                               std::vector<float>(&shifted_back[run], &shifted_back[run] + 256)));
        }
        CHECK(worst_run < 1.5 * bound.max_relative_rms);
    }
}

TEST_CASE("gguf quantisers: Q8_K's block sums are the sums of its quants in groups of 16") {
    const std::vector<float> values = gaussian_weights(256, 7);
    std::vector<uint8_t> block(292);
    quantize_q8_k(values.data(), block.data());
    for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += static_cast<int8_t>(block[4 + 16 * g + i]);
        int16_t stored;
        std::memcpy(&stored, block.data() + 260 + 2 * g, 2);
        CHECK(stored == sum);
    }
}

TEST_CASE("gguf quantisers: weights exactly on a type's grid come back exactly") {
    // A Q4_1 block holding 0, 0.5, ..., 7.5 (d = 0.5, m = 0) and a Q4_0 block of -8..7 (d = 1).
    std::vector<float> ramp(32), symmetric(32);
    for (int j = 0; j < 32; ++j) {
        ramp[j] = 0.5f * static_cast<float>(j % 16);
        symmetric[j] = static_cast<float>(j % 16 - 8);
    }
    std::vector<uint8_t> block(20);
    std::vector<float> back(32);
    quantize_q4_1(ramp.data(), block.data());
    dequantize_q4_1(block.data(), back.data());
    CHECK(back == ramp);
    quantize_q4_0(symmetric.data(), block.data());
    dequantize_q4_0(block.data(), back.data());
    CHECK(back == symmetric);
}

namespace {
// The InputError of opening `path` and reading all its tensors, or "(no error)".
std::string read_error(const std::string& path) {
    try {
        const GgufFile file = GgufFile::open(path);
        for (const auto& info : file.tensors()) file.read_tensor(info.name);
    } catch (const InputError& error) {
        return error.what();
    }
    return "(no error)";
}
}  // namespace

TEST_CASE("gguf errors: a block-format tensor cut short, at the end of the file or before the next tensor") {
    ScratchDir scratch;
    for (const QuantBound& bound : kQuantBounds) {
        const BlockFormat& format = *find_block_format(static_cast<uint32_t>(bound.type));
        const std::string type = format.name;
        CAPTURE(type);
        const auto block_bytes = static_cast<size_t>(format.block_bytes);
        const auto row = static_cast<uint64_t>(2 * format.block_elements);
        // The shape claims 4 blocks (2 rows of 2); 2 are written.
        const std::vector<uint8_t> half(2 * block_bytes, 0);
        {
            GgufWriter writer;
            writer.add_tensor("whole", {32}, std::vector<float>(32, 1.0f), TensorType::F32);
            writer.add_raw_tensor("blk.0.attn_q.weight", {row, 2}, format.type_id, half);
            const std::string path = scratch.file("end.gguf");
            writer.write(path);
            const std::string message = read_error(path);
            CHECK(message.find('\n') == std::string::npos);
            CHECK(message.find(path + ": tensor 'blk.0.attn_q.weight': data (bytes ") == 0);
            CHECK(message.find("4 " + type + " blocks of " + std::to_string(block_bytes) + " bytes") != std::string::npos);
            CHECK(message.find("extends past the end of the file") != std::string::npos);
        }
        {
            GgufWriter writer;
            writer.add_raw_tensor("blk.0.attn_q.weight", {row, 2}, format.type_id, half);
            // Long enough that the file does not end before the first tensor's claimed bytes.
            writer.add_tensor("next", {1024}, std::vector<float>(1024, 1.0f), TensorType::F32);
            const std::string path = scratch.file("middle.gguf");
            writer.write(path);
            const std::string message = read_error(path);
            CHECK(message.find('\n') == std::string::npos);
            CHECK(message == path + ": tensor 'blk.0.attn_q.weight': data (offset 0, 4 " + type + " blocks of " +
                                 std::to_string(block_bytes) + " bytes (" + std::to_string(format.block_elements) +
                                 " weights each)) runs into the data of tensor 'next' (offset " +
                                 std::to_string((2 * block_bytes + 31) / 32 * 32) + "): truncated or inconsistent tensor");
        }
    }
}

TEST_CASE("gguf errors: a row length that is not a whole number of blocks names the tensor and the block size") {
    ScratchDir scratch;
    for (const QuantBound& bound : kQuantBounds) {
        const BlockFormat& format = *find_block_format(static_cast<uint32_t>(bound.type));
        CAPTURE(format.name);
        // 1.5 blocks per row, with the bytes of 3 whole blocks present.
        const auto row = static_cast<uint64_t>(format.block_elements + format.block_elements / 2);
        GgufWriter writer;
        writer.add_raw_tensor("blk.1.ffn_down.weight", {row, 2}, format.type_id,
                              std::vector<uint8_t>(3 * static_cast<size_t>(format.block_bytes), 0));
        const std::string path = scratch.file("row.gguf");
        writer.write(path);
        CHECK(read_error(path) == path + ": tensor 'blk.1.ffn_down.weight': " + format.name + " row length " +
                                      std::to_string(row) + " is not a multiple of " +
                                      std::to_string(format.block_elements) + " (its block size)");
        // The writer refuses to make such a tensor from floats.
        GgufWriter refusing;
        CHECK_THROWS_AS(refusing.add_tensor("t", {row, 2}, std::vector<float>(2 * row, 0.0f), bound.type),
                        std::invalid_argument);
    }
}

TEST_CASE("gguf errors: an unsupported type is named, with the types that are supported") {
    ScratchDir scratch;
    GgufWriter writer;
    writer.add_raw_tensor("blk.0.attn_q.weight", {256}, 16, std::vector<uint8_t>(66, 0));  // one IQ2_XXS block
    const std::string path = scratch.file("iq2.gguf");
    writer.write(path);
    CHECK(read_error(path) == path + ": tensor 'blk.0.attn_q.weight': unsupported type IQ2_XXS (16); supported: F32, "
                                     "F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K");
}

namespace {

// A llama shape whose every matrix row (dim, hidden_dim, heads x head_dim) is a multiple of 256.
LlamaConfig k_quant_config() {
    LlamaConfig config = kvsim::model::testing::tiny_config();
    config.dim = 256;
    config.hidden_dim = 512;
    config.n_heads = 4;
    config.n_kv_heads = 2;
    config.head_dim = 64;
    return config;
}

// The same model with every tensor stored as the F32 the reader dequantises it to.
void write_dequantised_twin(const std::string& quantised, const std::string& twin) {
    const GgufFile file = GgufFile::open(quantised);
    GgufWriter writer;
    for (const auto& [key, value] : file.metadata()) writer.set(key, value);
    for (const auto& info : file.tensors()) writer.add_tensor(info.name, info.shape, file.read_tensor(info.name));
    writer.write(twin);
}

}  // namespace

TEST_CASE("gguf Q4_K model: forward pass, capture and eval equal the dequantised F32 model's") {
    ScratchDir scratch;
    const LlamaConfig config = k_quant_config();
    const std::string q4k = scratch.file("q4k.gguf"), f32 = scratch.file("f32.gguf");
    write_random_llama(q4k, config, 5, TensorType::Q4_K);
    write_dequantised_twin(q4k, f32);
    CHECK(GgufFile::open(q4k).tensor("blk.1.ffn_down.weight").type_id == static_cast<uint32_t>(TensorType::Q4_K));
    CHECK(std::filesystem::file_size(q4k) * 5 < std::filesystem::file_size(f32));  // 4.5 bits a weight, not 32

    SUBCASE("logits") {
        LlamaModel quantised = LlamaModel::load(q4k);
        LlamaModel exact = LlamaModel::load(f32);
        const std::vector<int> tokens = {1, 40, 77, 290, 5, 123};
        for (size_t pos = 0; pos < tokens.size(); ++pos) {
            const float* a = quantised.forward(tokens[pos], static_cast<int>(pos));
            const std::vector<float> from_quantised(a, a + config.vocab_size);
            const float* b = exact.forward(tokens[pos], static_cast<int>(pos));
            const std::vector<float> from_exact(b, b + config.vocab_size);
            // The same fp32 weights through the same code: equal up to float rounding (in fact bit for bit).
            float spread = 0.0f, worst = 0.0f;
            for (int i = 0; i < config.vocab_size; ++i) {
                spread = std::max(spread, std::fabs(from_exact[i]));
                worst = std::max(worst, std::fabs(from_quantised[i] - from_exact[i]));
            }
            CHECK(worst <= 1e-6f * spread);
            CHECK(spread > 0.0f);
        }
    }
    SUBCASE("capture and eval") {
        const std::string text = scratch.file("story.txt");
        std::ofstream(text) << "the tet he the\n<|endoftext|>\nthe hat sat on a mat\n";
        CaptureOptions capture;
        capture.input = {q4k, text, "<|endoftext|>", 0, 0};
        capture.output_path = scratch.file("q4k.h5");
        const CaptureSummary captured = capture_trace(capture);
        CHECK(captured.sequences == 2);
        capture.input.model_path = f32;
        capture.output_path = scratch.file("f32.h5");
        capture_trace(capture);
        TraceReader from_quantised(scratch.file("q4k.h5")), from_exact(scratch.file("f32.h5"));
        REQUIRE(from_quantised.sequences().size() == 2);
        for (size_t s = 0; s < 2; ++s)
            for (int layer = 0; layer < config.n_layers; ++layer) {
                const QkvLayer a = from_quantised.read_qkv(s, layer), b = from_exact.read_qkv(s, layer);
                CHECK(a.q == b.q);
                CHECK(a.k == b.k);
                CHECK(a.v == b.v);
            }

        const std::string config_path = scratch.file("eval.yaml");
        std::ofstream(config_path) << "budgets: [4]\npolicies: [tova]\n";
        const ExperimentConfig experiment = load_config(config_path);
        EvalOptions options;
        options.input = {q4k, text, "<|endoftext|>", 0, 0};
        options.show_progress = false;
        const EvalResult quantised = run_eval(experiment, {}, options);
        options.input.model_path = f32;
        const EvalResult exact = run_eval(experiment, {}, options);
        CHECK(std::isfinite(quantised.full_ppl));
        CHECK(quantised.full_ppl == doctest::Approx(exact.full_ppl).epsilon(1e-6));
        REQUIRE(quantised.records.size() == exact.records.size());
        CHECK(quantised.tokens == exact.tokens);
    }
}
