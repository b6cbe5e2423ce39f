// Quantised and tiered caches in the replay: output error, memory arithmetic, composition.
#include <doctest/doctest.h>

#include <tbb/global_control.h>

#include <cstring>
#include <fstream>
#include <random>

#include "helpers.h"
#include "src/config.h"
#include "base/errors.h"
#include "src/experiment.h"
#include "sim/harness.h"
#include "sim/replay.h"
#include "sim/sweep.h"
#include "sim/synthetic_qkv.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

ExperimentConfig tiny_config(std::vector<PolicyEntry> policies, std::vector<int> budgets = {48}) {
    ExperimentConfig config;
    config.file = "cfg.yaml";
    config.trace.synthetic = "qkv";
    config.trace.name = "tiny-256";
    config.budgets = std::move(budgets);
    config.policies = std::move(policies);
    config.metrics = {"retained_mass", "output_rel_error", "output_cosine", "bytes_per_token", "compression_ratio"};
    return config;
}

const ResultRecord& record(const std::vector<ResultRecord>& records, const std::string& label) {
    for (const ResultRecord& r : records)
        if (r.label == label && r.layer < 0) return r;
    throw std::runtime_error("no record " + label);
}

PolicyEntry composed(const std::string& evict, std::map<std::string, double> params,
                     std::map<std::string, double> quantize) {
    PolicyEntry e = entry(evict, std::move(params));
    e.quantized = true;
    e.quantize = std::move(quantize);
    return e;
}

}  // namespace

TEST_CASE("full has zero output error and ratio 1; int8 errs far less than int4") {
    const auto records = run_experiment(tiny_config({entry("full"), entry("int8"), entry("int4")}), {}, false).records;
    const ResultRecord& full = record(records, "full");
    CHECK(full.output_rel_error == 0.0);
    CHECK(full.output_cosine == doctest::Approx(1.0).epsilon(1e-12));
    CHECK(full.compression_ratio == 1.0);
    CHECK(full.bytes_per_token == 4.0 * 16);  // K and V at fp16, head size 16, no bookkeeping
    CHECK(full.budget_label == kEveryBudget);
    const ResultRecord &int8 = record(records, "int8"), &int4 = record(records, "int4");
    CHECK(int8.output_rel_error > 0);
    CHECK(int8.output_rel_error < 0.02);
    CHECK(int4.output_rel_error > 5 * int8.output_rel_error);
    CHECK(int8.retained_mass == doctest::Approx(1.0).epsilon(1e-5));  // nothing evicted
}

TEST_CASE("memory arithmetic: int8 with one-token key groups, closed form") {
    // Head size 16: keys 16 bytes + a 2-byte scale per channel per token (32); values 16 bytes +
    // one 2-byte scale for the whole head. Every key group is complete at once, so every token is
    // held at int8 except the current one, which the model reads at fp16 as it arrives.
    const auto records = run_experiment(tiny_config({entry("int8", {{"key_group", 1}, {"value_group", 16}})}), {}, false).records;
    const ResultRecord& r = record(records, "int8(key_group=1,value_group=16)");
    // Over steps t = 1..255 the cache holds t int8 tokens and one fp16 token: bytes per token of
    // context = sum(66 t + 64) / sum(t + 1).
    double bytes = 0, tokens = 0;
    for (int t = 1; t <= 255; ++t) {
        bytes += 66.0 * t + 64.0;
        tokens += t + 1;
    }
    CHECK(r.bytes_per_token == doctest::Approx(bytes / tokens).epsilon(1e-12));
    CHECK(r.compression_ratio == doctest::Approx(64.0 * tokens / bytes).epsilon(1e-12));
}

TEST_CASE("memory arithmetic: the held tiers' bytes by counts are the token-by-token sum's bits") {
    // Random held lists and tiers, keys and values apart; whole bytes a tier (counted) and a
    // projected cache's fractions of them (summed token by token), against the sum written here.
    std::mt19937 rng(7);
    const double whole_keys[3] = {256, 136, 72}, whole_values[3] = {256, 130, 66};
    double shared_keys[3], shared_values[3];
    for (int i = 0; i < 3; ++i) shared_keys[i] = 0.3 * whole_keys[i], shared_values[i] = 0.3 * whole_values[i];
    int cases = 0;
    for (int trial = 0; trial < 200; ++trial) {
        // The tier arrays at each alignment (the vector path reads the 32-bit words holding them).
        const int length = 1 + static_cast<int>(rng() % 3000), key_offset = trial % 4, value_offset = trial / 4 % 4;
        std::vector<uint8_t> key_buffer(length + 4, 9), value_buffer(length + 4, 9);
        uint8_t *key_tier = key_buffer.data() + key_offset, *value_tier = value_buffer.data() + value_offset;
        std::vector<int32_t> kept;
        for (int p = 0; p < length; ++p) {
            key_tier[p] = static_cast<uint8_t>(rng() % 3);
            value_tier[p] = trial % 2 ? key_tier[p] : static_cast<uint8_t>(rng() % 3);
            if (rng() % 4) kept.push_back(p);
        }
        for (const bool whole : {true, false}) {
            const double* keys = whole ? whole_keys : shared_keys;
            const double* values = whole ? whole_values : shared_values;
            const double start = whole ? 512 : 153.6;
            double expected = start;
            for (int32_t p : kept) expected += keys[key_tier[p]] + values[value_tier[p]];
            const double got = held_tier_bytes(start, kept, key_tier, value_tier, keys, values);
            CHECK(std::memcmp(&got, &expected, sizeof got) == 0);
            ++cases;
        }
    }
    CHECK(cases == 400);
    // A tier that is not one is a policy's bug, named rather than read past the table: among
    // sixteen and more held (the vector path) and fewer.
    for (const int held : {2, 40}) {
        std::vector<uint8_t> bad(held, 1), fine(held, 2);
        bad[held / 8] = 3;  // 40 held: in the first sixteen
        std::vector<int32_t> all(held);
        for (int p = 0; p < held; ++p) all[p] = p;
        CHECK_THROWS_AS(held_tier_bytes(0, all, bad.data(), fine.data(), whole_keys, whole_values), std::logic_error);
        CHECK_THROWS_AS(held_tier_bytes(0, all, fine.data(), bad.data(), whole_keys, whole_values), std::logic_error);
    }
}

TEST_CASE("composition: eviction decides what stays, quantisation how coarsely") {
    const auto records =
        run_experiment(tiny_config({entry("h2o", {{"recent_window", 8}}),
                                    composed("h2o", {{"recent_window", 8}}, {{"bits", 4}, {"older_than", 32}})}),
                       {}, false)
            .records;
    const ResultRecord& plain = record(records, "h2o(recent_window=8)");
    const ResultRecord& quant = record(records, "h2o(recent_window=8)+int4(older_than=32)");
    CHECK(quant.retained_mass == plain.retained_mass);  // the same tokens kept
    CHECK(quant.heavy_hitter_recall == plain.heavy_hitter_recall);
    CHECK(quant.bytes_per_token < plain.bytes_per_token);
    CHECK(quant.output_rel_error > plain.output_rel_error);
}

// The replay itself refuses a tier format whose groups do not fit the trace's head size, so a
// caller that skips the program's checks (search, the fuzzer) gets the same InputError, not a
// programmer's exception from the quantiser (a fuzzer find: value_group 2, head size 3).
TEST_CASE("a value group that does not divide the head size is the replay's input error") {
    auto source = make_synthetic_qkv_source(synthetic_qkv_trace("tiny-256", "test"), 40);
    for (const bool values : {false, true}) {
        ReplayOptions options;
        options.output_error = values;
        options.memory = values;
        std::string message;
        try {
            (void)replay(*source, expand_sweep({entry("int4", {{"value_group", 6}})}, {}, std::vector<int>{16}), options);
        } catch (const InputError& e) {
            message = e.what();
        }
        CHECK(message == "test: int4 (int4(value_group=6)): value_group 6 does not divide the head size 16 of " +
                             source->description());
    }
    ReplayOptions options;
    options.output_error = true;
    CHECK_NOTHROW(replay(*source, expand_sweep({entry("int4", {{"value_group", 4}})}, {}, std::vector<int>{16}), options));
}

TEST_CASE("precision mistakes are input errors naming the key") {
    auto error_of = [](const ExperimentConfig& config) -> std::string {
        try {
            run_experiment(config, {}, false);
        } catch (const InputError& e) {
            return e.what();
        }
        return "";
    };
    CHECK(error_of(tiny_config({composed("h2o", {{"recent_window", 8}}, {{"bits", 3}})})) ==
          "test: h2o.quantize.bits: must be 4 or 8, got 3");
    CHECK(error_of(tiny_config({composed("h2o", {{"recent_window", 8}}, {{"key_group", 0}})})) ==
          "test: h2o.quantize.key_group: must be >= 1, got 0");
    CHECK(error_of(tiny_config({entry("int4", {{"value_group", 6}})})).find(
              "test: int4 (int4(value_group=6)): value_group 6 does not divide the head size 16") == 0);
    ExperimentConfig attention_only = tiny_config({entry("int8")});
    attention_only.trace = {};
    attention_only.trace.synthetic = "policybook";
    attention_only.trace.name = "decode-4096";
    attention_only.trace.max_steps = 100;
    CHECK(error_of(attention_only).find("need a Q/K/V trace") != std::string::npos);
}

TEST_CASE("a composed policy in YAML") {
    const std::string path = temp_dir() + "/composed.yaml";
    std::ofstream(path) << "trace: {synthetic: qkv, name: tiny-256}\nbudgets: [48]\npolicies:\n"
                           "  - {evict: h2o, quantize: {bits: 4, older_than: 128}}\n"
                           "  - {evict: {h2o: {recent_window: 8}}, quantize: {bits: 8}}\n"
                           "  - {evict: tova, quantize: {bits: 4, colour: 2}}\n";
    try {
        load_config(path);
        const ExperimentConfig c = load_config(path);
        expand_sweep(c.policies, c.grid, budget_columns(c));
        FAIL("expected an InputError");
    } catch (const InputError& e) {
        CHECK(std::string(e.what()) == path + ":6: policies[2].tova.quantize: unknown key 'colour' (known: bits, older_than, key_group, value_group)");
    }
}

TEST_CASE("streaming heads in the replay: exact when nothing folds, retrieval heads from a pattern file") {
    // A window longer than the sequence folds nothing: the output is exact softmax attention.
    auto wide = run_experiment(tiny_config({entry("streaming_attention", {{"recent", 300}})}), {}, false).records;
    CHECK(record(wide, "streaming_attention(recent=300)").output_rel_error < 1e-5);
    // A narrow window folds; a decay of 0 forgets the folded tokens entirely, so the output is that
    // of the exact tokens alone, like StreamingLLM's (4 sinks + 28 recent = a 32-token window).
    auto narrow = run_experiment(tiny_config({entry("streaming_attention", {{"recent", 28}, {"lambda", 0}}),
                                              entry("streaming_llm")},
                                             {32}),
                                 {}, false)
                      .records;
    const ResultRecord& streaming = record(narrow, "streaming_attention(recent=28,lambda=0)");
    CHECK(streaming.output_rel_error > 0.01);
    CHECK(streaming.compression_ratio > 2.0);

    // A pattern file: layer 0 keeps both KV heads for retrieval, layers 1 and 2 stream.
    const std::string pattern = temp_dir() + "/full_attention_heads.tsv";
    std::ofstream(pattern) << "1\t1\n0\t0\n0\t0\n";
    PolicyEntry patterned = entry("streaming_attention", {{"recent", 28}});
    patterned.files["pattern"] = pattern;
    const auto mixed = run_experiment(tiny_config({patterned}), {}, false).records;
    CHECK(record(mixed, "streaming_attention(recent=28,pattern=full_attention_heads.tsv)").compression_ratio <
          record(narrow, "streaming_attention(recent=28,lambda=0)").compression_ratio);
    std::ofstream(pattern) << "1\t1\n0\t0\n";
    CHECK_THROWS_WITH_AS(run_experiment(tiny_config({patterned}), {}, false),
                         (pattern + ": 2 rows, but the trace has 3 layers").c_str(), InputError);
}

TEST_CASE("ratio budgets: each sequence's budget holds the cache at that compression in tokens") {
    // T = 1000: a budget of B holds sum(min(t, B) + 1) tokens over steps 1..999.
    auto ratio = [](int64_t T, int64_t B) {
        double full = 0, held = 0;
        for (int64_t t = 1; t < T; ++t) {
            full += t + 1;
            held += std::min(t, B) + 1;
        }
        return full / held;
    };
    for (double target : {1.0, 1.5, 2.0, 4.0, 10.0}) {
        const int b = budget_for_compression(target, 1000);
        INFO("target " << target << " budget " << b);
        CHECK(ratio(1000, b) >= target);
        if (target > 1.0) CHECK(ratio(1000, b + 1) < target);  // the largest budget that reaches it
    }
    CHECK(budget_for_compression(1.0, 1000) == 1000);
    CHECK(budget_for_compression(1e6, 1000) == 1);
    // In a config: "2x" is a column of its own.
    const std::string path = temp_dir() + "/ratio.yaml";
    std::ofstream(path) << "trace: {synthetic: qkv, name: tiny-256}\nbudgets: [64, 2x]\npolicies: [sliding_window]\n";
    const ExperimentConfig c = load_config(path);
    CHECK(c.compression_budgets == std::vector<double>{2.0});
    const auto records = run_experiment(c, {}, false).records;
    REQUIRE(records.size() == 2);
    CHECK(records[1].budget_label == "2x");
    std::ofstream(path) << "trace: {synthetic: qkv, name: tiny-256}\nbudgets: [0.5x]\npolicies: [sliding_window]\n";
    CHECK_THROWS_WITH_AS(load_config(path), (path + ":2: budgets[0]: expected a token count or a compression ratio >= 1 like 2x, got '0.5x'").c_str(), InputError);
}

TEST_CASE("value-level metrics do not depend on the number of threads") {
    ExperimentConfig config = tiny_config({entry("int4"), entry("stratigraphic"), entry("streaming_attention", {{"recent", 20}}),
                                           composed("tova", {}, {{"bits", 8}, {"older_than", 16}}), entry("snapkv", {{"recent_window", 8}})});
    auto run = [&](int threads) {
        tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
        std::vector<double> values;
        for (const ResultRecord& r : run_experiment(config, {}, false).records)
            for (double v : {r.output_rel_error, r.output_cosine, r.bytes_per_token, r.retained_mass}) values.push_back(v);
        return values;
    };
    CHECK(run(1) == run(2));
    CHECK(run(1) == run(3));
}

TEST_CASE("streaming heads from a profile: which heads stream, each head's lambda") {
    const std::string profile = temp_dir() + "/streaming.yaml";
    PolicyEntry profiled = entry("streaming_attention", {{"recent", 28}});
    profiled.files["profile"] = profile;
    // Every head retrieves: the full cache, exactly.
    std::ofstream(profile) << "streaming: [[0, 0], [0, 0], [0, 0]]\n";
    CHECK(record(run_experiment(tiny_config({profiled}), {}, false).records,
                 "streaming_attention(recent=28,profile=streaming.yaml)")
              .output_rel_error == 0.0);
    // Every head streams with lambda 0: the same as the parameter lambda = 0 for all.
    std::ofstream(profile) << "streaming: [[1, 1], [1, 1], [1, 1]]\nlambda: [[0, 0], [0, 0], [0, 0]]\n";
    const double from_profile =
        record(run_experiment(tiny_config({profiled}), {}, false).records,
                 "streaming_attention(recent=28,profile=streaming.yaml)").output_rel_error;
    const double from_params = record(run_experiment(tiny_config({entry("streaming_attention", {{"recent", 28}, {"lambda", 0}})}), {}, false).records,
                                      "streaming_attention(recent=28,lambda=0)")
                                   .output_rel_error;
    CHECK(from_profile == from_params);
    std::ofstream(profile) << "streaming: [[1, 1], [1, 2], [1, 1]]\n";
    CHECK_THROWS_WITH_AS(run_experiment(tiny_config({profiled}), {}, false),
                         (profile + ": streaming[1][1]: expected 0 or 1").c_str(), InputError);
    std::ofstream(profile) << "streaming: [[1, 1], [1, 1], [1, 1]]\nlambda: 1.5\n";
    CHECK_THROWS_WITH_AS(run_experiment(tiny_config({profiled}), {}, false),
                         doctest::Contains("lambda: 1.500000 is outside [0, 1]"), InputError);
    std::ofstream(profile) << "streaming: [[1, 1, 1], [1, 1, 1], [1, 1, 1]]\n";
    CHECK_THROWS_WITH_AS(run_experiment(tiny_config({profiled}), {}, false),
                         (profile + ": streaming[0]: 3 entries, but the trace has 2 KV heads").c_str(), InputError);
}
