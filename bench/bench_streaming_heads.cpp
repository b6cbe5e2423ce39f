// A streaming head's decayed linear state (cache_math/streaming_heads.h) alone: one KV head of 128
// channels with sinks 4 and a recent window of 64, through 4,096 steps of random keys, values and
// queries, its 4 query heads read at every step (the runtime's decode) and at one step in 8 (a
// replay's output error sampled at 1/8, as the search samples it). Prints the median of seven
// runs in microseconds a step, and the arithmetic rate that is: per step the state's fold (d^2
// multiply-adds, and d^2 multiplies of decay per read), and per read S^T phi(q) (d^2 a query)
// and the exact tokens' scores and values (2 d a token and query).
// Run by hand: build/bench/bench_streaming_heads
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "cache_math/streaming_heads.h"

using namespace kvsim;

int main() {
    constexpr int kSteps = 4096, kDim = 128, kGroup = 4, kRuns = 7, kSinks = 4, kRecent = 64;
    std::mt19937 rng(1);
    std::normal_distribution<float> draw(0.0f, 1.0f);
    std::vector<float> keys(kSteps * kDim), values(kSteps * kDim), queries(kSteps * kGroup * kDim);
    for (float& x : keys) x = draw(rng);
    for (float& x : values) x = draw(rng);
    for (float& x : queries) x = draw(rng);
    std::printf("%-28s %12s %10s\n", "reads", "us a step", "GFLOP/s");
    for (const int every : {1, 8}) {
        std::vector<double> seconds;
        double checksum = 0;
        for (int run = 0; run < kRuns; ++run) {
            StreamingHeadState head(kDim, {kSinks, kRecent, 0.99});
            std::vector<float> out(kGroup * kDim);
            const auto start = std::chrono::steady_clock::now();
            for (int t = 0; t < kSteps; ++t) {
                head.admit(t, &keys[t * kDim], &values[t * kDim]);
                if (t % every != 0) continue;
                const float* group[kGroup];
                for (int g = 0; g < kGroup; ++g) group[g] = &queries[(t * kGroup + g) * kDim];
                head.output(group, out.data());
                checksum += out[0];
            }
            seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        }
        std::sort(seconds.begin(), seconds.end());
        const double median = seconds[kRuns / 2];
        const double d = kDim, exact = kSinks + kRecent, reads = (kSteps + every - 1) / every;
        const double flops = 2 * d * d * kSteps + reads * (d * d + kGroup * (2 * d * d + 4 * d * exact));
        std::printf("%-28s %12.3f %10.2f   (checksum %.6g)\n", every == 1 ? "every step (runtime)" : "1 step in 8 (sampled replay)",
                    median * 1e6 / kSteps, flops / median * 1e-9, checksum);
    }
}
