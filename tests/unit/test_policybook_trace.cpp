// The policybook RNG and trace generator against the reference's committed vectors and hash.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "sim/policybook_trace.h"
#include "base/errors.h"

using namespace kvsim;

static uint32_t bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}

TEST_CASE("xoshiro128** matches the reference's committed vectors") {
    CHECK(Xoshiro128::mix32(1) == 2261973619u);
    Xoshiro128 a(1);
    CHECK(a.next_u32() == 393288148u);
    CHECK(a.next_u32() == 2174103013u);
    CHECK(a.next_u32() == 3814759091u);
    CHECK(a.next_u32() == 2092745082u);
    Xoshiro128 b(1);
    CHECK(b.next_float() == 0.09156953264027834);
    CHECK(b.next_float() == 0.5061978038866073);
    Xoshiro128 c(1);
    for (uint32_t expected : {1u, 5u, 3u, 1u, 5u, 5u}) CHECK(c.next_int(7) == expected);
    Xoshiro128 d(7);
    CHECK(d.state()[0] == 3838393609u);
    CHECK(d.state()[1] == 4210744933u);
    CHECK(d.state()[2] == 801465066u);
    CHECK(d.state()[3] == 1648156487u);
    for (uint32_t expected : {210494603u, 711084892u, 3993689120u, 4089369890u}) CHECK(d.next_u32() == expected);
    Xoshiro128 e(7);
    for (uint32_t expected : {23u, 52u, 20u, 50u, 55u, 6u}) CHECK(e.next_int(60) == expected);
    CHECK_THROWS(e.next_int(0));
}

TEST_CASE("decode-4096: committed prefix bits, heavy-hitter draws and the full-trace hash") {
    PolicybookGenerator gen(PolicybookTraceSpec{});
    std::vector<float> row(4096);
    Fnv1a32 hash;
    for (int t = 1; t <= 4095; ++t) {
        REQUIRE(gen.next_step() == t);
        gen.next_row(row);
        std::span<const float> r(row.data(), t);
        hash.add(r);
        if (t == 1) CHECK(bits(r[0]) == 0x3F800000u);
        if (t == 2) {
            CHECK(bits(r[0]) == 0x3F01EFC2u);
            CHECK(bits(r[1]) == 0x3EFC207Bu);
        }
        if (t == 3) {
            CHECK(bits(r[0]) == 0x3EB10866u);
            CHECK(bits(r[1]) == 0x3EAAAAABu);
            CHECK(bits(r[2]) == 0x3EA44CEFu);
        }
        if (t == 4) {
            const uint32_t expected[] = {0x3E890FF9u, 0x3E830553u, 0x3E79F55Au, 0x3E6DE00Du};
            for (int i = 0; i < 4; ++i) CHECK(bits(r[i]) == expected[i]);
        }
        if (t == 10) {
            const uint32_t expected[] = {1041123532u, 1040207130u, 1038394063u, 1036561258u, 1034728452u,
                                         1034908913u, 1035089374u, 1035269835u, 1035450296u, 1035630757u};
            for (int i = 0; i < 10; ++i) CHECK(bits(r[i]) == expected[i]);
        }
        if (t == 128) {
            const std::vector<int> h128 = {27, 56, 24, 54, 59, 10, 34, 62, 15, 44, 37, 23, 19, 13, 22, 43,
                                           35, 52, 38, 9,  33, 50, 42, 45, 53, 63, 30, 46, 39, 8,  7,  4};
            CHECK(gen.heavy_hitters() == h128);
            CHECK(bits(r[0]) == 0x3D775C29u);
            CHECK(bits(r[27]) == 0x3D7DE907u);
            CHECK(bits(r[127]) == 0x3C8DD577u);
        }
        if (t == 512) CHECK(std::vector<int>(gen.heavy_hitters().begin(), gen.heavy_hitters().begin() + 5) ==
                            std::vector<int>{338, 352, 14, 16, 403});
        if (t == 1024) CHECK(std::vector<int>(gen.heavy_hitters().begin(), gen.heavy_hitters().begin() + 5) ==
                             std::vector<int>{314, 715, 784, 941, 548});
        if (t == 4095) CHECK(bits(r[4094]) == 0x3C8ABBDFu);
    }
    CHECK(hash.value() == 0xBAEC2A10u);
}

TEST_CASE("an unknown policybook trace name is an input error naming it") {
    try {
        policybook_trace("decode-9999", "cfg.yaml: trace.name");
        FAIL("expected an InputError");
    } catch (const InputError& e) {
        CHECK(std::string(e.what()).find("cfg.yaml: trace.name") != std::string::npos);
        CHECK(std::string(e.what()).find("decode-9999") != std::string::npos);
    }
}
