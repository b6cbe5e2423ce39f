// Where replayed attention rows come from: an attention trace file, attention computed from a
// Q/K/V trace, or a synthetic generator run in-process. Every source hands out blocks of steps
// for all query heads of one layer at a time, so memory stays bounded by one layer's block.
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
    int num_query_heads = 1;
    int num_kv_heads = 1;  // query head h reads KV head h / (num_query_heads / num_kv_heads)
    std::vector<std::string> sequence_names;
    std::vector<int64_t> sequence_lengths;
    std::vector<int64_t> last_steps;  // per sequence: the last decode step replayed

    int group_size() const { return num_query_heads / num_kv_heads; }
};

// The last decode step replayed of a sequence of `length` tokens: every step, or the first
// max_steps (> 0) of them, an exact prefix.
int64_t last_replayed_step(int64_t length, int64_t max_steps);

// The shape of a trace file as a replay sees it: every sequence, or those of `sequences` (indices
// into the file, in that order).
AttentionShape trace_shape(const TraceReader& reader, int64_t max_steps, const std::vector<int>& sequences = {});
// The file's index of each sequence a replay sees: `sequences`, or every one in order.
std::vector<int> selected_sequences(const TraceReader& reader, const std::vector<int>& sequences);

// Decode steps [first_step, end_step) of one layer, every query head.
struct AttentionBlock {
    int64_t first_step = 0, end_step = 0;
    // rows[h]: step t's full-softmax weights on positions 0..t-1, packed row after row (a Q/K/V
    // source's buffers only grow: they may hold more floats than the block's rows).
    std::vector<std::vector<float>> rows;
    // self_weight[h][i]: the weight of step first_step + i on its own position. Empty when the
    // source records rows only; self_weight_from_row_sums() then derives it where a view needs it.
    std::vector<std::vector<float>> self_weight;

    const float* row(int head, int64_t t) const {
        return rows[head].data() + (attention_row_offset(t) - attention_row_offset(first_step));
    }
};

class AttentionSource {
public:
    virtual ~AttentionSource() = default;
    virtual const AttentionShape& shape() const = 0;
    virtual std::string description() const = 0;
    // Fills block for steps [first_step, end_step) of one (sequence, layer). Within a
    // (sequence, layer), blocks are asked for in increasing order.
    virtual void read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block) = 0;
    // Packed weights per query head a block may hold (memory bound), given the caller's wish.
    virtual int64_t block_floats(int64_t wanted) const { return wanted; }
};

enum class AttentionView {
    raw,           // the full-cache softmax restricted to kept positions (the reference harness)
    renormalized,  // the softmax over kept positions only: what the model computes after eviction
    cached         // the same, computed from the cache as held (keys at their tiers): what a runtime
                   // serving the policy can compute, and what kvsim's runtime computes (Q/K/V only)
};

// max_steps > 0 truncates every sequence to its first max_steps decode steps (an exact prefix).
std::unique_ptr<AttentionSource> make_policybook_source(const PolicybookTraceSpec& spec, int64_t max_steps);
// A trace file of either kind: attention rows are read, or computed from Q and K. `sequences`
// (indices into the file) replays only those, in that order (a search's fitting or held-out set).
std::unique_ptr<AttentionSource> open_trace_source(const std::string& path, int64_t max_steps,
                                                   const std::vector<int>& sequences = {});

// Writes a policybook trace to an HDF5 file (atomically).
void write_policybook_trace(const PolicybookTraceSpec& spec, const std::string& path);

// Sets self_weight to 1 - (row sum), for sources that record rows only (in parallel).
void self_weight_from_row_sums(AttentionBlock& block);

}  // namespace kvsim
