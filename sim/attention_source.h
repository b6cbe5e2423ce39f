// Where replayed attention rows come from: a trace file, or a synthetic generator run in-process.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sim/policybook_trace.h"
#include "sim/trace_store.h"

namespace kvsim {

struct AttentionShape {
    int num_layers = 1;
    int num_heads = 1;  // query heads: attention is per query head
    std::vector<std::string> sequence_names;
    std::vector<int64_t> sequence_lengths;
    std::vector<int64_t> last_steps;  // per sequence: the last decode step replayed
};

class AttentionSource {
public:
    virtual ~AttentionSource() = default;
    virtual const AttentionShape& shape() const = 0;
    virtual std::string description() const = 0;
    // Decode steps [first_step, end_step) of one (sequence, layer, head), packed row after row.
    // Steps are read in increasing order within a (sequence, layer, head).
    virtual void read_rows(int sequence, int layer, int head, int64_t first_step, int64_t end_step,
                           std::vector<float>& out) = 0;
};

// max_steps > 0 truncates every sequence to its first max_steps decode steps (an exact prefix).
std::unique_ptr<AttentionSource> make_policybook_source(const PolicybookTraceSpec& spec, int64_t max_steps);
// An attention-kind trace file; throws InputError for anything else.
std::unique_ptr<AttentionSource> open_attention_trace(const std::string& path, int64_t max_steps);

// Writes a policybook trace to an HDF5 file (atomically).
void write_policybook_trace(const PolicybookTraceSpec& spec, const std::string& path);

}  // namespace kvsim
