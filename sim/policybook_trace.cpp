#include "sim/policybook_trace.h"

#include <algorithm>
#include <cstring>

#include "base/errors.h"

namespace kvsim {
namespace {
constexpr double kSinkMass = 0.15;
constexpr double kSinkWeights[4] = {0.06, 0.045, 0.03, 0.015};
constexpr double kLocalMass = 0.55;
constexpr int kLocalSpan = 64;
constexpr int kLocalDecay = 65;
constexpr double kHeavyMass = 0.25;
constexpr int kHeavyCount = 32;
constexpr int kHeavyMargin = 65;  // heavy hitters lie in [4, t-65]: span t-68 plus offset 4
constexpr int kHeavyStart = 128;
constexpr int kHeavyPeriod = 512;
constexpr double kNoiseMass = 0.05;
}  // namespace

PolicybookTraceSpec policybook_trace(const std::string& name, const std::string& where) {
    if (name == "decode-4096") return PolicybookTraceSpec{};
    throw InputError(where + ": unknown policybook trace '" + name + "' (known: decode-4096)");
}

PolicybookGenerator::PolicybookGenerator(const PolicybookTraceSpec& spec)
    : spec_(spec), rng_(spec.seed), w_(spec.sequence_length) {
    heavy_.reserve(kHeavyCount);
}

void PolicybookGenerator::redraw_heavy_hitters(int t) {
    heavy_.clear();
    const int span = t - kHeavyMargin - 3;
    if (span < kHeavyCount) return;
    while (static_cast<int>(heavy_.size()) < kHeavyCount) {
        const int p = static_cast<int>(rng_.next_int(static_cast<uint64_t>(span))) + 4;
        // A duplicate is discarded but its draw stays consumed.
        if (std::find(heavy_.begin(), heavy_.end(), p) == heavy_.end()) heavy_.push_back(p);
    }
}

void PolicybookGenerator::next_row(std::span<float> out) {
    const int t = next_step_;
    if (t == kHeavyStart || (t > kHeavyStart && t % kHeavyPeriod == 0)) redraw_heavy_hitters(t);

    double* w = w_.data();
    std::fill(w, w + t, 0.0);

    const int sink_count = std::min(4, t);
    double sink_total = 0.0;
    for (int i = 0; i < sink_count; ++i) sink_total += kSinkWeights[i];
    for (int i = 0; i < sink_count; ++i) w[i] += (kSinkWeights[i] * kSinkMass) / sink_total;

    const int local_span = std::min(kLocalSpan, t);
    double local_total = 0.0;
    for (int d = 1; d <= local_span; ++d) local_total += static_cast<double>(kLocalDecay - d);
    // Before the heavy hitters appear, their mass goes to the local band.
    const double local_mass = (t < kHeavyStart) ? kLocalMass + kHeavyMass : kLocalMass;
    for (int d = 1; d <= local_span; ++d) w[t - d] += ((kLocalDecay - d) * local_mass) / local_total;

    if (t >= kHeavyStart && !heavy_.empty()) {
        double harmonic = 0.0;
        for (int r = 0; r < kHeavyCount; ++r) harmonic += 1.0 / (r + 1);
        for (size_t r = 0; r < heavy_.size(); ++r) w[heavy_[r]] += (kHeavyMass / (r + 1)) / harmonic;
    }

    const double noise = kNoiseMass / t;
    for (int i = 0; i < t; ++i) w[i] += noise;

    double total = 0.0;
    for (int i = 0; i < t; ++i) total += w[i];
    for (int i = 0; i < t; ++i) out[i] = static_cast<float>(w[i] / total);
    ++next_step_;
}

void Fnv1a32::add(std::span<const float> values) {
    uint32_t h = h_;
    for (float v : values) {
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        for (int k = 0; k < 4; ++k) {
            h ^= (bits >> (8 * k)) & 0xFFu;
            h *= 0x01000193u;
        }
    }
    h_ = h;
}

}  // namespace kvsim
