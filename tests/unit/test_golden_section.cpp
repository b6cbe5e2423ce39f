// GoldenSections, the streaming fit's lambda searches: every unit's bracket closes on its own
// minimum, measuring one new probe a unit a pass after the first, and ends where a search that
// measures both probes every step (the textbook form) ends, but for rounding.
#include <doctest/doctest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "search/golden_section.h"

using namespace kvsim;

namespace {

constexpr int kSteps = 16;  // as the streaming fit takes

// The textbook search: both probes measured anew every step.
template <class F>
std::pair<double, double> textbook(F f) {
    double low = 0, high = 1;
    for (int step = 0; step < kSteps; ++step) {
        const double left = high - GoldenSections::kGolden * (high - low);
        const double right = low + GoldenSections::kGolden * (high - low);
        if (f(left) <= f(right))
            high = right;
        else
            low = left;
    }
    return {low, high};
}

}  // namespace

TEST_CASE("golden sections: each unit closes on its own minimum, one new probe a unit a pass") {
    // Minima inside, at the ends and near 1, where a streaming head's lambda usually lies.
    const std::vector<double> minimum = {0.0, 0.05, 0.3, 0.5, 0.77, 0.93, 0.988, 0.999, 1.0};
    const std::size_t units = minimum.size();
    // Unimodal, and of different shapes: a parabola, a V, and a step that is flat on one side.
    auto error = [&](std::size_t u, double lambda) {
        const double d = lambda - minimum[u];
        if (u % 3 == 0) return d * d;
        if (u % 3 == 1) return std::abs(d);
        return d < 0 ? -d : 0.25 * d;
    };
    GoldenSections sections(units);
    std::vector<int> measured(units, 0);
    auto measure = [&](const std::vector<double>& lambdas) {
        REQUIRE(lambdas.size() == units);
        std::vector<double> e(units);
        for (std::size_t u = 0; u < units; ++u) {
            CHECK(lambdas[u] >= sections.low()[u]);
            CHECK(lambdas[u] <= sections.high()[u]);
            e[u] = error(u, lambdas[u]);
            ++measured[u];
        }
        return e;
    };
    sections.first_errors(measure(sections.left()), measure(sections.right()));
    for (int step = 0; step < kSteps; ++step) {
        const std::vector<double>& probes = sections.shrink();
        if (step + 1 < kSteps) sections.new_errors(measure(probes));
    }
    const double width = std::pow(GoldenSections::kGolden, kSteps);
    for (std::size_t u = 0; u < units; ++u) {
        CAPTURE(u);
        CHECK(measured[u] == kSteps + 1);  // both probes once, then one a pass: not 2 x kSteps
        CHECK(sections.low()[u] <= minimum[u] + 1e-12);
        CHECK(sections.high()[u] >= minimum[u] - 1e-12);
        CHECK(sections.high()[u] - sections.low()[u] == doctest::Approx(width).epsilon(1e-9));
        const auto [low, high] = textbook([&](double lambda) { return error(u, lambda); });
        CHECK(sections.low()[u] == doctest::Approx(low).epsilon(1e-12));
        CHECK(sections.high()[u] == doctest::Approx(high).epsilon(1e-12));
    }
}

TEST_CASE("golden sections: a tie keeps the left part, as the textbook search does") {
    GoldenSections sections(2);
    sections.first_errors({1.0, 1.0}, {1.0, 1.0});
    for (int step = 0; step < kSteps; ++step) {
        (void)sections.shrink();
        if (step + 1 < kSteps) sections.new_errors({1.0, 1.0});
    }
    const auto [low, high] = textbook([](double) { return 1.0; });
    CHECK(low == 0.0);
    for (std::size_t u = 0; u < 2; ++u) {
        CHECK(sections.low()[u] == 0.0);
        CHECK(sections.high()[u] == doctest::Approx(high).epsilon(1e-12));
    }
}

TEST_CASE("golden sections: an error list of the wrong length is a logic error") {
    GoldenSections sections(3);
    CHECK_THROWS_AS(sections.first_errors({1, 2}, {1, 2, 3}), std::logic_error);
    sections.first_errors({1, 2, 3}, {3, 2, 1});
    (void)sections.shrink();
    CHECK_THROWS_AS(sections.new_errors({1}), std::logic_error);
}
