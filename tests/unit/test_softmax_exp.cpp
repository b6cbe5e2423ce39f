// The softmax's exponentials and their sum: the bits of Eigen's own expressions, on either path.
#include <doctest/doctest.h>

#include <Eigen/Core>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "sim/rng.h"
#include "cache_math/softmax_exp.h"

using namespace kvsim;

namespace {

using AlignedFloats = std::vector<float, Eigen::aligned_allocator<float>>;

bool same_bits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

// Rows whose exponents cover both paths: most values within 80 of the peak (one multiply by 2^m),
// some far below it, some above the peak passed (m > 0), and -inf, -0, NaN and huge values.
float draw(Xoshiro128& rng, int kind) {
    const double u = rng.next_float();
    switch (kind) {
        case 0: return static_cast<float>(3.0 * (2 * u - 1));
        case 1: return static_cast<float>(-120.0 * u);            // m from 0 down past -125 and the clamp
        case 2: return static_cast<float>(4.0 * u - 1.0);        // above the peak 0.5: m up to 3
        default: {
            const float special[] = {-std::numeric_limits<float>::infinity(), -0.0f, 0.0f, -1e30f, -87.0f, -86.5f,
                                     -88.72f, -88.73f, std::numeric_limits<float>::quiet_NaN(), 200.0f, 1e-40f};
            return u < 0.5 ? static_cast<float>(-2.0 * u) : special[static_cast<int>(u * 22) % 11];
        }
    }
}

}  // namespace

TEST_CASE("the softmax's exponentials and sum have the bits of Eigen's exp and sum, at every alignment") {
    const std::string path = fast_softmax_exp() ? "one multiply where it serves" : "Eigen's expressions";
    MESSAGE("this build's exponentials: " << path);
    Xoshiro128 rng(20261202);
    std::vector<int64_t> lengths;
    for (int64_t n = 1; n <= 72; ++n) lengths.push_back(n);
    for (int64_t n : {255, 256, 257, 1000, 1023, 1024, 1031, 4097}) lengths.push_back(n);
    int64_t values = 0, rows = 0, nans = 0;
    for (int kind = 0; kind < 4; ++kind)
        for (int offset = 0; offset < 8; ++offset)
            for (int64_t n : lengths) {
                AlignedFloats input(static_cast<std::size_t>(offset + n)), ours, eigen;
                for (float& x : input) x = draw(rng, kind);
                const float peak = kind == 2 ? 0.5f : 0.0f;
                ours = eigen = input;
                Eigen::Map<Eigen::ArrayXf> row(eigen.data() + offset, n);
                row = (row - peak).exp();
                const float eigen_sum = row.sum();
                const float our_sum = exp_minus_peak_and_sum(ours.data() + offset, n, peak);
                AlignedFloats without_sum = input;
                exp_minus_peak(without_sum.data() + offset, n, peak);
                int64_t differing = 0;
                for (int64_t j = 0; j < n; ++j) {
                    const float want = eigen[offset + j];
                    nans += std::isnan(want);
                    differing += !same_bits(ours[offset + j], want) || !same_bits(without_sum[offset + j], want);
                }
                CAPTURE(kind);
                CAPTURE(offset);
                CAPTURE(n);
                CHECK(differing == 0);
                CHECK(same_bits(our_sum, eigen_sum));
                values += n;
                ++rows;
            }
    MESSAGE(rows << " rows, " << values << " values, " << nans << " NaN");
    CHECK(nans > 0);
}

TEST_CASE("exponents in [-125, 0] take one multiply, with the bits of Eigen's four") {
    // Every float from the peak down to 90 below it, in steps that cross each exponent's boundary:
    // the fast path's whole range and both of its edges, in packets of eight from an aligned start.
    AlignedFloats input;
    for (float x = 0.0f; x > -90.0f; x -= 0.0037f) input.push_back(x);
    AlignedFloats ours = input, eigen = input;
    Eigen::Map<Eigen::ArrayXf> row(eigen.data(), static_cast<Eigen::Index>(eigen.size()));
    row = (row - 0.0f).exp();
    const float eigen_sum = row.sum();
    const float our_sum = exp_minus_peak_and_sum(ours.data(), static_cast<int64_t>(ours.size()), 0.0f);
    int64_t differing = 0;
    for (std::size_t j = 0; j < input.size(); ++j) differing += !same_bits(ours[j], eigen[j]);
    CHECK(differing == 0);
    CHECK(same_bits(our_sum, eigen_sum));
}
