// The stratified sample of decode steps that search.sample measures output error on, and its
// estimates: one step a stratum, sums scaled by stratum sizes, the collapsed-strata variance.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "sim/rng.h"
#include "sim/step_sample.h"

using namespace kvsim;

TEST_CASE("draw_stratified_steps: one step from each stratum of consecutive steps, reproducible") {
    const int64_t population = 100, strata = 13;
    std::vector<int> times_chosen(population, 0);
    for (uint32_t seed = 1; seed <= 400; ++seed) {
        std::vector<uint8_t> chosen(population, 0), again(population, 0);
        Xoshiro128 rng(seed), same(seed);
        draw_stratified_steps(population, strata, rng, chosen.data());
        draw_stratified_steps(population, strata, same, again.data());
        CHECK(chosen == again);
        for (int64_t h = 0; h < strata; ++h) {
            const int64_t begin = stratum_begin(h, population, strata), end = stratum_begin(h + 1, population, strata);
            CHECK((end - begin == 7 || end - begin == 8));  // 100 / 13: sizes differ by at most one
            CHECK(std::accumulate(chosen.begin() + begin, chosen.begin() + end, 0) == 1);
        }
        for (int64_t t = 0; t < population; ++t) times_chosen[static_cast<std::size_t>(t)] += chosen[static_cast<std::size_t>(t)];
    }
    CHECK(stratum_begin(0, population, strata) == 0);
    CHECK(stratum_begin(strata, population, strata) == population);
    for (int64_t t = 0; t < population; ++t) CHECK(times_chosen[static_cast<std::size_t>(t)] > 0);  // every step can be drawn
    std::vector<uint8_t> chosen(10, 0);
    Xoshiro128 rng(1);
    CHECK_THROWS(draw_stratified_steps(10, 1, rng, chosen.data()));
    CHECK_THROWS(draw_stratified_steps(10, 11, rng, chosen.data()));
}

TEST_CASE("StratifiedSum: sums scaled by stratum sizes, the collapsed-strata variance by hand") {
    // 10 steps in 4 strata of 2, 3, 2 and 3 steps; pairs (0, 1) and (2, 3).
    StratifiedSum even(10, 4);
    const double values[] = {1, 2, 3, 5};
    for (double v : values) even.add(v, 10 * v);
    CHECK(even.complete());
    CHECK(even.total() == doctest::Approx(2 * 1 + 3 * 2 + 2 * 3 + 3 * 5));
    CHECK(even.second_total() == doctest::Approx(290));
    // Pair (0, 1): weighted mean 1.6, deviations -1.2 and 1.2, 2 x 2.88; pair (2, 3): mean 4.2,
    // deviations -2.4 and 2.4, 2 x 11.52.
    CHECK(even.variance() == doctest::Approx(5.76 + 23.04));
    CHECK_THROWS(even.add(1, 1));

    // 9 steps in 3 strata of 3: one group of three, 3/2 x (16 + 1 + 25).
    StratifiedSum odd(9, 3);
    odd.add(1, 0), odd.add(2, 0);
    CHECK(!odd.complete());
    CHECK(odd.variance() == 0);  // the last pair waits for the last stratum
    odd.add(4, 0);
    CHECK(odd.total() == doctest::Approx(21));
    CHECK(odd.variance() == doctest::Approx(63));

    // 5 strata of one step: a pair (2 x (1 + 1)), then a group of three (3/2 x (1 + 1 + 4)).
    StratifiedSum five(5, 5);
    for (double v : {1.0, 3.0, 0.0, 0.0, 3.0}) five.add(v, 0);
    CHECK(five.variance() == doctest::Approx(2.0 * 2 + 1.5 * 6));
}

TEST_CASE("StratifiedSum: unbiased, its variance estimate covers the drift, below a simple random sample's") {
    // An error that grows with the context and wobbles: what a cache that fills and then evicts gives.
    const int64_t population = 400, strata = 25;
    std::vector<double> y(population);
    for (int64_t t = 0; t < population; ++t) y[t] = 1.0 * t / population + 0.05 * std::sin(0.37 * t) + 0.03 * ((t * 7919) % 13) / 13.0;
    const double exact = std::accumulate(y.begin(), y.end(), 0.0);
    double sum = 0, squares = 0, estimated = 0;
    const int draws = 4000;
    for (int d = 0; d < draws; ++d) {
        std::vector<uint8_t> chosen(population, 0);
        Xoshiro128 rng(static_cast<uint32_t>(d + 1));
        draw_stratified_steps(population, strata, rng, chosen.data());
        StratifiedSum s(population, strata);
        for (int64_t t = 0; t < population; ++t)
            if (chosen[static_cast<std::size_t>(t)]) s.add(y[t], 0);
        REQUIRE(s.complete());
        sum += s.total(), squares += s.total() * s.total(), estimated += s.variance();
    }
    const double mean = sum / draws, variance = squares / draws - mean * mean;
    CHECK(std::abs(mean - exact) < 4 * std::sqrt(variance / draws));  // unbiased
    CHECK(estimated / draws >= variance);                               // conservative on average
    // A simple random sample of as many steps: N^2 (1 - n/N) S^2 / n.
    double mean_y = exact / population, s2 = 0;
    for (double v : y) s2 += (v - mean_y) * (v - mean_y);
    s2 /= population - 1;
    const double simple = double(population) * population * (1 - double(strata) / population) * s2 / strata;
    CHECK(variance * 4 < simple);
}
