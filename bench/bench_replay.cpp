// The policybook sweep benchmark: 7 policies x 3 budgets on decode-4096, trace generated
// in-process. Prints the median policy-steps per second of wall time over several runs, the
// split between generating the trace and replaying it, and the peak resident memory.
//   build/bench/bench_replay [runs]
#include <sys/resource.h>
#include <tbb/global_control.h>
#include <tbb/info.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sim/replay.h"
#include "sim/sweep.h"
#include "bench/arguments.h"

using namespace kvsim;
using Clock = std::chrono::steady_clock;

namespace {

// An in-memory copy of the trace, to time the replay alone.
class MemorySource : public AttentionSource {
public:
    explicit MemorySource(const PolicybookTraceSpec& spec) {
        shape_.sequence_names = {spec.name};
        shape_.sequence_lengths = {spec.sequence_length};
        shape_.last_steps = {spec.sequence_length - 1};
        PolicybookGenerator gen(spec);
        rows_.resize(attention_row_offset(spec.sequence_length));
        for (int t = 1; t < spec.sequence_length; ++t) gen.next_row({rows_.data() + attention_row_offset(t), size_t(t)});
    }
    const AttentionShape& shape() const override { return shape_; }
    std::string description() const override { return "memory"; }
    void read_block(int, int, int64_t first, int64_t end, AttentionBlock& block) override {
        block.first_step = first;
        block.end_step = end;
        block.rows.resize(1);
        block.rows[0].assign(rows_.begin() + attention_row_offset(first), rows_.begin() + attention_row_offset(end));
        block.self_weight.clear();
    }

private:
    AttentionShape shape_;
    std::vector<float> rows_;
};

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    const int runs = kvsim::bench::integer_argument(argc, argv, 1, 9, 1, 1000, "runs");
    std::vector<PolicyEntry> policies;
    for (const char* name : {"sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "snapkv", "pyramidkv"})
        policies.push_back({name, {}, "bench"});
    const auto combos = expand_sweep(policies, {}, {256, 512, 1024});
    const double policy_steps = static_cast<double>(combos.size()) * 4095;

    auto end_to_end_seconds = [&] {
        const auto start = Clock::now();
        auto source = make_policybook_source(PolicybookTraceSpec{}, 0);
        replay(*source, combos, ReplayOptions{});
        return seconds_since(start);
    };
    std::vector<double> end_to_end, single_thread, generate, replay_only;
    for (int r = 0; r < runs; ++r) end_to_end.push_back(end_to_end_seconds());
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    const double peak_mb = usage.ru_maxrss / 1024.0;  // before the in-memory copy below
    {
        tbb::global_control one(tbb::global_control::max_allowed_parallelism, 1);
        for (int r = 0; r < runs; ++r) single_thread.push_back(end_to_end_seconds());
    }
    for (int r = 0; r < runs; ++r) {
        auto start = Clock::now();
        MemorySource memory(PolicybookTraceSpec{});
        generate.push_back(seconds_since(start));
        start = Clock::now();
        replay(memory, combos, ReplayOptions{});
        replay_only.push_back(seconds_since(start));
    }
    std::printf("policybook sweep: %zu combinations x 4095 steps = %.0f policy-steps, %d threads, %d runs (medians)\n",
                combos.size(), policy_steps, tbb::info::default_concurrency(), runs);
    std::printf("  end to end (generate + replay): %.3f s  %.0f policy-steps/s  (%.1fx the reference's 35000/s)\n",
                median(end_to_end), policy_steps / median(end_to_end), policy_steps / median(end_to_end) / 35000);
    std::printf("  the same on one thread:         %.3f s  %.0f policy-steps/s\n", median(single_thread),
                policy_steps / median(single_thread));
    std::printf("  generate the trace alone:       %.3f s\n", median(generate));
    std::printf("  replay from memory alone:       %.3f s  %.0f policy-steps/s\n", median(replay_only),
                policy_steps / median(replay_only));
    std::printf("  target: 700000 policy-steps/s end to end, peak memory under 100 MB\n");
    std::printf("  peak resident memory, end to end: %.1f MB\n", peak_mb);
    return 0;
}
