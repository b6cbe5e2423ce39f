// The policybook benchmark (7 policies x budgets 256, 512, 1024 on decode-4096) as the plainest
// correct single-threaded C++ loop, written from ../shared/reference/policybook-kvcache.md
// sections 3 and 4 alone: one policy and budget after another, a full sort for the heavy hitters,
// a rescan of every slot for each victim, no lockstep, no shared work, no threads. It is the
// baseline issue 10 measures kvsim against, and an independent check: it replays the same trace
// through kvsim's own replay and reports whether every figure agrees.
//   build/bench/bench_plain_policybook [runs]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>
#include <vector>

#include "sim/policybook_trace.h"
#include "sim/replay.h"
#include "sim/sweep.h"
#include "bench/arguments.h"

using namespace kvsim;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kRecentWindow = 32, kObsWindow = 16, kPoolKernel = 7, kSinks = 4, kHeavyK = 32;

// A policy holds ascending positions (slot order) and one score-like state per slot.
struct PlainPolicy {
    std::string name;
    std::vector<int> pos{0};
    std::vector<double> score{0.0};              // h2o: sum; tova: last weight (-1 unobserved); scissorhands: votes
    std::vector<std::vector<float>> history{std::vector<float>(kObsWindow, 0.0f)};  // snapkv's ring per slot
    int ring_slot = 0;

    explicit PlainPolicy(std::string n) : name(std::move(n)) {
        if (name == "tova") score[0] = -1.0;
    }

    void on_decode_step(int t, const std::vector<float>& attn) {
        for (std::size_t i = 0; i < attn.size(); ++i) {
            if (name == "h2o") score[i] += attn[i];
            if (name == "tova") score[i] = attn[i];
            if (name == "scissorhands") score[i] += static_cast<double>(attn[i]) > 1.0 / attn.size() ? 1 : 0;
            if (name == "snapkv" || name == "pyramidkv") history[i][ring_slot] = attn[i];
        }
        if (name == "snapkv" || name == "pyramidkv") ring_slot = (ring_slot + 1) % kObsWindow;
        pos.push_back(t);
        score.push_back(name == "tova" ? -1.0 : 0.0);
        history.push_back(std::vector<float>(kObsWindow, 0.0f));
    }

    // The slots to evict, chosen one at a time by a full argmin scan (ties to the lower slot).
    std::vector<int> evict(int budget) {
        std::vector<int> victims;  // slot indices
        const int size = static_cast<int>(pos.size());
        if (name == "sliding_window") {
            for (int i = 0; i < size - budget; ++i) victims.push_back(i);
        } else if (name == "streaming_llm") {
            for (int i = 0; i < size && size - static_cast<int>(victims.size()) > budget; ++i)
                if (pos[i] >= kSinks) victims.push_back(i);
        } else {
            std::vector<double> s = score;
            if (name == "snapkv" || name == "pyramidkv") {
                std::vector<double> sums(size, 0.0);
                for (int i = 0; i < size; ++i)
                    for (int j = 0; j < kObsWindow; ++j) sums[i] += history[i][j];
                const int r = (kPoolKernel - 1) / 2;
                for (int i = 0; i < size; ++i) {
                    s[i] = sums[std::max(0, i - r)];
                    for (int j = std::max(0, i - r); j <= std::min(size - 1, i + r); ++j) s[i] = std::max(s[i], sums[j]);
                }
            }
            const int evictable_end = name == "tova" ? size : size - std::min(kRecentWindow, size);
            const int needed = size - budget;
            std::vector<bool> chosen(size, false);
            for (int taken = 0; taken < needed && taken < evictable_end; ++taken) {
                int best = -1;
                for (int i = 0; i < evictable_end; ++i) {
                    if (chosen[i] || (name == "tova" && s[i] == -1.0)) continue;
                    if (best < 0 || s[i] < s[best]) best = i;
                }
                if (best < 0) break;
                chosen[best] = true;
            }
            for (int i = 0; i < size; ++i)
                if (chosen[i]) victims.push_back(i);
        }
        for (int k = static_cast<int>(victims.size()) - 1; k >= 0; --k) {
            pos.erase(pos.begin() + victims[k]);
            score.erase(score.begin() + victims[k]);
            history.erase(history.begin() + victims[k]);
        }
        return victims;
    }
};

struct PlainResult {
    double retained_mass;
    double recall;
};

double round6(double x) { return std::floor(x * 1e6 + 0.5) / 1e6; }

PlainResult run_plain(const std::vector<std::vector<float>>& rows, const std::string& policy, int budget) {
    PlainPolicy p(policy);
    std::vector<int> kept{0};
    std::vector<bool> is_kept(rows.size() + 1, false);
    is_kept[0] = true;
    double mass = 0;
    long hits = 0, possible = 0;
    for (std::size_t t = 1; t < rows.size(); ++t) {
        const std::vector<float>& w = rows[t];
        std::vector<float> attn;
        for (int j : kept) attn.push_back(w[j]);
        for (float a : attn) mass += a;
        // Heavy hitters: the k-th largest weight by a full sort; ties fill in ascending position.
        const int k = std::min<int>(kHeavyK, static_cast<int>(t));
        std::vector<float> sorted = w;
        std::sort(sorted.begin(), sorted.end(), std::greater<float>());
        const float threshold = sorted[k - 1];
        int above = 0;
        for (float x : w) above += x > threshold;
        int ties_left = k - above;
        for (std::size_t j = 0; j < w.size(); ++j) {
            const bool top = w[j] > threshold || (w[j] == threshold && ties_left-- > 0);
            if (top && is_kept[j]) ++hits;
        }
        possible += k;
        p.on_decode_step(static_cast<int>(t), attn);
        kept.push_back(static_cast<int>(t));
        is_kept[t] = true;
        if (static_cast<int>(kept.size()) > budget) {
            const int share = budget;  // one layer: PyramidKV's share is the budget (spec section 4)
            const std::vector<int> victims = p.evict(share);
            for (int k2 = static_cast<int>(victims.size()) - 1; k2 >= 0; --k2) {
                is_kept[kept[victims[k2]]] = false;
                kept.erase(kept.begin() + victims[k2]);
            }
        }
    }
    return {round6(mass / (rows.size() - 1)), round6(static_cast<double>(hits) / possible)};
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

int main(int argc, char** argv) {
    const int runs = kvsim::bench::integer_argument(argc, argv, 1, 3, 1, 1000, "runs");
    const PolicybookTraceSpec spec;
    std::vector<std::vector<float>> rows(spec.sequence_length);
    PolicybookGenerator gen(spec);
    for (int t = 1; t < spec.sequence_length; ++t) {
        rows[t].resize(t);
        gen.next_row(rows[t]);
    }
    const std::vector<std::string> names = {"sliding_window", "streaming_llm", "h2o", "scissorhands",
                                            "tova",           "snapkv",        "pyramidkv"};
    const std::vector<int> budgets = {256, 512, 1024};

    // kvsim's replay of the same trace, for the agreement check.
    std::vector<PolicyEntry> policies;
    for (const std::string& name : names) {
        PolicyEntry entry;
        entry.name = name;
        entry.where = "bench";
        policies.push_back(entry);
    }
    const auto combos = expand_sweep(policies, {}, budgets);
    auto source = make_policybook_source(spec, 0);
    const std::vector<ComboResult> kvsim_results = replay(*source, combos, ReplayOptions{});

    std::vector<double> seconds;
    int agree = 0, compared = 0;
    for (int r = 0; r < runs; ++r) {
        const auto start = Clock::now();
        std::size_t c = 0;
        for (const std::string& name : names)
            for (int budget : budgets) {
                const PlainResult plain = run_plain(rows, name, budget);
                if (r == 0) {
                    const StreamMetrics& m = kvsim_results[c].total;
                    const double mass = round6(m.retained_mass / m.steps);
                    const double recall = round6(static_cast<double>(m.heavy_hitter_hits) / m.heavy_hitter_possible);
                    const bool same = mass == plain.retained_mass && recall == plain.recall;
                    agree += same;
                    ++compared;
                    std::printf("  %-15s %5d  plain %.6f %.6f  kvsim %.6f %.6f  %s\n", name.c_str(), budget,
                                plain.retained_mass, plain.recall, mass, recall, same ? "agree" : "DIFFER");
                }
                ++c;
            }
        seconds.push_back(seconds_since(start));
    }
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds[seconds.size() / 2];
    const double policy_steps = static_cast<double>(names.size() * budgets.size()) * (spec.sequence_length - 1);
    std::printf("plain single-threaded harness: %d of %d figures agree with kvsim's replay\n", agree, compared);
    std::printf("  %.0f policy-steps in %.3f s (median of %d), %.0f policy-steps/s, trace generated beforehand\n",
                policy_steps, median, runs, policy_steps / median);
    return agree == compared ? 0 : 1;
}
