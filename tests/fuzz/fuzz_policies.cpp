// Fuzzes the selection code every policy and metric shares with rows no trace reader would let
// through: the bytes are attention weights of any bits (NaN, Inf, negative, denormal, huge), a
// budget, a step count, a group size and a heavy-hitter k. Each row goes to top_k_positions,
// checked against a sort by the same total order, and through the harness (both attention views,
// grouped heads) to every registered policy. The harness contract must hold: a policy may throw
// InputError or PolicyError, never crash, read out of bounds, or let anything else escape.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "base/errors.h"
#include "base/size_limits.h"
#include "fuzz_bytes.h"
#include "policies/policy.h"
#include "sim/harness.h"
#include "sim/heavy_hitters.h"

namespace {

using kvsim::fuzz::Bytes;

[[noreturn]] void broken(const std::string& what) {
    std::fprintf(stderr, "fuzz_policies: %s\n", what.c_str());
    std::abort();
}

// The order top_k_positions documents: IEEE 754 totalOrder (-NaN lowest, +NaN highest).
int64_t rank(float x) {
    int32_t bits;
    std::memcpy(&bits, &x, 4);
    return bits >= 0 ? bits : bits ^ INT32_MAX;
}

// top_k_positions against its definition: the k largest by that order, ties to the lower position.
void check_top_k(const std::vector<float>& row, int k) {
    std::vector<int32_t> got = {-7};  // it appends: what was there stays
    kvsim::top_k_positions(row, k, got);
    if (got.empty() || got[0] != -7) broken("top_k_positions overwrote its output");
    got.erase(got.begin());
    const size_t want = k > 0 ? std::min<size_t>(static_cast<size_t>(k), row.size()) : 0;
    if (got.size() != want) broken("top_k_positions returned " + std::to_string(got.size()) + " of " + std::to_string(want));
    std::vector<int32_t> order(row.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return rank(row[a]) > rank(row[b]); });
    order.resize(want);
    std::sort(order.begin(), order.end());
    std::sort(got.begin(), got.end());
    if (got != order) broken("top_k_positions chose other positions than the total order does");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const bool limited = (kvsim::set_memory_limit_bytes(uint64_t{256} << 20), true);
    (void)limited;
    Bytes in(data, size);
    const int budget = static_cast<int>(1 + in.u8() % 12);
    const int64_t steps = 2 + in.u8() % 48;
    const int group = 1 + in.u8() % 3;
    const int k = static_cast<int>(in.count(1, 8));
    const uint8_t view = in.u8();
    const uint8_t prefill = in.u8() % 4 == 3 ? in.u8() % 8 : 0;
    const uint8_t param_bytes = in.u8();

    // Rows of every step for every head of the group: raw floats while the bytes last, then a
    // pattern; a weight is sometimes a special value.
    std::vector<std::vector<float>> rows(group);  // [head] packed steps 1..steps-1
    std::vector<std::vector<float>> self(group);
    for (int h = 0; h < group; ++h)
        for (int64_t t = 1; t < steps; ++t) {
            for (int64_t j = 0; j < t; ++j) {
                const uint8_t how = in.u8();
                rows[h].push_back(how < 64 ? 1.0f / static_cast<float>(t + 1)
                                  : how < 160 ? in.raw_float()
                                              : in.special());
            }
            self[h].push_back(in.u8() < 128 ? 0.5f : in.special());
        }
    auto row = [&](int h, int64_t t) { return rows[h].data() + (t - 1) * t / 2; };

    for (int h = 0; h < group; ++h)
        for (int64_t t = 1; t < steps; ++t) check_top_k({row(h, t), row(h, t) + t}, k);

    kvsim::HarnessOptions options;
    options.view = view % 2 ? kvsim::AttentionView::renormalized : kvsim::AttentionView::raw;
    options.reduce = static_cast<kvsim::GroupReduce>(view / 2 % 3);
    options.prefill_tokens = prefill;
    for (const kvsim::PolicyDescriptor& policy : kvsim::policy_registry()) {
        if (policy.prompt_press) continue;  // reads a prompt's Q/K/V, not rows (test_prompt_press.cpp)
        try {
            // Small integer parameters the bytes pick where a policy takes them (then its budget
            // check decides, as a config's would).
            std::map<std::string, double> given;
            for (const kvsim::ParamSpec& spec : policy.params)
                if (spec.integer && !spec.file && (param_bytes & 1)) {
                    int v = std::max(static_cast<int>(spec.min_value), (param_bytes >> 1) % 5);
                    if (spec.odd && v % 2 == 0) ++v;
                    given[spec.name] = v;
                }
            const kvsim::ParamValues params = kvsim::resolve_params(policy, given, "fuzz: " + policy.name);
            if (policy.check_budget && !policy.check_budget(params, budget).empty()) continue;
            const int harness_budget = policy.keeps_everything ? static_cast<int>(steps) : budget;
            const int capacity = static_cast<int>(std::min<int64_t>(std::max<int>(harness_budget, prefill), steps)) + 1;
            const kvsim::PolicyContext ctx{harness_budget, capacity, 0, 1, 0, 1, 0};
            kvsim::Harness harness(policy.make(params, ctx), harness_budget, steps, options, policy.name, " (fuzz)");
            std::vector<float> combined;
            std::vector<std::vector<int32_t>> heavy(group);
            for (int64_t t = 1; t < steps; ++t) {
                const float* rows_of_group[3];
                std::span<const int32_t> heavy_of_group[3];
                float self_of_group[3];
                for (int h = 0; h < group; ++h) {
                    rows_of_group[h] = row(h, t);
                    heavy[h].clear();
                    kvsim::top_k_positions({row(h, t), static_cast<size_t>(t)}, k, heavy[h]);
                    heavy_of_group[h] = heavy[h];
                    self_of_group[h] = self[h][t - 1];
                }
                combined.resize(t);
                kvsim::combine_group_rows({rows_of_group, static_cast<size_t>(group)}, t, options.reduce,
                                          combined.data());
                kvsim::GroupStep step;
                step.t = static_cast<int32_t>(t);
                step.rows = {rows_of_group, static_cast<size_t>(group)};
                step.heavy = {heavy_of_group, static_cast<size_t>(group)};
                step.self_weight = {self_of_group, static_cast<size_t>(group)};
                step.combined = group > 1 ? combined.data() : rows_of_group[0];
                harness.step(step);
                // The contract the harness enforces, checked from outside too.
                const std::span<const int32_t> kept = harness.kept();
                if (!std::is_sorted(kept.begin(), kept.end()) || std::adjacent_find(kept.begin(), kept.end()) != kept.end() ||
                    (!kept.empty() && (kept.front() < 0 || kept.back() > t)))
                    broken(policy.name + ": the cache is not an ascending list of positions up to step " + std::to_string(t));
                if (t + 1 >= prefill && kept.size() > static_cast<size_t>(harness_budget))
                    broken(policy.name + ": over budget at step " + std::to_string(t));
            }
        } catch (const kvsim::InputError&) {
        } catch (const kvsim::PolicyError&) {
        }
    }
    return 0;
}
