// The CUDA decode-attention kernel against the CPU on random rows at every tier. Where no GPU is
// present (CI, these machines) the comparison is skipped with one line saying why, and the entry
// point must refuse cleanly with the same reason.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "src/runtime/cuda_attention.h"
#include "src/runtime/tier_store.h"

using namespace kvsim;
using namespace kvsim::runtime;

TEST_CASE("cuda decode attention matches the CPU over FP16, INT8 and INT4 rows (skipped without a GPU)") {
    const int d = 128, group = 4, rows = 777;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    TierStore keys[3], values[3];
    for (int tier = 0; tier < 3; ++tier) {
        keys[tier].plan(tier, rows, d, 32);
        values[tier].plan(tier, rows, d, 32);
    }
    std::vector<int> slots(rows);
    std::vector<uint8_t> key_tier(rows), value_tier(rows);
    std::vector<float> row(d);
    for (int r = 0; r < rows; ++r) {
        slots[r] = (r * 7) % rows;  // rows visit slots out of order
        key_tier[r] = static_cast<uint8_t>(r % 3);
        value_tier[r] = static_cast<uint8_t>((r / 3) % 3);
        for (float& x : row) x = normal(rng);
        keys[key_tier[r]].write(slots[r], row.data());
        for (float& x : row) x = normal(rng);
        values[value_tier[r]].write(slots[r], row.data());
    }
    std::vector<float> q(group * d);
    for (float& x : q) x = 0.3f * normal(rng);

    // The CPU reference in double: every row read back through TierStore::read.
    std::vector<double> reference(group * d, 0.0), reference_scores(group * rows);
    std::vector<float> k(d), v(d);
    for (int h = 0; h < group; ++h) {
        double peak = -INFINITY;
        for (int r = 0; r < rows; ++r) {
            keys[key_tier[r]].read(slots[r], k.data());
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += double(q[h * d + i]) * k[i];
            reference_scores[h * rows + r] = dot / std::sqrt(double(d));
            peak = std::max(peak, reference_scores[h * rows + r]);
        }
        double total = 0;
        for (int r = 0; r < rows; ++r) {
            const double w = std::exp(reference_scores[h * rows + r] - peak);
            total += w;
            values[value_tier[r]].read(slots[r], v.data());
            for (int i = 0; i < d; ++i) reference[h * d + i] += w * v[i];
        }
        for (int i = 0; i < d; ++i) reference[h * d + i] /= total;
    }

    std::string why;
    std::vector<float> out(group * d, 0.0f), scores(group * rows, 0.0f);
    if (!cuda::device_available(why)) {
        MESSAGE("skipped: " << why);
        std::string error;
        CHECK_FALSE(cuda::decode_attention(keys, values, slots, key_tier, value_tier, d, group, q.data(), out.data(),
                                           scores.data(), error));
        CHECK(error == why);
        return;
    }
    std::string error;
    REQUIRE_MESSAGE(cuda::decode_attention(keys, values, slots, key_tier, value_tier, d, group, q.data(), out.data(),
                                           scores.data(), error),
                    error);
    for (int i = 0; i < group * d; ++i) CHECK(out[i] == doctest::Approx(reference[i]).epsilon(1e-4).scale(1.0));
    for (int i = 0; i < group * rows; ++i)
        CHECK(scores[i] == doctest::Approx(reference_scores[i]).epsilon(1e-4).scale(1.0));
}
