// The policybook "decode-4096" synthetic attention trace: four components (attention sinks, a
// decaying local band, 32 ranked heavy hitters redrawn every 512 steps, uniform noise),
// generated step by step exactly as ../shared/reference/policybook-kvcache.md section 2 says.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sim/rng.h"

namespace kvsim {

struct PolicybookTraceSpec {
    std::string name = "decode-4096";
    int sequence_length = 4096;  // positions 0..4095; decode steps 1..4095
    uint32_t seed = 7;
};

// Looks up a named policybook trace; throws InputError naming `where` for an unknown name.
PolicybookTraceSpec policybook_trace(const std::string& name, const std::string& where);

// Produces the rows of a policybook trace in order: step t has t weights (positions 0..t-1).
class PolicybookGenerator {
public:
    explicit PolicybookGenerator(const PolicybookTraceSpec& spec);

    int next_step() const { return next_step_; }
    int last_step() const { return spec_.sequence_length - 1; }

    // Writes step next_step()'s weights into out (size >= next_step()) and advances.
    void next_row(std::span<float> out);

    const std::vector<int>& heavy_hitters() const { return heavy_; }

private:
    void redraw_heavy_hitters(int t);

    PolicybookTraceSpec spec_;
    Xoshiro128 rng_;
    std::vector<int> heavy_;  // in draw order: the order is the rank, and sets the weights
    std::vector<double> w_;
    int next_step_ = 1;
};

// FNV-1a-32 over the little-endian bytes of every f32 weight, steps in order: the reference's
// parity hash (0xBAEC2A10 for decode-4096).
class Fnv1a32 {
public:
    void add(std::span<const float> values);
    uint32_t value() const { return h_; }

private:
    uint32_t h_ = 0x811C9DC5u;
};

}  // namespace kvsim
