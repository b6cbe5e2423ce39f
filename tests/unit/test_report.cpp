#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "src/eval.h"
#include "src/report.h"

using namespace kvsim;

TEST_CASE("results JSON stays valid for any bytes in names, and writes non-finite numbers as null") {
    ResultRecord r;
    r.policy = "h2o";
    r.label = "h2o(\"quoted\")\n\xff\xfe";  // a profile name or trace path need not be UTF-8
    r.budget_label = "profile \x01";
    r.layer_budgets = {8, 16};
    r.params["recent_window"] = 4;
    r.retained_mass = 0.5;
    r.heavy_hitter_recall = std::nan("");
    r.output_rel_error = 0.25;
    r.output_cosine = INFINITY;
    const nlohmann::json parsed = nlohmann::json::parse(format_json({r}, "trace\xc3.h5"));
    REQUIRE(parsed.size() == 1);
    const auto& record = parsed[0];
    CHECK(record["label"] == "h2o(\"quoted\")\n\xef\xbf\xbd\xef\xbf\xbd");  // U+FFFD for each bad byte
    CHECK(record["budget_profile"] == "profile \x01");
    CHECK(record["layer_budgets"] == nlohmann::json::array({8, 16}));
    CHECK(record["params"]["recent_window"] == 4.0);
    CHECK(record["retained_mass"] == 0.5);
    CHECK(record["heavy_hitter_recall"].is_null());
    CHECK(record["output_cosine"].is_null());
    CHECK(record["trace"] == "trace\xef\xbf\xbd.h5");
    CHECK_FALSE(record.contains("ppl"));
}

TEST_CASE("fractions stay in range: a float sum over 1 is clamped at the end, cosine to [-1, 1]") {
    StreamMetrics m;
    m.steps = 4;
    m.retained_mass = 4.0000000118;  // four steps of a full softmax whose float sum rounds above 1
    m.heavy_hitter_hits = 8;
    m.heavy_hitter_possible = 8;
    m.output_steps = 2;
    m.output_cosine = 2.0000000004;
    m.output_rel_error = 0.5;
    ResultRecord r;
    set_measured(r, m);
    CHECK(r.retained_mass == 1.0);
    CHECK(r.heavy_hitter_recall == 1.0);
    CHECK(r.output_cosine == 1.0);
    CHECK(r.output_rel_error == 0.25);  // not a fraction: never clamped
    m.retained_mass = -1e-12;           // a sum of tiny negative rounding cannot print below 0 either
    m.output_cosine = -3.0;
    set_measured(r, m);
    CHECK(r.retained_mass == 0.0);
    CHECK(r.output_cosine == -1.0);
    m.retained_mass = 2.5;  // in range: exactly the mean, nothing rounded
    set_measured(r, m);
    CHECK(r.retained_mass == 2.5 / 4);
}

TEST_CASE("a record without a budget writes budget null in JSON and an empty cell in CSV") {
    ResultRecord keeps_all;
    keeps_all.policy = keeps_all.label = "int8";
    keeps_all.budget_label = kEveryBudget;
    ResultRecord evicts;
    evicts.policy = evicts.label = "h2o";
    evicts.budget = 64;
    evicts.budget_label = "64";
    const nlohmann::json parsed = nlohmann::json::parse(format_json({keeps_all, evicts}, "t.h5"));
    CHECK(parsed[0].contains("budget"));
    CHECK(parsed[0]["budget"].is_null());
    CHECK(parsed[0]["budget_label"] == "full");
    CHECK(parsed[1]["budget"] == 64);
    CHECK(parsed[1]["budget_label"] == "64");
    const std::string csv = format_csv({keeps_all, evicts});
    CHECK(csv.find("\nint8,int8,,,full,all,") != std::string::npos);
    CHECK(csv.find("\nh2o,h2o,,64,64,all,") != std::string::npos);
}

namespace {
// A record of `label` at budget 32, its metrics left to the test.
ResultRecord at_budget_32(const std::string& label) {
    ResultRecord r;
    r.policy = r.label = label;
    r.budget = 32;
    r.budget_label = "32";
    return r;
}
}  // namespace

TEST_CASE("per-sequence records: JSON names the sequence, tables get a column per sequence") {
    std::vector<ResultRecord> records;
    auto add = [&](const std::string& label, int sequence, double mass) {
        ResultRecord r = at_budget_32(label);
        r.retained_mass = mass;
        r.heavy_hitter_recall = mass;
        r.sequence = sequence;
        if (sequence >= 0) r.sequence_name = "story-" + std::to_string(sequence);
        records.push_back(r);
    };
    add("h2o", -1, 0.5);
    add("h2o", 3, 0.25);
    add("h2o", 4, 0.75);
    const nlohmann::json parsed = nlohmann::json::parse(format_json(records, "t.h5"));
    CHECK_FALSE(parsed[0].contains("sequence"));
    CHECK(parsed[1]["sequence"] == nlohmann::json({{"index", 3}, {"name", "story-3"}}));
    const std::string table = format_table(records, {"retained_mass"}, "");
    // The pooled table shows the pooled record only; the per-sequence table follows it.
    CHECK(table.find("h2o     0.500000") != std::string::npos);
    CHECK(table.find("by sequence") != std::string::npos);
    CHECK(table.find("story-3   story-4") != std::string::npos);
    CHECK(table.find("h2o @ 32       0.250000  0.750000") != std::string::npos);
    CHECK(format_comparison(records, {"retained_mass"}, "").find("by sequence") != std::string::npos);
    const std::string csv = format_csv(records);
    CHECK(csv.find(",sequence,sequence_name\n") != std::string::npos);
    CHECK(csv.find(",3,story-3\n") != std::string::npos);
    CHECK(csv.find(",all,\n") != std::string::npos);
}

TEST_CASE("perplexity cells: four decimals, and a huge perplexity in six digits rather than cut short") {
    std::vector<ResultRecord> records;
    auto add = [&](const std::string& label, double ppl, double delta) {
        ResultRecord r = at_budget_32(label);
        r.ppl = ppl;
        r.delta_ppl = delta;
        records.push_back(r);
    };
    add("full", 12.5, 0.0);
    add("h2o", 3.25e200, 3.25e200 - 12.5);
    const std::string table = format_table(records, {"ppl", "delta_ppl"}, "");
    CHECK(table.find("12.5000") != std::string::npos);
    CHECK(table.find("+0.0000") != std::string::npos);
    CHECK(table.find("3.25e+200") != std::string::npos);
    CHECK(table.find("+3.25e+200") != std::string::npos);
}

TEST_CASE("a perplexity beyond a double: \"inf\" with the mean NLL beside it, in the table, CSV and JSON") {
    std::vector<ResultRecord> records;
    auto add = [&](const std::string& label, double nll, double full_nll) {
        ResultRecord r = at_budget_32(label);
        r.nll = nll;
        r.ppl = std::exp(nll);
        r.delta_ppl = perplexity_rise(nll, full_nll);
        records.push_back(r);
    };
    add("full", 812.25, 812.25);
    add("h2o", 812.5, 812.25);
    add("tova", 2.5, 812.25);
    REQUIRE(std::isinf(records[0].ppl));
    const std::string table = format_table(records, {"ppl", "delta_ppl"}, "");
    // The cell widens its column: every row stays aligned.
    CHECK(table.find("  policy                B=32\n") != std::string::npos);
    CHECK(table.find("  full    inf (NLL 812.2500)\n") != std::string::npos);
    CHECK(table.find("  h2o     inf (NLL 812.5000)\n") != std::string::npos);
    CHECK(table.find("  tova               12.1825\n") != std::string::npos);
    CHECK(table.find("  h2o         +inf\n") != std::string::npos);  // e^812.25 (e^0.25 - 1) overflows too
    CHECK(table.find("  tova        -inf\n") != std::string::npos);
    const std::string csv = format_csv(records);
    CHECK(csv.find(",ppl,delta_ppl,nll,sequence,") != std::string::npos);
    CHECK(csv.find(",inf,0,812.25,all,") != std::string::npos);
    CHECK(csv.find(",inf,inf,812.5,all,") != std::string::npos);
    const nlohmann::json parsed = nlohmann::json::parse(format_json(records, "t.h5"));
    CHECK(parsed[0]["ppl"] == "inf");
    CHECK(parsed[0]["delta_ppl"] == 0.0);
    CHECK(parsed[0]["nll"] == 812.25);
    CHECK(parsed[1]["delta_ppl"] == "inf");
    CHECK(parsed[2]["ppl"] == doctest::Approx(std::exp(2.5)));
    CHECK(parsed[2]["delta_ppl"] == "-inf");
}

TEST_CASE("the perplexity rise: exp(nll) - exp(full_nll) as before where both fit, never NaN where they do not") {
    CHECK(perplexity_rise(1.5, 1.25) == std::exp(1.5) - std::exp(1.25));
    CHECK(perplexity_rise(800.0, 800.0) == 0.0);  // inf - inf would be NaN
    // Both perplexities overflow, their difference does not: e^709.9 (e^0.1 - 1).
    const double rise = std::exp(709.0) * (std::exp(0.9) * std::expm1(0.1));  // e^709.9 itself overflows
    CHECK(perplexity_rise(710.0, 709.9) == doctest::Approx(rise).epsilon(1e-12));
    CHECK(perplexity_rise(709.9, 710.0) == doctest::Approx(-rise).epsilon(1e-12));
    CHECK(perplexity_rise(900.0, 800.0) == INFINITY);
    CHECK(perplexity_rise(800.0, 900.0) == -INFINITY);
    CHECK(perplexity_rise(2.0, 900.0) == -INFINITY);
}
