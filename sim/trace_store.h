// The kvsim trace store: recorded attention (or the Q/K/V it comes from) in HDF5, schema
// version 1, documented in docs/trace-format.md. The reader validates every attribute and shape
// before use and reads one (layer, head) block of steps at a time, so replay memory stays bounded.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache_math/qkv_layer.h"
#include "cache_math/rope.h"

namespace kvsim {

inline constexpr const char* kTraceFormat = "kvsim-trace";
inline constexpr int64_t kTraceFormatVersion = 1;

enum class TraceKind { attention, qkv };
enum class TensorDtype { float32, float16 };

const char* to_string(TraceKind kind);

struct TraceMetadata {
    TraceKind kind = TraceKind::attention;
    std::string model_name;
    int64_t num_layers = 1;
    int64_t num_query_heads = 1;
    int64_t num_kv_heads = 1;
    int64_t head_dim = 0;  // 0 when the trace has no Q/K/V (a synthetic attention trace)
    std::string source_kind;       // "synthetic" or "model"
    std::string source_generator;  // e.g. "policybook/decode-4096"
    int64_t source_seed = 0;
    std::string source_model_file;
    std::string source_model_sha256;
    std::string source_text_sha256;
    // "nfc" when the text was normalised to Unicode NFC before it was tokenised; empty when it was
    // tokenised as it is.
    std::string source_text_normalization;
    // The model's attention window (Mistral's sliding_window) when it has one, else 0: the
    // capture attends in full; a replay may apply the window as a policy.
    int64_t source_sliding_window = 0;
    // A capture of some of the model's layers: the model layer of each trace layer, comma
    // separated ("0,8,15"); empty when the trace holds every layer in order.
    std::string source_layers;
    // The RoPE the model applied to the recorded Q and K (a capture records it); unknown (no
    // frequencies) for synthetic traces and for captures before kvsim recorded it.
    Rope rope;
    // The trace also holds each layer's keys as they were before RoPE (`kvsim capture
    // --pre-rope-keys`): dataset k_pre_rope beside k.
    bool pre_rope_keys = false;
    std::string kvsim_version;  // filled in by the writer
};

struct SequenceInfo {
    std::string name;
    int64_t length = 0;  // tokens; an attention trace has decode steps 1..length-1
};

// The longest sequence a trace may hold: positions are 32-bit everywhere, and every size below
// (attention_row_offset of it, times heads or head size) then fits 64 bits. The reader refuses more.
inline constexpr int64_t kMaxTraceTokens = int64_t{1} << 30;

// Offset of decode step t's row in a packed attention dataset (rows 1..T-1, row t has t weights).
// Exact for 0 <= step <= 2^32: the halving comes first, so the product stays within 64 bits (the
// reader holds every step to kMaxTraceTokens; sizes from elsewhere go through the checked form).
constexpr int64_t attention_row_offset(int64_t step) {
    return step % 2 == 0 ? (step / 2) * (step - 1) : step * ((step - 1) / 2);
}

// The packed weights of a sequence of `length` tokens, or InputError "<what>: ..." when the length
// is outside [0, kMaxTraceTokens].
int64_t attention_floats(int64_t length, const std::string& what);

// End (exclusive) of a block of decode steps that starts at first_step, ends by last_step and
// holds at most max_floats packed weights (always at least one row): readers stream in blocks.
inline int64_t attention_block_end(int64_t first_step, int64_t last_step, int64_t max_floats) {
    int64_t end = first_step + 1;
    while (end <= last_step && attention_row_offset(end + 1) - attention_row_offset(first_step) <= max_floats) ++end;
    return end;
}

class TraceWriter {
public:
    // Creates the file under a temporary name; commit() publishes it.
    TraceWriter(const std::string& path, TraceMetadata metadata);
    ~TraceWriter();

    int add_sequence(const std::string& name, int64_t length);
    // Writes decode steps [first_step, first_step + rows) of one (layer, query head), packed.
    void write_attention_rows(int sequence, int layer, int head, int64_t first_step, std::span<const float> rows);
    // One layer's Q, K and V for the whole sequence (layer_data.tokens is its length).
    void write_qkv(int sequence, int layer, const QkvLayer& layer_data, TensorDtype dtype);
    // Tokens [first_token, first_token + rows.tokens) of one layer, into datasets that span the
    // sequence (made by the first call): a capture writes a long sequence chunk by chunk.
    void write_qkv_rows(int sequence, int layer, int64_t first_token, const QkvLayer& rows, TensorDtype dtype);
    void write_tokens(int sequence, std::span<const int32_t> tokens);
    void commit();

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

struct DatasetSize {
    std::string name;
    uint64_t raw_bytes = 0;
    uint64_t stored_bytes = 0;
};

class TraceReader {
public:
    // Throws InputError naming the file and the attribute or dataset at the first problem.
    explicit TraceReader(const std::string& path);
    ~TraceReader();

    const std::string& path() const;
    const TraceMetadata& metadata() const;
    const std::vector<SequenceInfo>& sequences() const;

    // Decode steps [first_step, end_step) of one (sequence, layer, query head), packed row after
    // row, into out (resized). Throws InputError naming the file, the dataset and the first bad
    // element when a weight is not finite or outside [0, 1], or a row sums to more than 1.
    void read_attention_rows(int sequence, int layer, int head, int64_t first_step, int64_t end_step,
                             std::vector<float>& out) const;
    // One layer's Q, K and V; throws InputError naming the file, the dataset and the first
    // element that is not finite, or when the layer is over the memory limit.
    QkvLayer read_qkv(int sequence, int layer) const;
    // The same into `data`, over its buffers where they are large enough: a replay reads layer
    // after layer without faulting in and clearing a fresh layer's pages each time.
    void read_qkv(int sequence, int layer, QkvLayer& data) const;
    // The keys of one layer before RoPE, into out: InputError naming the file when the trace does
    // not record them (metadata().pre_rope_keys), or on a value that is not finite.
    void read_pre_rope_keys(int sequence, int layer, std::vector<float>& out) const;
    std::vector<int32_t> read_tokens(int sequence) const;  // empty when the trace stores none

    uint64_t file_bytes() const;
    std::vector<DatasetSize> dataset_sizes() const;

    // How many Q/K/V datasets this reader read from their stored chunks (inflated by kvsim itself,
    // where a dataset is laid out as kvsim writes it) rather than through HDF5's filters.
    uint64_t datasets_read_from_chunks() const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvsim
