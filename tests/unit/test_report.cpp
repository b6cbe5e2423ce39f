#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

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
