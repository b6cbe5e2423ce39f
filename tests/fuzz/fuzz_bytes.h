// Reads a fuzz input as a stream of decisions for the structured harnesses (fuzz_trace,
// fuzz_policies). Past the end every read is 0, and 0 always means the ordinary choice, so a
// short input is a small valid case and each byte the fuzzer adds makes one thing stranger.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvsim::fuzz {

class Bytes {
public:
    Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}

    uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
    uint32_t u32() {
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(u8()) << (8 * i);
        return v;
    }
    // Any 32 bits as a float: NaN payloads, infinities, denormals, negative zero.
    float raw_float() {
        const uint32_t bits = u32();
        float x;
        std::memcpy(&x, &bits, 4);
        return x;
    }
    // A count: usually lo + (byte % span), and for the top bytes a value that probes a limit.
    int64_t count(int64_t lo, int64_t span) {
        const uint8_t b = u8();
        if (b < 224 || span <= 0) return lo + (span > 0 ? b % span : 0);
        static constexpr int64_t kOdd[] = {0, -1, 2, 65536, (int64_t{1} << 30), (int64_t{1} << 30) + 1,
                                           std::numeric_limits<int32_t>::max(),
                                           int64_t{std::numeric_limits<int32_t>::max()} + 1, int64_t{1} << 32,
                                           3037000500LL,  // its square overflows int64
                                           int64_t{1} << 40, std::numeric_limits<int64_t>::max(),
                                           std::numeric_limits<int64_t>::min(), -(int64_t{1} << 31), 1000000000,
                                           100000000};
        return kOdd[(b - 224) % (sizeof kOdd / sizeof kOdd[0])];
    }
    // A special float: the values that break comparisons, sums and products.
    float special() {
        static const float kSpecial[] = {std::numeric_limits<float>::quiet_NaN(),
                                         -std::numeric_limits<float>::quiet_NaN(),
                                         std::numeric_limits<float>::infinity(),
                                         -std::numeric_limits<float>::infinity(),
                                         3e38f,
                                         -3e38f,
                                         -0.0f,
                                         std::numeric_limits<float>::denorm_min(),
                                         1.5f,
                                         -0.1f,
                                         2.0f,
                                         1e20f,
                                         std::numeric_limits<float>::max(),
                                         std::numeric_limits<float>::min(),
                                         0.0f,
                                         1.0f};
        return kSpecial[u8() % (sizeof kSpecial / sizeof kSpecial[0])];
    }
    bool empty() const { return pos_ >= size_; }

private:
    const uint8_t* data_;
    size_t size_;
    size_t pos_ = 0;
};

// A small deterministic generator for bulk contents the bytes only seed (xorshift64*).
class Rng {
public:
    explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint64_t next() {
        state_ ^= state_ >> 12;
        state_ ^= state_ << 25;
        state_ ^= state_ >> 27;
        return state_ * 0x2545F4914F6CDD1Dull;
    }
    float uniform() { return static_cast<float>(next() >> 40) / static_cast<float>(1 << 24); }  // [0, 1)

private:
    uint64_t state_;
};

}  // namespace kvsim::fuzz
