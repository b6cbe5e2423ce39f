// The runtime's CPU backend at the Llama-3.2-1B shape (one layer: 32 query heads over 8 KV heads of
// 128 channels, one query token): decode attention over FP16, INT8 and INT4 caches and two tier
// mixes, at 4K, 16K and 32K tokens of context, as time, bytes read a token and GB/s beside this
// machine's memory read bandwidth, measured in the same run on the same threads (rounds that
// alternate the bandwidth and every cache, medians; each pass's data flushed from the caches
// first), and the arithmetic as a share of this machine's fp32 FMA peak (measured once,
// bench/fp32_peak.h); the largest difference of any query head's output from the cpu-oracle
// backend's two-pass attention on the same cache; then a whole decode step (admission, attention,
// the policy's update, eviction and re-zoning) against its attention alone, for H2O and for
// stratigraphic tiers (both warm: the same cache step after step).
//
//   build/bench/bench_runtime [--context 4096 ...] [--threads 2] [--group 32] [--rounds 7]
//                             [--step-context 4096]
#include <CLI/CLI.hpp>
#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_reduce.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "fp32_peak.h"
#include "policies/policy.h"
#include "runtime/attention_kernels.h"
#include "runtime/head_cache.h"
#include "bench/flags.h"

using namespace kvsim;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kQueryHeads = 32, kKvHeads = 8, kDim = 128, kGroup = kQueryHeads / kKvHeads;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x.size() % 2 ? x[x.size() / 2] : 0.5 * (x[x.size() / 2 - 1] + x[x.size() / 2]);
}

// Whether flush_from_caches can drop lines on this CPU (x86's CLFLUSH).
constexpr bool kCanFlush =
#if defined(__x86_64__) || defined(__i386__)
    true;
#else
    false;
#endif

// Drops [p, p + bytes) from every level of the cache hierarchy. A decode step reads each layer's
// cache once before the other layers' pass through, and a real model's cache at these contexts is
// many times any last-level cache; one layer here is not (a 2-core VM reported a 480 MiB L3, which
// held every cache of the 32K table): so every timed pass, and the bandwidth it is measured
// against, starts from memory.
void flush_from_caches([[maybe_unused]] const void* p, [[maybe_unused]] std::size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
    if (p == nullptr || bytes == 0) return;
    const std::uintptr_t end = reinterpret_cast<std::uintptr_t>(p) + bytes;
    for (std::uintptr_t line = reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t{63}; line < end; line += 64) {
#if defined(__CLFLUSHOPT__)
        _mm_clflushopt(reinterpret_cast<void*>(line));
#else
        _mm_clflush(reinterpret_cast<void*>(line));
#endif
    }
    _mm_mfence();
#endif
}

// Memory read bandwidth: every thread sums its share of a 256 MiB array, flushed from the caches
// before each pass, with as many loads in flight as the attention keeps.
class ReadBandwidth {
public:
    ReadBandwidth() : words_(std::size_t{32} << 20, 1) {}  // 256 MiB
    double bytes() const { return static_cast<double>(words_.size() * sizeof(uint64_t)); }
    double seconds() {
        flush_from_caches(words_.data(), words_.size() * sizeof(uint64_t));
        const auto start = Clock::now();
        sink_ += tbb::parallel_reduce(
            tbb::blocked_range<std::size_t>(0, words_.size(), std::size_t{1} << 16), uint64_t{0},
            [&](const tbb::blocked_range<std::size_t>& r, uint64_t total) { return total + sum(r.begin(), r.end()); },
            [](uint64_t a, uint64_t b) { return a + b; });
        return seconds_since(start);
    }

private:
    uint64_t sum(std::size_t begin, std::size_t end) const {
        const uint64_t* w = words_.data();
        uint64_t total = 0;
        std::size_t i = begin;
#if defined(__AVX2__)
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        for (; i + 16 <= end; i += 16)
            for (int a = 0; a < 4; ++a)
                acc[a] = _mm256_add_epi64(acc[a], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 4 * a)));
        alignas(32) uint64_t lanes[4];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                           _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3])));
        total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
        for (; i < end; ++i) total += w[i];
        return total;
    }
    std::vector<uint64_t> words_;
    uint64_t sink_ = 0;
};

// A cache's shares: FP16, INT8, INT4, evicted (the held tokens drawn at random with these shares;
// the last, the current token, at FP16).
struct Mix {
    const char* name;
    double share[4];
};

// One layer's KV heads holding the same tokens at one mix.
struct Layer {
    const Mix* mix = nullptr;
    std::vector<std::unique_ptr<runtime::HeadCache>> heads;
    int held = 0;
    double bytes = 0;  // keys and values with their scales, every head: what one step reads

    void attend(const float* q, float* out, bool oracle = false) {
        tbb::parallel_for(0, kKvHeads, [&](int kv) {
            heads[kv]->bench_attend(q + kv * kGroup * kDim, out + kv * kGroup * kDim, oracle);
        });
    }
    // Every head's stored keys and values, and their scales, out of the caches (each tier's arrays
    // whole: a slot's row lies at its tier's row, anywhere in the array).
    void flush() const {
        for (const auto& head : heads) {
            runtime::TierView keys[3], values[3];
            head->tier_views(keys, values);
            const std::size_t slots = static_cast<std::size_t>(head->capacity());
            for (const runtime::TierView* side : {keys, values})
                for (int tier = 0; tier < 3; ++tier) {
                    const runtime::TierView& view = side[tier];
                    flush_from_caches(view.half, slots * view.half_row_bytes());
                    flush_from_caches(view.levels, slots * view.level_row_bytes());
                    flush_from_caches(view.scales, slots * view.scale_row_bytes());
                }
        }
    }
};

runtime::HeadPlan head_plan(int kv, int budget, int max_context) {
    runtime::HeadPlan plan;
    plan.layer = 0, plan.kv_head = kv, plan.num_layers = 1, plan.num_kv_heads = kKvHeads;
    plan.group = kGroup, plan.head_dim = kDim, plan.budget = budget, plan.max_context = max_context;
    return plan;
}

runtime::HeadCache::PolicyMaker policy_maker(const std::string& name, const ParamValues& params, int kv, int budget,
                                             int max_context) {
    static const std::map<std::string, std::string> no_files;
    const PolicyDescriptor* d = find_policy(name);
    const int capacity = std::min(budget, max_context) + 1;
    const PolicyContext ctx{budget, capacity, 0, 1, kv, kKvHeads, kDim, &no_files};
    return [d, params, ctx] { return d->make(params, ctx); };
}

Layer fill_layer(const Mix& mix, int T, int scale_group, const std::vector<float>& k, const std::vector<float>& v) {
    const ParamValues params = resolve_params(*find_policy("stratigraphic"), {{"value_group", scale_group}}, "bench");
    Layer layer;
    layer.mix = &mix;
    layer.held = static_cast<int>(std::lround(T * (1.0 - mix.share[3])));
    std::mt19937 rng(5);
    std::uniform_real_distribution<double> u(0.0, 1.0 - mix.share[3]);
    std::vector<uint8_t> tier(layer.held);
    for (uint8_t& t : tier) {
        const double x = u(rng);
        t = x < mix.share[0] ? 0 : x < mix.share[0] + mix.share[1] ? 1 : 2;
    }
    tier.back() = 0;
    const int groups = (kDim + scale_group - 1) / scale_group;
    const double row_bytes[3] = {2.0 * kDim, kDim + 2.0 * groups, (kDim + 1) / 2 + 2.0 * groups};
    for (int kv = 0; kv < kKvHeads; ++kv) {
        auto head = std::make_unique<runtime::HeadCache>(head_plan(kv, T, T),
                                                         policy_maker("stratigraphic", params, kv, T, T));
        const std::size_t at = static_cast<std::size_t>(kv) * T * kDim;
        head->bench_fill(layer.held, k.data() + at, v.data() + at, [&](int p) { return tier[p]; });
        layer.heads.push_back(std::move(head));
    }
    for (uint8_t t : tier) layer.bytes += 2.0 * row_bytes[t] * kKvHeads;
    return layer;
}

// The largest ||cpu - oracle|| / ||oracle|| over the query heads, on one query.
double largest_difference(Layer& layer, const std::vector<float>& q) {
    std::vector<float> fast(q.size()), oracle(q.size());
    layer.attend(q.data(), fast.data());
    layer.attend(q.data(), oracle.data(), true);
    double worst = 0;
    for (int h = 0; h < kQueryHeads; ++h) {
        double diff = 0, norm = 0;
        for (int i = 0; i < kDim; ++i) {
            const double a = fast[h * kDim + i], b = oracle[h * kDim + i];
            diff += (a - b) * (a - b);
            norm += b * b;
        }
        worst = std::max(worst, std::sqrt(diff / norm));
    }
    return worst;
}

// Repeats of `pass` that take about 50 ms, so that one sample is not the clock's resolution.
template <class F>
int repeats_for(F&& pass) {
    const auto start = Clock::now();
    pass();
    return std::max(1, static_cast<int>(std::ceil(0.05 / std::max(seconds_since(start), 1e-6))));
}

template <class F>
double sample(int repeats, F&& pass) {
    const auto start = Clock::now();
    for (int r = 0; r < repeats; ++r) pass();
    return seconds_since(start) / repeats;
}

// The same, each pass from memory: `flush` before it, outside the time.
template <class Flush, class F>
double cold_sample(int repeats, Flush&& flush, F&& pass) {
    double total = 0;
    for (int r = 0; r < repeats; ++r) {
        flush();
        const auto start = Clock::now();
        pass();
        total += seconds_since(start);
    }
    return total / repeats;
}

void attention_table(int T, int scale_group, int rounds, ReadBandwidth& bandwidth, double fma_peak_gflops,
                     std::mt19937& rng) {
    static const Mix mixes[] = {{"FP16", {1, 0, 0, 0}},
                                {"INT8", {0, 1, 0, 0}},
                                {"INT4", {0, 0, 1, 0}},
                                {"tiers 20/40/20%, 20% evicted", {0.2, 0.4, 0.2, 0.2}},
                                {"tiers 5/20/40%, 35% evicted", {0.05, 0.2, 0.4, 0.35}}};
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(kQueryHeads * kDim), out(q.size());
    for (float& x : q) x = normal(rng) * 0.3f;
    std::vector<Layer> layers;
    {
        std::vector<float> k(static_cast<std::size_t>(kKvHeads) * T * kDim), v(k.size());
        for (float& x : k) x = normal(rng);
        for (float& x : v) x = normal(rng);
        for (const Mix& mix : mixes) layers.push_back(fill_layer(mix, T, scale_group, k, v));
    }
    std::vector<int> repeats;
    for (Layer& layer : layers) repeats.push_back(repeats_for([&] { layer.attend(q.data(), out.data()); }));
    std::vector<double> bandwidth_samples;
    std::vector<std::vector<double>> samples(layers.size());
    for (int round = 0; round < rounds; ++round) {
        bandwidth_samples.push_back(bandwidth.bytes() / bandwidth.seconds());
        for (std::size_t i = 0; i < layers.size(); ++i)
            samples[i].push_back(cold_sample(repeats[i], [&] { layers[i].flush(); },
                                             [&] { layers[i].attend(q.data(), out.data()); }));
    }
    const double read = median(bandwidth_samples);
    std::printf("\n%d tokens of context; memory read bandwidth %.1f GB/s (median of %d, alternated with the caches "
                "below)\n",
                T, read / 1e9, rounds);
    std::printf("  %-30s %7s %11s %9s %9s %8s %9s %8s %9s %12s\n", "cache", "held", "bytes/token", "MB/step", "ms/step",
                "GB/s", "of read", "of FMA", "vs FP16", "vs oracle");
    const double fp16 = median(samples[0]);
    for (std::size_t i = 0; i < layers.size(); ++i) {
        const Layer& layer = layers[i];
        const double s = median(samples[i]);
        // Multiply-adds a step: every held row's key against each query head, and its value into each.
        const double flops = 2.0 * 2.0 * kGroup * kDim * layer.held * kKvHeads;
        std::printf("  %-30s %7d %11.1f %9.1f %9.3f %8.2f %8.0f%% %7.0f%% %8.2fx %12.2e\n", layer.mix->name, layer.held,
                    layer.bytes / layer.held / kKvHeads, layer.bytes / 1e6, s * 1e3, layer.bytes / s / 1e9,
                    100 * layer.bytes / s / read, 100 * flops / s / 1e9 / fma_peak_gflops, fp16 / s,
                    largest_difference(layers[i], q));
    }
}

// A whole decode step (every head's decode in parallel, as kvsim_rt_decode runs them) against the
// attention alone over the very cache the steps leave, alternated.
void whole_step(const std::string& policy, const ParamValues& params, int T, int rounds, std::mt19937& rng) {
    const int steps = 64, max_context = T + rounds * steps + steps + 1;
    // A policy that sizes itself (stratigraphic's shares) plans for every position, as the runtime does.
    const int budget = find_policy(policy)->keeps_everything ? max_context : T / 2;
    std::vector<std::unique_ptr<runtime::HeadCache>> heads;
    for (int kv = 0; kv < kKvHeads; ++kv)
        heads.push_back(std::make_unique<runtime::HeadCache>(head_plan(kv, budget, max_context),
                                                             policy_maker(policy, params, kv, budget, max_context)));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // A pool of tokens, cycled: drawing fresh numbers is not part of a step.
    const int pool = 256;
    std::vector<float> q(static_cast<std::size_t>(pool) * kQueryHeads * kDim), k(static_cast<std::size_t>(pool) * kKvHeads * kDim),
        v(k.size()), out(kQueryHeads * kDim);
    for (float& x : q) x = normal(rng) * 0.3f;
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    int t = 0;
    auto step = [&] {
        const std::size_t i = static_cast<std::size_t>(t % pool);
        tbb::parallel_for(0, kKvHeads, [&](int kv) {
            heads[kv]->decode(t, q.data() + (i * kKvHeads + kv) * kGroup * kDim, k.data() + (i * kKvHeads + kv) * kDim,
                              v.data() + (i * kKvHeads + kv) * kDim, out.data() + kv * kGroup * kDim);
        });
        ++t;
    };
    const auto fill_start = Clock::now();
    while (t < T) step();
    const double fill = seconds_since(fill_start);
    std::vector<double> whole, alone;
    for (int round = 0; round < rounds; ++round) {
        whole.push_back(sample(steps, step));
        alone.push_back(sample(steps, [&] {
            tbb::parallel_for(0, kKvHeads, [&](int kv) {
                heads[kv]->bench_attend(q.data() + kv * kGroup * kDim, out.data() + kv * kGroup * kDim);
            });
        }));
    }
    const double w = median(whole), a = median(alone);
    std::printf("  %-14s %7zu held after %d tokens (filled in %.1f s): %.3f ms a step, %.3f ms its attention alone: "
                "%+.1f%%\n",
                policy.c_str(), heads[0]->held().size(), t, fill, w * 1e3, a * 1e3, 100 * (w - a) / a);
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"the runtime's decode attention against this machine's memory read bandwidth"};
    std::vector<int> contexts;
    int threads = tbb::info::default_concurrency(), scale_group = 32, rounds = 7, step_context = 4096;
    app.add_option("--context", contexts, "tokens of context (repeatable; default 4096, 16384 and 32768)")
        ->check(CLI::Range(2, 1 << 20));
    app.add_option("--threads", threads, "threads (default: every core)")->check(CLI::Range(1, 1024));
    app.add_option("--group", scale_group, "channels sharing one INT8/INT4 scale")->check(CLI::Range(1, kDim));
    app.add_option("--rounds", rounds, "alternated rounds; each figure is their median")->check(CLI::Range(1, 1000));
    app.add_option("--step-context", step_context, "tokens before the whole decode steps are timed (0: skip them)")
        ->check(CLI::Range(0, 1 << 20));
    if (const auto status = kvsim::bench::parse_flags(app, argc, argv)) return *status;
    if (contexts.empty()) contexts = {4096, 16384, 32768};
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(threads));

    std::printf("decode attention, one Llama-3.2-1B-shaped layer: %d query heads over %d KV heads of %d channels, one "
                "query token\n",
                kQueryHeads, kKvHeads, kDim);
    std::printf("threads: %d; INT8/INT4 scales: one fp16 a %d channels; kernels: %s; medians of %d rounds\n", threads,
                scale_group, runtime::kernel_set_name(runtime::kernel_sets().back()), rounds);
    const double fma_peak = bench::measure_fp32_peak_gflops(threads);
    std::printf("fp32 FMA peak measured on %d threads: %.0f GFLOP/s; of FMA: a step's 4 x 32 x 128 flops a held token "
                "(scores and weighted values) against it\n",
                threads, fma_peak);
    std::printf("bytes/token: keys and values with their scales, per token and KV head; GB/s: bytes a step / time a "
                "step;\nvs oracle: the largest ||cpu - cpu-oracle|| / ||cpu-oracle|| over the 32 query heads\n");
    std::printf(kCanFlush ? "every timed attention pass and bandwidth pass starts with its data flushed from the caches\n"
                          : "caches not flushed (no CLFLUSH on this CPU): a layer that fits the last-level cache is "
                            "read from it\n");
    std::mt19937 rng(1);
    ReadBandwidth bandwidth;
    for (int T : contexts) attention_table(T, scale_group, rounds, bandwidth, fma_peak, rng);

    if (step_context > 0) {
        std::printf("\nwhole decode step (admission, attention, the policy's update, eviction, re-zoning) against its "
                    "attention alone, medians of %d rounds of 64 steps:\n",
                    rounds);
        whole_step("h2o", resolve_params(*find_policy("h2o"), {}, "bench"), step_context, rounds, rng);
        whole_step("stratigraphic", resolve_params(*find_policy("stratigraphic"), {{"value_group", scale_group}}, "bench"),
                   step_context, rounds, rng);
    }
    return 0;
}
