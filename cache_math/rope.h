// RoPE (Su et al. 2021), "RoFormer: Enhanced Transformer with Rotary Position Embedding": within
// each head, pair i of a query or key turns by the angle position * frequency[i]. One definition
// for the model's forward pass (model/llama.cpp), the trace a capture writes (which records
// the model's pairing and frequencies) and the simulator's pre-RoPE low-rank keys
// (cache_math/lowrank.cpp), so a replay rotates exactly as the model did.
// Header-only: the model library (model) uses it without linking the simulator.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace kvsim {

// Which elements of a head rotate together: pair i is (2i, 2i+1) in Meta's Llama code (and
// llama.cpp's "normal" mode, into which the GGUF converters permute Llama's Q/K weights), (i,
// i + head_dim/2) in Qwen2 (llama.cpp's "neox" mode; the weights are stored unpermuted).
enum class RopePairing { adjacent, halves };
inline const char* to_string(RopePairing pairing) { return pairing == RopePairing::adjacent ? "adjacent" : "halves"; }
// "adjacent" or "halves"; false for anything else.
inline bool parse_rope_pairing(const std::string& text, RopePairing& out) {
    if (text == "adjacent") return out = RopePairing::adjacent, true;
    if (text == "halves") return out = RopePairing::halves, true;
    return false;
}

struct Rope {
    RopePairing pairing = RopePairing::adjacent;
    std::vector<double> frequencies;  // radians per position, per pair (head_dim / 2); empty: unknown
    bool known() const { return !frequencies.empty(); }
    bool operator==(const Rope& o) const { return pairing == o.pairing && frequencies == o.frequencies; }
};

// The unscaled frequencies theta^(-2i/head_dim), i < head_dim/2, in double: at positions near
// 10^5, position * frequency needs more than float's digits.
inline std::vector<double> rope_base_frequencies(double theta, int head_dim) {
    std::vector<double> frequencies(static_cast<std::size_t>(head_dim / 2));
    for (int i = 0; i < head_dim / 2; ++i) frequencies[static_cast<std::size_t>(i)] = 1.0 / std::pow(theta, 2.0 * i / head_dim);
    return frequencies;
}

// cos and sin of position * frequency[i], computed in double and rounded to float: what the
// rotation multiplies by (the model tabulates these per position).
inline void rope_cos_sin(const std::vector<double>& frequencies, int64_t position, float* cos, float* sin) {
    for (std::size_t i = 0; i < frequencies.size(); ++i) {
        const double angle = static_cast<double>(position) * frequencies[i];
        cos[i] = static_cast<float>(std::cos(angle));
        sin[i] = static_cast<float>(std::sin(angle));
    }
}

// Rotates one head in place by per-pair cos and sin: a' = a cos - b sin, b' = a sin + b cos, in
// float. Negating sin rotates back.
inline void rotate_head(float* head, int head_dim, RopePairing pairing, const float* cos, const float* sin) {
    const int pairs = head_dim / 2;
    const int stride = pairing == RopePairing::adjacent ? 2 : 1;       // first element of pair i
    const int partner = pairing == RopePairing::adjacent ? 1 : pairs;  // its partner's offset
    for (int i = 0; i < pairs; ++i) {
        float& a = head[stride * i];
        float& b = head[stride * i + partner];
        const float a0 = a, b0 = b;
        a = a0 * cos[i] - b0 * sin[i];
        b = a0 * sin[i] + b0 * cos[i];
    }
}

// RoPE on `count` rows of num_heads * head_dim floats at positions first_pos, first_pos + 1, ...;
// `inverse` rotates back (by the negated angle).
inline void apply_rope_rows(float* rows, int64_t first_pos, int64_t count, int num_heads, int head_dim,
                            const Rope& rope, bool inverse) {
    std::vector<float> cosine(rope.frequencies.size()), sine(rope.frequencies.size());
    for (int64_t t = 0; t < count; ++t) {
        rope_cos_sin(rope.frequencies, first_pos + t, cosine.data(), sine.data());
        if (inverse)
            for (float& s : sine) s = -s;
        float* row = rows + t * num_heads * head_dim;
        for (int h = 0; h < num_heads; ++h)
            rotate_head(row + h * head_dim, head_dim, rope.pairing, cosine.data(), sine.data());
    }
}

}  // namespace kvsim
