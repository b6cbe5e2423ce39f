// How a sweep divides into work units and shards, and that replaying units in any grouping sums to
// the bits of one replay.
#include <doctest/doctest.h>

#include <set>

#include "base/errors.h"
#include "helpers.h"
#include "sim/replay.h"
#include "sim/shard_plan.h"
#include "sim/sweep.h"
#include "src/experiment.h"

using namespace kvsim;
using namespace kvsim::test;

TEST_CASE("work units go layer by layer, cells in table order, and shards take contiguous ranges") {
    const std::vector<WorkUnit> units = enumerate_work(3, 2);
    REQUIRE(units.size() == 6);
    for (std::size_t u = 0; u < units.size(); ++u) {
        CHECK(units[u].layer == static_cast<int>(u / 3));
        CHECK(units[u].cell == u % 3);
    }
    for (int n : {1, 2, 3, 7, 21, 22}) {
        std::size_t next = 0, smallest = SIZE_MAX, largest = 0;
        for (int i = 0; i < n; ++i) {
            const auto [first, end] = shard_range(21, ShardSpec{i, n});
            CHECK(first == next);  // every unit once, in order
            next = end;
            smallest = std::min(smallest, end - first);
            largest = std::max(largest, end - first);
        }
        CHECK(next == 21);
        CHECK(largest - smallest <= 1);  // equal counts, give or take one
    }
}

TEST_CASE("--shard is I/N with I in range, else an InputError naming the flag") {
    const ShardSpec s = parse_shard("2/7", "--shard");
    CHECK(s.index == 2);
    CHECK(s.count == 7);
    CHECK(s.text() == "2/7");
    CHECK_THROWS_WITH_AS(parse_shard("7/7", "--shard"), "--shard 7/7: shard index out of range (0 to 6)", InputError);
    CHECK_THROWS_AS(parse_shard("0/0", "--shard"), InputError);
    CHECK_THROWS_AS(parse_shard("-1/3", "--shard"), InputError);
    CHECK_THROWS_AS(parse_shard("1/3x", "--shard"), InputError);
    CHECK_THROWS_AS(parse_shard("/3", "--shard"), InputError);
    CHECK_THROWS_AS(parse_shard("13", "--shard"), InputError);
}

TEST_CASE("units replayed one layer at a time, in any grouping, sum to the bits of one replay") {
    ExperimentConfig config;
    config.file = "cfg.yaml";
    config.trace.path = KVSIM_SOURCE_DIR "/data/tinystories-stories260K.h5";
    config.trace.max_steps = 40;
    config.budgets = {12};
    config.policies = {entry("h2o", {{"recent_window", 4}}), entry("tova"), entry("int4")};
    config.metrics = {"retained_mass", "output_rel_error", "compression_ratio"};
    config.per_layer = true;
    config.per_sequence = true;
    const ExperimentResult whole = run_experiment(config, {}, false);

    Experiment experiment(config, {});
    const std::size_t count = experiment.unit_count();
    REQUIRE(count == 3 * 5);  // 3 cells x 5 layers
    std::vector<UnitResult> units(count);
    // Backwards and in two passes: the order units run in does not matter.
    for (int pass : {1, 0}) {
        std::vector<std::size_t> some;
        for (std::size_t u = count; u-- > 0;)
            if (static_cast<int>(u % 2) == pass) some.push_back(u);
        experiment.run_units(some, false, [&](const std::vector<std::size_t>& done, std::vector<UnitResult>& r) {
            for (std::size_t i = 0; i < done.size(); ++i) units[done[i]] = std::move(r[i]);
        });
    }
    const ExperimentResult rebuilt = build_result(experiment.frame(), units);
    REQUIRE(rebuilt.records.size() == whole.records.size());
    for (std::size_t i = 0; i < whole.records.size(); ++i) {
        const ResultRecord &a = whole.records[i], &b = rebuilt.records[i];
        CHECK(a.label == b.label);
        CHECK(a.layer == b.layer);
        CHECK(a.sequence == b.sequence);
        CHECK(a.steps == b.steps);
        CHECK(a.retained_mass == b.retained_mass);  // to the last bit
        CHECK(a.output_rel_error == b.output_rel_error);
        CHECK(a.compression_ratio == b.compression_ratio);
    }
    CHECK(format_json(rebuilt.records, rebuilt.trace) == format_json(whole.records, whole.trace));
}
