// xoshiro128** with a splitmix32-style seeder, as the policybook reference harness defines it
// (../shared/reference/policybook-kvcache.md, section 1). Exact u32 arithmetic: the synthetic
// trace's hash depends on every draw.
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>

namespace kvsim {

class Xoshiro128 {
public:
    explicit Xoshiro128(uint32_t seed) {
        uint32_t x = seed;
        for (uint32_t& word : state_) {
            x += 0x9E3779B9u;
            word = mix32(x);
        }
        if ((state_[0] | state_[1] | state_[2] | state_[3]) == 0) state_[0] = 1;
    }

    static uint32_t mix32(uint32_t z) {
        z ^= z >> 16;
        z *= 0x21F0AAADu;
        z ^= z >> 15;
        z *= 0x735A2D97u;
        z ^= z >> 15;
        return z;
    }

    uint32_t next_u32() {
        uint32_t* s = state_;
        const uint32_t result = rotl(s[1] * 5u, 7) * 9u;
        const uint32_t t = s[1] << 9;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = rotl(s[3], 11);
        return result;
    }

    double next_float() { return next_u32() / 4294967296.0; }

    // Uniform in [0, n) by rejecting the low tail, n in [1, 2^32].
    uint32_t next_int(uint64_t n) {
        if (n < 1 || n > (uint64_t{1} << 32)) throw std::range_error("Xoshiro128::next_int: n out of range");
        const uint64_t threshold = ((uint64_t{1} << 32) - n) % n;
        uint32_t v = next_u32();
        while (v < threshold) v = next_u32();
        return static_cast<uint32_t>(v % n);
    }

    const uint32_t* state() const { return state_; }

private:
    static uint32_t rotl(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }
    uint32_t state_[4];
};

// Standard normal floats by Box-Muller over xoshiro128**: the synthetic Q/K/V traces' noise.
class NormalStream {
public:
    explicit NormalStream(uint32_t seed) : rng_(seed) {}
    float next() {  // Box-Muller; the second value is kept for the next call
        if (has_spare_) {
            has_spare_ = false;
            return spare_;
        }
        double u = rng_.next_float(), v = rng_.next_float();
        if (u < 1e-300) u = 1e-300;
        const double r = std::sqrt(-2.0 * std::log(u)), a = 6.283185307179586 * v;
        spare_ = static_cast<float>(r * std::sin(a));
        has_spare_ = true;
        return static_cast<float>(r * std::cos(a));
    }
    uint32_t next_int(uint32_t n) { return rng_.next_int(n); }
    double uniform() { return rng_.next_float(); }
    // Moves past the next n normals as next() would, without computing them: a pair costs two
    // raw draws. A generator copied before a skip replays exactly what the skip passed over.
    void skip(uint64_t n) {
        if (n > 0 && has_spare_) {
            has_spare_ = false;
            --n;
        }
        for (uint64_t pair = 0; pair < n / 2; ++pair) {
            rng_.next_u32();
            rng_.next_u32();
        }
        if (n % 2) next();
    }

private:
    Xoshiro128 rng_;
    bool has_spare_ = false;
    float spare_ = 0;
};

}  // namespace kvsim
