// The runtime's CPU backend at the Llama-3.2-1B shape (one layer: 32 query heads, 8 KV heads, head
// size 128): decode attention over a tiered cache against an fp32 full-cache decode attention of
// the same shape (computed the same way; the plainest scalar loops shown too), at 4K and 32K tokens of context, as a time ratio and as a share of this
// machine's memory bandwidth measured in the same run (a STREAM-style copy); then a whole decode
// step (admission, H2O's score update and eviction) against its attention alone, at 4K.
//   build/bench/bench_runtime [repeats, default 7]
#include <tbb/info.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include <Eigen/Core>

#include "policies/policy.h"
#include "cache_math/numerics.h"
#include "cache_math/softmax_exp.h"
#include "search/profile.h"
#include "runtime/head_cache.h"
#include "runtime/kvsim_runtime.h"

using namespace kvsim;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kQueryHeads = 32, kKvHeads = 8, kDim = 128, kGroup = kQueryHeads / kKvHeads;

template <class F>
double median_seconds(int repeats, F&& f) {
    std::vector<double> times;
    for (int r = 0; r < repeats; ++r) {
        const auto start = Clock::now();
        f();
        times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}

// STREAM's copy kernel over arrays far larger than the caches: bytes read plus bytes written.
double copy_bandwidth(int repeats) {
    const std::size_t n = std::size_t{1} << 27;  // 512 MiB of floats each
    std::vector<float> a(n, 1.0f), b(n, 0.0f);
    const double s = median_seconds(repeats, [&] {
        tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, 1 << 20), [&](const auto& r) {
            std::memcpy(b.data() + r.begin(), a.data() + r.begin(), (r.end() - r.begin()) * sizeof(float));
        });
    });
    return 2.0 * n * sizeof(float) / s;
}

// The plainest fp32 full-cache decode attention: per KV head, one pass over its T keys and values for
// the group's four query heads (scores, softmax, weighted sum), in parallel over KV heads.
void fp32_attention(const std::vector<float>& k, const std::vector<float>& v, int T, const float* q, float* out) {
    tbb::parallel_for(0, kKvHeads, [&](int kv) {
        thread_local std::vector<float> scores;
        scores.resize(static_cast<std::size_t>(kGroup) * T);
        const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
        const float* keys = k.data() + static_cast<std::size_t>(kv) * T * kDim;
        const float* values = v.data() + static_cast<std::size_t>(kv) * T * kDim;
        float peak[kGroup], total[kGroup];
        for (int h = 0; h < kGroup; ++h) peak[h] = -INFINITY, total[h] = 0;
        for (int t = 0; t < T; ++t)
            for (int h = 0; h < kGroup; ++h) {
                const float* qh = q + (kv * kGroup + h) * kDim;
                float dot = 0;
                for (int i = 0; i < kDim; ++i) dot += qh[i] * keys[static_cast<std::size_t>(t) * kDim + i];
                scores[h * T + t] = dot * scale;
                peak[h] = std::max(peak[h], dot * scale);
            }
        for (int h = 0; h < kGroup; ++h) {
            float* o = out + (kv * kGroup + h) * kDim;
            std::fill(o, o + kDim, 0.0f);
        }
        for (int t = 0; t < T; ++t)
            for (int h = 0; h < kGroup; ++h) {
                const float w = std::exp(scores[h * T + t] - peak[h]);
                total[h] += w;
                float* o = out + (kv * kGroup + h) * kDim;
                for (int i = 0; i < kDim; ++i) o[i] += w * values[static_cast<std::size_t>(t) * kDim + i];
            }
        for (int h = 0; h < kGroup; ++h) {
            float* o = out + (kv * kGroup + h) * kDim;
            for (int i = 0; i < kDim; ++i) o[i] /= total[h];
        }
    });
}

// The same fp32 full cache attended the way the runtime's CPU backend attends (blocks of rows,
// scores and outputs as small matrix products, an online softmax), reading the rows in place: the
// baseline the tiered cache is measured against, so a ratio is about bytes, not about code.
void fp32_blocked_attention(const std::vector<float>& k, const std::vector<float>& v, int T, const float* q, float* out) {
    using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    constexpr int kBlock = 64;
    tbb::parallel_for(0, kKvHeads, [&](int kv) {
        const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
        const Eigen::Map<const RowMajor> queries(q + kv * kGroup * kDim, kGroup, kDim);
        Eigen::Map<RowMajor> o(out + kv * kGroup * kDim, kGroup, kDim);
        o.setZero();
        Eigen::MatrixXf scores(kBlock, kGroup);
        OnlineSoftmax online[kGroup];
        for (int first = 0; first < T; first += kBlock) {
            const int m = std::min(kBlock, T - first);
            const std::size_t at = (static_cast<std::size_t>(kv) * T + first) * kDim;
            const Eigen::Map<const RowMajor> keys(k.data() + at, m, kDim), values(v.data() + at, m, kDim);
            auto s = scores.topRows(m);
            s.noalias() = keys * queries.transpose();
            s *= scale;
            for (int h = 0; h < kGroup; ++h) {
                const float rescale = online[h].raise_to(s.col(h).maxCoeff());
                online[h].sum += exp_minus_peak_and_sum(s.col(h).data(), m, online[h].maximum);
                if (rescale != 1.0f) o.row(h) *= rescale;
            }
            o.noalias() += s.transpose() * values;
        }
        for (int h = 0; h < kGroup; ++h) o.row(h) /= online[h].sum;
    });
}

std::string write_profile_file(const std::string& policy, const ParamValues& params, int budget, bool tiers) {
    Profile p;
    p.name = "bench-" + policy;
    p.model = {"llama-1b-shaped", 1, kQueryHeads, kKvHeads, kDim};
    p.policy = policy;
    p.params = params;
    if (tiers)
        p.tiers = TierShares{1, kKvHeads, std::vector<double>(kKvHeads, 0.2), std::vector<double>(kKvHeads, 0.4),
                             std::vector<double>(kKvHeads, 0.2)};
    else
        p.layer_budgets = {budget};
    const std::string path = (std::filesystem::temp_directory_path() / ("kvsim-bench-" + policy + ".json")).string();
    write_profile(p, path);
    return path;
}

// One HeadCache per KV head, filled with the same rows at the tiers of a mix.
struct TieredLayer {
    std::vector<std::unique_ptr<runtime::HeadCache>> heads;
    double row_bytes = 0;  // K and V bytes read per step, over every head
};

TieredLayer tiered_layer(int T, const double mix[4], const std::vector<float>& k, const std::vector<float>& v) {
    const PolicyDescriptor* d = find_policy("stratigraphic");
    static const std::map<std::string, std::string> files;
    const ParamValues params = resolve_params(*d, {}, "bench");
    TieredLayer layer;
    // Tiers by position: a fixed pseudo-random draw with the mix's shares; evicted ones are left out
    // by placing them past the held count, so `held` rows remain; the last is the FP16 current token.
    const int held = static_cast<int>(std::lround(T * (1.0 - mix[3])));
    std::mt19937 rng(5);
    std::uniform_real_distribution<double> u(0.0, 1.0 - mix[3]);
    std::vector<uint8_t> tier(held);
    for (int p = 0; p < held; ++p) {
        const double x = u(rng);
        tier[p] = x < mix[0] ? 0 : x < mix[0] + mix[1] ? 1 : 2;
    }
    tier[held - 1] = 0;
    const double bytes_of[3] = {2.0 * kDim * 2, 2.0 * (kDim + 2), 2.0 * (kDim / 2 + 2)};
    for (int kv = 0; kv < kKvHeads; ++kv) {
        runtime::HeadPlan plan;
        plan.layer = 0, plan.kv_head = kv, plan.num_layers = 1, plan.num_kv_heads = kKvHeads;
        plan.group = kGroup, plan.head_dim = kDim, plan.budget = T, plan.max_context = T;
        const PolicyContext ctx{T, T + 1, 0, 1, kv, kKvHeads, kDim, &files};
        auto head = std::make_unique<runtime::HeadCache>(plan, [d, params, ctx] { return d->make(params, ctx); });
        head->bench_fill(held, k.data() + static_cast<std::size_t>(kv) * T * kDim,
                         v.data() + static_cast<std::size_t>(kv) * T * kDim, [&](int p) { return tier[p]; });
        layer.heads.push_back(std::move(head));
    }
    for (int p = 0; p < held; ++p) layer.row_bytes += bytes_of[tier[p]] * kKvHeads;
    return layer;
}

}  // namespace

int main(int argc, char** argv) {
    const int repeats = argc > 1 ? std::atoi(argv[1]) : 7;
    std::printf("threads: %d\n", tbb::info::default_concurrency());
    const double bandwidth = copy_bandwidth(repeats);
    std::printf("memory bandwidth (STREAM-style copy, 512 MiB arrays, median of %d): %.2f GB/s\n\n", repeats,
                bandwidth / 1e9);

    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(kQueryHeads * kDim), out(kQueryHeads * kDim);
    for (float& x : q) x = normal(rng) * 0.3f;

    std::printf("decode attention, one layer (32 query heads, 8 KV heads, head size 128), median of %d:\n", repeats);
    std::printf("  %-44s %8s %12s %10s %10s %12s\n", "cache", "context", "bytes read", "ms", "vs fp32", "of bandwidth");
    const double mixes[3][4] = {{1.0, 0.0, 0.0, 0.0}, {0.2, 0.4, 0.2, 0.2}, {0.05, 0.2, 0.4, 0.35}};
    const char* names[3] = {"runtime, all FP16", "runtime, tiers 20/40/20% + 20% evicted", "runtime, tiers 5/20/40% + 35% evicted"};
    for (int T : {4096, 32768}) {
        std::vector<float> k(static_cast<std::size_t>(kKvHeads) * T * kDim), v(k.size());
        for (float& x : k) x = normal(rng);
        for (float& x : v) x = normal(rng);
        const double fp32_bytes = 2.0 * kKvHeads * T * kDim * sizeof(float);
        const double scalar = median_seconds(repeats, [&] { fp32_attention(k, v, T, q.data(), out.data()); });
        const double fp32 = median_seconds(repeats, [&] { fp32_blocked_attention(k, v, T, q.data(), out.data()); });
        char scalar_ratio[32];
        std::snprintf(scalar_ratio, sizeof scalar_ratio, "%.2fx", fp32 / scalar);
        std::printf("  %-44s %8d %10.1f MB %10.3f %10s %11.0f%%\n", "fp32 full cache, scalar loops", T, fp32_bytes / 1e6,
                    scalar * 1e3, scalar_ratio, 100 * fp32_bytes / scalar / bandwidth);
        std::printf("  %-44s %8d %10.1f MB %10.3f %10s %11.0f%%\n", "fp32 full cache, blocked products", T, fp32_bytes / 1e6,
                    fp32 * 1e3, "1.00", 100 * fp32_bytes / fp32 / bandwidth);
        for (int m = 0; m < 3; ++m) {
            TieredLayer layer = tiered_layer(T, mixes[m], k, v);
            const double s = median_seconds(repeats, [&] {
                tbb::parallel_for(0, kKvHeads, [&](int kv) {
                    layer.heads[kv]->bench_attend(q.data() + kv * kGroup * kDim, out.data() + kv * kGroup * kDim);
                });
            });
            char ratio[32];
            std::snprintf(ratio, sizeof ratio, "%.2fx", fp32 / s);
            std::printf("  %-44s %8d %10.1f MB %10.3f %10s %11.0f%%\n", names[m], T, layer.row_bytes / 1e6, s * 1e3,
                        ratio, 100 * layer.row_bytes / s / bandwidth);
        }
    }

    // A whole decode step through the C API (t's admission, attention, H2O's update and eviction)
    // against the attention alone over the same number of held tokens.
    const int T = 4096, budget = 2048;
    const std::string path = write_profile_file("h2o", resolve_params(*find_policy("h2o"), {}, "bench"), budget, false);
    const kvsim_model_shape shape{1, kQueryHeads, kKvHeads, kDim, T + 256, 0};
    kvsim_rt* rt = nullptr;
    if (kvsim_rt_create(path.c_str(), &shape, "cpu", &rt) != KVSIM_OK) {
        std::fprintf(stderr, "%s\n", kvsim_rt_create_error());
        return 1;
    }
    std::vector<float> kt(kKvHeads * kDim), vt(kKvHeads * kDim), qt(kQueryHeads * kDim);
    auto step = [&](int t) {
        for (float& x : kt) x = normal(rng);
        for (float& x : vt) x = normal(rng);
        for (float& x : qt) x = normal(rng) * 0.3f;
        if (kvsim_rt_decode(rt, 0, t, qt.data(), kt.data(), vt.data(), out.data()) != KVSIM_OK) {
            std::fprintf(stderr, "%s\n", kvsim_rt_last_error(rt));
            std::exit(1);
        }
    };
    const auto fill_start = Clock::now();
    for (int t = 0; t < T; ++t) step(t);
    const double fill = std::chrono::duration<double>(Clock::now() - fill_start).count();
    const int steps = 256;
    const auto start = Clock::now();
    for (int t = T; t < T + steps; ++t) step(t);
    const double per_step = std::chrono::duration<double>(Clock::now() - start).count() / steps;
    kvsim_rt_destroy(rt);
    std::vector<float> k(static_cast<std::size_t>(kKvHeads) * (budget + 1) * kDim), v(k.size());
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    const double all_fp16[4] = {1.0, 0.0, 0.0, 0.0};
    TieredLayer layer = tiered_layer(budget + 1, all_fp16, k, v);
    const double attention = median_seconds(repeats, [&] {
        tbb::parallel_for(0, kKvHeads, [&](int kv) {
            layer.heads[kv]->bench_attend(q.data() + kv * kGroup * kDim, out.data() + kv * kGroup * kDim);
        });
    });
    std::printf("\nwhole decode step, H2O at budget %d (2x) after %d tokens (filled in %.1f s): %.3f ms a step against "
                "%.3f ms for its attention alone: admission, scores and eviction add %.0f%%\n",
                budget, T, fill, per_step * 1e3, attention * 1e3, 100 * (per_step - attention) / attention);
    std::filesystem::remove(path);
    return 0;
}
