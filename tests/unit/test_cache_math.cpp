// cache_math/numerics.h: the shared fp16 conversion against Eigen's (an independent implementation),
// and the online softmax against the two-pass one.
#include <doctest/doctest.h>

#include <Eigen/Core>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cache_math/numerics.h"
#include "cache_math/tiers.h"

using namespace kvsim;

namespace {
// Bit-for-bit equality of two float arrays; an empty vector's data() may be null, which memcmp
// must never be given (UBSan aborts on it), so lengths are compared first.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}
}  // namespace

TEST_CASE("fp16 conversion: every half round-trips, and floats round as Eigen::half rounds them") {
    for (uint32_t h = 0; h < 0x10000u; ++h) {
        const uint16_t bits = static_cast<uint16_t>(h);
        const float f = half_bits_to_float(bits);
        const Eigen::half reference = Eigen::numext::bit_cast<Eigen::half>(bits);
        if (std::isnan(f)) {
            CHECK(std::isnan(static_cast<float>(reference)));
            continue;
        }
        REQUIRE(f == static_cast<float>(reference));
        REQUIRE(float_to_half_bits(f) == bits);
    }
    // Random bit patterns over the whole float range, plus every float near the boundaries: the
    // subnormal threshold, the overflow threshold and the ties.
    std::mt19937 rng(7);
    std::vector<uint32_t> patterns;
    for (int i = 0; i < 2000000; ++i) patterns.push_back(rng());
    for (uint32_t centre : {0x33000000u, 0x33800000u, 0x38800000u, 0x387fc000u, 0x477fe000u, 0x477ff000u, 0x3f800000u})
        for (uint32_t d = 0; d < 5000; ++d) patterns.push_back(centre - 2500 + d);
    int checked = 0;
    for (uint32_t u : patterns) {
        const float f = bits_float(u);
        if (std::isnan(f)) continue;
        const uint16_t mine = float_to_half_bits(f);
        const uint16_t eigen = Eigen::numext::bit_cast<uint16_t>(Eigen::half(f));
        if (mine != eigen) FAIL("float bits " << u << ": ours " << mine << ", Eigen " << eigen);
        ++checked;
    }
    CHECK(checked > 1900000);
    CHECK(round_to_fp16(1e6f) == 65504.0f);  // saturates instead of overflowing
    CHECK(round_to_fp16(-1e6f) == -65504.0f);
    CHECK(std::isnan(round_to_fp16(NAN)));
}

TEST_CASE("quantisation levels: half away from zero, clamped, zero scale gives zero") {
    const float scale = group_scale(1.0f, 7);
    CHECK(scale == round_to_fp16(1.0f / 7.0f));
    CHECK(quant_level(2.5f * scale, scale, 7) == 3.0f);   // a tie rounds away from zero
    CHECK(quant_level(-2.5f * scale, scale, 7) == -3.0f);
    CHECK(quant_level(100.0f, scale, 7) == 7.0f);
    CHECK(quant_level(-100.0f, scale, 7) == -7.0f);
    CHECK(group_scale(0.0f, 127) == 0.0f);
    CHECK(dequantize_level(quant_level(0.3f, 0.0f, 127), 0.0f) == 0.0f);
}

TEST_CASE("round_half_away: roundf's bits for every float on a stride through all 2^32 patterns, and the edges") {
    // The stride is odd, so the patterns visited cover every exponent and both signs; ties, the
    // largest non-whole floats and the specials are checked by name.
    std::size_t checked = 0;
    for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 601) {
        const float x = std::bit_cast<float>(static_cast<uint32_t>(bits));
        const float want = roundf(x), got = round_half_away(x);
        if (std::isnan(want)) {
            REQUIRE(std::isnan(got));
        } else {
            REQUIRE(std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want));
        }
        ++checked;
    }
    CHECK(checked > 7000000);
    for (const float x : {0.5f, -0.5f, 1.5f, -2.5f, 0.49999997f, -0.49999997f, 8388607.5f, -8388607.5f, 8388608.0f,
                          -0.0f, 0.0f, 1e-45f, -1e-45f, INFINITY, -INFINITY, 16777215.0f, 3.4028235e38f})
        CHECK(std::bit_cast<uint32_t>(round_half_away(x)) == std::bit_cast<uint32_t>(roundf(x)));
}

TEST_CASE("online softmax: the same weights and output as the two-pass softmax, within float rounding") {
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    const int n = 500, d = 8;
    std::vector<float> scores(n), values(n * d);
    for (float& s : scores) s = normal(rng);
    for (float& v : values) v = normal(rng);
    OnlineSoftmax online;
    std::vector<double> acc(d, 0.0);
    for (int j = 0; j < n; ++j) {
        float w = 0;
        const float rescale = online.add(scores[j], w);
        for (int i = 0; i < d; ++i) acc[i] = acc[i] * rescale + w * values[j * d + i];
    }
    double peak = -INFINITY, total = 0;
    for (float s : scores) peak = std::max<double>(peak, s);
    for (float s : scores) total += std::exp(s - peak);
    CHECK(online.maximum == static_cast<float>(peak));
    CHECK(online.sum == doctest::Approx(total).epsilon(1e-5));
    for (int i = 0; i < d; ++i) {
        double reference = 0;
        for (int j = 0; j < n; ++j) reference += std::exp(scores[j] - peak) / total * values[j * d + i];
        CHECK(acc[i] / online.sum == doctest::Approx(reference).epsilon(1e-5));
    }
}

TEST_CASE("online softmax: chunks attended apart and merged give the sequential result (split-K)") {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    const int n = 700, d = 4;
    std::vector<float> scores(n), values(n * d);
    for (float& s : scores) s = normal(rng);
    for (float& v : values) v = normal(rng);
    auto attend = [&](int first, int end, OnlineSoftmax& softmax, std::vector<float>& acc) {
        acc.assign(d, 0.0f);
        for (int j = first; j < end; ++j) {
            float w = 0;
            const float rescale = softmax.add(scores[j], w);
            for (int i = 0; i < d; ++i) acc[i] = acc[i] * rescale + w * values[j * d + i];
        }
    };
    OnlineSoftmax whole;
    std::vector<float> whole_acc;
    attend(0, n, whole, whole_acc);
    // Uneven chunks, an empty one among them, merged in order.
    const int bounds[] = {0, 1, 64, 64, 300, 699, 700};
    OnlineSoftmax merged;
    std::vector<float> merged_acc(d, 0.0f), part_acc;
    for (int c = 0; c + 1 < 7; ++c) {
        OnlineSoftmax part;
        attend(bounds[c], bounds[c + 1], part, part_acc);
        float mine = 0, theirs = 0;
        merged.merge(part, mine, theirs);
        for (int i = 0; i < d; ++i) merged_acc[i] = merged_acc[i] * mine + part_acc[i] * theirs;
    }
    CHECK(merged.maximum == whole.maximum);
    CHECK(merged.sum == doctest::Approx(whole.sum).epsilon(1e-5));
    for (int i = 0; i < d; ++i)
        CHECK(merged_acc[i] / merged.sum == doctest::Approx(whole_acc[i] / whole.sum).epsilon(1e-5));
    // Merging an empty softmax changes nothing; merging into an empty one takes the other's.
    OnlineSoftmax empty, copy = whole;
    float mine = 0, theirs = 0;
    copy.merge(empty, mine, theirs);
    CHECK(copy.maximum == whole.maximum);
    CHECK(copy.sum == whole.sum);
    CHECK(mine == 1.0f);
    CHECK(theirs == 0.0f);
    empty.merge(whole, mine, theirs);
    CHECK(empty.sum == whole.sum);
    CHECK(mine == 0.0f);
    CHECK(theirs == 1.0f);
}

// Random keys and values standing in for each tier's arrays, [token][kv_head][d].
struct RandomTiers {
    std::array<std::vector<float>, 3> k, v;
    TierArrays arrays;
    RandomTiers(int tokens, int kv_heads, int d, std::mt19937& rng) {
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (int tier = 0; tier < 3; ++tier) {
            k[tier].resize(static_cast<std::size_t>(tokens) * kv_heads * d);
            v[tier].resize(k[tier].size());
            for (float& x : k[tier]) x = normal(rng);
            for (float& x : v[tier]) x = normal(rng);
            arrays.k[tier] = k[tier].data();
            arrays.v[tier] = v[tier].data();
        }
    }
};

TEST_CASE("score_row gives each key fixed_order_dot's bits, scaled, whatever the count and head size") {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const int d : {8, 16, 20, 48, 64, 128}) {
        for (const int64_t count : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{300}}) {
            CAPTURE(d);
            CAPTURE(count);
            const int kv_heads = 3, kv = 2;
            std::vector<float> keys(static_cast<std::size_t>(count) * kv_heads * d), q(d);
            for (float& x : keys) x = normal(rng);
            for (float& x : q) x = normal(rng);
            std::vector<float> scores(count);
            score_row(q.data(), keys.data(), count, kv, kv_heads, d, scores.data());
            const float scale = 1.0f / std::sqrt(static_cast<float>(d));
            bool same = true;
            for (int64_t p = 0; p < count; ++p) {
                const float expected = fixed_order_dot(q.data(), keys.data() + (p * kv_heads + kv) * d, d) * scale;
                same = same && std::bit_cast<uint32_t>(scores[p]) == std::bit_cast<uint32_t>(expected);
            }
            CHECK(same);
        }
    }
}

TEST_CASE("score_rows_of_group gives each head score_row's bits, whatever the group, count and head size") {
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const int d : {8, 16, 20, 64, 100, 128}) {
        for (const int heads : {1, 2, 3, 4, 5}) {
            for (const int64_t count : {int64_t{1}, int64_t{8}, int64_t{16}, int64_t{23}, int64_t{33}, int64_t{300}}) {
                CAPTURE(d);
                CAPTURE(heads);
                CAPTURE(count);
                const int kv_heads = 3, kv = 1;
                std::vector<float> keys(static_cast<std::size_t>(count) * kv_heads * d), q(heads * d);
                for (float& x : keys) x = normal(rng);
                for (float& x : q) x = normal(rng);
                std::vector<std::vector<float>> scores(heads, std::vector<float>(count));
                std::vector<const float*> queries(heads);
                std::vector<float*> outs(heads);
                for (int h = 0; h < heads; ++h) {
                    queries[h] = q.data() + h * d;
                    outs[h] = scores[h].data();
                }
                score_rows_of_group(queries.data(), heads, keys.data(), count, kv, kv_heads, d, outs.data());
                const float scale = 1.0f / std::sqrt(static_cast<float>(d));
                bool same = true;
                for (int h = 0; h < heads; ++h)
                    for (int64_t p = 0; p < count; ++p) {
                        const float expected = fixed_order_dot(queries[h], keys.data() + (p * kv_heads + kv) * d, d) * scale;
                        same = same && std::bit_cast<uint32_t>(scores[h][p]) == std::bit_cast<uint32_t>(expected);
                    }
                CHECK(same);
            }
        }
    }
}

TEST_CASE("cached attention: tiers mixed, shared scores of any tier and weights alone give the same bits; the output is the softmax's") {
    // Head sizes with a fixed-size accumulation (64, 128) and without (48), over a held subset
    // whose keys and values sit at all three tiers (random arrays stand in for each tier).
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const int d : {48, 64, 128}) {
        CAPTURE(d);
        const int tokens = 300, kv_heads = 2, kv = 1;
        const RandomTiers random(tokens, kv_heads, d, rng);
        const TierArrays& arrays = random.arrays;
        std::vector<float> q(d);
        for (float& x : q) x = normal(rng);
        std::vector<int32_t> held;
        std::vector<uint8_t> key_tier(tokens), value_tier(tokens);
        for (int p = 0; p < tokens; ++p) {
            if (p % 3 != 1) held.push_back(p);
            key_tier[p] = static_cast<uint8_t>(p % 7 == 0 ? 1 : p % 5 == 0 ? 2 : 0);
            value_tier[p] = static_cast<uint8_t>(p % 4 == 0 ? 2 : p % 11 == 0 ? 1 : 0);
        }
        std::array<std::vector<float>, 3> tier_scores;
        for (int tier = 0; tier < 3; ++tier) {
            tier_scores[tier].resize(tokens);
            score_row(q.data(), arrays.k[tier], tokens, kv, kv_heads, d, tier_scores[tier].data());
        }
        Eigen::ArrayXf scratch;
        std::vector<float> out(d), weights(held.size());
        cached_attention_output(q.data(), held, key_tier, value_tier, arrays, kv, kv_heads, d, scratch, out.data(),
                                weights.data());
        // Scores shared for fp16 keys alone, for every tier, and for the quantised tiers alone.
        const std::array<std::array<const float*, 3>, 3> shares = {
            std::array<const float*, 3>{tier_scores[0].data(), nullptr, nullptr},
            std::array<const float*, 3>{tier_scores[0].data(), tier_scores[1].data(), tier_scores[2].data()},
            std::array<const float*, 3>{nullptr, tier_scores[1].data(), tier_scores[2].data()}};
        for (const auto& shared : shares) {
            std::vector<float> out_shared(d), weights_shared(held.size()), weights_alone(held.size());
            cached_attention_output(q.data(), held, key_tier, value_tier, arrays, kv, kv_heads, d, scratch,
                                    out_shared.data(), weights_shared.data(), shared);
            cached_attention_output(q.data(), held, key_tier, value_tier, arrays, kv, kv_heads, d, scratch, nullptr,
                                    weights_alone.data(), shared);
            CHECK(same_bits(out, out_shared));
            CHECK(same_bits(weights, weights_shared));
            CHECK(same_bits(weights, weights_alone));
        }

        // In double: softmax of q.k / sqrt(d) over held, each key and value at its tier.
        std::vector<double> score(held.size()), want(d, 0.0);
        double peak = -1e300, total = 0;
        for (std::size_t j = 0; j < held.size(); ++j) {
            const int p = held[j];
            const float* key = arrays.k[key_tier[p]] + (static_cast<std::size_t>(p) * kv_heads + kv) * d;
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += double(q[i]) * key[i];
            score[j] = dot / std::sqrt(double(d));
            peak = std::max(peak, score[j]);
        }
        for (double& x : score) total += (x = std::exp(x - peak));
        double worst_weight = 0, worst_out = 0, norm = 0;
        for (std::size_t j = 0; j < held.size(); ++j) {
            const int p = held[j];
            const float* value = arrays.v[value_tier[p]] + (static_cast<std::size_t>(p) * kv_heads + kv) * d;
            worst_weight = std::max(worst_weight, std::abs(weights[j] - score[j] / total));
            for (int i = 0; i < d; ++i) want[i] += score[j] / total * value[i];
        }
        for (int i = 0; i < d; ++i) {
            worst_out = std::max(worst_out, std::abs(out[i] - want[i]));
            norm = std::max(norm, std::abs(want[i]));
        }
        CHECK(worst_weight < 1e-6);
        CHECK(worst_out < 1e-5 * std::max(1.0, norm));
    }
}

TEST_CASE("cached attention: one quantised key among fp16 ones is read at its tier, whatever its place") {
    // Shared fp16 scores serve only a cache whose every held key is fp16: a lone INT8 key, at
    // each place among 40 held and each alignment of the tier array, must be scored as INT8.
    std::mt19937 rng(13);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int tokens = 48, kv_heads = 1, kv = 0, d = 64;
    const RandomTiers random(tokens, kv_heads, d, rng);
    std::vector<float> q(d);
    for (float& x : q) x = normal(rng);
    std::vector<float> fp16_scores(tokens);
    score_row(q.data(), random.arrays.k[0], tokens, kv, kv_heads, d, fp16_scores.data());
    std::vector<int32_t> held;
    for (int p = 0; p < tokens; ++p)
        if (p % 6 != 5) held.push_back(p);  // 40 held
    Eigen::ArrayXf scratch;
    int checked = 0;
    for (int offset = 0; offset < 4; ++offset) {
        std::vector<uint8_t> key_buffer(tokens + 4, 0), value_tier(tokens, 0);
        const std::span<uint8_t> key_tier(key_buffer.data() + offset, tokens);
        for (const int32_t quantised : held) {
            std::fill(key_tier.begin(), key_tier.end(), 0);
            key_tier[quantised] = 1;
            std::vector<float> out(d), out_shared(d);
            cached_attention_output(q.data(), held, key_tier, value_tier, random.arrays, kv, kv_heads, d, scratch,
                                    out.data(), nullptr);
            cached_attention_output(q.data(), held, key_tier, value_tier, random.arrays, kv, kv_heads, d, scratch,
                                    out_shared.data(), nullptr, {fp16_scores.data(), nullptr, nullptr});
            CHECK(same_bits(out, out_shared));
            ++checked;
        }
    }
    CHECK(checked == 160);
}

TEST_CASE("value sums of many caches at once: each output is its own cache's call's bits") {
    // Caches of one step as a replay's plans are: held sets that overlap, ascending, each ending at
    // the current token, over more than one block of positions; value tiers that differ between
    // caches; 1 to 5 heads (a pass takes four); 70 caches; two caches of another KV head; a cache
    // whose heads ask for no output.
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const int d : {8, 20, 64, 128})
        for (const std::size_t group : {std::size_t{1}, std::size_t{4}, std::size_t{5}}) {
            CAPTURE(d);
            CAPTURE(group);
            const int tokens = 600, kv_heads = 3, caches = 70, t = tokens - 1;
            const RandomTiers random(tokens, kv_heads, d, rng);
            std::vector<std::vector<int32_t>> held(caches);
            std::vector<std::vector<uint8_t>> key_tier(caches, std::vector<uint8_t>(tokens)), value_tier = key_tier;
            std::vector<std::vector<float>> q(group, std::vector<float>(d));
            for (auto& qh : q)
                for (float& x : qh) x = normal(rng) * 0.5f;
            std::uniform_real_distribution<double> uniform(0.0, 1.0);
            std::vector<std::vector<std::vector<float>>> fused_out(caches), own_out(caches);
            std::vector<Eigen::ArrayXf> scratch(caches);
            std::vector<CachedValueSums> sums(caches);
            std::vector<const CachedValueSums*> pointers;
            for (int c = 0; c < caches; ++c) {
                const double keep = 0.1 + 0.9 * c / caches;  // larger budgets hold more, mostly the same
                for (int p = 0; p < t; ++p)
                    if (uniform(rng) < keep) held[c].push_back(p);
                held[c].push_back(t);
                for (int p = 0; p < tokens; ++p) {
                    key_tier[c][p] = static_cast<uint8_t>(c % 3 == 0 ? p % 3 : 0);
                    value_tier[c][p] = static_cast<uint8_t>(c % 3 == 0 ? (p + c) % 3 : c % 5 == 0 ? 1 : 0);
                }
                const int kv = c >= caches - 2 ? 1 : 2;
                fused_out[c].assign(group, std::vector<float>(d, -1.0f));
                own_out[c] = fused_out[c];
                std::vector<CachedQuery> heads(group), own_heads(group);
                for (std::size_t h = 0; h < group; ++h) {
                    const bool wants_out = c != 7;
                    heads[h] = {q[h].data(), wants_out ? fused_out[c][h].data() : nullptr, nullptr, {}};
                    own_heads[h] = {q[h].data(), wants_out ? own_out[c][h].data() : nullptr, nullptr, {}};
                }
                Eigen::ArrayXf own_scratch;
                cached_attention_outputs(own_heads, held[c], key_tier[c], value_tier[c], random.arrays, kv, kv_heads, d,
                                         own_scratch);
                sums[c] = cached_attention_weights(heads, held[c], key_tier[c], value_tier[c], random.arrays, kv,
                                                   kv_heads, d, scratch[c]);
                pointers.push_back(&sums[c]);
            }
            cached_attention_values_of_caches(pointers);
            for (int c = 0; c < caches; ++c)
                for (std::size_t h = 0; h < group; ++h) {
                    CAPTURE(c);
                    CAPTURE(h);
                    CHECK(same_bits(fused_out[c][h], own_out[c][h]));
                }
        }
}

TEST_CASE("cached attention for a query group: each head's output and weights are its lone call's bits") {
    // Groups of 1 to 6 heads (a pass takes up to four: 5 and 6 take two) and of 71 (a multi-query
    // model's: a call takes 64 at a time), head sizes with the fused accumulation (64, 128) and
    // without (48); some heads ask for weights alone, some for outputs alone, and one head's scores
    // come shared.
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const int d : {48, 64, 128})
        for (const std::size_t group : {1, 2, 3, 4, 5, 6, 71}) {
            CAPTURE(d);
            CAPTURE(group);
            const int tokens = 260, kv_heads = 3, kv = 2;
            const RandomTiers random(tokens, kv_heads, d, rng);
            const TierArrays& arrays = random.arrays;
            std::vector<int32_t> held;
            std::vector<uint8_t> key_tier(tokens), value_tier(tokens);
            for (int p = 0; p < tokens; ++p) {
                if (p % 4 != 2) held.push_back(p);
                key_tier[p] = static_cast<uint8_t>(p % 6 == 0 ? 1 : p % 5 == 0 ? 2 : 0);
                value_tier[p] = static_cast<uint8_t>(p % 3 == 0 ? 2 : p % 7 == 0 ? 1 : 0);
            }
            std::vector<std::vector<float>> q(group, std::vector<float>(d)), shared_row(group, std::vector<float>(tokens));
            std::vector<std::vector<float>> out(group, std::vector<float>(d, -1.0f)), weights(group),
                lone_out(group, std::vector<float>(d, -1.0f)), lone_weights(group);
            std::vector<CachedQuery> heads(group);
            Eigen::ArrayXf scratch, lone_scratch;
            for (std::size_t h = 0; h < group; ++h) {
                for (float& x : q[h]) x = normal(rng) * 0.5f;
                const bool wants_out = h % 3 != 1, wants_weights = h % 2 == 0;
                weights[h].assign(wants_weights ? held.size() : 0, -1.0f);
                lone_weights[h] = weights[h];
                std::array<const float*, 3> shared{};
                if (h == 1) {  // fp16 keys' scores shared, as a replay step shares them
                    score_row(q[h].data(), arrays.k[0], tokens, kv, kv_heads, d, shared_row[h].data());
                    shared[0] = shared_row[h].data();
                }
                heads[h] = {q[h].data(), wants_out ? out[h].data() : nullptr, wants_weights ? weights[h].data() : nullptr,
                            shared};
                cached_attention_output(q[h].data(), held, key_tier, value_tier, arrays, kv, kv_heads, d, lone_scratch,
                                        wants_out ? lone_out[h].data() : nullptr,
                                        wants_weights ? lone_weights[h].data() : nullptr, shared);
            }
            cached_attention_outputs(heads, held, key_tier, value_tier, arrays, kv, kv_heads, d, scratch);
            for (std::size_t h = 0; h < group; ++h) {
                CAPTURE(h);
                CHECK(same_bits(out[h], lone_out[h]));
                CHECK(same_bits(weights[h], lone_weights[h]));
            }
        }
}
