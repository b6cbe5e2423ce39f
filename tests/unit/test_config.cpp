// Config parsing and sweep expansion: every mistake is one InputError naming the file and key.
#include <doctest/doctest.h>

#include <fstream>

#include "helpers.h"
#include "src/config.h"
#include "base/errors.h"
#include "src/experiment.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

std::string write_config(const std::string& name, const std::string& text) {
    const std::string path = temp_dir() + "/" + name + ".yaml";
    std::ofstream(path) << text;
    return path;
}

// The InputError message from loading and expanding a config ("" when it is fine).
std::string config_error(const std::string& text) {
    const std::string path = write_config("case", text);
    try {
        const ExperimentConfig c = load_config(path);
        expand_sweep(c.policies, c.grid, budget_columns(c));
    } catch (const InputError& e) {
        return e.what();
    }
    return "";
}

const std::string kGood = "trace: {synthetic: policybook}\nbudgets: [64]\npolicies: [h2o]\n";

}  // namespace

TEST_CASE("a full config parses") {
    const std::string path = write_config("full", R"(
trace: {synthetic: policybook, name: decode-4096, max_steps: 500}
budgets: [64, 128]
policies:
  - sliding_window
  - h2o: {recent_window: 16}
  - snapkv: {pool_kernel: 5}
metrics: [retained_mass, {heavy_hitter_recall: {k: 16}}, eviction_calls]
grid: {h2o.recent_window: [8, 16]}
output: {dir: out/x, format: json, per_layer: true}
)");
    const ExperimentConfig c = load_config(path);
    CHECK(c.trace.synthetic == "policybook");
    CHECK(c.trace.max_steps == 500);
    CHECK(c.budgets == std::vector<int>{64, 128});
    REQUIRE(c.policies.size() == 3);
    CHECK(c.policies[1].params.at("recent_window") == 16);
    CHECK(c.heavy_hitter_k == 16);
    CHECK(c.metrics.size() == 3);
    CHECK(c.output_dir == "out/x");
    CHECK(c.output_format == "json");
    CHECK(c.per_layer);
    const auto combos = expand_sweep(c.policies, c.grid, c.budgets);
    // sliding_window x 2 budgets, h2o x 2 grid points x 2 budgets, snapkv x 2 budgets.
    CHECK(combos.size() == 8);
    CHECK(combos[2].label == "h2o(recent_window=8)");
    CHECK(combos[4].label == "h2o(recent_window=16)");  // the grid overrides the entry's own value
    CHECK(combos[6].label == "snapkv(pool_kernel=5)");
}

TEST_CASE("a trace path is resolved against the config file's folder") {
    const ExperimentConfig c = load_config(write_config("path", "trace: traces/t.h5\nbudgets: [4]\npolicies: [tova]\n"));
    CHECK(c.trace.path == temp_dir() + "/traces/t.h5");
}

TEST_CASE("config mistakes name the file, the line and the key") {
    CHECK(config_error(kGood) == "");
    const std::string file = temp_dir() + "/case.yaml";
    // A config without a trace is fine for kvsim eval (it runs a model), not for kvsim run.
    CHECK(config_error("budgets: [64]\npolicies: [h2o]\n") == "");
    CHECK_THROWS_WITH_AS(run_experiment(load_config(file), {}, false),
                         (file + ": missing key 'trace' (kvsim run replays a trace)").c_str(), InputError);
    CHECK(config_error(kGood + "colour: blue\n") == file + ":4: colour: unknown key (known: attention_view, budgets, grid, group_reduce, layer_budgets, metrics, output, "
                                                   "policies, prefill_tokens, search, trace)");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: []\npolicies: [h2o]\n") == file + ":2: budgets: empty list");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: [64, 0]\npolicies: [h2o]\n") ==
          file + ":2: budgets[1]: must be >= 1, got 0");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: [64, 1.5]\npolicies: [h2o]\n") ==
          file + ":2: budgets[1]: expected an integer, got 1.5");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: 64\npolicies: [h2o]\n") ==
          file + ":2: budgets: expected a list of integers, e.g. [256, 512, 1024]");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: [64]\npolicies: [lru]\n").find(
              "policies[0].lru: unknown policy 'lru' (known: sliding_window, streaming_llm, h2o") != std::string::npos);
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: [64]\npolicies: [{h2o: {recnt_window: 3}}]\n") ==
          file + ":3: policies[0].h2o: unknown parameter 'recnt_window' for policy h2o (known: recent_window)");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: [64]\npolicies: [{h2o: {recent_window: many}}]\n") ==
          file + ":3: policies[0].h2o.recent_window: expected a number, got 'many'");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: [64]\npolicies: [{snapkv: {pool_kernel: 4}}]\n") ==
          file + ":3: policies[0].snapkv.pool_kernel: must be odd, got 4");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: [16]\npolicies: [h2o]\n") ==
          file + ":3: policies[0].h2o: h2o: recent_window = 32 must be less than the budget 16");
    CHECK(config_error("trace: {synthetic: policybook}\nbudgets: [64]\npolicies: [h2o, h2o]\n").find("h2o is listed twice") !=
          std::string::npos);
    CHECK(config_error("trace: {synthetic: imagined}\nbudgets: [64]\npolicies: [h2o]\n") ==
          file + ":1: trace.synthetic: unknown generator 'imagined' (known: policybook, qkv)");
    CHECK(config_error(kGood + "metrics: [perplexity]\n").find("metrics[0]: unknown metric 'perplexity'") != std::string::npos);
    CHECK(config_error(kGood + "grid: {tova.recent_window: [1, 2]}\n").find("policy 'tova' is not among") !=
          std::string::npos);
    CHECK(config_error("trace: {synthetic: policybook\nbudgets: [64]\n").find(file + ":") == 0);  // YAML syntax
    CHECK(config_error("- just\n- a list\n") == file + ": expected a map of keys (trace, budgets, policies, ...)");
}

TEST_CASE("replay options: view, group reduction, prefill and per-layer budgets") {
    const std::string file = temp_dir() + "/case.yaml";
    CHECK(config_error(kGood + "attention_view: cooked\n") ==
          file + ":4: attention_view: expected raw, renormalized or cached, got 'cooked'");
    CHECK(config_error(kGood + "group_reduce: median\n") == file + ":4: group_reduce: expected mean, max or sum, got 'median'");
    CHECK(config_error(kGood + "prefill_tokens: -3\n") == file + ":4: prefill_tokens: must be >= 0, got -3");
    CHECK(config_error(kGood + "layer_budgets: [64, 0]\n") == file + ":4: layer_budgets[1]: must be >= 1, got 0");
    CHECK(config_error(kGood + "layer_budgets: missing-profile.yaml\n") ==
          temp_dir() + "/missing-profile.yaml: no such file");
    const std::string profile = write_config("pyramid", "name: pyramid-64\nlayer_budgets: [96, 64, 32]\n");
    const ExperimentConfig c = load_config(write_config("with-profile", kGood + "layer_budgets: pyramid.yaml\n"));
    REQUIRE(c.layer_budget_profiles.size() == 1);
    CHECK(c.layer_budget_profiles[0].label == "pyramid-64");
    CHECK(c.layer_budget_profiles[0].budget == 64);
    CHECK(c.layer_budget_profiles[0].layer_budgets == std::vector<int>{96, 64, 32});
    const auto columns = budget_columns(c);
    REQUIRE(columns.size() == 2);
    CHECK(columns[0].label == "64");
    // H2O's window of 32 must fit the tightest layer of a profile.
    CHECK(config_error(kGood + "layer_budgets: [96, 64, 32]\n").find("recent_window = 32 must be less than the budget 32 (profile per-layer)") !=
          std::string::npos);
}

TEST_CASE("a missing config file is named") {
    try {
        load_config("/nonexistent/x.yaml");
        FAIL("expected InputError");
    } catch (const InputError& e) {
        CHECK(std::string(e.what()) == "/nonexistent/x.yaml: no such file");
    }
}

TEST_CASE("command-line grids: --budgets and --set") {
    CHECK(parse_budget_list("64,128,256", "--budgets") == std::vector<int>{64, 128, 256});
    CHECK_THROWS_WITH_AS(parse_budget_list("64,,256", "--budgets"), "--budgets: '' is not a budget (an integer from 1 to 100000000)",
                         InputError);
    CHECK_THROWS_WITH_AS(parse_budget_list("0", "--budgets"), "--budgets: '0' is not a budget (an integer from 1 to 100000000)",
                         InputError);
    const GridAxis axis = parse_grid_flag("h2o.recent_window=16,32,64", "--set");
    CHECK(axis.policy == "h2o");
    CHECK(axis.param == "recent_window");
    CHECK(axis.values == std::vector<double>{16, 32, 64});
    CHECK_THROWS_AS(parse_grid_flag("h2o=16", "--set"), InputError);
    CHECK_THROWS_AS(parse_grid_flag("h2o.recent_window=a", "--set"), InputError);
}

TEST_CASE("default metrics fit the policies: output error and compression where a policy changes values") {
    auto load = [](const std::string& text) { return load_config(write_config("metrics", text)); };
    const ExperimentConfig quantised =
        load("trace: {synthetic: qkv, name: tiny-256}\nbudgets: [64]\npolicies: [sliding_window, int8]\n");
    CHECK(quantised.metrics.empty());  // none named: chosen when the trace is known
    const std::vector<std::string> value_metrics = {"output_rel_error", "compression_ratio"};
    const std::vector<std::string> attention_metrics = {"retained_mass", "heavy_hitter_recall"};
    CHECK(table_metrics(quantised, true) == value_metrics);
    CHECK(table_metrics(quantised, false) == attention_metrics);  // an attention-only trace has no values
    for (const char* policy : {"int4", "stratigraphic", "streaming_attention",
                               "{evict: h2o, quantize: {bits: 4, older_than: 32}}"})
        CHECK(table_metrics(load(std::string("budgets: [64]\npolicies: [") + policy + "]\n"), true) == value_metrics);
    // Eviction alone, and the full cache, keep today's defaults.
    CHECK(table_metrics(load("budgets: [64]\npolicies: [full, h2o, {evict: h2o, adakv: {floor: 0.5}}]\n"), true) ==
          attention_metrics);
    // Metrics a config names are kept as named.
    const ExperimentConfig named =
        load("budgets: [64]\npolicies: [int8]\nmetrics: [retained_mass, eviction_calls]\n");
    CHECK(table_metrics(named, true) == std::vector<std::string>{"retained_mass", "eviction_calls"});
}

TEST_CASE("output.per_sequence parses, and a bad value names the key") {
    CHECK(load_config(write_config("per_sequence", kGood + "output: {per_sequence: true}\n")).per_sequence);
    CHECK_FALSE(load_config(write_config("per_sequence", kGood)).per_sequence);
    CHECK(contains(config_error(kGood + "output: {per_sequence: maybe}\n"),
                   "case.yaml:4: output.per_sequence: expected true or false"));
}
