// The runtime's CPU backend against the simulator, on the shipped stories260K trace: with the same
// profile, replayed in the cached attention view (the policy shown the attention of the cache as
// held, which is all a runtime can compute), every step's attention output and bytes must match
// bit for bit: the summed output errors and bytes per (layer, KV head) are equal to the last digit.
#include <doctest/doctest.h>
#include <tbb/global_control.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "search/profile.h"
#include "cache_math/tiers.h"
#include "sim/replay.h"
#include "sim/sweep.h"
#include "sim/trace_store.h"
#include "runtime/head_cache.h"
#include "runtime/kvsim_runtime.h"
#include "runtime/runtime_internal.h"
#include "tests/unit/helpers.h"
#include "tests/unit/host_device_cache.h"

using namespace kvsim;

namespace {

std::string temp_file(const std::string& name) {
    // The process id in the name: two test runs at once (worktrees side by side) must not share.
    return (std::filesystem::temp_directory_path() /
            ("kvsim-runtime-test-" + std::to_string(::getpid()) + "-" + name)).string();
}

// The shipped trace stores K and V in fp32, and the simulator's FP16 tier reads them as they are;
// the runtime stores real fp16. A copy written as float16 gives both the same numbers, so every
// remaining difference would be the runtime's own.
std::string fp16_trace() {
    static const std::string path = [] {
        const TraceReader reader(std::string(KVSIM_SOURCE_DIR) + "/data/tinystories-stories260K.h5");
        const std::string out = temp_file("stories260K-fp16.h5");
        TraceWriter writer(out, reader.metadata());
        for (std::size_t s = 0; s < reader.sequences().size(); ++s) {
            const int id = writer.add_sequence(reader.sequences()[s].name, reader.sequences()[s].length);
            for (int layer = 0; layer < static_cast<int>(reader.metadata().num_layers); ++layer)
                writer.write_qkv(id, layer, reader.read_qkv(static_cast<int>(s), layer), TensorDtype::float16);
        }
        writer.commit();
        return out;
    }();
    return path;
}

Profile base_profile(const TraceMetadata& m) {
    Profile p;
    p.name = "runtime-test";
    p.model = {m.model_name, static_cast<int>(m.num_layers), static_cast<int>(m.num_query_heads),
               static_cast<int>(m.num_kv_heads), static_cast<int>(m.head_dim)};
    return p;
}

struct HeadFigures {
    std::vector<double> error, bytes;  // per (layer, KV head), summed over decode steps
};

// The simulator: one lockstep replay of the profile on the given sequences, cached view.
HeadFigures simulate(const std::string& profile_path, const std::vector<int>& sequences, int prefill = 0) {
    const Profile profile = load_profile(profile_path);
    PolicyEntry entry;
    entry.name = profile.policy;
    entry.params = profile.params;
    entry.where = profile_path;
    entry.profile_shape = profile.model;
    if (profile.streaming || profile.tiers || profile.mixed)
        entry.files["profile"] = profile_path;
    else if (!find_policy(profile.policy)->keeps_everything)
        entry.profile_budgets.push_back(profile_column(profile, profile_path));
    auto source = open_trace_source(fp16_trace(), 0, sequences);
    ReplayOptions options;
    options.harness = named_harness_options("cached", "mean", true, prefill, "test");
    options.output_error = true;
    options.memory = true;
    const std::vector<ReplayCombo> combos =
        entry.profile_budgets.empty() ? expand_sweep({entry}, {}, std::vector<int>{1}) : expand_sweep({entry}, {}, entry.profile_budgets);
    const std::vector<ComboResult> r = replay(*source, combos, options);
    HeadFigures f;
    for (const StreamMetrics& m : r.front().by_head) {
        f.error.push_back(m.output_rel_error);
        f.bytes.push_back(m.cache_bytes);
    }
    return f;
}

// The runtime: every sequence through kvsim_rt_decode, the output error against the full cache's
// output computed as the replay computes it, and the bytes as the runtime reports them.
// With `device`, the "cuda" backend's path with that device cache (a failed call is retried once,
// as an engine would).
HeadFigures run_runtime(const std::string& profile_path, const std::vector<int>& sequences,
                        const char* backend = "cpu-oracle", int prefill = 0,
                        const runtime::DeviceFactory& device = nullptr) {
    const TraceReader reader(fp16_trace());
    const TraceMetadata& m = reader.metadata();
    const int L = static_cast<int>(m.num_layers), H = static_cast<int>(m.num_query_heads),
              K = static_cast<int>(m.num_kv_heads), d = static_cast<int>(m.head_dim), group = H / K;
    int longest = 0;
    for (int s : sequences) longest = std::max<int>(longest, static_cast<int>(reader.sequences()[s].length));
    const kvsim_model_shape shape{L, H, K, d, longest, prefill};
    kvsim_rt* rt = nullptr;
    const kvsim_status created = device ? runtime::create_with_device(profile_path.c_str(), shape, device, &rt)
                                        : kvsim_rt_create(profile_path.c_str(), &shape, backend, &rt);
    REQUIRE_MESSAGE(created == KVSIM_OK, std::string(kvsim_rt_create_error()));
    HeadFigures f{std::vector<double>(static_cast<std::size_t>(L) * K, 0.0), std::vector<double>(static_cast<std::size_t>(L) * K, 0.0)};
    std::vector<float> out(static_cast<std::size_t>(H) * d), full(d);
    Eigen::ArrayXf scratch;
    for (int s : sequences) {
        REQUIRE(kvsim_rt_reset(rt) == KVSIM_OK);
        // Summed per sequence first, then across sequences: the replay's order of addition.
        HeadFigures seq{std::vector<double>(f.error.size(), 0.0), std::vector<double>(f.bytes.size(), 0.0)};
        for (int layer = 0; layer < L; ++layer) {
            const QkvLayer data = reader.read_qkv(s, layer);
            std::vector<int32_t> every(data.tokens);
            for (int64_t p = 0; p < data.tokens; ++p) every[p] = static_cast<int32_t>(p);
            const std::vector<uint8_t> fp16(data.tokens, 0);
            TierArrays arrays;
            arrays.k[0] = data.k.data();
            arrays.v[0] = data.v.data();
            if (prefill > 0) {  // the prompt in one call; the replay measures only what follows it
                std::vector<float> prompt_out(static_cast<std::size_t>(prefill) * H * d);
                const kvsim_status status = kvsim_rt_prefill(rt, layer, 0, prefill, data.q.data(), data.k.data(),
                                                             data.v.data(), prompt_out.data());
                REQUIRE_MESSAGE(status == KVSIM_OK, kvsim_rt_last_error(rt));
            }
            for (int64_t t = prefill; t < data.tokens; ++t) {
                const float* q = data.q.data() + t * H * d;
                auto decode = [&] {
                    return kvsim_rt_decode(rt, layer, static_cast<int32_t>(t), q, data.k.data() + t * K * d,
                                           data.v.data() + t * K * d, out.data());
                };
                kvsim_status status = decode();
                if (status == KVSIM_ERROR_BACKEND && device) {
                    CHECK(std::string(kvsim_rt_last_error(rt)) == "backend 'cuda': an injected failure");
                    status = decode();
                }
                REQUIRE_MESSAGE(status == KVSIM_OK, kvsim_rt_last_error(rt));
                if (t == 0) continue;  // the replay measures decode steps 1..T
                for (int kv = 0; kv < K; ++kv) {
                    for (int h = 0; h < group; ++h) {
                        const int head = kv * group + h;
                        cached_attention_output(q + head * d, {every.data(), static_cast<std::size_t>(t + 1)}, fp16, fp16,
                                                arrays, kv, K, d, scratch, full.data());
                        const float* cached = out.data() + head * d;
                        double diff = 0, norm_full = 0;
                        for (int i = 0; i < d; ++i) {
                            diff += double(cached[i] - full[i]) * (cached[i] - full[i]);
                            norm_full += double(full[i]) * full[i];
                        }
                        seq.error[static_cast<std::size_t>(layer) * K + kv] +=
                            norm_full > 0 ? std::sqrt(diff / norm_full) : std::sqrt(diff);
                    }
                }
                double held = 0, full_bytes = 0;
                REQUIRE(kvsim_rt_bytes(rt, layer, &held, &full_bytes) == KVSIM_OK);
                seq.bytes[static_cast<std::size_t>(layer) * K] += held;  // per layer: compared summed over heads
            }
        }
        for (std::size_t u = 0; u < f.error.size(); ++u) f.error[u] += seq.error[u], f.bytes[u] += seq.bytes[u];
    }
    kvsim_rt_destroy(rt);
    return f;
}

void check_same(const HeadFigures& sim, const HeadFigures& rt, int K) {
    REQUIRE(sim.error.size() == rt.error.size());
    for (std::size_t u = 0; u < sim.error.size(); ++u) {
        INFO("layer " << u / K << ", KV head " << u % K);
        CHECK(rt.error[u] == sim.error[u]);  // bit for bit
    }
    for (std::size_t layer = 0; layer * K < sim.bytes.size(); ++layer) {
        double sim_layer = 0;
        for (int kv = 0; kv < K; ++kv) sim_layer += sim.bytes[layer * K + kv];
        INFO("layer " << layer);
        CHECK(rt.bytes[layer * K] == doctest::Approx(sim_layer).epsilon(1e-12));
    }
}

}  // namespace

std::string h2o_profile() {
    const TraceReader reader(fp16_trace());
    Profile p = base_profile(reader.metadata());
    p.policy = "h2o";
    p.params = resolve_params(*find_policy("h2o"), {{"recent_window", 8}}, "test");
    const int L = p.model.num_layers, K = p.model.num_kv_heads;
    for (int l = 0; l < L; ++l) {
        p.layer_budgets.push_back(20 + 10 * l);
        for (int kv = 0; kv < K; ++kv) p.head_budgets.push_back(12 + 7 * ((l * K + kv) % 9));
    }
    const std::string path = temp_file("h2o.json");
    write_profile(p, path);
    return path;
}

TEST_CASE("runtime (cpu): per-head H2O budgets match the simulator bit for bit") {
    const std::string path = h2o_profile();
    check_same(simulate(path, {3, 4}), run_runtime(path, {3, 4}), 4);
    std::filesystem::remove(path);
}

std::string tier_profile() {
    const TraceReader reader(fp16_trace());
    Profile p = base_profile(reader.metadata());
    p.policy = "stratigraphic";
    p.params = resolve_params(*find_policy("stratigraphic"), {{"recent", 16}}, "test");
    const int L = p.model.num_layers, K = p.model.num_kv_heads;
    p.tiers = TierShares{L, K, {}, {}, {}};
    for (int u = 0; u < L * K; ++u) {
        p.tiers->fp16.push_back(0.05 * (u % 4));
        p.tiers->int8.push_back(0.1 + 0.1 * (u % 3));
        p.tiers->int4.push_back(0.15 * (u % 2));
    }
    const std::string path = temp_file("tiers.json");
    write_profile(p, path);
    return path;
}

TEST_CASE("runtime (cpu): a stratigraphic tier profile matches the simulator bit for bit") {
    const std::string path = tier_profile();
    check_same(simulate(path, {3, 4}), run_runtime(path, {3, 4}), 4);
    std::filesystem::remove(path);
}

// A whole-cache KIVI quantiser: keys per channel with a scale per group of positions.
std::string kivi_profile(const std::string& policy, int key_group) {
    const TraceReader reader(fp16_trace());
    Profile p = base_profile(reader.metadata());
    p.policy = policy;
    p.params = resolve_params(*find_policy(policy), {{"key_group", key_group}, {"value_group", 4}, {"fp16_recent", 5}},
                              "test");
    // A policy that keeps every token takes no budgets (search/profile.h refuses them).
    const std::string path = temp_file(policy + "-kivi.json");
    write_profile(p, path);
    return path;
}

TEST_CASE("runtime (cpu): KIVI per-channel key groups (int4, int8) match the simulator bit for bit") {
    // Keys wait at FP16 until their position group is complete, then take the group's per-channel
    // scales; values are quantised per token once older than fp16_recent.
    for (const std::string& path : {kivi_profile("int4", 16), kivi_profile("int8", 7)}) {
        INFO(path);
        check_same(simulate(path, {3, 4}), run_runtime(path, {3, 4}), 4);
        check_same(simulate(path, {3}, 100), run_runtime(path, {3}, "cpu-oracle", 100), 4);
        const HeadFigures oracle = run_runtime(path, {3}, "cpu-oracle"), fast = run_runtime(path, {3}, "cpu");
        for (std::size_t u = 0; u < oracle.error.size(); ++u) {
            CHECK(fast.error[u] == doctest::Approx(oracle.error[u]).epsilon(1e-5));
            CHECK(fast.bytes[u] == oracle.bytes[u]);
        }
        std::filesystem::remove(path);
    }
}

TEST_CASE("runtime (cpu): a prefill compresses once, as the simulator's prefill_tokens does, bit for bit") {
    for (const std::string& path : {h2o_profile(), tier_profile()}) {
        INFO(path);
        check_same(simulate(path, {3, 4}, 100), run_runtime(path, {3, 4}, "cpu-oracle", 100), 4);
        std::filesystem::remove(path);
    }
}

TEST_CASE("runtime (cpu): a reset that cannot reread its plan changes nothing") {
    // stratigraphic rereads its per-head shares when a head's policy is rebuilt; with the file gone
    // the reset must fail as a whole, naming the file, and the sequence go on as before.
    const std::string path = tier_profile();
    const kvsim_model_shape shape{5, 8, 4, 8, 16, 0};
    kvsim_rt* rt = nullptr;
    REQUIRE(kvsim_rt_create(path.c_str(), &shape, "cpu", &rt) == KVSIM_OK);
    std::vector<float> q(8 * 8, 0.5f), k(4 * 8, 0.25f), v(4 * 8, 1.0f), out(8 * 8);
    REQUIRE(kvsim_rt_decode(rt, 0, 0, q.data(), k.data(), v.data(), out.data()) == KVSIM_OK);
    std::filesystem::remove(path);
    CHECK(kvsim_rt_reset(rt) == KVSIM_ERROR_INPUT);
    CHECK(std::string(kvsim_rt_last_error(rt)).find(path) != std::string::npos);
    CHECK(kvsim_rt_decode(rt, 0, 1, q.data(), k.data(), v.data(), out.data()) == KVSIM_OK);  // position 1 still next
    int32_t positions[4];
    uint8_t tiers[4];
    int32_t count = 0;
    REQUIRE(kvsim_rt_held(rt, 0, 0, positions, tiers, 4, &count) == KVSIM_OK);
    CHECK(count == 2);
    kvsim_rt_destroy(rt);
}

TEST_CASE("runtime (cpu): the one-pass online softmax stays within float rounding of the oracle") {
    // Not bit for bit: the online softmax rescales as its maximum rises. Per (layer, KV head) the
    // summed output error over two stories may differ only by rounding (1e-5 relative), which also
    // says no eviction or re-zoning decision flipped on this trace.
    for (const std::string& path : {h2o_profile(), tier_profile()}) {
        const HeadFigures oracle = run_runtime(path, {3, 4}, "cpu-oracle"), fast = run_runtime(path, {3, 4}, "cpu");
        for (std::size_t u = 0; u < oracle.error.size(); ++u) {
            INFO(path << ", unit " << u);
            CHECK(fast.error[u] == doctest::Approx(oracle.error[u]).epsilon(1e-5));
            CHECK(fast.bytes[u] == oracle.bytes[u]);
        }
        std::filesystem::remove(path);
    }
}

// The serving path against the oracle, step by step on the same inputs: the largest relative
// difference of any query head's output at any step, ||cpu - oracle|| / ||oracle||, and whether
// the two caches ever held different positions or tiers (a decision flipped by rounding).
struct StepAgreement {
    double worst = 0;
    long outputs = 0;
    bool same_holdings = true;
};

StepAgreement serving_against_oracle(const std::string& profile_path, const std::vector<int>& sequences) {
    const TraceReader reader(fp16_trace());
    const TraceMetadata& m = reader.metadata();
    const int L = static_cast<int>(m.num_layers), H = static_cast<int>(m.num_query_heads),
              K = static_cast<int>(m.num_kv_heads), d = static_cast<int>(m.head_dim);
    int longest = 0;
    for (int s : sequences) longest = std::max<int>(longest, static_cast<int>(reader.sequences()[s].length));
    const kvsim_model_shape shape{L, H, K, d, longest, 0};
    kvsim_rt *fast = nullptr, *oracle = nullptr;
    REQUIRE(kvsim_rt_create(profile_path.c_str(), &shape, "cpu", &fast) == KVSIM_OK);
    REQUIRE(kvsim_rt_create(profile_path.c_str(), &shape, "cpu-oracle", &oracle) == KVSIM_OK);
    StepAgreement a;
    std::vector<float> out_fast(static_cast<std::size_t>(H) * d), out_oracle(out_fast.size());
    std::vector<int32_t> held_fast(longest), held_oracle(longest);
    std::vector<uint8_t> tiers_fast(longest), tiers_oracle(longest);
    for (int s : sequences) {
        REQUIRE(kvsim_rt_reset(fast) == KVSIM_OK);
        REQUIRE(kvsim_rt_reset(oracle) == KVSIM_OK);
        for (int layer = 0; layer < L; ++layer) {
            const QkvLayer data = reader.read_qkv(s, layer);
            for (int64_t t = 0; t < data.tokens; ++t) {
                const float *q = data.q.data() + t * H * d, *k = data.k.data() + t * K * d, *v = data.v.data() + t * K * d;
                REQUIRE(kvsim_rt_decode(fast, layer, static_cast<int32_t>(t), q, k, v, out_fast.data()) == KVSIM_OK);
                REQUIRE(kvsim_rt_decode(oracle, layer, static_cast<int32_t>(t), q, k, v, out_oracle.data()) == KVSIM_OK);
                for (int h = 0; h < H; ++h) {
                    double diff = 0, norm = 0;
                    for (int i = 0; i < d; ++i) {
                        const double x = out_fast[h * d + i], y = out_oracle[h * d + i];
                        diff += (x - y) * (x - y);
                        norm += y * y;
                    }
                    a.worst = std::max(a.worst, std::sqrt(diff / std::max(norm, 1e-30)));
                    ++a.outputs;
                }
                for (int kv = 0; kv < K; ++kv) {
                    int32_t n_fast = 0, n_oracle = 0;
                    REQUIRE(kvsim_rt_held(fast, layer, kv, held_fast.data(), tiers_fast.data(), longest, &n_fast) == KVSIM_OK);
                    REQUIRE(kvsim_rt_held(oracle, layer, kv, held_oracle.data(), tiers_oracle.data(), longest, &n_oracle) ==
                            KVSIM_OK);
                    a.same_holdings = a.same_holdings && n_fast == n_oracle &&
                                      std::equal(held_fast.begin(), held_fast.begin() + n_fast, held_oracle.begin()) &&
                                      std::equal(tiers_fast.begin(), tiers_fast.begin() + n_fast, tiers_oracle.begin());
                }
            }
        }
    }
    kvsim_rt_destroy(fast);
    kvsim_rt_destroy(oracle);
    return a;
}

std::string streaming_profile() {
    const TraceReader reader(fp16_trace());
    Profile p = base_profile(reader.metadata());
    p.policy = "streaming_attention";
    p.params = resolve_params(*find_policy("streaming_attention"), {{"sinks", 4}, {"recent", 16}}, "test");
    const int L = p.model.num_layers, K = p.model.num_kv_heads;
    StreamingHeads heads;
    heads.sinks = 4;
    heads.recent = 16;
    for (int u = 0; u < L * K; ++u) {
        heads.heads.push_back(u % 3 != 0);
        heads.lambda.push_back(0.2 * (u % 5));
    }
    p.streaming = heads;
    const std::string path = temp_file("streaming.json");
    write_profile(p, path);
    return path;
}

// Each head its own method: in every layer the four methods, rotated from layer to layer; odd
// layers' streaming heads keep no linear state.
std::string mixed_profile() {
    const TraceReader reader(fp16_trace());
    Profile p = base_profile(reader.metadata());
    p.policy = "mixed";
    const int L = p.model.num_layers, K = p.model.num_kv_heads;
    MixedPlan plan = test::mixed_plan_frame(L, K);
    for (int u = 0; u < L * K; ++u) {
        const int layer = u / K;
        const auto m = static_cast<HeadMethod>((u + layer) % kHeadMethods);
        plan.method.push_back(m);
        plan.budgets.push_back(m == HeadMethod::evict ? 20 + 6 * u : 0);
        plan.fp16.push_back(m == HeadMethod::tiers ? 0.05 * (u % 3) : 0);
        plan.int8.push_back(m == HeadMethod::tiers ? 0.3 : 0);
        plan.int4.push_back(m == HeadMethod::tiers ? 0.1 + 0.05 * (u % 2) : 0);
        plan.lambda.push_back(m == HeadMethod::streaming ? 0.5 : 0);
        plan.stateless.push_back(m == HeadMethod::streaming && layer % 2 == 1);
    }
    p.mixed = plan;
    const std::string path = temp_file("mixed.json");
    write_profile(p, path);
    return path;
}

TEST_CASE("runtime (cpu): streaming heads match the simulator bit for bit") {
    const std::string path = streaming_profile();
    check_same(simulate(path, {3}), run_runtime(path, {3}), 4);
    std::filesystem::remove(path);
}

TEST_CASE("runtime (cpu): a mixed profile (every method in every layer) matches the simulator bit for bit") {
    const std::string path = mixed_profile();
    check_same(simulate(path, {3, 4}), run_runtime(path, {3, 4}), 4);
    std::filesystem::remove(path);
}

TEST_CASE("runtime (cpu): every output of the serving path within 1e-5 of the oracle's, every step") {
    // The serving path reads the stored rows with vector code (runtime/attention_kernels.h): the
    // same dequantised numbers as the oracle, summed in another order. Each query head's output at
    // each step may differ from the oracle's by rounding alone, and no policy decision may flip.
    for (const std::string& path : {h2o_profile(), tier_profile(), kivi_profile("int4", 16), kivi_profile("int8", 7),
                                    streaming_profile()}) {
        const StepAgreement a = serving_against_oracle(path, {3});
        MESSAGE(std::filesystem::path(path).filename().string() << ": largest relative difference " << a.worst << " over "
                                                                << a.outputs << " outputs");
        CHECK(a.worst < 1e-5);
        CHECK(a.same_holdings);
        std::filesystem::remove(path);
    }
}

TEST_CASE("runtime (cpu): every output the same bits on one thread as on several") {
    // kvsim_rt_decode steps the KV heads in parallel; each head's arithmetic is its own, so the
    // outputs and what each head holds may not depend on the threads, nor on where the heap put a
    // head's buffers (a second run on one thread: the heap is in another state by then). Seen to
    // fail when the serving path's score rows lay wherever the allocator put them: the
    // exponentials of a row's unaligned head are taken one by one, in other bits; and again on an
    // AVX-512 machine, where Eigen's packets align on 64 bytes and the rows were aligned on 32.
    const TraceReader reader(fp16_trace());
    const TraceMetadata& m = reader.metadata();
    const int L = static_cast<int>(m.num_layers), H = static_cast<int>(m.num_query_heads),
              K = static_cast<int>(m.num_kv_heads), d = static_cast<int>(m.head_dim);
    const int s = 3, length = static_cast<int>(reader.sequences()[s].length);
    const kvsim_model_shape shape{L, H, K, d, length, 0};
    for (const std::string& path : {tier_profile(), kivi_profile("int4", 16)}) {
        auto run = [&](int threads) {
            tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(threads));
            kvsim_rt* rt = nullptr;
            REQUIRE(kvsim_rt_create(path.c_str(), &shape, "cpu", &rt) == KVSIM_OK);
            std::vector<float> outputs, out(static_cast<std::size_t>(H) * d);
            std::vector<int32_t> held(length);
            std::vector<uint8_t> tiers(length);
            for (int layer = 0; layer < L; ++layer) {
                const QkvLayer data = reader.read_qkv(s, layer);
                for (int64_t t = 0; t < data.tokens; ++t) {
                    REQUIRE(kvsim_rt_decode(rt, layer, static_cast<int32_t>(t), data.q.data() + t * H * d,
                                            data.k.data() + t * K * d, data.v.data() + t * K * d, out.data()) == KVSIM_OK);
                    outputs.insert(outputs.end(), out.begin(), out.end());
                }
                for (int kv = 0; kv < K; ++kv) {
                    int32_t n = 0;
                    REQUIRE(kvsim_rt_held(rt, layer, kv, held.data(), tiers.data(), length, &n) == KVSIM_OK);
                    for (int i = 0; i < n; ++i) outputs.push_back(static_cast<float>(held[i] * 4 + tiers[i]));
                }
            }
            kvsim_rt_destroy(rt);
            return outputs;
        };
        const std::vector<float> one = run(1), several = run(4), again = run(1);
        REQUIRE(one.size() == several.size());
        REQUIRE(one.size() == again.size());
        CHECK(std::memcmp(one.data(), several.data(), one.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(one.data(), again.data(), one.size() * sizeof(float)) == 0);
        std::filesystem::remove(path);
    }
}

namespace {

// The "cuda" backend's path with its device done on the host (tests/unit/host_device_cache.h).
runtime::DeviceFactory host_device(int fail_every = 0, std::shared_ptr<int> failures = nullptr) {
    return [fail_every, failures](const std::vector<runtime::HeadLayout>& heads, int K, int group, int d,
                                  std::string&) -> std::unique_ptr<runtime::cuda::DeviceCache> {
        auto cache = std::make_unique<runtime::HostDeviceCache>(heads, K, group, d);
        cache->fail_every = fail_every;
        cache->failures = failures;
        return cache;
    };
}

void check_close(const HeadFigures& reference, const HeadFigures& got) {
    REQUIRE(reference.error.size() == got.error.size());
    for (std::size_t u = 0; u < reference.error.size(); ++u) {
        INFO("unit " << u);
        // Relative 1e-5, or 1e-3 absolute: a head that keeps every token (the exact heads of the
        // streaming profile) has an output error of rounding alone, summed over its ~1,800 outputs
        // here; the cpu backend sums its dot products in eight lanes, the device (here on the host)
        // in order, and each path's rounding is ~3e-7 an output on average (about 5e-4 summed).
        CHECK(got.error[u] == doctest::Approx(reference.error[u]).epsilon(1e-5).scale(100.0));
        CHECK(got.bytes[u] == reference.bytes[u]);
    }
}

}  // namespace

TEST_CASE("runtime (cuda path, device done on the host): within float rounding of the cpu backend") {
    // Everything the CUDA backend does but the kernels' lanes: the pool's layout, staging only the
    // slots that changed, attending by slot in merged chunks, each head's step completed from the
    // device's weights; streaming heads (a third of them here) stay on the host. Same bytes, and
    // errors within rounding, which also says no eviction or re-zoning decision flipped.
    for (const std::string& path : {h2o_profile(), tier_profile(), streaming_profile(), mixed_profile()}) {
        INFO(path);
        check_close(run_runtime(path, {3, 4}, "cpu"), run_runtime(path, {3, 4}, "cuda", 0, host_device()));
        check_close(run_runtime(path, {3}, "cpu", 100), run_runtime(path, {3}, "cuda", 100, host_device()));
        std::filesystem::remove(path);
    }
}

TEST_CASE("runtime (cuda path): per-channel (KIVI) key groups are refused in one line, not run wrong") {
    const std::string path = kivi_profile("int4", 16);
    const kvsim_model_shape shape{5, 8, 4, 8, 64, 0};
    kvsim_rt* rt = nullptr;
    CHECK(runtime::create_with_device(path.c_str(), shape, host_device(), &rt) == KVSIM_ERROR_BACKEND);
    CHECK(rt == nullptr);
    CHECK(std::string(kvsim_rt_create_error()) ==
          "backend 'cuda': per-channel (KIVI) key groups (policy int4) are not on the device yet; use cpu");
    std::filesystem::remove(path);
}

TEST_CASE("runtime (cuda path, device done on the host): a failed device call undoes its step, and the next resends the cache") {
    const std::string path = tier_profile();
    auto failures = std::make_shared<int>(0);
    check_close(run_runtime(path, {3}, "cpu"), run_runtime(path, {3}, "cuda", 0, host_device(97, failures)));
    CHECK(*failures > 10);  // each retried, as an engine would
    std::filesystem::remove(path);
}

TEST_CASE("runtime (cuda): against the cpu backend on a GPU (skipped without one)") {
    std::string why;
    if (!runtime::cuda::device_available(why)) {
        MESSAGE("skipped: " << why);
        return;
    }
    for (const std::string& path : {h2o_profile(), tier_profile(), streaming_profile(), mixed_profile()}) {
        INFO(path);
        check_close(run_runtime(path, {3, 4}, "cpu"), run_runtime(path, {3, 4}, "cuda"));
        check_close(run_runtime(path, {3}, "cpu", 100), run_runtime(path, {3}, "cuda", 100));
        std::filesystem::remove(path);
    }
}

TEST_CASE("runtime (cpu): bad input is an error code and one line, and the cache stays usable") {
    const TraceReader reader(fp16_trace());
    Profile p = base_profile(reader.metadata());
    p.policy = "h2o";
    p.params = resolve_params(*find_policy("h2o"), {{"recent_window", 4}}, "test");
    p.layer_budgets.assign(p.model.num_layers, 16);
    const std::string path = temp_file("bad.json");
    write_profile(p, path);
    const int L = p.model.num_layers, H = p.model.num_query_heads, K = p.model.num_kv_heads, d = p.model.head_dim;

    kvsim_rt* rt = nullptr;
    kvsim_model_shape other{L + 1, H, K, d, 64, 0};
    CHECK(kvsim_rt_create(path.c_str(), &other, "cpu", &rt) == KVSIM_ERROR_INPUT);
    CHECK(rt == nullptr);
    CHECK(std::string(kvsim_rt_create_error()).find("the profile was fitted to 5 layers, 8 query heads, 4 KV heads, "
                                                    "head size 8") != std::string::npos);
    CHECK(std::string(kvsim_rt_create_error()).find("has 6 layers") != std::string::npos);
    const kvsim_model_shape shape{L, H, K, d, 4, 2};
    std::string why;
    if (!runtime::cuda::device_available(why)) {
        CHECK(kvsim_rt_create(path.c_str(), &shape, "cuda", &rt) == KVSIM_ERROR_BACKEND);
        CHECK(std::string(kvsim_rt_create_error()) == "backend 'cuda': " + why);
    }
    CHECK(kvsim_rt_create(path.c_str(), &shape, "tpu", &rt) == KVSIM_ERROR_INPUT);
    CHECK(kvsim_rt_create("/nonexistent/profile.json", &shape, "cpu", &rt) == KVSIM_ERROR_INPUT);
    REQUIRE(kvsim_rt_create(path.c_str(), &shape, "cpu", &rt) == KVSIM_OK);

    std::vector<float> q(H * d, 0.5f), k(K * d, 0.25f), v(K * d, 1.0f), out(H * d);
    REQUIRE(kvsim_rt_decode(rt, 0, 0, q.data(), k.data(), v.data(), out.data()) == KVSIM_OK);
    CHECK(kvsim_rt_decode(rt, 0, 2, q.data(), k.data(), v.data(), out.data()) == KVSIM_ERROR_CAPACITY);
    CHECK(std::string(kvsim_rt_last_error(rt)) == "layer 0: position 2 out of order (the next is 1)");
    k[3] = NAN;
    CHECK(kvsim_rt_decode(rt, 0, 1, q.data(), k.data(), v.data(), out.data()) == KVSIM_ERROR_NONFINITE);
    k[3] = 0.25f;
    CHECK(kvsim_rt_decode(rt, 7, 1, q.data(), k.data(), v.data(), out.data()) == KVSIM_ERROR_INPUT);
    // Still usable after the refusals: the next position goes through.
    for (int t = 1; t < 4; ++t) REQUIRE(kvsim_rt_decode(rt, 0, t, q.data(), k.data(), v.data(), out.data()) == KVSIM_OK);
    CHECK(kvsim_rt_decode(rt, 0, 4, q.data(), k.data(), v.data(), out.data()) == KVSIM_ERROR_CAPACITY);
    std::vector<float> q3(3 * H * d, 0.5f), k3(3 * K * d, 0.25f), v3(3 * K * d, 1.0f), out3(3 * H * d);
    CHECK(kvsim_rt_prefill(rt, 1, 0, 3, q3.data(), k3.data(), v3.data(), out3.data()) == KVSIM_ERROR_CAPACITY);
    CHECK(std::string(kvsim_rt_last_error(rt)) == "kvsim_rt_prefill: 3 tokens, but the plan allows 1..2 a call (max_prefill)");
    CHECK(kvsim_rt_prefill(rt, 1, 0, 2, q3.data(), k3.data(), v3.data(), out3.data()) == KVSIM_OK);
    CHECK(out3[H * d] == 1.0f);
    CHECK(out[0] == 1.0f);  // every value is 1: attention returns 1
    int32_t positions[8];
    uint8_t tiers[8];
    int32_t count = 0;
    REQUIRE(kvsim_rt_held(rt, 0, 0, positions, tiers, 8, &count) == KVSIM_OK);
    CHECK(count == 4);
    kvsim_rt_destroy(rt);
    std::filesystem::remove(path);
}

TEST_CASE("runtime (cpu): bytes held, counted by hand for a KIVI int8 cache and the full cache") {
    // Written from the arrangement, not from the code that counts: while step t attends, the
    // current token is at FP16 (4d bytes); every earlier value was quantised at the end of its own
    // step (d bytes and one fp16 scale, value_group = d); an earlier key is at FP16 (2d) until its
    // group of G positions completed by step t-1, then d bytes plus its share of the group's
    // per-channel scales (2d / G).
    const int L = 1, H = 2, K = 1, d = 8, G = 4, T = 11;
    Profile p;
    p.name = "bytes";
    p.model = {"bytes", L, H, K, d};
    p.policy = "int8";
    p.params = resolve_params(*find_policy("int8"), {{"key_group", G}, {"value_group", d}}, "test");
    const std::string path = temp_file("bytes-int8.json");
    write_profile(p, path);
    Profile full = p;
    full.policy = "full";
    full.params = {};
    const std::string full_path = temp_file("bytes-full.json");
    write_profile(full, full_path);
    const kvsim_model_shape shape{L, H, K, d, T, 0};
    kvsim_rt *rt = nullptr, *rt_full = nullptr;
    REQUIRE(kvsim_rt_create(path.c_str(), &shape, "cpu", &rt) == KVSIM_OK);
    REQUIRE(kvsim_rt_create(full_path.c_str(), &shape, "cpu", &rt_full) == KVSIM_OK);
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(H * d), k(K * d), v(K * d), out(H * d);
    for (int t = 0; t < T; ++t) {
        for (float& x : q) x = normal(rng);
        for (float& x : k) x = normal(rng);
        for (float& x : v) x = normal(rng);
        REQUIRE(kvsim_rt_decode(rt, 0, t, q.data(), k.data(), v.data(), out.data()) == KVSIM_OK);
        REQUIRE(kvsim_rt_decode(rt_full, 0, t, q.data(), k.data(), v.data(), out.data()) == KVSIM_OK);
        double expected = 4.0 * d;
        for (int pos = 0; pos < t; ++pos) {
            expected += d + 2.0;
            const bool key_quantised = (pos / G + 1) * G - 1 <= t - 1;
            expected += key_quantised ? d + 2.0 * d / G : 2.0 * d;
        }
        double held = 0, full_fp16 = 0;
        REQUIRE(kvsim_rt_bytes(rt, -1, &held, &full_fp16) == KVSIM_OK);
        INFO("step " << t);
        CHECK(held == expected);
        CHECK(full_fp16 == 4.0 * d * (t + 1));
        REQUIRE(kvsim_rt_bytes(rt_full, 0, &held, &full_fp16) == KVSIM_OK);
        CHECK(held == 4.0 * d * (t + 1));
        CHECK(full_fp16 == 4.0 * d * (t + 1));
    }
    kvsim_rt_destroy(rt);
    kvsim_rt_destroy(rt_full);
    std::filesystem::remove(path);
    std::filesystem::remove(full_path);
}

// Counts this test binary's heap allocations while `counting` is set (the decode-path test below).
// Not under AddressSanitizer, which owns operator new.
#if defined(__SANITIZE_ADDRESS__)
#define KVSIM_COUNTS_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVSIM_COUNTS_ALLOCATIONS 0
#endif
#endif
#ifndef KVSIM_COUNTS_ALLOCATIONS
#define KVSIM_COUNTS_ALLOCATIONS 1
#endif

namespace {
std::atomic<long> allocations{0};
std::atomic<bool> counting{false};
}  // namespace

#if KVSIM_COUNTS_ALLOCATIONS
// The global operators replaced as a pair over malloc and free; GCC 12, seeing free() reached
// from a delete expression once these are inlined, calls the pair mismatched.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t size) {
    if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1, std::memory_order_relaxed);
    if (void* p = std::malloc(size ? size : 1)) return p;
    throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
#endif

TEST_CASE("runtime (cpu): the decode path allocates nothing once planned") {
    if (!KVSIM_COUNTS_ALLOCATIONS) {
        MESSAGE("skipped under AddressSanitizer: it owns operator new");
        return;
    }
    for (const std::string& path : {h2o_profile(), tier_profile(), streaming_profile(), kivi_profile("int4", 16)}) {
        INFO(path);
        const int L = 5, H = 8, K = 4, d = 8, T = 300;
        const kvsim_model_shape shape{L, H, K, d, T, 0};
        kvsim_rt* rt = nullptr;
        REQUIRE(kvsim_rt_create(path.c_str(), &shape, "cpu", &rt) == KVSIM_OK);
        std::mt19937 rng(1);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> q(H * d), k(K * d), v(K * d), out(H * d);
        long during = 0;
        for (int t = 0; t < T; ++t) {
            for (float& x : q) x = normal(rng);
            for (float& x : k) x = normal(rng);
            for (float& x : v) x = normal(rng);
            counting = t >= 150;  // after the first steps have sized what grows with the cache
            const long before = allocations.load();
            for (int layer = 0; layer < L; ++layer)
                REQUIRE(kvsim_rt_decode(rt, layer, t, q.data(), k.data(), v.data(), out.data()) == KVSIM_OK);
            during += allocations.load() - before;
            counting = false;
        }
        CHECK(during == 0);
        kvsim_rt_destroy(rt);
        std::filesystem::remove(path);
    }
}

TEST_CASE("runtime (cpu): a KIVI key group longer than the context reserves no more than the context") {
    // key_group may be up to 10^9 positions; a group that long never completes within a planned
    // context, so the keys kept aside for it are bounded by the context, not by key_group.
    const PolicyDescriptor* int4 = find_policy("int4");
    const ParamValues params = resolve_params(*int4, {{"key_group", 100000000}, {"value_group", 8}}, "test");
    static const std::map<std::string, std::string> no_files;
    runtime::HeadPlan plan;
    plan.group = 2, plan.head_dim = 8, plan.budget = 64, plan.max_context = 64;
    const PolicyContext ctx{64, 65, 0, 1, 0, 1, 8, &no_files};
    runtime::HeadCache head(plan, [&] { return int4->make(params, ctx); });
    // 65 slots at three tiers (about 4 KB), the group's keys for 64 positions (2 KB) and two
    // tiers' scales for one group (64 B); sized by key_group it would be 3.2 GB.
    CHECK(head.reserved_bytes() < 16 * 1024);
    std::vector<float> q(16, 0.5f), k(8, 0.25f), v(8, 1.0f), out(16);
    for (int t = 0; t < 64; ++t) head.decode(t, q.data(), k.data(), v.data(), out.data());
    for (std::size_t i = 0; i < head.held().size(); ++i)
        CHECK(head.key_tier_of(i) == 0);  // the group never completed: every key still FP16
}

namespace {
// A tiered policy for the runtime's bookkeeping alone: it sinks each position by its age (keys at
// 37 and 70 steps, values at 45 and 90) and, from step 150 on, every position below 120 to INT8
// at least (a run of changes longer than the runtime's 32-position scan); it evicts every seventh
// position at age 11; it writes a tier for a position it evicted (to be ignored) and, at step
// raise_at, an FP16 key for position 3, long at INT4 (to be refused).
class SinksOnSchedule : public Policy {
public:
    explicit SinksOnSchedule(int32_t raise_at) : raise_at_(raise_at) { format_.per_token_keys = true, format_.value_group = 4; }
    static uint8_t key_tier(int32_t p, int32_t t) {
        const int32_t age = t - p;
        return static_cast<uint8_t>(std::max((age >= 37) + (age >= 70), t >= 150 && p < 120 ? 1 : 0));
    }
    static uint8_t value_tier(int32_t p, int32_t t) {
        const int32_t age = t - p;
        return static_cast<uint8_t>(std::max((age >= 45) + (age >= 90), t >= 150 && p < 120 ? 1 : 0));
    }
    void on_decode_step(int32_t pos, std::span<const float>) override { step_ = pos; }
    void evict(int, std::vector<int32_t>& victims) override {
        if (const int32_t p = step_ - 11; p > 0 && p % 7 == 0) victims.push_back(last_evicted_ = p);
    }
    bool sizes_itself() const override { return true; }
    std::size_t bytes_per_slot() const override { return 4; }
    const TierFormat* tier_format() const override { return &format_; }
    void assign_tiers(int32_t t, std::span<const int32_t> held, std::span<uint8_t> keys,
                      std::span<uint8_t> values) override {
        for (int32_t p : held) keys[p] = key_tier(p, t), values[p] = value_tier(p, t);
        if (last_evicted_ > 0) keys[last_evicted_] = 2, values[last_evicted_] = 1;  // not held
        if (t == raise_at_) keys[3] = 0;
    }

private:
    TierFormat format_;
    int32_t step_ = 0, last_evicted_ = 0, raise_at_;
};
}  // namespace

TEST_CASE("runtime (cpu): a head finds every tier change, ignores tiers of positions it does not hold, refuses a rise") {
    runtime::HeadPlan plan;
    plan.group = 1, plan.head_dim = 8, plan.budget = 400, plan.max_context = 400;
    std::vector<float> q(8, 0.5f), k(8, 0.25f), v(8, 1.0f), out(8);
    {
        runtime::HeadCache head(plan, [] { return std::make_unique<SinksOnSchedule>(-1); });
        int checked = 0;
        for (int32_t t = 0; t < 300; ++t) {
            head.decode(t, q.data(), k.data(), v.data(), out.data());
            int key_rows[3] = {}, value_rows[3] = {};
            for (std::size_t i = 0; i < head.held().size(); ++i) {
                const int32_t p = head.held()[i];
                const bool evicted = p % 7 == 0 && t - p >= 11 && p > 0;
                REQUIRE_FALSE(evicted);
                REQUIRE(int{head.key_tier_of(i)} == int{SinksOnSchedule::key_tier(p, t)});
                ++key_rows[SinksOnSchedule::key_tier(p, t)];
                ++value_rows[SinksOnSchedule::value_tier(p, t)];
                ++checked;
            }
            runtime::TierView keys[3], values[3];
            head.tier_views(keys, values);
            for (int tier = 0; tier < 3; ++tier) {
                INFO("step " << t << ", tier " << tier);
                // Every held key and value sits in its tier's store, and nothing else.
                int key_held = 0, value_held = 0;
                for (int slot = 0; slot < head.capacity(); ++slot) {
                    key_held += keys[tier].row_of_slot[slot] >= 0 ? 1 : 0;
                    value_held += values[tier].row_of_slot[slot] >= 0 ? 1 : 0;
                }
                REQUIRE(key_held == key_rows[tier]);
                REQUIRE(value_held == value_rows[tier]);
            }
        }
        CHECK(checked > 30000);
    }
    runtime::HeadCache head(plan, [] { return std::make_unique<SinksOnSchedule>(120); });
    for (int32_t t = 0; t < 120; ++t) head.decode(t, q.data(), k.data(), v.data(), out.data());
    CHECK_THROWS_WITH_AS(head.decode(120, q.data(), k.data(), v.data(), out.data()),
                         doctest::Contains("moved position 3 to a finer or unknown tier"), std::logic_error);
}
