#include "src/capture.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <filesystem>

#include "model/llama.h"
#include "model/tokenizer.h"
#include "src/model_text.h"
#include "src/progress.h"
#include "base/errors.h"
#include "base/sha256.h"
#include "base/size_limits.h"

namespace kvsim {
namespace {

// Tokens the forward pass runs at a time while capturing: each layer's Q/K/V rows of one chunk are
// held until that layer's attention has them, then written, so memory is the model, its KV cache
// and one layer's chunk whatever the sequence's length and the number of layers. 256 matches the
// trace datasets' HDF5 chunks.
constexpr int kCaptureChunk = 256;

// Copies a recorded layer's Q, K and V (and keys before RoPE) of the chunk's positions into
// [token][head][d] rows and writes them into the trace once the chunk's last position of that
// layer has arrived. The writes come in the order a whole chunk's layers would be written after
// its forward pass (layer 0, 1, ...), so the file is the same.
class QkvRecorder : public model::ForwardHooks {
public:
    // trace_layer[l]: where model layer l goes in the trace, -1 when not recorded.
    QkvRecorder(const model::LlamaConfig& config, std::vector<int> trace_layer, TraceWriter& writer, TensorDtype dtype,
                bool pre_rope_keys)
        : config_(config), trace_layer_(std::move(trace_layer)), writer_(writer), dtype_(dtype),
          pre_rope_keys_(pre_rope_keys) {}
    // The next chunk of `sequence` starts at first_pos and has `tokens` positions.
    void start_chunk(int sequence, int first_pos, int tokens) {
        sequence_ = sequence;
        first_pos_ = first_pos;
        rows_.tokens = tokens;
        rows_.q.resize(static_cast<std::size_t>(tokens) * config_.q_dim());
        rows_.k.resize(static_cast<std::size_t>(tokens) * config_.kv_dim());
        rows_.v.resize(static_cast<std::size_t>(tokens) * config_.kv_dim());
        if (pre_rope_keys_) rows_.k_pre_rope.resize(static_cast<std::size_t>(tokens) * config_.kv_dim());
    }
    void before_rope(int layer, int pos, const float* k) override {
        if (!pre_rope_keys_ || trace_layer_[layer] < 0) return;
        const std::size_t row = static_cast<std::size_t>(pos - first_pos_);
        std::memcpy(rows_.k_pre_rope.data() + row * config_.kv_dim(), k, config_.kv_dim() * sizeof(float));
    }
    void after_qkv(int layer, int pos, float* q, float* k, float* v) override {
        if (trace_layer_[layer] < 0) return;
        const std::size_t row = static_cast<std::size_t>(pos - first_pos_);
        std::memcpy(rows_.q.data() + row * config_.q_dim(), q, config_.q_dim() * sizeof(float));
        std::memcpy(rows_.k.data() + row * config_.kv_dim(), k, config_.kv_dim() * sizeof(float));
        std::memcpy(rows_.v.data() + row * config_.kv_dim(), v, config_.kv_dim() * sizeof(float));
        // The model calls after_qkv position by position, layer by layer (llama.h): the chunk's
        // last position completes the layer.
        if (static_cast<int64_t>(row) + 1 == rows_.tokens)
            writer_.write_qkv_rows(sequence_, trace_layer_[layer], first_pos_, rows_, dtype_);
    }

private:
    const model::LlamaConfig& config_;
    std::vector<int> trace_layer_;
    TraceWriter& writer_;
    TensorDtype dtype_;
    bool pre_rope_keys_;
    QkvLayer rows_;  // the layer being recorded, rows of the current chunk
    int sequence_ = 0, first_pos_ = 0;
};

}  // namespace

CaptureSummary capture_trace(const CaptureOptions& options) {
    LoadedInput loaded = load_model_input(options.input);
    model::LlamaModel& llama = loaded.model;
    const TokenizedText& text = loaded.text;
    const std::string& model_path = options.input.model_path;
    const model::LlamaConfig& c = llama.config();

    // The layers recorded: all, or the ascending list asked for.
    std::vector<int> trace_layer(static_cast<std::size_t>(c.n_layers), -1);
    std::string layer_list;
    int recorded = 0;
    if (options.layers.empty()) {
        for (int l = 0; l < c.n_layers; ++l) trace_layer[l] = recorded++;
    } else {
        for (std::size_t i = 0; i < options.layers.size(); ++i) {
            const int l = options.layers[i];
            if (l < 0 || l >= c.n_layers)
                throw InputError(model_path + ": --layers: layer " + std::to_string(l) + " is not in the model (layers 0.." +
                                 std::to_string(c.n_layers - 1) + ")");
            if (i > 0 && l <= options.layers[i - 1])
                throw InputError(model_path + ": --layers: " + std::to_string(l) + " after " +
                                 std::to_string(options.layers[i - 1]) + " (list each layer once, in ascending order)");
            trace_layer[l] = recorded++;
            layer_list += (i ? "," : "") + std::to_string(l);
        }
    }

    TraceMetadata m;
    m.kind = TraceKind::qkv;
    m.model_name = std::filesystem::path(model_path).stem().string();
    m.num_layers = recorded;
    m.source_layers = layer_list;
    m.num_query_heads = c.n_heads;
    m.num_kv_heads = c.n_kv_heads;
    m.head_dim = c.head_dim;
    m.source_kind = "model";
    m.source_model_file = std::filesystem::path(model_path).filename().string();
    m.source_model_sha256 = sha256_file(model_path);
    m.source_text_sha256 = text.text_sha256;
    if (options.input.normalize != model::TextNormalization::none)
        m.source_text_normalization = model::to_string(options.input.normalize);
    m.source_sliding_window = c.sliding_window;
    m.rope = llama.rope();
    m.pre_rope_keys = options.pre_rope_keys;
    TraceWriter writer(options.output_path, m);

    // One layer's chunk of Q, K and V, held until written, next to the model itself.
    std::size_t longest = 0;
    for (const std::vector<int>& tokens : text.sequences) longest = std::max(longest, tokens.size());
    const int chunk = static_cast<int>(std::min<std::size_t>(longest, kCaptureChunk));
    const std::string what = model_path + ": Q/K/V of one layer for a chunk of " + std::to_string(chunk) + " tokens";
    const uint64_t per_token_bytes =
        (static_cast<uint64_t>(c.q_dim()) + (options.pre_rope_keys ? 3ull : 2ull) * c.kv_dim()) * sizeof(float);
    check_memory(checked_add(checked_mul(per_token_bytes, static_cast<uint64_t>(chunk), what), llama.memory_bytes(), what),
                 what);
    QkvRecorder recorder(c, trace_layer, writer, options.dtype, options.pre_rope_keys);

    // The time left is estimated from the work done: each chunk's multiply-adds (attention's grow
    // with its position), not its tokens.
    double total_flops = 0, done_flops = 0;
    for (const std::vector<int>& tokens : text.sequences)
        for (std::size_t start = 0; start < tokens.size(); start += chunk)
            total_flops += c.chunk_flops(static_cast<int>(start), static_cast<int>(std::min<std::size_t>(chunk, tokens.size() - start)),
                                         /*logits=*/false);
    ProgressBar bar(options.show_progress);

    CaptureSummary summary;
    for (std::size_t i = 0; i < text.sequences.size(); ++i) {
        const std::vector<int>& tokens = text.sequences[i];
        const std::string sequence_name = text.sequence_name(options.input.text_path, i);
        const int length = static_cast<int>(tokens.size());
        const int sequence = writer.add_sequence(TokenizedText::trace_sequence_name(options.input.text_path, i), length);
        llama.reset();
        for (int start = 0; start < length; start += chunk) {
            const int n = std::min(chunk, length - start);
            recorder.start_chunk(sequence, start, n);
            try {
                // No logits: the trace records Q, K and V, and the classifier would be a fifth of the
                // work for a 1B model with a 128K vocabulary.
                llama.forward_batch(std::span<const int>(tokens).subspan(static_cast<std::size_t>(start), n), start,
                                    &recorder, /*logits=*/false);
            } catch (const model::NonFiniteError& error) {
                throw error.in_sequence(sequence_name);  // the trace is left unwritten
            }
            done_flops += c.chunk_flops(start, n, /*logits=*/false);
            bar.update(done_flops / total_flops);
        }
        writer.write_tokens(sequence, std::vector<int32_t>(tokens.begin(), tokens.end()));
        ++summary.sequences;
        summary.tokens += static_cast<long>(tokens.size());
    }
    bar.finish();
    writer.commit();
    return summary;
}

}  // namespace kvsim
