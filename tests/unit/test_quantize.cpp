// KV-cache quantisation: round-trip error bounds, the KIVI arrangement (keys per channel, values
// per token), requantisation, pending key groups, memory arithmetic and spec validation.
#include <doctest/doctest.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>

#include "cache_math/quantize.h"
#include "base/errors.h"

using namespace kvsim;

namespace {

constexpr int kTokens = 96, kHeads = 2, kDim = 64;

std::size_t at(int64_t t, int h, int c, int heads = kHeads, int d = kDim) {
    return (static_cast<std::size_t>(t) * heads + h) * d + c;
}

QkvLayer gaussian_layer(int64_t tokens, int heads, int d, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    QkvLayer layer;
    layer.tokens = tokens;
    layer.k.resize(static_cast<std::size_t>(tokens) * heads * d);
    layer.v.resize(layer.k.size());
    for (float& x : layer.k) x = normal(rng);
    for (float& x : layer.v) x = normal(rng);
    return layer;
}

// Which elements share a scale, recomputed independently of the library: a group id per element.
// KIVI keys: (token group, head, channel); per token: (token, head, channel group).
int64_t group_of(int64_t t, int h, int c, bool per_channel, int key_group, int value_group, int d = kDim) {
    const int vg = std::min(value_group, d);
    if (per_channel) return ((t / key_group) * kHeads + h) * d + c;
    return (t * kHeads + h) * (d / vg) + c / vg;
}

struct Checked {
    double mean_rel_l2 = 0;  // mean over (token, head) rows of |x^ - x| / |x|
    bool within_bound = true;
    bool max_exact = true;
    bool on_grid = true;
};

// Checks every dequantised value against its fp16 input and its group's scale. `extra_steps`
// widens the bound by that many more steps of the group's max |x| (for a second round trip).
Checked check_roundtrip(const std::vector<float>& x, const std::vector<float>& y, int bits, bool per_channel,
                        int key_group, int value_group, double extra_steps = 0) {
    const int qmax = quant_qmax(bits);
    // Group max |fp16(x)| and the element that attains it.
    std::vector<float> max_abs(x.size(), 0.0f);
    std::vector<std::size_t> argmax(x.size(), 0);
    for (int64_t t = 0; t < kTokens; ++t)
        for (int h = 0; h < kHeads; ++h)
            for (int c = 0; c < kDim; ++c) {
                const int64_t g = group_of(t, h, c, per_channel, key_group, value_group);
                const float a = std::abs(round_to_fp16(x[at(t, h, c)]));
                if (a > max_abs[g]) max_abs[g] = a, argmax[g] = at(t, h, c);
            }
    Checked out;
    double rel_sum = 0;
    for (int64_t t = 0; t < kTokens; ++t)
        for (int h = 0; h < kHeads; ++h) {
            double err2 = 0, norm2 = 0;
            for (int c = 0; c < kDim; ++c) {
                const std::size_t i = at(t, h, c);
                const int64_t g = group_of(t, h, c, per_channel, key_group, value_group);
                const float scale = max_abs[g] / static_cast<float>(qmax);  // unrounded scale
                const float xin = round_to_fp16(x[i]);
                const double err = std::abs(static_cast<double>(y[i]) - xin);
                const double extra = extra_steps * max_abs[g] * (1 + 1e-3) + (extra_steps > 0) * 1e-3 * std::abs(xin);
                if (err > scale * (0.5 + 1e-3) + 1e-3 * std::abs(xin) + extra) out.within_bound = false;
                if (argmax[g] == i && err > 1e-3 * std::abs(xin)) out.max_exact = false;
                // The output is an integer multiple (|q| <= qmax) of the fp16 scale.
                const float s16 = quant_scale(max_abs[g], bits);
                const double q = y[i] / s16;
                if (std::abs(q - std::round(q)) > 1e-4 || std::abs(q) > qmax) out.on_grid = false;
                err2 += err * err;
                norm2 += static_cast<double>(xin) * xin;
            }
            rel_sum += std::sqrt(err2 / norm2);
        }
    out.mean_rel_l2 = rel_sum / (kTokens * kHeads);
    return out;
}

// Mean absolute error of K over the elements selected by `keep`.
template <class Keep>
double mean_key_error(const QkvLayer& layer, const DequantizedKV& dq, Keep keep, bool values = false) {
    const std::vector<float>& x = values ? layer.v : layer.k;
    const std::vector<float>& y = values ? dq.v : dq.k;
    double sum = 0;
    int64_t n = 0;
    for (int64_t t = 0; t < layer.tokens; ++t)
        for (int h = 0; h < kHeads; ++h)
            for (int c = 0; c < kDim; ++c)
                if (keep(t, c)) sum += std::abs(y[at(t, h, c)] - round_to_fp16(x[at(t, h, c)])), ++n;
    return sum / n;
}

}  // namespace

TEST_CASE("scalar numerics: fp16 rounding, scales, half-away-from-zero rounding and clamping") {
    CHECK(quant_qmax(8) == 127);
    CHECK(quant_qmax(4) == 7);
    CHECK_THROWS_AS(quant_qmax(2), std::invalid_argument);
    CHECK(round_to_fp16(1.0f + 1.0f / 4096) == 1.0f);         // below half an fp16 ulp
    CHECK(round_to_fp16(1.0f + 3.0f / 4096) == 1.0f + 1.0f / 1024);
    CHECK(round_to_fp16(1e6f) == 65504.0f);                    // saturates, no infinity
    CHECK(round_to_fp16(-1e6f) == -65504.0f);
    CHECK(quant_scale(7.0f, 4) == 1.0f);
    CHECK(quant_scale(0.0f, 8) == 0.0f);
    CHECK(quant_scale(1e-9f, 8) == 0.0f);  // rounds to 0 in fp16: a zero group
    // 2.5 and -2.5 steps round away from zero; beyond qmax clamps.
    CHECK(quant_roundtrip(2.5f, 1.0f, 7) == 3.0f);
    CHECK(quant_roundtrip(-2.5f, 1.0f, 7) == -3.0f);
    CHECK(quant_roundtrip(7.4f, 1.0f, 7) == 7.0f);
    CHECK(quant_roundtrip(9.0f, 1.0f, 7) == 7.0f);
    CHECK(quant_roundtrip(-9.0f, 1.0f, 7) == -7.0f);
    CHECK(quant_roundtrip(3.0f, 0.0f, 7) == 0.0f);
    // A group: max 14 -> scale 2; 5 -> round(2.5) = 3 -> 6.
    const float in[4] = {14.0f, 5.0f, -1.0f, -14.0f};
    float out[4];
    CHECK(roundtrip_group(in, out, 4, 1, 4) == 2.0f);
    CHECK(out[0] == 14.0f);
    CHECK(out[1] == 6.0f);
    CHECK(out[2] == -2.0f);  // -0.5 rounds away from zero to -1
    CHECK(out[3] == -14.0f);
    // Inputs are rounded to fp16 first: 2.4998 is 2.5 in fp16 and so rounds up to 3, not down to 2.
    const float near_half[2] = {127.0f, 2.4998f};
    CHECK(roundtrip_group(near_half, out, 2, 1, 8) == 1.0f);
    CHECK(out[1] == 3.0f);
    QkvLayer tiny;
    tiny.tokens = 2;
    tiny.k = {127.0f, -127.0f, 2.4998f, -2.4998f};  // KIVI: per channel over the 2 tokens
    tiny.v = {127.0f, 2.4998f, -2.4998f, -127.0f};  // per token
    const DequantizedKV dq = dequantize_layer(tiny, 1, 2, QuantSpec{8, 2, 2, false});
    CHECK(dq.k == std::vector<float>{127.0f, -127.0f, 3.0f, -3.0f});
    CHECK(dq.v == std::vector<float>{127.0f, 3.0f, -3.0f, -127.0f});
}

TEST_CASE("round trip on Gaussian data stays within half a scale step; int8 error << int4 error") {
    const QkvLayer layer = gaussian_layer(kTokens, kHeads, kDim, 20240611u);
    double rel[2][2] = {};  // [bits 8, 4][K, V]
    for (const int bits : {8, 4}) {
        for (const bool per_token_keys : {false, true}) {
            const QuantSpec spec{bits, 32, 16, per_token_keys};
            CAPTURE(bits);
            CAPTURE(per_token_keys);
            const DequantizedKV dq = dequantize_layer(layer, kHeads, kDim, spec);
            const Checked k = check_roundtrip(layer.k, dq.k, bits, !per_token_keys, 32, 16);
            const Checked v = check_roundtrip(layer.v, dq.v, bits, false, 32, 16);
            CHECK(k.within_bound);
            CHECK(v.within_bound);
            CHECK(k.max_exact);
            CHECK(v.max_exact);
            CHECK(k.on_grid);
            CHECK(v.on_grid);
            if (!per_token_keys) {
                rel[bits == 4][0] = k.mean_rel_l2;
                rel[bits == 4][1] = v.mean_rel_l2;
            }
            std::printf("quantize: int%d %s keys: mean relative L2 error K %.4f%%, V %.4f%%\n", bits,
                        per_token_keys ? "per-token" : "KIVI per-channel", 100 * k.mean_rel_l2, 100 * v.mean_rel_l2);
        }
    }
    for (int kv = 0; kv < 2; ++kv) {
        CHECK(rel[0][kv] < 0.01);
        CHECK(rel[1][kv] < 0.15);
        CHECK(rel[0][kv] * 8 < rel[1][kv]);  // int8 error well below int4 error
    }
    // A value_group at or above head_dim: the whole head shares one scale.
    const DequantizedKV whole = dequantize_layer(layer, kHeads, kDim, QuantSpec{4, 32, 1000, true});
    const Checked vw = check_roundtrip(layer.v, whole.v, 4, false, 32, kDim);
    CHECK(vw.within_bound);
    CHECK(vw.on_grid);
}

TEST_CASE("KIVI keys per channel: an outlier channel does not inflate other channels' error") {
    QkvLayer plain = gaussian_layer(kTokens, kHeads, kDim, 7u);
    QkvLayer outlier = plain;
    const int hot = 5;
    for (int64_t t = 0; t < kTokens; ++t)
        for (int h = 0; h < kHeads; ++h) outlier.k[at(t, h, hot)] *= 100.0f;
    const auto others = [&](int64_t, int c) { return c != hot; };
    const QuantSpec kivi{4, 32, kDim, false}, per_token{4, 32, kDim, true};
    const double kivi_plain = mean_key_error(plain, dequantize_layer(plain, kHeads, kDim, kivi), others);
    const double kivi_out = mean_key_error(outlier, dequantize_layer(outlier, kHeads, kDim, kivi), others);
    const double token_out = mean_key_error(outlier, dequantize_layer(outlier, kHeads, kDim, per_token), others);
    std::printf("quantize: int4 key error off the outlier channel: KIVI %.4f (no outlier %.4f), per-token %.4f\n",
                kivi_out, kivi_plain, token_out);
    CHECK(kivi_out == doctest::Approx(kivi_plain).epsilon(1e-12));  // per-channel scales are untouched
    CHECK(token_out > 5 * kivi_out);  // a shared per-token scale is inflated: most values round to 0
}

TEST_CASE("values per token: an outlier token does not inflate other tokens' error") {
    QkvLayer plain = gaussian_layer(kTokens, kHeads, kDim, 11u);
    QkvLayer outlier = plain;
    const int64_t hot = 40;
    for (int h = 0; h < kHeads; ++h)
        for (int c = 0; c < kDim; ++c) {
            outlier.v[at(hot, h, c)] *= 100.0f;
            outlier.k[at(hot, h, c)] *= 100.0f;
        }
    const auto others = [&](int64_t t, int) { return t != hot; };
    const QuantSpec kivi{4, 32, 16, false};
    const double v_plain = mean_key_error(plain, dequantize_layer(plain, kHeads, kDim, kivi), others, true);
    const DequantizedKV dq = dequantize_layer(outlier, kHeads, kDim, kivi);
    const double v_out = mean_key_error(outlier, dq, others, true);
    // Contrast: keys quantised per channel across the outlier's token group do get inflated.
    const auto same_group = [&](int64_t t, int) { return t != hot && t / 32 == hot / 32; };
    const double k_out = mean_key_error(outlier, dq, same_group);
    std::printf("quantize: int4 value error off the outlier token %.4f (no outlier %.4f); per-channel keys %.4f\n",
                v_out, v_plain, k_out);
    CHECK(v_out == doctest::Approx(v_plain).epsilon(1e-12));
    CHECK(k_out > 5 * v_out);
}

TEST_CASE("requantising int8 to int4 differs from direct int4 but keeps the int4 bound") {
    const QkvLayer layer = gaussian_layer(kTokens, kHeads, kDim, 99u);
    for (const bool per_token_keys : {false, true}) {
        CAPTURE(per_token_keys);
        const QuantSpec int8{8, 32, 16, per_token_keys}, int4{4, 32, 16, per_token_keys};
        const DequantizedKV q8 = dequantize_layer(layer, kHeads, kDim, int8);
        const DequantizedKV direct = dequantize_layer(layer, kHeads, kDim, int4);
        const DequantizedKV sunk = requantize(q8, kTokens, kHeads, kDim, int4);
        CHECK(sunk.k != direct.k);
        CHECK(sunk.v != direct.v);
        // A valid int4 round trip of what the cache held...
        const Checked k4 = check_roundtrip(q8.k, sunk.k, 4, !per_token_keys, 32, 16);
        const Checked v4 = check_roundtrip(q8.v, sunk.v, 4, false, 32, 16);
        CHECK(k4.within_bound);
        CHECK(v4.within_bound);
        CHECK(k4.on_grid);
        CHECK(v4.on_grid);
        // ...and against the original: within the int4 half step plus the int8 half step it inherited.
        const Checked k_orig = check_roundtrip(layer.k, sunk.k, 4, !per_token_keys, 32, 16, 0.5 / 127);
        const Checked orig = check_roundtrip(layer.v, sunk.v, 4, false, 32, 16, 0.5 / 127);
        CHECK(k_orig.within_bound);
        CHECK(orig.within_bound);
        CHECK(k_orig.mean_rel_l2 < 0.15);
        CHECK(orig.mean_rel_l2 < 0.15);
    }
}

TEST_CASE("key_group_pending: a key stays fp16 until its token group is complete") {
    // key_group 4: group 0 = positions 0..3 completes at step 3, group 1 = 4..7 at step 7.
    CHECK(key_group_pending(0, 0, 4));
    CHECK(key_group_pending(0, 2, 4));
    CHECK_FALSE(key_group_pending(0, 3, 4));
    CHECK_FALSE(key_group_pending(3, 3, 4));
    CHECK_FALSE(key_group_pending(2, 100, 4));
    CHECK(key_group_pending(4, 4, 4));
    CHECK(key_group_pending(7, 6, 4));
    CHECK_FALSE(key_group_pending(4, 7, 4));
    CHECK_FALSE(key_group_pending(7, 7, 4));
    CHECK(key_group_pending(8, 9, 4));
    // key_group 1: every key is quantised the step it arrives.
    CHECK_FALSE(key_group_pending(5, 5, 1));
    CHECK(key_group_pending(5, 4, 1));
    CHECK_THROWS_AS(key_group_pending(0, 0, 0), std::invalid_argument);
    CHECK_THROWS_AS(key_group_pending(-1, 0, 4), std::invalid_argument);
}

TEST_CASE("all-zero and fp16-underflowing groups dequantise to finite zeros; fp16 tier") {
    QkvLayer layer = gaussian_layer(40, kHeads, kDim, 3u);
    for (int c = 0; c < kDim; ++c) {
        layer.v[at(10, 1, c)] = 0.0f;
        layer.k[at(10, 1, c)] = 1e-9f;  // fp16 rounds to 0 (and its per-token scale to 0)
    }
    // A token group of keys where channel 3 is tiny: its scale is an fp16 subnormal or 0.
    for (int64_t t = 0; t < 8; ++t) layer.k[at(t, 0, 3)] = 3e-6f * static_cast<float>(t % 3);
    for (const int bits : {8, 4})
        for (const bool per_token_keys : {false, true}) {
            const DequantizedKV dq = dequantize_layer(layer, kHeads, kDim, QuantSpec{bits, 8, 16, per_token_keys});
            for (int c = 0; c < kDim; ++c) CHECK(dq.v[at(10, 1, c)] == 0.0f);
            if (per_token_keys)
                for (int c = 0; c < kDim; ++c) CHECK(dq.k[at(10, 1, c)] == 0.0f);
            CHECK(std::all_of(dq.k.begin(), dq.k.end(), [](float x) { return std::isfinite(x); }));
            CHECK(std::all_of(dq.v.begin(), dq.v.end(), [](float x) { return std::isfinite(x); }));
            for (int64_t t = 0; t < 8; ++t) CHECK(std::abs(dq.k[at(t, 0, 3)]) <= 1e-5f);
        }
    const DequantizedKV f16 = fp16_layer(layer);
    REQUIRE(f16.k.size() == layer.k.size());
    bool all_rounded = true, some_changed = false;
    for (std::size_t i = 0; i < layer.k.size(); ++i) {
        all_rounded = all_rounded && f16.k[i] == round_to_fp16(layer.k[i]) && f16.v[i] == round_to_fp16(layer.v[i]);
        some_changed = some_changed || f16.k[i] != layer.k[i];
    }
    CHECK(all_rounded);
    CHECK(some_changed);
}

TEST_CASE("an incomplete last key group and the thread count do not change the result") {
    const int64_t tokens = 70;  // key_group 32: groups 0..31, 32..63 and a partial 64..69
    const QkvLayer layer = gaussian_layer(tokens, kHeads, kDim, 5u);
    const QuantSpec spec{4, 32, 16, false};
    const DequantizedKV many = dequantize_layer(layer, kHeads, kDim, spec);
    DequantizedKV one;
    tbb::task_arena single(1);
    single.execute([&] { one = dequantize_layer(layer, kHeads, kDim, spec); });
    CHECK(one.k == many.k);
    CHECK(one.v == many.v);
    // The partial group is quantised over the tokens present: channel by channel, the group's
    // largest element comes back exactly up to fp16 scale rounding.
    for (int h = 0; h < kHeads; ++h)
        for (int c = 0; c < kDim; ++c) {
            float best = 0;
            int64_t arg = 64;
            for (int64_t t = 64; t < tokens; ++t)
                if (std::abs(round_to_fp16(layer.k[at(t, h, c)])) > best)
                    best = std::abs(round_to_fp16(layer.k[at(t, h, c)])), arg = t;
            CHECK(std::abs(many.k[at(arg, h, c)] - round_to_fp16(layer.k[at(arg, h, c)])) <= 1e-3 * best);
        }
}

TEST_CASE("dequantize_layer rejects bad specs and shapes") {
    const QkvLayer layer = gaussian_layer(8, kHeads, kDim, 1u);
    CHECK_THROWS_AS(dequantize_layer(layer, kHeads, kDim, QuantSpec{3, 32, 16, false}), std::invalid_argument);
    CHECK_THROWS_AS(dequantize_layer(layer, kHeads, kDim, QuantSpec{8, 0, 16, false}), std::invalid_argument);
    CHECK_THROWS_AS(dequantize_layer(layer, kHeads, kDim, QuantSpec{8, 32, 0, false}), std::invalid_argument);
    CHECK_THROWS_AS(dequantize_layer(layer, kHeads, kDim + 1, QuantSpec{8, 32, 1000, false}), std::invalid_argument);
    try {
        dequantize_layer(layer, kHeads, kDim, QuantSpec{8, 32, 24, false});
        FAIL("expected std::invalid_argument");
    } catch (const std::invalid_argument& e) {
        const std::string message = e.what();
        CHECK(message.find("value_group 24") != std::string::npos);
        CHECK(message.find("head_dim 64") != std::string::npos);
    }
}

TEST_CASE("memory arithmetic: bytes per token and compression against fp16") {
    const QuantSpec int8_kivi{8, 128, 128, false}, int4_kivi{4, 64, 64, false};
    CHECK(kv_bytes_per_token(128, 16, int8_kivi) == 512.0);
    CHECK(kv_bytes_per_token(128, 8, int8_kivi) == 260.0);  // K 128 + 2, V 128 + 2
    CHECK(compression_vs_fp16(128, 260.0) == doctest::Approx(512.0 / 260.0));
    CHECK(compression_vs_fp16(128, 260.0) == doctest::Approx(1.969).epsilon(1e-3));
    CHECK(kv_bytes_per_token(128, 4, int4_kivi) == 136.0);  // K 64 + 4, V 64 + 4
    CHECK(compression_vs_fp16(128, 136.0) == doctest::Approx(3.765).epsilon(1e-3));
    // Per-token keys: 2*ceil(d / value_group) scale bytes per token, like values.
    CHECK(kv_bytes_per_token(128, 4, QuantSpec{4, 64, 32, true}) == 144.0);  // (64 + 8) * 2
    // value_group above head_dim: one scale for the whole head; amortised key scales are fractional.
    CHECK(kv_bytes_per_token(128, 4, QuantSpec{4, 256, 1000, false}) == 64 + 1.0 + 64 + 2);
    CHECK(kv_bytes_per_token(96, 8, QuantSpec{8, 32, 1000, true}) == (96 + 2) * 2.0);
    CHECK(compression_vs_fp16(128, kv_bytes_per_token(128, 16, int4_kivi)) == 1.0);
    CHECK_THROWS_AS(kv_bytes_per_token(128, 2, int4_kivi), std::invalid_argument);
    CHECK_THROWS_AS(compression_vs_fp16(128, 0.0), std::invalid_argument);
}

TEST_CASE("check_quant_spec names the key in one line") {
    const auto message = [](const QuantSpec& spec, int head_dim) -> std::string {
        try {
            check_quant_spec(spec, head_dim, "where");
        } catch (const InputError& e) {
            return e.what();
        }
        return "no error";
    };
    CHECK(message(QuantSpec{3, 32, 128, false}, 128) == "where.bits: must be 4 or 8, got 3");
    CHECK(message(QuantSpec{8, 0, 128, false}, 128) == "where.key_group: must be >= 1, got 0");
    CHECK(message(QuantSpec{8, 32, 0, false}, 128) == "where.value_group: must be >= 1, got 0");
    CHECK(message(QuantSpec{4, 32, 24, false}, 128) == "where.value_group: 24 does not divide the head size 128");
    CHECK(message(QuantSpec{4, 32, 256, false}, 128) == "no error");  // above head_dim: whole head
    CHECK(message(QuantSpec{8, 1, 32, true}, 128) == "no error");
}
