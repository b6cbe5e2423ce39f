// Streaming heads: exact window + decayed linear state, checked against naive double-precision
// references, and DuoAttention pattern-file parsing with its error messages.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "sim/rng.h"
#include "cache_math/streaming_heads.h"
#include "base/errors.h"

using namespace kvsim;

namespace {

// Keys, values and queries for a toy sequence, uniform in [-scale, scale].
struct Sequence {
    int d;
    std::vector<std::vector<float>> keys, values, queries;
};

Sequence random_sequence(int d, int n, uint32_t seed, double scale = 1.5) {
    Xoshiro128 rng(seed);
    auto draw = [&] {
        std::vector<float> x(d);
        for (float& xi : x) xi = static_cast<float>((2.0 * rng.next_float() - 1.0) * scale);
        return x;
    };
    Sequence s{d, {}, {}, {}};
    for (int i = 0; i < n; ++i) {
        s.keys.push_back(draw());
        s.values.push_back(draw());
        s.queries.push_back(draw());
    }
    return s;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
    double acc = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) acc += double(a[i]) * b[i];
    return acc;
}

double kernel(const std::vector<float>& q, const std::vector<float>& k) {
    double acc = 0.0;
    for (std::size_t i = 0; i < q.size(); ++i) acc += streaming_feature(q[i]) * streaming_feature(k[i]);
    return acc;
}

// The header's output formula written out token by token: `exact` are softmax-attended,
// `folded` are (token, decay weight) pairs seen only through the kernel.
std::vector<double> reference_output(const Sequence& s, const std::vector<float>& q, const std::vector<int>& exact,
                                     const std::vector<std::pair<int, double>>& folded) {
    const int d = s.d;
    std::vector<double> lin_num(d, 0.0);
    double lin_den = 0.0;
    for (auto [j, w] : folded) {
        const double kq = w * kernel(q, s.keys[j]);
        lin_den += kq;
        for (int i = 0; i < d; ++i) lin_num[i] += kq * s.values[j][i];
    }
    std::vector<double> out(d, 0.0);
    if (exact.empty()) {
        for (int i = 0; i < d; ++i) out[i] = lin_num[i] / std::max(lin_den, 1e-6);
        return out;
    }
    double max_score = -1e300, kernel_mass = 0.0;
    for (int j : exact) {
        max_score = std::max(max_score, dot(q, s.keys[j]) / std::sqrt(double(d)));
        kernel_mass += kernel(q, s.keys[j]);
    }
    std::vector<double> soft(d, 0.0);
    double soft_sum = 0.0;
    for (int j : exact) {
        const double w = std::exp(dot(q, s.keys[j]) / std::sqrt(double(d)) - max_score);
        soft_sum += w;
        for (int i = 0; i < d; ++i) soft[i] += w * s.values[j][i];
    }
    for (int i = 0; i < d; ++i) out[i] = (kernel_mass * soft[i] / soft_sum + lin_num[i]) / (kernel_mass + lin_den);
    return out;
}

double max_abs_diff(const std::vector<float>& got, const std::vector<double>& want) {
    double worst = 0.0;
    for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(double(got[i]) - want[i]));
    return worst;
}

std::vector<float> output_of(StreamingHeadState& head, const std::vector<float>& q) {
    std::vector<float> out(q.size());
    head.output(q.data(), out.data());
    return out;
}

std::string temp_path(const std::string& name) {
#ifdef KVSIM_TEST_TMP
    const std::filesystem::path dir = KVSIM_TEST_TMP;
#else
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / "kvsim_test_streaming_heads";
#endif
    std::filesystem::create_directories(dir);
    return (dir / name).string();
}

std::string write_file(const std::string& name, const std::string& text) {
    const std::string path = temp_path(name);
    std::ofstream(path, std::ios::binary) << text;
    return path;
}

}  // namespace

TEST_CASE("streaming head with nothing folded is exact softmax attention") {
    const int d = 16;
    const Sequence s = random_sequence(d, 60, 11);
    for (double lambda : {1.0, 0.9}) {  // with nothing folded the decay must not matter
        StreamingHeadState head(d, {4, 64, lambda});
        std::vector<int> all;
        for (int t = 0; t < 60; ++t) {
            head.admit(t, s.keys[t].data(), s.values[t].data());
            all.push_back(t);
            CHECK(max_abs_diff(output_of(head, s.queries[t]), reference_output(s, s.queries[t], all, {})) < 1e-5);
        }
        CHECK(head.folded_tokens() == 0);
    }
    // A window that exactly covers the sequence (sinks + recent == tokens) folds nothing either.
    StreamingHeadState tight(d, {3, 9, 1.0});
    std::vector<int> all;
    for (int t = 0; t < 12; ++t) {
        tight.admit(t, s.keys[t].data(), s.values[t].data());
        all.push_back(t);
    }
    CHECK(tight.folded_tokens() == 0);
    CHECK(max_abs_diff(output_of(tight, s.queries[0]), reference_output(s, s.queries[0], all, {})) < 1e-5);
}

TEST_CASE("sinks=0, recent=1 is decayed linear attention") {
    const int d = 8, n = 300;
    const double lambda = 0.97;
    const Sequence s = random_sequence(d, n, 23);
    StreamingHeadState head(d, {0, 1, lambda});
    for (int t = 0; t < n; ++t) {
        head.admit(t, s.keys[t].data(), s.values[t].data());
        if (t % 37 != 36 && t != n - 1) continue;
        // Naive: token j < t was folded at step j + 1, so at step t it weighs lambda^(t - j - 1);
        // the current token is exact with kernel weight 1.
        std::vector<double> num(d, 0.0);
        double den = 0.0;
        for (int j = 0; j <= t; ++j) {
            const double w = (j == t ? 1.0 : std::pow(lambda, t - j - 1)) * kernel(s.queries[t], s.keys[j]);
            den += w;
            for (int i = 0; i < d; ++i) num[i] += w * s.values[j][i];
        }
        for (double& x : num) x /= den;
        CHECK(max_abs_diff(output_of(head, s.queries[t]), num) < 1e-4);
    }
    CHECK(head.folded_tokens() == n - 1);
}

TEST_CASE("recent=0 leaves an empty exact set: the output is the linear readout") {
    const int d = 8, n = 120;
    const double lambda = 0.95;
    const Sequence s = random_sequence(d, n, 31);
    StreamingHeadState head(d, {0, 0, lambda});
    for (int t = 0; t < n; ++t) head.admit(t, s.keys[t].data(), s.values[t].data());
    CHECK(head.exact_positions().empty());
    // Each token was folded at its own step: S = sum_j lambda^(t - j) phi(k_j) v_j^T.
    Eigen::MatrixXd state = Eigen::MatrixXd::Zero(d, d);
    Eigen::VectorXd z = Eigen::VectorXd::Zero(d);
    std::vector<std::pair<int, double>> folded;
    for (int j = 0; j < n; ++j) {
        const double w = std::pow(lambda, n - 1 - j);
        folded.emplace_back(j, w);
        for (int a = 0; a < d; ++a) {
            z[a] += w * streaming_feature(s.keys[j][a]);
            for (int b = 0; b < d; ++b) state(a, b) += w * streaming_feature(s.keys[j][a]) * s.values[j][b];
        }
    }
    CHECK((head.state_matrix() - state).cwiseAbs().maxCoeff() < 1e-9);
    CHECK((head.state_normaliser() - z).cwiseAbs().maxCoeff() < 1e-9);
    for (int i : {0, 50, 119})
        CHECK(max_abs_diff(output_of(head, s.queries[i]), reference_output(s, s.queries[i], {}, folded)) < 1e-5);

    // Nothing admitted at all: zeros, not NaN.
    StreamingHeadState empty(d, {4, 8, 0.9});
    for (float x : output_of(empty, s.queries[0])) CHECK(x == 0.0f);
}

TEST_CASE("sinks + window + folded tokens follow the documented mix") {
    const int d = 8, n = 40, sinks = 2, recent = 3;
    const double lambda = 0.9;
    const Sequence s = random_sequence(d, n, 47);
    StreamingHeadState head(d, {sinks, recent, lambda});
    for (int t = 0; t < n; ++t) {
        head.admit(t, s.keys[t].data(), s.values[t].data());
        std::vector<int> exact;
        std::vector<std::pair<int, double>> folded;
        for (int j = 0; j <= t; ++j) {
            if (j < sinks || j > t - recent)
                exact.push_back(j);
            else  // folded at step j + recent, read at step t
                folded.emplace_back(j, std::pow(lambda, t - j - recent));
        }
        CHECK(max_abs_diff(output_of(head, s.queries[t]), reference_output(s, s.queries[t], exact, folded)) < 1e-5);
    }
}

TEST_CASE("a state read now and then gives what one read every step gives") {
    // Folded tokens wait beside the state until it is read, then enter as one product at their own
    // decays (a sampled replay reads a head at one step in eight). So a head read on a sparse
    // schedule, with gaps longer than kMaxWaiting among them, must give the outputs and the state
    // of a head read at every step, to rounding, and both the reference formula's.
    for (const int d : {8, 20, 128})
        for (const double lambda : {0.0, 0.5, 0.93, 1.0})
            for (const int recent : {0, 5}) {
                CAPTURE(d);
                CAPTURE(lambda);
                CAPTURE(recent);
                const int n = 150, sinks = 2;
                const Sequence s = random_sequence(d, n, 91 + d);
                StreamingHeadState every(d, {sinks, recent, lambda}), sparse(d, {sinks, recent, lambda});
                Xoshiro128 rng(5);
                int reads = 0;
                for (int t = 0; t < n; ++t) {
                    every.admit(t, s.keys[t].data(), s.values[t].data());
                    sparse.admit(t, s.keys[t].data(), s.values[t].data());
                    const std::vector<float> each = output_of(every, s.queries[t]);
                    // Read at 1 step in 6, and not at all over steps 60 to 109 (past kMaxWaiting).
                    if ((t < 60 || t >= 110) && rng.next_float() < 1.0 / 6) {
                        ++reads;
                        const std::vector<float> now_and_then = output_of(sparse, s.queries[t]);
                        for (int i = 0; i < d; ++i) CHECK(std::abs(now_and_then[i] - each[i]) <= 1e-6 * (std::abs(each[i]) + 1e-3));
                        std::vector<int> exact;
                        std::vector<std::pair<int, double>> folded;
                        for (int j = 0; j <= t; ++j) {
                            if (j < sinks || (recent > 0 && j > t - recent))
                                exact.push_back(j);
                            else  // folded at step j + recent, read at step t
                                folded.emplace_back(j, std::pow(lambda, t - j - recent));
                        }
                        CHECK(max_abs_diff(now_and_then, reference_output(s, s.queries[t], exact, folded)) < 1e-5);
                    }
                }
                CHECK(reads > 10);
                CHECK(sparse.folded_tokens() == every.folded_tokens());
                const Eigen::MatrixXd a = every.state_matrix(), b = sparse.state_matrix();
                CHECK((a - b).cwiseAbs().maxCoeff() <= 1e-12 * std::max(1.0, a.cwiseAbs().maxCoeff()));
                CHECK((every.state_normaliser() - sparse.state_normaliser()).cwiseAbs().maxCoeff() <=
                      1e-12 * std::max(1.0, every.state_normaliser().cwiseAbs().maxCoeff()));
            }
}

TEST_CASE("a query's output does not depend on the group it is asked with") {
    // The runtime and the replay ask for a KV head's query heads together; each query's output
    // must be the one it has alone, so that neither the group size nor a query's place in it
    // changes a figure.
    for (const int d : {8, 20, 128}) {
        CAPTURE(d);
        const int n = 90;  // past the window of 40, so the state and 43 exact tokens both count
        const Sequence s = random_sequence(d, n, 3 + d);
        StreamingHeadState head(d, {3, 40, 0.9});
        for (int t = 0; t < n; ++t) {
            head.admit(t, s.keys[t].data(), s.values[t].data());
            if (t % 9 != 0 && t != 1) continue;
            for (int group = 1; group <= 6; ++group) {
                std::vector<const float*> queries;
                for (int g = 0; g < group; ++g) queries.push_back(s.queries[(t + 7 * g) % n].data());
                std::vector<float> together(static_cast<std::size_t>(group) * d);
                head.output(queries, together.data());
                for (int g = 0; g < group; ++g) {
                    const std::vector<float> alone = output_of(head, s.queries[(t + 7 * g) % n]);
                    for (int i = 0; i < d; ++i) CHECK(together[g * d + i] == alone[i]);
                }
            }
        }
    }
}

TEST_CASE("decay: a token folded k steps ago weighs lambda^k relative to a fresh one") {
    // sinks=0, recent=1, lambda=0.5. Token 0 (value e0) is folded at step 1; tokens 1..T-1 carry a
    // key with phi ~ e^-60 (no mass) and value e2; token T is exact, with token 0's key and value
    // e1. Both then share a kernel score, so out[0] / out[1] is token 0's decay weight.
    const int d = 4;
    const std::vector<float> key = {0.3f, -0.7f, 1.1f, 0.2f}, dead_key(d, -60.0f), q = {0.5f, 0.4f, -0.2f, 0.9f};
    const std::vector<float> e0 = {1, 0, 0, 0}, e1 = {0, 1, 0, 0}, e2 = {0, 0, 1, 0};
    for (int k = 1; k <= 8; ++k) {
        StreamingHeadState head(d, {0, 1, 0.5});
        head.admit(0, key.data(), e0.data());
        for (int t = 1; t < k + 1; ++t) head.admit(t, dead_key.data(), e2.data());
        head.admit(k + 1, key.data(), e1.data());  // token 0 was folded at step 1: k steps ago
        const std::vector<float> out = output_of(head, q);
        const double want = std::pow(0.5, k);
        CHECK(std::abs(out[0] / out[1] - want) < 1e-5 * want);
        CHECK(std::abs(out[2]) < 1e-12);
    }
    // Skipped positions decay once per position: folded at position 1, read at position 6.
    StreamingHeadState gap(d, {0, 1, 0.5});
    gap.admit(0, key.data(), e0.data());
    gap.admit(1, dead_key.data(), e2.data());
    gap.admit(6, key.data(), e1.data());
    const std::vector<float> out = output_of(gap, q);
    CHECK(std::abs(out[0] / out[1] - std::pow(0.5, 5)) < 1e-5 * std::pow(0.5, 5));
}

TEST_CASE("exact positions: sinks then the recent window") {
    const int d = 4;
    const std::vector<float> x(d, 0.1f);
    StreamingHeadState head(d, {4, 8, 0.99});
    for (int t = 0; t < 6; ++t) head.admit(t, x.data(), x.data());
    CHECK(head.exact_positions() == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
    for (int t = 6; t < 100; ++t) head.admit(t, x.data(), x.data());
    CHECK(head.exact_positions() == std::vector<int64_t>{0, 1, 2, 3, 92, 93, 94, 95, 96, 97, 98, 99});
    CHECK(head.folded_tokens() == 88);
    CHECK_THROWS_AS(head.admit(99, x.data(), x.data()), std::invalid_argument);
}

TEST_CASE("bytes: fp16 exact tokens plus the fp32 state") {
    const std::vector<float> x(16, 0.1f);
    StreamingHeadState head(16, {4, 8, 0.99});
    CHECK(head.bytes() == 4.0 * (16 * 16 + 16));
    for (int t = 0; t < 3; ++t) head.admit(t, x.data(), x.data());
    CHECK(head.bytes() == 3 * 4.0 * 16 + 4.0 * (16 * 16 + 16));
    for (int t = 3; t < 100; ++t) head.admit(t, x.data(), x.data());
    CHECK(head.bytes() == 12 * 4.0 * 16 + 4.0 * (16 * 16 + 16));

    const std::vector<float> y(128, 0.1f);
    StreamingHeadState big(128, StreamingHeadParams{});
    for (int t = 0; t < 1000; ++t) big.admit(t, y.data(), y.data());
    CHECK(big.bytes() == 68 * 512.0 + 4.0 * (128 * 128 + 128));
}

TEST_CASE("invalid streaming parameters are input errors") {
    CHECK_THROWS_WITH_AS(StreamingHeadState(8, {-1, 8, 0.9}), "streaming heads: sinks must be >= 0, got -1",
                         InputError);
    CHECK_THROWS_WITH_AS(StreamingHeadState(8, {4, -2, 0.9}), "streaming heads: recent must be >= 0, got -2",
                         InputError);
    CHECK_THROWS_WITH_AS(StreamingHeadState(8, {4, 8, 1.5}), "streaming heads: lambda must be in [0, 1], got 1.5",
                         InputError);
    CHECK_THROWS_AS(StreamingHeadState(8, {4, 8, std::nan("")}), InputError);
}

TEST_CASE("DuoAttention pattern file: gates above the threshold keep the full cache") {
    // numpy.savetxt's layout (as in DuoAttention's attn_patterns), then blank trailing lines.
    const std::string path = write_file("full_attention_heads.tsv",
                                        "-9.584426879882812500e-05\t1.000000000000000000e+00\t5.5e-01\t0.5\n"
                                        "1.0\t0.0\t0.25\t7.343750000000000000e-01\r\n"
                                        "0.9\t0.8\t0.1\t0.6\n"
                                        "\n  \n");
    const StreamingPlan plan = load_duo_attention_pattern(path, 3, 4, 0.98);
    CHECK(plan.num_layers == 3);
    CHECK(plan.num_kv_heads == 4);
    const std::vector<uint8_t> want = {1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 0};  // gate == 0.5 streams
    CHECK(plan.streaming == want);
    CHECK(plan.streaming_count() == 5);
    CHECK(plan.is_streaming(0, 0));
    CHECK_FALSE(plan.is_streaming(0, 1));
    CHECK(plan.is_streaming(2, 2));
    CHECK(plan.lambda_of(1, 3) == 0.98);
    CHECK_THROWS_AS(plan.is_streaming(3, 0), std::out_of_range);
    CHECK_THROWS_AS(plan.lambda_of(0, 4), std::out_of_range);

    const StreamingPlan strict = load_duo_attention_pattern(path, 3, 4, 0.9, 0.95);
    CHECK(strict.streaming == std::vector<uint8_t>{1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1});
}

TEST_CASE("DuoAttention pattern file errors name the file and the problem on one line") {
    const std::string missing = temp_path("no_such_pattern.tsv");
    std::filesystem::remove(missing);
    CHECK_THROWS_WITH_AS(load_duo_attention_pattern(missing, 2, 2, 0.9), (missing + ": no such file").c_str(),
                         InputError);

    const std::string bad_cell = write_file("bad_cell.tsv", "1\t0\n0\t1\n1\tx\n0\t0\n");
    CHECK_THROWS_WITH_AS(load_duo_attention_pattern(bad_cell, 4, 2, 0.9),
                         (bad_cell + ": row 3, column 2: 'x' is not a number").c_str(), InputError);

    const std::string partial = write_file("partial.tsv", "1\t0.5abc\n");
    CHECK_THROWS_WITH_AS(load_duo_attention_pattern(partial, 1, 2, 0.9),
                         (partial + ": row 1, column 2: '0.5abc' is not a number").c_str(), InputError);

    const std::string rows = write_file("rows.tsv", "1\t0\n0\t1\n1\t1\n0\t0\n\n");
    CHECK_THROWS_WITH_AS(load_duo_attention_pattern(rows, 5, 2, 0.9),
                         (rows + ": 4 rows, but the trace has 5 layers").c_str(), InputError);
    CHECK_THROWS_WITH_AS(load_duo_attention_pattern(rows, 3, 2, 0.9),
                         (rows + ": 4 rows, but the trace has 3 layers").c_str(), InputError);

    const std::string cols = write_file("cols.tsv", "1\t0\t1\t0\n0\t1\t1\n1\t1\t0\t0\n");
    CHECK_THROWS_WITH_AS(load_duo_attention_pattern(cols, 3, 4, 0.9),
                         (cols + ": row 2 has 3 gates, but the trace has 4 KV heads").c_str(), InputError);

    const std::string blank_row = write_file("blank_row.tsv", "1\t0\n\n0\t1\n");
    CHECK_THROWS_WITH_AS(load_duo_attention_pattern(blank_row, 3, 2, 0.9),
                         (blank_row + ": row 2 has 0 gates, but the trace has 2 KV heads").c_str(), InputError);

    const std::string empty = write_file("empty.tsv", "\n\n");
    CHECK_THROWS_WITH_AS(load_duo_attention_pattern(empty, 1, 1, 0.9),
                         (empty + ": 0 rows, but the trace has 1 layer").c_str(), InputError);
}
