// The policies' own work per decode step (observe, score, evict), without the harness, the
// attention or the metrics: each policy at budgets 256, 512 and 1024 through 4,096 steps of
// random weights, one victim a step once full. A policy that sizes itself (stratigraphic's shares)
// is asked to evict every step, as the harness asks it, and runs at 4,096 too, where its shares
// alone size it (the search's tier fit). Prints the median of five runs in ns per step.
// Run by hand: build/bench/bench_policy_steps [policy ...]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "policies/policy.h"

using namespace kvsim;

int main(int argc, char** argv) {
    std::vector<std::string> names = {"sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "snapkv"};
    if (argc > 1) names.assign(argv + 1, argv + argc);
    constexpr int kSteps = 4096, kRuns = 5;
    // Weights drawn once: a step reads the next `held` of them (exponential, mean 1e-3).
    std::mt19937 rng(1);
    std::exponential_distribution<float> draw(1.0f);
    std::vector<float> weights(1 << 22);
    for (float& w : weights) w = draw(rng) * 1e-3f;
    for (const std::string& name : names) {
        const PolicyDescriptor* d = find_policy(name);
        if (!d) {
            std::fprintf(stderr, "no policy %s\n", name.c_str());
            return 2;
        }
        std::vector<int> budgets = {256, 512, 1024};
        const bool sizes_itself = d->make(resolve_params(*d, {}, "bench"), PolicyContext{2, 4, 0, 1, 0, 1, 128})->sizes_itself();
        if (sizes_itself) budgets.push_back(kSteps);
        for (int budget : budgets) {
            std::vector<double> ns;
            for (int run = 0; run < kRuns; ++run) {
                auto policy = d->make(resolve_params(*d, {}, "bench"), PolicyContext{budget, budget + 2, 0, 1, 0, 1, 128});
                std::vector<int32_t> victims;
                std::size_t held = 1, at = 0;
                const auto start = std::chrono::steady_clock::now();
                for (int32_t t = 1; t < kSteps; ++t) {
                    if (at + held > weights.size()) at = 0;
                    policy->on_decode_step(t, std::span<const float>(weights.data() + at, held));
                    at += held++;
                    if (held > static_cast<std::size_t>(budget) || sizes_itself) {
                        victims.clear();
                        policy->evict(budget, victims);
                        held -= victims.size();
                    }
                }
                ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
                             kSteps);
            }
            std::sort(ns.begin(), ns.end());
            std::printf("%-15s B=%4d %8.1f ns/step\n", name.c_str(), budget, ns[kRuns / 2]);
        }
    }
}
