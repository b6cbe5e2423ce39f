// Attention recomputed from recorded Q and K (after RoPE): causal, scaled by 1/sqrt(head_dim),
// once per step for every query head, and shared by every policy of a run. One layer's Q/K/V
// is held at a time, so memory is bounded by one layer whatever the layer count.
#pragma once
#include <functional>
#include <memory>
#include <span>
#include <string>

#include <tbb/task_group.h>

#include "sim/attention_source.h"
#include "sim/trace_store.h"

namespace kvsim {

struct QkvShape {
    int num_query_heads = 1;
    int num_kv_heads = 1;
    int head_dim = 1;
};

// Each KV head's keys feature by feature, built once per layer in the layout the score products
// read fastest. Where kvsim's own score kernel serves (AVX-512 or AVX2 builds with FMA,
// score_panels_serve; see qkv_attention.cpp) that is panels of 48 tokens, the last zero-padded,
// each as blocks of the kernel's width, [kv head][panel][block][feature][width]: one block of 48
// with AVX-512, three of 16 with AVX2. Elsewhere a column-major copy of the keys,
// [kv head][feature][token].
struct KeysByFeature {
    int64_t tokens = 0;
    bool panels = false;
    std::vector<float> values;
};
// Whether keys_by_feature builds panels for this head size (so the score kernel serves).
bool score_panels_serve(int head_dim);
inline constexpr int kScorePanelTokens = 48;
void keys_by_feature(const QkvLayer& layer, const QkvShape& shape, KeysByFeature& out);

// Rows of steps [first_step, end_step) of every query head, from one layer's Q and K: row t is
// the softmax of q_t . k_j / sqrt(d) over j = 0..t, positions 0..t-1 packed, t's own weight in
// self_weight. Heads run in parallel; each uses matrix products over the block. A logit that
// overflows to +-Inf or NaN is an InputError naming `where` (trace, sequence, layer), the head and
// the step.
void attention_from_qkv(const QkvLayer& layer, const QkvShape& shape, int64_t first_step, int64_t end_step,
                        AttentionBlock& block, const std::string& where = {});

// Called with each row as soon as it is written, on the thread that wrote it, while it is still in
// cache: (query head, row index in the block, the row's t weights). One head's rows come in step
// order from one thread; different heads' rows come in parallel.
// Where `gather_floor` is given and returns a key above 0 for a head's next row, that row's
// positions whose weight's bits are at least it are gathered as the row is stored (what
// heavy_hitters.h's positions_at_or_above finds, from the registers instead of a second pass over
// the row) and handed to `visit`; otherwise that span is empty.
struct RowVisitor {
    std::function<int32_t(int head)> gather_floor;
    std::function<void(int head, int64_t index, std::span<const float> row, std::span<const int32_t> at_or_above)>
        visit;
};

// The same with the layer's keys by feature already built (what a replay does once per layer),
// and each row handed to `visit` where given.
void attention_from_qkv(const QkvLayer& layer, const KeysByFeature& keys, const QkvShape& shape, int64_t first_step,
                        int64_t end_step, AttentionBlock& block, const std::string& where = {},
                        const RowVisitor* visit = nullptr);

// attention_from_qkv in parts, for a caller that consumes each KV head's rows as soon as they are
// made (the replay): the block's steps set once, then each query head's rows (any heads in
// parallel), which return the first step whose logits overflow (-1: none; its rows are then
// incomplete), reported by throw_logit_overflow for the lowest such head.
void start_attention_block(const QkvShape& shape, int64_t first_step, int64_t end_step, AttentionBlock& block);
int64_t attention_rows_of_head(const QkvLayer& layer, const KeysByFeature& keys, const QkvShape& shape, int head,
                               AttentionBlock& block, const RowVisitor* visit);
[[noreturn]] void throw_logit_overflow(const std::string& where, int head, int64_t step);

// Floating-point operations attention_from_qkv spends on a block (the score products).
double attention_flops(const QkvShape& shape, int64_t first_step, int64_t end_step);

// A source that yields one layer's Q/K/V at a time.
class QkvSource : public AttentionSource {
public:
    const AttentionShape& shape() const override { return shape_; }
    void read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block) override;
    // The same, each row handed to `visit` as it is computed (see RowVisitor).
    void read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block,
                    const RowVisitor& visit);
    // read_block in parts, for a replay that consumes each KV head's rows as soon as they are made:
    // the layer (and its keys) readied and the block's steps set; then each query head's rows,
    // heads in parallel, which return the first step whose logits overflow (-1: none); then the
    // lowest such head reported as read_block would.
    void begin_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block);
    int64_t head_rows(int head, AttentionBlock& block, const RowVisitor* visit) const;
    [[noreturn]] void report_overflow(int sequence, int layer, int head, int64_t step) const;
    // Blocks of at least 64 steps: fewer rows leave the score products too thin to run near peak.
    int64_t block_floats(int64_t wanted) const override;
    const QkvShape& qkv_shape() const { return qkv_; }
    // Q/K/V of one (sequence, layer): what eval-free replays and output metrics read.
    const QkvLayer& layer_data(int sequence, int layer);
    // Starts loading (sequence, layer) as a task beside the caller's work on the layer held
    // now, into a second layer's memory: layer_data() takes it when it is asked for (and throws
    // the load's error then, as a load in place would). One load at a time. While it runs, the
    // caller must not ask for another layer's data nor read the trace: the source's reader is
    // then the load's alone (HDF5 serialises its calls, but a reader's handles are not shared).
    void prefetch(int sequence, int layer);
    // Waits for a load prefetch() started, and drops it with its error: what a replay that
    // throws does, so that no load outlives it.
    void drop_prefetch();
    ~QkvSource() override;

protected:
    // Loads a layer into `data`, which holds the previous one: its buffers may be reused.
    virtual void load_layer(int sequence, int layer, QkvLayer& data) = 0;
    AttentionShape shape_;
    QkvShape qkv_;

private:
    std::string where(int sequence, int layer) const;  // names the trace, sequence and layer in errors
    void ready_layer(int sequence, int layer);          // (sequence, layer) loaded, its keys by feature built
    int loaded_sequence_ = -1, loaded_layer_ = -1;
    QkvLayer loaded_;
    // A prefetch's load runs as a task among the replay's own (another thread beside them would
    // take a core from a parallel loop whose other threads then wait at its end).
    // (Held by pointer: a task_group's own destructor may throw, which a source's may not.)
    std::unique_ptr<tbb::task_group> loading_ = std::make_unique<tbb::task_group>();
    bool prefetching_ = false;  // a load was started and not yet waited for
    int prefetch_sequence_ = -1, prefetch_layer_ = -1;
    QkvLayer prefetched_;
    KeysByFeature keys_;
    bool keys_current_ = false;  // keys_ is built from loaded_ (reset when a layer loads)
};

std::unique_ptr<AttentionSource> make_qkv_source(std::unique_ptr<TraceReader> reader, int64_t max_steps,
                                                 const std::vector<int>& sequences = {});

}  // namespace kvsim
