// What `kvsim run` records: per-sequence records beside the pooled ones, budgets only where one
// applies, and fractions that stay in range on the shipped trace.
#include <doctest/doctest.h>

#include "helpers.h"
#include "src/config.h"
#include "src/experiment.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

// The shipped stories260K trace, each of its five stories cut to its first 48 decode steps.
ExperimentConfig stories_config(std::vector<PolicyEntry> policies) {
    ExperimentConfig config;
    config.file = "cfg.yaml";
    config.trace.path = KVSIM_SOURCE_DIR "/data/tinystories-stories260K.h5";
    config.trace.max_steps = 48;
    config.budgets = {16};
    config.compression_budgets = {2.0};
    config.policies = std::move(policies);
    config.metrics = {"retained_mass", "output_cosine", "compression_ratio"};
    return config;
}

std::vector<const ResultRecord*> pooled(const std::vector<ResultRecord>& records) {
    std::vector<const ResultRecord*> out;
    for (const ResultRecord& r : records)
        if (r.sequence < 0 && r.layer < 0) out.push_back(&r);
    return out;
}

}  // namespace

TEST_CASE("per-sequence records leave the pooled ones as they were, and add up to them") {
    ExperimentConfig config = stories_config({entry("full"), entry("int4"), entry("h2o", {{"recent_window", 8}})});
    const ExperimentResult alone = run_experiment(config, {}, false);
    config.per_sequence = true;
    const ExperimentResult split = run_experiment(config, {}, false);
    const auto before = pooled(alone.records), after = pooled(split.records);
    REQUIRE(before.size() == 4);  // full, int4, h2o at 16 and at 2x
    REQUIRE(after.size() == before.size());
    for (std::size_t i = 0; i < before.size(); ++i) {
        CHECK(after[i]->label == before[i]->label);
        CHECK(after[i]->retained_mass == before[i]->retained_mass);  // to the last digit
        CHECK(after[i]->output_cosine == before[i]->output_cosine);
        CHECK(after[i]->compression_ratio == before[i]->compression_ratio);
        CHECK(after[i]->steps == before[i]->steps);
    }
    REQUIRE(split.records.size() == before.size() * 6);  // the pooled records, then five sequences of each
    for (std::size_t i = 0; i < before.size(); ++i) {
        int64_t steps = 0;
        for (int s = 0; s < 5; ++s) {
            const ResultRecord& r = split.records[before.size() + i * 5 + s];
            CHECK(r.label == before[i]->label);
            CHECK(r.sequence == s);
            CHECK(r.sequence_name == "tinystories_sample-" + std::to_string(s));
            steps += r.steps;
        }
        CHECK(steps == before[i]->steps);
    }

    // Only the sequences a config selects, named by their index in the trace.
    config.trace.sequences = {3, 1};
    const ExperimentResult some = run_experiment(config, {}, false);
    CHECK(some.records[4].sequence == 3);
    CHECK(some.records[4].sequence_name == "tinystories_sample-3");
    CHECK(some.records[5].sequence == 1);
}

TEST_CASE("a budget is recorded only where one applies") {
    ExperimentConfig config = stories_config({entry("int8"), entry("sliding_window")});
    config.per_sequence = true;
    const std::vector<ResultRecord> records = run_experiment(config, {}, false).records;
    const auto rows = pooled(records);
    REQUIRE(rows.size() == 3);
    CHECK_FALSE(rows[0]->budget.has_value());  // int8 keeps every token
    CHECK(rows[1]->budget == 16);
    CHECK(rows[2]->budget_label == "2x");
    CHECK_FALSE(rows[2]->budget.has_value());  // 2x is a different budget in each sequence...
    const std::vector<int64_t> lengths = open_source(config.trace)->shape().sequence_lengths;
    int stated = 0;
    for (const ResultRecord& r : records)
        if (r.sequence >= 0 && r.budget_label == "2x") {  // ... which its per-sequence records state
            REQUIRE(r.budget.has_value());
            CHECK(*r.budget == budget_for_compression(2.0, lengths.at(r.sequence)));
            ++stated;
        }
    CHECK(stated == 5);
}

TEST_CASE("the full cache's retained mass is 1 exactly on the shipped trace, never above") {
    // Summed in floats, the full softmax rows of this trace came to a mean of 1.0000000029538971.
    ExperimentConfig config = stories_config({entry("full"), entry("int8")});
    config.trace.max_steps = 0;
    config.compression_budgets.clear();
    config.metrics = {"retained_mass", "heavy_hitter_recall", "output_cosine"};
    config.per_sequence = true;
    for (const ResultRecord& r : run_experiment(config, {}, false).records) {
        CHECK(r.retained_mass <= 1.0);
        CHECK(r.retained_mass == doctest::Approx(1.0).epsilon(1e-7));
        if (r.sequence < 0) CHECK(r.retained_mass == 1.0);  // pooled, the sum was above 1: clamped
        CHECK(r.heavy_hitter_recall == 1.0);
        CHECK(r.output_cosine <= 1.0);
        CHECK(r.output_cosine > 0.99);
    }
}
