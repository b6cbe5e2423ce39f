// The runtime's attention kernels (runtime/attention_kernels.h) and the packed tier storage they
// read (runtime/tier_store.h), against numerics.h's definitions one number at a time: every kernel
// set the build holds (portable, AVX2, AVX-512), every tier, scale groups of whole eights and
// sixteens, of other sizes and per channel (KIVI), head sizes of whole sixteens, of whole eights
// and with a tail past the last eight channels, and query groups of 1 to 9 heads; then one head's
// whole serving attention against the oracle's two-pass attention on the same cache.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <numeric>
#include <random>
#include <vector>

#include "policies/policy.h"
#include "runtime/attention_kernels.h"
#include "runtime/head_cache.h"
#include "runtime/tier_store.h"

using namespace kvsim;
using namespace kvsim::runtime;

namespace {

// One tier's store holding `slots` slots, added in a shuffled order and some removed again, so
// that a slot's row is not the slot itself; with group 0 at a quantised tier, per-channel scales
// for position groups of 3 (a slot holds position slot + 5).
struct Rows {
    TierStore store;
    std::vector<float> channel_scales;
    std::vector<int32_t> position_of_slot;
    std::vector<int> held;  // slots, by row
    int head_dim = 0;

    Rows(int tier, int slots, int d, int group, std::mt19937& rng) : head_dim(d) {
        std::normal_distribution<float> normal(0.0f, 1.5f);
        store.plan(tier, slots, d, group);
        const bool per_channel = tier != 0 && group == 0;
        position_of_slot.resize(slots);
        for (int s = 0; s < slots; ++s) position_of_slot[s] = s + 5;
        if (per_channel) {
            channel_scales.resize(static_cast<std::size_t>((slots + 5) / 3 + 1) * d);
            for (float& x : channel_scales) x = round_to_fp16(0.02f + std::abs(normal(rng)) / (tier == 1 ? 127 : 7));
        }
        std::vector<int> order(slots);
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<float> x(d);
        for (int slot : order) {
            for (float& v : x) v = normal(rng);
            store.add(slot);
            if (per_channel)
                store.write_with_channel_scales(slot, x.data(), scales_of(slot));
            else
                store.write(slot, x.data());
        }
        for (int i = 0; i < slots / 3; ++i) store.remove(order[static_cast<std::size_t>(i) * 2 % slots]);
        for (int r = 0; r < store.rows(); ++r) held.push_back(store.slot_of_row()[r]);
    }
    const float* scales_of(int slot) const {
        return channel_scales.data() + static_cast<std::size_t>(position_of_slot[slot] / 3) * head_dim;
    }
    TierRows rows() const {
        TierRows t{store.tier(), head_dim, store.rows(), store.row_bytes(), store.groups(), store.group_channels(),
                   store.half(), store.levels(), store.scales(), store.slot_of_row()};
        if (!channel_scales.empty()) {
            t.channel_scales = channel_scales.data();
            t.position_of_slot = position_of_slot.data();
            t.key_group = 3;
        }
        return t;
    }
    // Channel c of a slot as numerics.h defines it.
    float element(int slot, int c) const {
        if (channel_scales.empty()) return store.view().element(slot, c);
        std::vector<float> row(head_dim);
        store.read_with_channel_scales(slot, scales_of(slot), row.data());
        return row[c];
    }
};

struct Shape {
    int tier, head_dim, group;  // group 0: per-channel (KIVI) scales
};

std::vector<Shape> shapes() {
    std::vector<Shape> all;
    for (int tier = 0; tier < 3; ++tier)
        for (const auto& [d, groups] : std::vector<std::pair<int, std::vector<int>>>{
                 {128, {32, 8, 128, 12, 0}}, {192, {64}}, {48, {16, 48, 24, 0}}, {8, {8, 4, 0}}, {67, {16, 67, 0}}, {20, {5, 0}}})
            for (int group : groups)
                if (tier > 0 || group == groups.front()) all.push_back({tier, d, group});
    return all;
}

}  // namespace

TEST_CASE("attention kernels: each stored number reaches attention as numerics.h defines it, bit for bit") {
    // A query that is 1 on one channel and 0 elsewhere scores a row at exactly that channel's value
    // (scale 1), and a weight of 1 on one row accumulates exactly its values: what the kernels
    // widen and scale must be half_bits_to_float, and level * scale, to the last bit.
    std::mt19937 rng(11);
    for (const Shape& shape : shapes()) {
        const int d = shape.head_dim, slots = 41;
        const Rows r(shape.tier, slots, d, shape.group, rng);
        const TierRows t = r.rows();
        std::vector<float> scratch(kernel_scratch_floats(d, d));
        for (KernelSet set : kernel_sets()) {
            INFO("tier " << shape.tier << ", head size " << d << ", group " << shape.group << ", "
                         << kernel_set_name(set));
            for (int c = 0; c < d; ++c) {
                std::vector<float> q(d, 0.0f), scores(slots);
                q[c] = 1.0f;
                float peak = -INFINITY;
                score_rows_with(set, t, q.data(), 1, 1.0f, scores.data(), slots, &peak, scratch.data());
                for (int row = 0; row < t.count; ++row) REQUIRE(scores[row] == r.element(r.held[row], c));
            }
            std::vector<int32_t> index_of_slot(slots, 0);
            for (int row = 0; row < t.count; ++row) {
                std::vector<float> weights(slots, 0.0f), out(d, 0.0f);
                weights[row] = 1.0f;
                for (int i = 0; i < t.count; ++i) index_of_slot[r.held[i]] = i;
                accumulate_rows_with(set, t, weights.data(), slots, index_of_slot.data(), 1, out.data(),
                                     scratch.data());
                for (int c = 0; c < d; ++c) REQUIRE(out[c] == r.element(r.held[row], c));
            }
        }
    }
}

TEST_CASE("attention kernels: scores and weighted sums for query groups of 1 to 9 heads, within rounding") {
    // Against the same sums in double from numerics.h's numbers: each score within float rounding
    // of its terms' magnitude (n terms summed in float err by at most n * 2^-24 of it), each head's
    // peak the largest of its scores, each output within rounding of the weighted values'
    // magnitude; every kernel set alike.
    std::mt19937 rng(12);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    for (const Shape& shape : shapes()) {
        const int d = shape.head_dim, slots = 70;
        const Rows r(shape.tier, slots, d, shape.group, rng);
        const TierRows t = r.rows();
        std::vector<float> scratch(kernel_scratch_floats(d, d));
        for (int group = 1; group <= 9; ++group) {
            const std::size_t stride = slots + 3;
            std::vector<float> q(static_cast<std::size_t>(group) * d), weights(group * stride);
            for (float& x : q) x = normal(rng);
            for (float& x : weights) x = uniform(rng);
            std::vector<int32_t> index_of_slot(slots, -1);
            for (int i = 0; i < t.count; ++i) index_of_slot[r.held[i]] = (i * 7) % t.count;  // any order
            const float scale = 0.3f;
            for (KernelSet set : kernel_sets()) {
                INFO("tier " << shape.tier << ", head size " << d << ", group " << shape.group << ", " << group
                             << " query heads, " << kernel_set_name(set));
                std::vector<float> scores(group * stride, 0.0f), peaks(group, -INFINITY);
                std::vector<float> out(static_cast<std::size_t>(group) * d, 0.25f);  // accumulates onto what is there
                score_rows_with(set, t, q.data(), group, scale, scores.data(), stride, peaks.data(), scratch.data());
                accumulate_rows_with(set, t, weights.data(), stride, index_of_slot.data(), group, out.data(),
                                     scratch.data());
                for (int h = 0; h < group; ++h) {
                    float peak = -INFINITY;
                    std::vector<double> expected(d, 0.25), magnitude(d, 0.25);
                    for (int row = 0; row < t.count; ++row) {
                        double dot = 0, size = 0;
                        for (int c = 0; c < d; ++c) {
                            const double x = r.element(r.held[row], c);
                            dot += q[h * d + c] * x;
                            size += std::abs(q[h * d + c] * x);
                            const double w = weights[h * stride + index_of_slot[r.held[row]]];
                            expected[c] += w * x;
                            magnitude[c] += std::abs(w * x);
                        }
                        const float got = scores[h * stride + row];
                        REQUIRE(std::abs(got - scale * dot) <= (d + 2) * 0x1p-24 * scale * size);
                        peak = std::max(peak, got);
                    }
                    CHECK(peaks[h] == peak);
                    for (int c = 0; c < d; ++c)
                        REQUIRE(std::abs(out[h * d + c] - expected[c]) <= (t.count + 2) * 0x1p-24 * magnitude[c]);
                }
            }
        }
    }
}

TEST_CASE("attention kernels: a query the tile path cannot split scores as the AVX-512 kernels score it") {
    // The AMX path splits the query into int8 parts under a power-of-two scale; a query with NaN or
    // an infinity, or so large or small that the scale leaves float's range, takes the AVX-512
    // kernels instead, to the bit (NaN where they give NaN). Where the build or CPU has no tiles the
    // set is absent and there is nothing to compare.
    const std::vector<KernelSet> sets = kernel_sets();
    if (std::find(sets.begin(), sets.end(), KernelSet::amx) == sets.end()) return;
    std::mt19937 rng(14);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int tier = 1; tier <= 2; ++tier) {
        const int d = 128, slots = 300;
        const Rows r(tier, slots, d, 32, rng);
        const TierRows t = r.rows();
        std::vector<float> scratch(kernel_scratch_floats(d, d));
        for (const float odd : {NAN, INFINITY, -INFINITY, 3e38f, 1e-30f, 1e-42f}) {
            std::vector<float> q(4 * d);
            for (float& x : q) x = normal(rng);
            if (std::abs(odd) >= 1e38f || std::isnan(odd))
                q[2 * d + 17] = odd;  // one number of head 2
            else
                for (int c = 0; c < d; ++c) q[c] = odd * (c % 3 == 0 ? 1.0f : 0.5f);  // all of head 0 tiny
            std::vector<float> by_tiles(4 * slots, 0.0f), by_vectors(4 * slots, 0.0f);
            std::vector<float> peaks_tiles(4, -INFINITY), peaks_vectors(4, -INFINITY);
            score_rows_with(KernelSet::amx, t, q.data(), 4, 0.1f, by_tiles.data(), slots, peaks_tiles.data(),
                            scratch.data());
            score_rows_with(KernelSet::avx512, t, q.data(), 4, 0.1f, by_vectors.data(), slots,
                            peaks_vectors.data(), scratch.data());
            INFO("tier " << tier << ", odd number " << odd);
            CHECK(std::memcmp(by_tiles.data(), by_vectors.data(), by_tiles.size() * sizeof(float)) == 0);
            CHECK(std::memcmp(peaks_tiles.data(), peaks_vectors.data(), 4 * sizeof(float)) == 0);
        }
    }
}

TEST_CASE("tier store: rows stay packed at the front and every slot keeps its numbers as slots come and go") {
    std::mt19937 rng(13);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int tier = 0; tier < 3; ++tier) {
        const int d = 24, slots = 50;
        TierStore store;
        store.plan(tier, slots, d, 8);
        std::vector<std::vector<float>> expected(slots);  // what each held slot reads back
        std::vector<int> held;
        std::vector<float> x(d);
        for (int step = 0; step < 2000; ++step) {
            const bool add = held.empty() || (static_cast<int>(held.size()) < slots && rng() % 2);
            if (add) {
                int slot;
                do slot = static_cast<int>(rng() % slots);
                while (store.holds(slot));
                for (float& v : x) v = normal(rng);
                store.add(slot);
                store.write(slot, x.data());
                expected[slot].resize(d);
                store.read(slot, expected[slot].data());
                held.push_back(slot);
            } else {
                const std::size_t i = rng() % held.size();
                store.remove(held[i]);
                held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
            }
            INFO("tier " << tier << ", step " << step);
            REQUIRE(store.rows() == static_cast<int>(held.size()));
            std::vector<int> by_row(store.slot_of_row(), store.slot_of_row() + store.rows());
            std::vector<int> sorted_held = held;
            std::sort(by_row.begin(), by_row.end());
            std::sort(sorted_held.begin(), sorted_held.end());
            REQUIRE(by_row == sorted_held);
            for (int r = 0; r < store.rows(); ++r) REQUIRE(store.view().row(store.slot_of_row()[r]) == static_cast<std::size_t>(r));
            std::vector<float> row(d);
            for (int slot : held) {
                store.read(slot, row.data());
                REQUIRE(row == expected[slot]);
            }
        }
    }
}

TEST_CASE("tier store: a row is stored as numerics.h's scalar definitions give it, NaN, infinities and ties included") {
    // write() takes eight numbers at a time through the CPU's conversions where it can; each stored
    // bit must be what float_to_half_bits, group_scale and quant_level give one number at a time.
    std::mt19937 rng(17);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float nan_payload = std::bit_cast<float>(0x7fa12345u), negative_nan = std::bit_cast<float>(0xffc00001u);
    const float specials[] = {NAN, nan_payload, negative_nan, INFINITY, -INFINITY, 0.0f, -0.0f, 65504.0f, 65519.0f,
                              65520.0f, -70000.0f, 1e9f, 6.1e-5f, 6.0e-8f, 2.9802322e-8f, -2.9802326e-8f, 1e-40f,
                              -1e-40f, 1e-4f, 0.375f, -0.625f};
    for (const Shape& shape : shapes()) {
        if (shape.group == 0) continue;  // per-channel scales: write_with_channel_scales, scalar
        const int d = shape.head_dim, slots = 60;
        TierStore store;
        store.plan(shape.tier, slots, d, shape.group);
        std::vector<float> x(d);
        for (int slot = 0; slot < slots; ++slot) {
            const float magnitude = std::pow(10.0f, static_cast<float>(static_cast<int>(rng() % 13)) - 8.0f);
            for (float& v : x) v = normal(rng) * magnitude;
            if (slot % 3 == 1)  // a few special numbers anywhere in the row
                for (int k = 0; k < 3; ++k) x[rng() % d] = specials[rng() % std::size(specials)];
            if (slot % 5 == 2)  // halfway between two levels: the largest is 7 * 0.25, the rest ties
                for (int c = 0; c < d; ++c) x[c] = c % 7 == 0 ? 1.75f : (static_cast<float>(rng() % 14) - 6.5f) * 0.25f;
            if (slot % 11 == 4) std::fill(x.begin(), x.end(), 0.0f);  // scale 0
            if (slot % 13 == 6) std::fill(x.begin(), x.end(), NAN);   // nothing but NaN: scale 0 too
            store.add(slot);
            store.write(slot, x.data());
            const TierView view = store.view();
            const std::size_t r = view.row(slot);
            INFO("tier " << shape.tier << ", head size " << d << ", group " << shape.group << ", slot " << slot);
            if (shape.tier == 0) {
                for (int c = 0; c < d; ++c) REQUIRE(view.half[r * d + c] == float_to_half_bits(round_to_fp16(x[c])));
                continue;
            }
            const int qmax = quant_levels(shape.tier == 1 ? 8 : 4);
            const uint8_t* levels = view.levels + r * view.row_bytes;
            for (int g = 0; g < view.groups; ++g) {
                const int first = g * view.group_channels, end = std::min(d, first + view.group_channels);
                float largest = 0.0f;
                for (int c = first; c < end; ++c) largest = std::max(largest, std::abs(round_to_fp16(x[c])));
                const float scale = group_scale(largest, qmax);
                REQUIRE(view.scales[r * view.groups + g] == float_to_half_bits(scale));
                for (int c = first; c < end; ++c) {
                    // A NaN has no level: the row keeps 0 (a cast of a NaN would be undefined).
                    const float q = quant_level(round_to_fp16(x[c]), scale, qmax);
                    const int level = std::isnan(q) ? 0 : static_cast<int>(q);
                    if (shape.tier == 1)
                        REQUIRE(static_cast<int8_t>(levels[c]) == static_cast<int8_t>(level));
                    else
                        REQUIRE(int4_level(levels, c) == static_cast<int8_t>(static_cast<uint8_t>(level << 4)) >> 4);
                }
            }
            if (shape.tier == 2 && d % 2) REQUIRE((levels[d / 2] & 0xf0) == 0);  // the last byte's spare nibble
        }
    }
}

TEST_CASE("attention kernels: a softmax's total summed in double") {
    // One weight of 1 (the peak's) and many below half its float ulp: a float total loses them.
    std::mt19937 rng(14);
    std::uniform_real_distribution<float> uniform(0.0f, 6e-8f);
    for (std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{33}, std::size_t{100000}}) {
        std::vector<float> x(n);
        for (float& v : x) v = uniform(rng);
        x[0] = 1.0f;
        double total = 0;
        for (float v : x) total += v;
        CHECK(reciprocal_of_sum(x.data(), n) == doctest::Approx(1.0 / total).epsilon(1e-7));
    }
}

TEST_CASE("attention kernels: a head's serving attention within 1e-5 of the oracle's at FP16, INT8, INT4 and mixed") {
    // One head holding `tokens` positions at the given tiers (the last, the current token, at
    // FP16), attended once by the serving path (score_rows, exponentials, accumulate_rows) and once
    // by the oracle's two-pass attention over the same stored rows: each query head's output may
    // differ by summation order alone, ||serving - oracle|| / ||oracle|| < 1e-5 (the order the
    // runtime's agreement test holds over whole stories). Lengths of one row, of blocks and a part
    // (kernel blocks are 32 rows), groups of one to nine query heads (nine: eight, then one).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    REQUIRE(vector_kernels());  // otherwise the serving path below would be the portable loops
#endif
    const PolicyDescriptor* stratigraphic = find_policy("stratigraphic");
    REQUIRE(stratigraphic);
    static const std::map<std::string, std::string> no_files;
    std::mt19937 rng(15);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const std::vector<std::pair<const char*, std::vector<double>>> mixes = {
        {"FP16", {1, 0, 0}}, {"INT8", {0, 1, 0}}, {"INT4", {0, 0, 1}}, {"mixed", {0.3, 0.4, 0.3}}};
    for (const int d : {128, 40})
        for (const int value_group : {32, 8})
            for (const int tokens : {1, 2, 31, 33, 97, 300})
                for (const int group : {1, 4, 5, 9})
                    for (const auto& mix : mixes) {
                        // Not a structured binding: clang 14 cannot capture one in INFO's lambda.
                        const char* name = mix.first;
                        const std::vector<double>& share = mix.second;
                        INFO(name << ", head size " << d << ", scale group " << value_group << ", " << tokens
                                  << " tokens, " << group << " query heads");
                        const ParamValues params = resolve_params(*stratigraphic, {{"value_group", value_group}}, "test");
                        HeadPlan plan;
                        plan.group = group, plan.head_dim = d, plan.budget = tokens, plan.max_context = tokens;
                        const PolicyContext ctx{tokens, tokens + 1, 0, 1, 0, 1, d, &no_files};
                        HeadCache head(plan, [&] { return stratigraphic->make(params, ctx); });
                        std::vector<float> k(static_cast<std::size_t>(tokens) * d), v(k.size()),
                            q(static_cast<std::size_t>(group) * d);
                        for (float& x : k) x = normal(rng);
                        for (float& x : v) x = normal(rng);
                        for (float& x : q) x = 0.5f * normal(rng);
                        std::uniform_real_distribution<double> u(0.0, 1.0);
                        std::vector<uint8_t> tier(tokens);
                        for (uint8_t& t : tier) {
                            const double x = u(rng);
                            t = x < share[0] ? 0 : x < share[0] + share[1] ? 1 : 2;
                        }
                        tier.back() = 0;
                        head.bench_fill(tokens, k.data(), v.data(), [&](int p) { return tier[p]; });
                        REQUIRE(static_cast<int>(head.held().size()) == tokens);
                        std::vector<float> serving(q.size()), oracle(q.size());
                        head.bench_attend(q.data(), serving.data());
                        head.bench_attend(q.data(), oracle.data(), true);
                        for (int h = 0; h < group; ++h) {
                            double diff = 0, norm = 0;
                            for (int c = 0; c < d; ++c) {
                                const double a = serving[h * d + c], b = oracle[h * d + c];
                                diff += (a - b) * (a - b);
                                norm += b * b;
                            }
                            REQUIRE(norm > 0);
                            REQUIRE(std::sqrt(diff / norm) < 1e-5);
                        }
                    }
}
