// Attention recomputed from Q/K traces, grouped-query replay, the two views, prefill and
// per-layer budgets.
#include <doctest/doctest.h>
#include <tbb/global_control.h>

#include <Eigen/Core>
#include <cmath>
#include <limits>
#include <cstring>

#include "helpers.h"
#include "sim/heavy_hitters.h"
#include "sim/qkv_attention.h"
#include "sim/rng.h"
#include "sim/synthetic_qkv.h"
#include "src/config.h"
#include "base/errors.h"
#include "src/eval.h"
#include "src/experiment.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

SyntheticQkvSpec tiny() { return synthetic_qkv_trace("tiny-256", "test"); }

// Records what the harness shows a policy; evicts nothing itself (wrapped in H2O's behaviour is
// not needed: tests use budgets above the sequence length).
struct Spy : Policy {
    std::vector<std::vector<float>>* seen;
    explicit Spy(std::vector<std::vector<float>>* s) : seen(s) {}
    void on_decode_step(int32_t, std::span<const float> attn) override { seen->emplace_back(attn.begin(), attn.end()); }
    void evict(int, std::vector<int32_t>&) override {}
    std::size_t bytes_per_slot() const override { return 0; }
};

// Replays `combos` together, then each alone, and hands `check` each combination's two totals
// (together first).
template <class Check>
void compare_together_and_alone(AttentionSource& source, const std::vector<ReplayCombo>& combos,
                                const ReplayOptions& options, const Check& check) {
    const auto together = replay(source, combos, options);
    for (std::size_t c = 0; c < combos.size(); ++c) {
        CAPTURE(combos[c].label);
        CAPTURE(combos[c].budget);
        const auto alone = replay(source, {combos[c]}, options);
        check(together[c].total, alone[0].total);
    }
}

// A replay's options measuring output error (on `sample` of the steps) and memory in `view`.
ReplayOptions output_options(AttentionView view, double sample) {
    ReplayOptions options;
    options.harness.view = view;
    options.output_error = options.memory = true;
    options.output_error_sample = sample;
    return options;
}

// Two replays of one combination measured alike: its output error, cosine and their sampling
// variance, bytes and evictions, bit for bit.
void check_same_outputs(const StreamMetrics& a, const StreamMetrics& b) {
    CHECK(a.output_steps > 0);
    CHECK(a.output_steps == b.output_steps);
    CHECK(std::memcmp(&a.output_rel_error, &b.output_rel_error, sizeof(double)) == 0);
    CHECK(std::memcmp(&a.output_cosine, &b.output_cosine, sizeof(double)) == 0);
    CHECK(std::memcmp(&a.output_error_variance, &b.output_error_variance, sizeof(double)) == 0);
    CHECK(std::memcmp(&a.cache_bytes, &b.cache_bytes, sizeof(double)) == 0);
    CHECK(a.eviction_calls == b.eviction_calls);
}

}  // namespace

TEST_CASE("skipping n normals leaves the stream where drawing them would, spare or not") {
    for (uint64_t before : {0, 1, 2, 5}) {
        for (uint64_t n : {0, 1, 2, 3, 7, 10}) {
            NormalStream drawn(42), skipped(42);
            for (uint64_t i = 0; i < before; ++i) {
                drawn.next();
                skipped.next();
            }
            for (uint64_t i = 0; i < n; ++i) drawn.next();
            skipped.skip(n);
            for (int i = 0; i < 5; ++i) CHECK(drawn.next() == skipped.next());
            CHECK(drawn.uniform() == skipped.uniform());
        }
    }
}

TEST_CASE("a synthetic Q/K/V layer is the same on one thread as on many") {
    const SyntheticQkvSpec spec = synthetic_qkv_trace("small-1024", "test");
    QkvLayer one;
    {
        tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 1);
        one = generate_synthetic_qkv_layer(spec, 2);
    }
    const QkvLayer many = generate_synthetic_qkv_layer(spec, 2);
    CHECK(one.q == many.q);
    CHECK(one.k == many.k);
    CHECK(one.v == many.v);
    // Each KV head's tokens start where the previous head's left the stream: heads differ.
    CHECK(many.k[0] != many.k[static_cast<std::size_t>(spec.head_dim)]);
}

TEST_CASE("a row's positions gathered as the attention stores it are the heavy hitters' pass over it") {
    // Rows from 1 to 255 weights (tails of every length below 16) and floors from none passing to
    // most passing: the attention's gather must be positions_at_or_above's, and the heavy hitters
    // from it the same as from the row alone.
    const SyntheticQkvSpec spec = tiny();
    const QkvLayer layer = generate_synthetic_qkv_layer(spec, 1);
    const QkvShape shape{spec.num_query_heads, spec.num_kv_heads, spec.head_dim};
    KeysByFeature keys;
    keys_by_feature(layer, shape, keys);
    // The rows as the attention gives them without a visitor: the visited rows must be the same
    // bits, and some floors are a weight of the row itself (ties at the floor are gathered).
    AttentionBlock plain;
    attention_from_qkv(layer, keys, shape, 1, 256, plain, "test");
    const auto floor_for = [&](int head, int64_t index) -> int32_t {
        const int64_t t = 1 + index;
        const float levels[] = {0.0f, 1e-9f, 1e-4f, 0.004f, 0.02f, 0.2f, 2.0f};
        float level = levels[(head + index) % 7];
        if ((head + index) % 3 == 0) level = plain.row(head, t)[(index * 7) % t];
        int32_t bits;
        std::memcpy(&bits, &level, sizeof bits);
        return (head + index) % 11 == 0 ? -1 : bits;  // -1 (and 0): nothing gathered
    };
    std::vector<int64_t> index_of_head(shape.num_query_heads, 0);
    int64_t rows_checked = 0, gathered_total = 0, fused_calls = 0;
    RowVisitor visit{[&](int head) { return floor_for(head, index_of_head[head]); },
                     [&](int head, int64_t index, std::span<const float> row, std::span<const int32_t> at) {
                         const int32_t floor = floor_for(head, index);
                         CHECK(index == index_of_head[head]);
                         ++index_of_head[head];
                         ++rows_checked;
                         const float* expected_row = plain.row(head, 1 + index);
                         REQUIRE(row.size() == static_cast<std::size_t>(1 + index));
                         CHECK(std::memcmp(row.data(), expected_row, row.size() * sizeof(float)) == 0);
                         if (floor <= 0) {
                             CHECK(at.empty());
                             return;
                         }
                         const std::span<const int32_t> expected = positions_at_or_above(row, floor);
                         REQUIRE(at.size() == expected.size());
                         CHECK(std::equal(at.begin(), at.end(), expected.begin()));
                         gathered_total += static_cast<int64_t>(at.size());
                         for (int k : {1, 4, 32}) {
                             std::vector<int32_t> from_row, from_gathered;
                             int32_t hint_row = floor, hint_gathered = floor;
                             top_k_positions(row, k, from_row, hint_row);
                             top_k_positions(row, k, from_gathered, hint_gathered, at);
                             CHECK(from_row == from_gathered);
                             CHECK(hint_row == hint_gathered);
                             ++fused_calls;
                         }
                     }};
    tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);  // the visitor counts
    AttentionBlock block;
    attention_from_qkv(layer, keys, shape, 1, 256, block, "test", &visit);
    CHECK(rows_checked == 255 * shape.num_query_heads);
    CHECK(gathered_total > 1000);  // the floors do gather
    CHECK(fused_calls > 0);
}

TEST_CASE("attention from Q and K matches a direct double-precision softmax") {
    const SyntheticQkvSpec spec = tiny();
    const QkvLayer layer = generate_synthetic_qkv_layer(spec, 1);
    const QkvShape shape{spec.num_query_heads, spec.num_kv_heads, spec.head_dim};
    AttentionBlock block;
    attention_from_qkv(layer, shape, 100, 140, block);
    const int d = spec.head_dim, hq = spec.num_query_heads, hkv = spec.num_kv_heads;
    double worst = 0;
    for (int h = 0; h < hq; ++h) {
        const int g = h / (hq / hkv);
        for (int64_t t = 100; t < 140; ++t) {
            std::vector<double> logits(t + 1);
            double peak = -1e300;
            for (int64_t j = 0; j <= t; ++j) {
                double dot = 0;
                for (int i = 0; i < d; ++i)
                    dot += double(layer.q[(t * hq + h) * d + i]) * layer.k[(j * hkv + g) * d + i];
                logits[j] = dot / std::sqrt(double(d));
                peak = std::max(peak, logits[j]);
            }
            double total = 0;
            for (double& l : logits) total += (l = std::exp(l - peak));
            const float* row = block.row(h, t);
            for (int64_t j = 0; j < t; ++j) worst = std::max(worst, std::abs(row[j] - logits[j] / total));
            worst = std::max(worst, std::abs(block.self_weight[h][t - 100] - logits[t] / total));
        }
    }
    CHECK(worst < 2e-6);
}

TEST_CASE("scores from keys stored by feature have the bits of scores from the trace's token-major keys") {
    // attention_from_qkv multiplies queries by a column-major copy of the keys (KeysByFeature).
    // Eigen packs either layout into the same values, except where a block's one row makes a
    // matrix-vector product: every block, whatever its rows and length (mod Eigen's panels of
    // 48 keys and 4 queries), must equal the softmax of the product with the token-major keys
    // (the computation before the copy), bit for bit.
    using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using StridedRows = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
    struct Case {
        int hq, hkv, d;
        int64_t first, end;
    };
    std::vector<Case> cases;
    for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 47, 48, 50, 64, 67})
        for (int64_t first : {1, 40, 95, 201}) cases.push_back({8, 2, 64, first, first + rows});
    for (int d : {8, 32, 128}) cases.push_back({4, 1, d, 30, 41});
    cases.push_back({6, 6, 32, 10, 17});  // one query head per KV head
    cases.push_back({12, 3, 128, 300, 366});
    // kvsim's score kernel takes every whole panel of 48 keys and leaves the last keys to Eigen
    // (a matrix-vector product where one key is left): block ends on, just past and just before a
    // panel's edge, rows that fill groups of eight queries or not, head sizes 1 to 256 (with and
    // without a whole peel of eight features; Eigen takes each in one depth sweep, so the kernel
    // serves them all on AVX-512 builds).
    for (int64_t end : {96, 97, 98, 143, 1007, 1008, 1009, 1055})
        for (int64_t rows : {2, 9, 64, 67}) cases.push_back({4, 2, 128, end - rows, end});
    for (int d : {1, 7, 100, 129, 256}) cases.push_back({2, 1, d, 150, 193});
    for (const Case& c : cases) {
        CAPTURE(c.hq);
        CAPTURE(c.d);
        CAPTURE(c.first);
        CAPTURE(c.end);
        QkvLayer layer;
        NormalStream normal(7 + c.d + c.first);
        layer.q.resize(static_cast<std::size_t>(c.end) * c.hq * c.d);
        layer.k.resize(static_cast<std::size_t>(c.end) * c.hkv * c.d);
        for (float& x : layer.q) x = static_cast<float>(2.0 * normal.next());
        for (float& x : layer.k) x = static_cast<float>(normal.next());
        AttentionBlock block;
        attention_from_qkv(layer, {c.hq, c.hkv, c.d}, c.first, c.end, block);
        const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
        int64_t differing = 0;
        for (int h = 0; h < c.hq; ++h) {
            const int g = h / (c.hq / c.hkv);
            const StridedRows q(layer.q.data() + c.first * c.hq * c.d + int64_t{h} * c.d, c.end - c.first, c.d,
                                Eigen::OuterStride<>(int64_t{c.hq} * c.d));
            const StridedRows k(layer.k.data() + int64_t{g} * c.d, c.end, c.d, Eigen::OuterStride<>(int64_t{c.hkv} * c.d));
            RowMatrix scores = (q * scale) * k.transpose();
            for (int64_t t = c.first; t < c.end; ++t) {
                auto row = scores.row(t - c.first).head(t + 1).array();
                row = (row - row.maxCoeff()).exp();
                const float inv_total = 1.0f / row.sum();
                const float* got = block.row(h, t);
                for (int64_t j = 0; j < t; ++j) differing += got[j] != row(j) * inv_total;
                differing += block.self_weight[h][t - c.first] != row(t) * inv_total;
            }
        }
        CHECK(differing == 0);
    }
}

TEST_CASE("a logit that overflows is found wherever it falls in a row") {
    // The check runs sixteen scores at a time, then the row's last few: an infinite logit in
    // either part, in a row of 41 or of 100, names its step.
    for (int64_t t : {40, 99})
        for (int64_t key : {int64_t{3}, int64_t{20}, t - 1, t}) {
            CAPTURE(t);
            CAPTURE(key);
            const int d = 8;
            QkvLayer layer;
            NormalStream normal(3);
            layer.q.resize(120 * d);
            layer.k.resize(120 * d);
            for (float& x : layer.q) x = static_cast<float>(normal.next());
            for (float& x : layer.k) x = static_cast<float>(normal.next());
            // q_t . k_key = 8e38, past float's largest (3.4e38)
            for (int i = 0; i < d; ++i) layer.q[t * d + i] = layer.k[key * d + i] = 1e19f;
            AttentionBlock block;
            std::string error;
            try {
                attention_from_qkv(layer, {1, 1, d}, 1, 120, block, "trace");
            } catch (const InputError& e) {
                error = e.what();
            }
            CAPTURE(error);
            CHECK(error.find("trace, head 0, step " + std::to_string(t) + ":") == 0);
        }
}

TEST_CASE("a synthetic Q/K/V trace replays the same from memory and from its HDF5 file") {
    const SyntheticQkvSpec spec = tiny();
    const std::string path = temp_dir() + "/tiny-qkv.h5";
    write_synthetic_qkv_trace(spec, path, TensorDtype::float32);
    const std::vector<PolicyEntry> policies = {entry("streaming_llm"), entry("h2o", {{"recent_window", 8}}),
                                               entry("tova"), entry("pyramidkv", {{"recent_window", 8}})};
    auto memory = make_synthetic_qkv_source(spec, 0);
    auto file = open_trace_source(path, 0);
    const auto a = replay_rows(*memory, policies, {32, 64});
    const auto b = replay_rows(*file, policies, {32, 64});
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
        CHECK(a[i].retained_mass == b[i].retained_mass);
        CHECK(a[i].recall == b[i].recall);
    }
    // The synthetic trace has heavy hitters to find: H2O, which keeps them, recalls more than a window.
    CHECK(find_row(a, "h2o(recent_window=8)", 32).recall > find_row(a, "streaming_llm", 32).recall);
    // Three layers: PyramidKV gives layers different shares, so it differs from SnapKV-like budgets.
    CHECK(find_row(a, "streaming_llm", 32).eviction_calls == 2 * 3 * (255 - 32 + 1));  // KV heads x layers
}

TEST_CASE("combinations on one KV head read its four heads' rows interleaved, and each gives the bits it gives alone") {
    // On one thread the replay runs all of a KV head's combinations together, and they share the
    // step's four rows interleaved by position (built once a step); a combination replayed alone
    // reads the rows themselves. Every metric must come out the same, bit for bit, in both views.
    SyntheticQkvSpec spec = synthetic_qkv_trace("small-1024", "test");
    REQUIRE(spec.num_query_heads == 4 * spec.num_kv_heads);
    spec.num_layers = 1;
    tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
    auto source = make_synthetic_qkv_source(spec, 300);
    const std::vector<PolicyEntry> policies = {entry("h2o"), entry("tova"), entry("snapkv"), entry("sliding_window")};
    for (AttentionView view : {AttentionView::raw, AttentionView::renormalized}) {
        CAPTURE(static_cast<int>(view));
        ReplayOptions options;
        options.harness.view = view;
        compare_together_and_alone(*source, expand_sweep(policies, {}, std::vector<int>{40, 64, 100}), options,
                                   [](const StreamMetrics& a, const StreamMetrics& b) {
                                       CHECK(std::memcmp(&a.retained_mass, &b.retained_mass, sizeof(double)) == 0);
                                       CHECK(a.heavy_hitter_hits == b.heavy_hitter_hits);
                                       CHECK(a.eviction_calls == b.eviction_calls);
                                       CHECK(a.steps == b.steps);
                                   });
    }
}

TEST_CASE("combinations replayed together share each step's scores, and give the bits they give alone") {
    // Together, a KV head's combinations take each key's score from one row per query head and tier
    // computed once a step (cached view: every step; otherwise the steps whose output error is
    // measured), and outside the cached view make their value sums in one pass over the step's
    // rows (cached_attention_values_of_caches); alone, each computes its own. The cached view's weights, the output error
    // (every step and sampled) and the memory must not move by a bit, tiered policies included.
    SyntheticQkvSpec spec = synthetic_qkv_trace("small-1024", "test");
    spec.num_layers = 1;
    tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
    // 600 steps: the shared value sums run over three blocks of positions, their sums carried.
    auto source = make_synthetic_qkv_source(spec, 600);
    // Four stratigraphic shapes of one tier format: together their INT8 and INT4 scores are shared too.
    const std::vector<PolicyEntry> policies = {entry("h2o"), entry("tova"), entry("stratigraphic"),
                                               entry("stratigraphic", {{"surface", 0.1}}),
                                               entry("stratigraphic", {{"surface", 0.5}, {"int4_share", 0.1}}),
                                               entry("stratigraphic", {{"int8_share", 0.4}})};
    for (AttentionView view : {AttentionView::cached, AttentionView::raw, AttentionView::renormalized}) {
        for (double sample : {1.0, 0.25}) {
            CAPTURE(static_cast<int>(view));
            CAPTURE(sample);
            compare_together_and_alone(*source, expand_sweep(policies, {}, std::vector<int>{70, 90, 110, 130}),
                                       output_options(view, sample), [](const StreamMetrics& a, const StreamMetrics& b) {
                                           check_same_outputs(a, b);
                                           CHECK(std::memcmp(&a.retained_mass, &b.retained_mass, sizeof(double)) == 0);
                                       });
        }
    }
}

TEST_CASE("a replay that measures no attention metric gives the same outputs, bytes and evictions") {
    // HarnessOptions::attention_metrics off (a search's streaming and tier fits): no retained
    // mass, no heavy hitters made; what the policies see and do must not move by a bit.
    SyntheticQkvSpec spec = synthetic_qkv_trace("small-1024", "test");
    spec.num_layers = 1;
    auto source = make_synthetic_qkv_source(spec, 180);
    const std::vector<PolicyEntry> policies = {entry("h2o"), entry("tova"), entry("stratigraphic"),
                                               entry("stratigraphic", {{"surface", 0.1}}), entry("sliding_window")};
    for (AttentionView view : {AttentionView::renormalized, AttentionView::raw, AttentionView::cached}) {
        for (double sample : {1.0, 0.25}) {
            CAPTURE(static_cast<int>(view));
            CAPTURE(sample);
            ReplayOptions options = output_options(view, sample);
            const auto combos = expand_sweep(policies, {}, std::vector<int>{40, 64, 100});
            const auto with = replay(*source, combos, options);
            options.harness.attention_metrics = false;
            const auto without = replay(*source, combos, options);
            REQUIRE(with.size() == without.size());
            for (std::size_t c = 0; c < with.size(); ++c) {
                CAPTURE(combos[c].label);
                const StreamMetrics &a = with[c].total, &b = without[c].total;
                CHECK(a.heavy_hitter_possible > 0);
                CHECK(b.heavy_hitter_possible == 0);
                CHECK(b.retained_mass == 0);
                check_same_outputs(a, b);
            }
        }
    }
}

TEST_CASE("the full cache's outputs kept in a memo give a replay the same bits, and a second replay reads them") {
    // A search replays its fitting sequences some forty times; FullOutputMemo computes the full
    // cache's output once. The first replay fills it, the next reads it: both must give the bits
    // of a replay without it, streaming heads (whose passes then make no scores) and others alike.
    SyntheticQkvSpec spec = synthetic_qkv_trace("small-1024", "test");
    spec.num_layers = 2;
    auto source = make_synthetic_qkv_source(spec, 160);
    const std::vector<PolicyEntry> policies = {
        entry("h2o"), entry("stratigraphic"), entry("streaming_attention", {{"sinks", 4}, {"recent", 16}, {"lambda", 0.9}})};
    auto same_bits = [](const std::vector<ComboResult>& a, const std::vector<ComboResult>& b) {
        REQUIRE(a.size() == b.size());
        for (std::size_t c = 0; c < a.size(); ++c) {
            CAPTURE(c);
            check_same_outputs(a[c].total, b[c].total);
        }
    };
    for (AttentionView view : {AttentionView::renormalized, AttentionView::cached}) {
        for (double sample : {1.0, 0.25}) {
            for (std::size_t only = 0; only <= policies.size(); ++only) {  // each policy alone, then all together
                CAPTURE(static_cast<int>(view));
                CAPTURE(sample);
                CAPTURE(only);
                const std::vector<PolicyEntry> chosen =
                    only < policies.size() ? std::vector<PolicyEntry>{policies[only]} : policies;
                const auto combos = expand_sweep(chosen, {}, std::vector<int>{48, 96});
                ReplayOptions options = output_options(view, sample);
                options.output_error_seed = 3;
                const auto plain = replay(*source, combos, options);

                FullOutputMemo memo(std::size_t{1} << 30);
                options.full_outputs = &memo;
                const auto filling = replay(*source, combos, options);
                CHECK(memo.bytes() > 0);
                const FullOutputMemo::Stream* kept = memo.stream(source.get(), 0, 1, 0);
                REQUIRE(kept);
                CHECK(kept->complete);
                const auto reading = replay(*source, combos, options);
                same_bits(plain, filling);
                same_bits(plain, reading);

                // A replay that measures other steps (another seed) neither reads nor refills it.
                if (sample < 1) {
                    ReplayOptions other = options;
                    other.output_error_seed = 4;
                    other.full_outputs = nullptr;
                    const auto other_plain = replay(*source, combos, other);
                    other.full_outputs = &memo;
                    same_bits(other_plain, replay(*source, combos, other));
                }

                // The second replay read the memo: outputs altered there move its output error.
                for (int s = 0; s < static_cast<int>(source->shape().sequence_lengths.size()); ++s)
                    for (int layer = 0; layer < spec.num_layers; ++layer)
                        for (int kv = 0; kv < spec.num_kv_heads; ++kv)
                            for (float& x : memo.stream(source.get(), s, layer, kv)->outputs) x *= 2;
                const auto altered = replay(*source, combos, options);
                for (std::size_t c = 0; c < combos.size(); ++c)
                    CHECK(altered[c].total.output_rel_error != plain[c].total.output_rel_error);

                // No room: nothing kept, the same bits.
                FullOutputMemo none(0);
                options.full_outputs = &none;
                same_bits(plain, replay(*source, combos, options));
                CHECK(none.bytes() == 0);
            }
        }
    }
}

namespace {

// A Q/K/V source's blocks, handed over whole: what a replay of an attention trace reads. Its
// replay takes every block's rows of every head before any harness steps; a Q/K/V source's
// makes each KV head's rows just before that KV head's harnesses step through them.
class WholeBlocks : public AttentionSource {
public:
    explicit WholeBlocks(AttentionSource& inner) : inner_(inner) {}
    const AttentionShape& shape() const override { return inner_.shape(); }
    std::string description() const override { return inner_.description(); }
    void read_block(int sequence, int layer, int64_t first, int64_t end, AttentionBlock& block) override {
        inner_.read_block(sequence, layer, first, end, block);
    }
    int64_t block_floats(int64_t wanted) const override { return inner_.block_floats(wanted); }

private:
    AttentionSource& inner_;
};

}  // namespace

TEST_CASE("a Q/K/V replay made KV head by KV head gives the bits of one made from whole blocks, at any thread count") {
    SyntheticQkvSpec spec = synthetic_qkv_trace("small-1024", "test");
    REQUIRE(spec.num_query_heads == 4 * spec.num_kv_heads);
    spec.num_layers = 2;
    std::vector<PolicyEntry> policies = {entry("h2o"), entry("tova"), entry("snapkv"), entry("sliding_window")};
    PolicyEntry ada = entry("snapkv");
    ada.adakv = true;
    ada.adakv_params = {{"floor", 0.2}};
    ada.adakv_where = "test: adakv";
    policies.push_back(ada);
    const auto combos = expand_sweep(policies, {}, std::vector<int>{40, 100});
    auto run = [&](bool whole, AttentionView view, int threads) {
        tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
        auto qkv = make_synthetic_qkv_source(spec, 400);
        WholeBlocks blocks(*qkv);
        ReplayOptions options;
        options.harness.view = view;
        options.block_floats = 1;  // the source's least: blocks of 64 rows of the longest length
        std::vector<double> values;
        for (const ComboResult& r : replay(whole ? static_cast<AttentionSource&>(blocks) : *qkv, combos, options))
            for (const StreamMetrics& m : r.by_head)
                values.insert(values.end(), {m.retained_mass, double(m.heavy_hitter_hits), double(m.eviction_calls)});
        return values;
    };
    for (AttentionView view : {AttentionView::raw, AttentionView::renormalized}) {
        CAPTURE(static_cast<int>(view));
        const auto reference = run(true, view, 1);
        REQUIRE(reference.size() == combos.size() * 2 * spec.num_kv_heads * 3);
        CHECK(std::memcmp(run(false, view, 1).data(), reference.data(), reference.size() * sizeof(double)) == 0);
        CHECK(std::memcmp(run(false, view, 2).data(), reference.data(), reference.size() * sizeof(double)) == 0);
        CHECK(std::memcmp(run(false, view, 3).data(), reference.data(), reference.size() * sizeof(double)) == 0);
        CHECK(std::memcmp(run(true, view, 3).data(), reference.data(), reference.size() * sizeof(double)) == 0);
    }
}

TEST_CASE("the renormalized view divides each head's row by what it keeps, then combines the group") {
    // Two query heads over one KV head, four steps, no eviction (budget above the length).
    std::vector<std::vector<float>> seen;
    HarnessOptions options;
    options.view = AttentionView::renormalized;
    options.reduce = GroupReduce::mean;
    Harness harness(std::make_unique<Spy>(&seen), 100, 8, options, "spy", "");
    const float a[3] = {0.2f, 0.1f, 0.3f}, b[3] = {0.5f, 0.25f, 0.05f};
    const float* rows[2] = {a, b};
    const float self[2] = {0.4f, 0.2f};
    const std::span<const int32_t> heavy[2] = {};
    GroupStep step;
    step.t = 3;
    step.rows = rows;
    step.self_weight = self;
    step.heavy = heavy;
    // Hold positions 0..2 by feeding steps 1 and 2 first.
    for (int32_t t = 1; t <= 3; ++t) {
        step.t = t;
        harness.step(step);
    }
    REQUIRE(seen.size() == 3);
    // Step 3 holds 0, 1, 2: head a keeps 0.6 of 1.0 -> divide by 0.6 + 0.4; head b by 0.8 + 0.2.
    CHECK(seen[2][0] == doctest::Approx((0.2 / 1.0 + 0.5 / 1.0) / 2));
    // Step 1 holds only position 0: head a renormalises by 0.2 + 0.4, head b by 0.5 + 0.2.
    CHECK(seen[0][0] == doctest::Approx((0.2 / 0.6 + 0.5 / 0.7) / 2));
}

TEST_CASE("retained mass is each head's kept weights summed in position order, whatever the weights") {
    // sum_kept_weights (the harness's retained mass and renormalized view) sums in any order where
    // that is exact, and in position order where it may not be. Rows whose order matters: 0.75,
    // then sixteen weights of a quarter of its last bit in double at odd positions 32 apart (in
    // order each rounds away; summed apart from the 0.75, as a second chain of additions does,
    // they add 4 bits); weights below float's normal range; 1.5 and 1.5, then sixteen of
    // 2^-29 + 2^-52 (in order each loses its last bit, past 2); a -0; and an ordinary row.
    const float quarter_bit = 0x1p-55f, past_two = 0x1.000002p-29f;
    constexpr int64_t t = 520;
    std::vector<std::vector<float>> rows_of_heads(5, std::vector<float>(t, 0.0f));
    rows_of_heads[0][0] = 0.75f;
    rows_of_heads[2][0] = rows_of_heads[2][1] = 1.5f;
    for (int k = 0; k < 16; ++k) {
        rows_of_heads[0][32 * k + 1] = quarter_bit;
        rows_of_heads[2][32 * k + 3] = past_two;
    }
    for (int64_t j = 0; j < t; ++j) {
        rows_of_heads[1][j] = j % 3 == 0 ? 1e-42f : 0.001f;
        rows_of_heads[3][j] = j == 7 ? -0.0f : 0.0009765625f;
        rows_of_heads[4][j] = 0.0001f * static_cast<float>(j % 5);
    }
    // Every group size (the sums go four heads at a time, and the rest one by one where exact in
    // any order, else two and one at a time in order), every row in every head,
    // every prefix of kept positions: every position, every other one, and runs of three (so
    // four kept slots are consecutive positions now and then, not always).
    for (std::size_t group : {1, 2, 3, 4, 5, 7}) {
        CAPTURE(group);
        const float* rows[7];
        std::vector<double> retained(group);
        std::vector<float> gathered;
        int64_t differing = 0, copies_differing = 0;
        // Each row in each head of the group, beside the ordinary row in every other head; a
        // group of four also from its rows interleaved by position, as the replay hands them.
        std::vector<float> interleaved;
        for (bool by_position : {false, true})
        for (std::size_t problem = 0; problem < 5 * group; ++problem)
            for (int stride : {1, 2, 0})  // 0: runs of three, one position left out after each
                for (int64_t held = 0; (stride == 0 ? held + held / 3 : held * stride) < t; held += held < 40 ? 1 : 7) {
                    std::vector<int32_t> kept;
                    for (int64_t j = 0; j < held; ++j) kept.push_back(static_cast<int32_t>(stride == 0 ? j + j / 3 : j * stride));
                    for (std::size_t h = 0; h < group; ++h)
                        rows[h] = rows_of_heads[h == problem % group ? problem / group : 4].data();
                    // As the replay hands them: interleaved, with interleave_rows' word on whether
                    // every weight is in the range where the sums are exact in any order.
                    interleaved.assign(4 * t, 0.0f);
                    const bool bounded = group == 4 && interleave_rows({rows, group}, t, interleaved.data());
                    gathered.assign(group * kept.size(), -1.0f);
                    sum_kept_weights({rows, group}, kept, gathered.data(), retained.data(),
                                     by_position && group == 4 ? interleaved.data() : nullptr, bounded);
                    // Without copies too, as for the policies that keep by position.
                    std::vector<double> retained_alone(group);
                    sum_kept_weights({rows, group}, kept, nullptr, retained_alone.data(),
                                     by_position && group == 4 ? interleaved.data() : nullptr, bounded);
                    for (std::size_t h = 0; h < group; ++h) {
                        double in_order = 0;
                        for (std::size_t j = 0; j < kept.size(); ++j) {
                            in_order += rows[h][kept[j]];
                            copies_differing += std::memcmp(&gathered[h * kept.size() + j], &rows[h][kept[j]], 4) != 0;
                        }
                        differing += std::memcmp(&retained[h], &in_order, sizeof(double)) != 0;
                        differing += std::memcmp(&retained_alone[h], &in_order, sizeof(double)) != 0;
                    }
                }
        CHECK(differing == 0);
        CHECK(copies_differing == 0);
    }
    // The orders differ on those rows: in order, and the small weights first.
    double first_in_order = 0, third_in_order = 0;
    for (float w : rows_of_heads[0]) first_in_order += w;
    for (float w : rows_of_heads[2]) third_in_order += w;
    CHECK(first_in_order == 0.75);
    CHECK(third_in_order == 3.0 + 16 * 0x1p-29);
}

TEST_CASE("interleave_rows lays four rows out by position and says whether every weight is +0 or in [2^-29, 2)") {
    // Lengths around the four-wide loop's edges; one weight out of the range at every position
    // of every row, in turn, and the range's edges themselves.
    for (int64_t t : {1, 3, 4, 5, 8, 13, 16, 17, 20, 31, 33, 64, 67}) {
        CAPTURE(t);
        std::vector<std::vector<float>> rows(4, std::vector<float>(t));
        for (int h = 0; h < 4; ++h)
            for (int64_t p = 0; p < t; ++p) rows[h][p] = p % 5 == 0 ? 0.0f : 0.001f * static_cast<float>(h + 1 + p % 7);
        const float* pointers[4] = {rows[0].data(), rows[1].data(), rows[2].data(), rows[3].data()};
        std::vector<float> out(4 * t);
        REQUIRE(interleave_rows(pointers, t, out.data()));
        int misplaced = 0;
        for (int64_t p = 0; p < t; ++p)
            for (int h = 0; h < 4; ++h) misplaced += std::memcmp(&out[4 * p + h], &rows[h][p], 4) != 0;
        CHECK(misplaced == 0);
        const float in_range[] = {0x1p-29f, 0x1.fffffep0f, 0.0f};
        const float out_of_range[] = {0x1.fffffep-30f, 2.0f, -0.0f, -0.5f, 1e-42f, std::numeric_limits<float>::quiet_NaN(),
                                      std::numeric_limits<float>::infinity()};
        int wrong = 0;
        for (int h = 0; h < 4; ++h)
            for (int64_t p = 0; p < t; ++p) {
                const float kept = rows[h][p];
                for (float w : in_range) {
                    rows[h][p] = w;
                    wrong += !interleave_rows(pointers, t, out.data());
                }
                for (float w : out_of_range) {
                    rows[h][p] = w;
                    wrong += interleave_rows(pointers, t, out.data());
                }
                rows[h][p] = kept;
            }
        CHECK(wrong == 0);
    }
}

TEST_CASE("views, reduction and a full-size cache") {
    const SyntheticQkvSpec spec = tiny();
    auto run = [&](const std::string& view, const std::string& reduce, int budget, int prefill = 0) {
        ExperimentConfig config;
        config.trace.synthetic = "qkv";
        config.trace.name = "tiny-256";
        config.budgets = {budget};
        config.policies = {entry("sliding_window"), entry("h2o", {{"recent_window", 4}}), entry("snapkv", {{"recent_window", 4}})};
        config.attention_view = view;
        config.group_reduce = reduce;
        config.prefill_tokens = prefill;
        return run_experiment(config, {}, false).records;
    };
    // A cache as long as the sequence forgets nothing, whatever the policy.
    for (const ResultRecord& r : run("renormalized", "mean", 256)) {
        CHECK(r.retained_mass == doctest::Approx(1.0).epsilon(1e-5));
        CHECK(r.heavy_hitter_recall == 1.0);
        CHECK(r.eviction_calls == 0);
    }
    const auto raw = run("raw", "mean", 24), renorm = run("renormalized", "mean", 24), by_max = run("raw", "max", 24);
    // The attention-free policy does not care how attention is shown; H2O does.
    CHECK(raw[0].retained_mass == renorm[0].retained_mass);
    CHECK(raw[1].retained_mass != renorm[1].retained_mass);
    CHECK(raw[1].retained_mass != by_max[1].retained_mass);
    // Prefill: the prompt enters whole, is compressed once, and only decode steps are measured.
    const auto prefilled = run("raw", "mean", 24, 100);
    // Per (layer, KV head): one compression after the prompt, then one per decode step 100..255.
    CHECK(prefilled[0].eviction_calls == 3 * 2 * (1 + (255 - 100 + 1)));
    CHECK(prefilled[0].steps == 3 * 4 * (255 - 100 + 1));
}

TEST_CASE("per-layer budgets: a flat profile equals the scalar budget; a wrong length is named") {
    ExperimentConfig config;
    config.file = "cfg.yaml";
    config.trace.synthetic = "qkv";
    config.trace.name = "tiny-256";
    config.budgets = {40};
    config.layer_budget_profiles = {{"flat", 40, {40, 40, 40}, "cfg.yaml: layer_budgets"},
                                    {"pyramid", 40, {60, 40, 20}, "cfg.yaml: layer_budgets"}};
    config.policies = {entry("h2o", {{"recent_window", 8}})};
    config.per_layer = true;
    const auto records = run_experiment(config, {}, false).records;
    const ResultRecord *scalar = nullptr, *flat = nullptr;
    for (const ResultRecord& r : records)
        if (r.layer < 0 && r.budget_label == "40") scalar = &r;
        else if (r.layer < 0 && r.budget_label == "flat") flat = &r;
    REQUIRE(scalar);
    REQUIRE(flat);
    CHECK(scalar->retained_mass == flat->retained_mass);
    int per_layer_records = 0;
    for (const ResultRecord& r : records) per_layer_records += r.layer >= 0;
    CHECK(per_layer_records == 3 * 3);  // three columns x three layers

    config.layer_budget_profiles = {{"short", 40, {40, 40}, "cfg.yaml: layer_budgets"}};
    CHECK_THROWS_WITH_AS(run_experiment(config, {}, false),
                         doctest::Contains("cfg.yaml: layer_budgets: 2 per-layer budgets, but trace"), InputError);
}

TEST_CASE("Spearman rank correlation, ties by average rank") {
    CHECK(spearman({1, 2, 3, 4}, {10, 20, 30, 40}) == doctest::Approx(1.0));
    CHECK(spearman({1, 2, 3, 4}, {4, 3, 2, 1}) == doctest::Approx(-1.0));
    // x ranks 1, 2.5, 2.5, 4; y ranks 1, 2, 3, 4: r = 4.5 / sqrt(4.5 * 5).
    CHECK(spearman({1, 2, 2, 3}, {1, 2, 3, 4}) == doctest::Approx(4.5 / std::sqrt(4.5 * 5.0)));
    CHECK(std::isnan(spearman({1, 1, 1}, {1, 2, 3})));
}
