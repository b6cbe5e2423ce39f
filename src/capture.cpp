#include "src/capture.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <filesystem>

#include "model/llama.h"
#include "model/tokenizer.h"
#include "src/model_text.h"
#include "base/errors.h"
#include "base/sha256.h"
#include "base/size_limits.h"

namespace kvsim {
namespace {

// Tokens the forward pass runs at a time while capturing: Q/K/V are held for one chunk (every
// layer) and then written, so memory is the model, its KV cache and this chunk's working set
// whatever the sequence's length. 256 matches the trace datasets' HDF5 chunks.
constexpr int kCaptureChunk = 256;

// Copies the recorded layers' Q, K and V of the chunk's positions into [token][head][d] buffers.
class QkvRecorder : public model::ForwardHooks {
public:
    // trace_layer[l]: where model layer l goes in the trace, -1 when not recorded.
    QkvRecorder(const model::LlamaConfig& config, std::vector<int> trace_layer, int tokens, int recorded,
                bool pre_rope_keys)
        : config_(config), trace_layer_(std::move(trace_layer)), layers_(static_cast<std::size_t>(recorded)),
          pre_rope_keys_(pre_rope_keys) {
        start_chunk(0, tokens);
    }
    // The next chunk starts at first_pos and has `tokens` positions.
    void start_chunk(int first_pos, int tokens) {
        first_pos_ = first_pos;
        for (QkvLayer& layer : layers_) {
            layer.tokens = tokens;
            layer.q.resize(static_cast<std::size_t>(tokens) * config_.q_dim());
            layer.k.resize(static_cast<std::size_t>(tokens) * config_.kv_dim());
            layer.v.resize(static_cast<std::size_t>(tokens) * config_.kv_dim());
            if (pre_rope_keys_) layer.k_pre_rope.resize(static_cast<std::size_t>(tokens) * config_.kv_dim());
        }
    }
    void before_rope(int layer, int pos, const float* k) override {
        if (!pre_rope_keys_ || trace_layer_[layer] < 0) return;
        QkvLayer& out = layers_[trace_layer_[layer]];
        const std::size_t row = static_cast<std::size_t>(pos - first_pos_);
        std::memcpy(out.k_pre_rope.data() + row * config_.kv_dim(), k, config_.kv_dim() * sizeof(float));
    }
    void after_qkv(int layer, int pos, float* q, float* k, float* v) override {
        if (trace_layer_[layer] < 0) return;
        QkvLayer& out = layers_[trace_layer_[layer]];
        const std::size_t row = static_cast<std::size_t>(pos - first_pos_);
        std::memcpy(out.q.data() + row * config_.q_dim(), q, config_.q_dim() * sizeof(float));
        std::memcpy(out.k.data() + row * config_.kv_dim(), k, config_.kv_dim() * sizeof(float));
        std::memcpy(out.v.data() + row * config_.kv_dim(), v, config_.kv_dim() * sizeof(float));
    }
    const QkvLayer& layer(int trace_layer) const { return layers_[trace_layer]; }

private:
    const model::LlamaConfig& config_;
    std::vector<int> trace_layer_;
    std::vector<QkvLayer> layers_;
    bool pre_rope_keys_;
    int first_pos_ = 0;
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
    m.source_sliding_window = c.sliding_window;
    m.rope = llama.rope();
    m.pre_rope_keys = options.pre_rope_keys;
    TraceWriter writer(options.output_path, m);

    CaptureSummary summary;
    for (std::size_t i = 0; i < text.sequences.size(); ++i) {
        const std::vector<int>& tokens = text.sequences[i];
        const std::string sequence_name = text.sequence_name(options.input.text_path, i);
        const int length = static_cast<int>(tokens.size());
        const int chunk = std::min(length, kCaptureChunk);
        // One chunk's Q, K and V of every layer, held until written, next to the model itself.
        const std::string what = model_path + ": Q/K/V of " + sequence_name + " (chunks of " + std::to_string(chunk) + " tokens)";
        const uint64_t per_token_bytes = checked_mul(
            static_cast<uint64_t>(recorded), (static_cast<uint64_t>(c.q_dim()) + (options.pre_rope_keys ? 3ull : 2ull) * c.kv_dim()) * sizeof(float), what);
        check_memory(checked_add(checked_mul(per_token_bytes, static_cast<uint64_t>(chunk), what), llama.memory_bytes(), what), what);
        QkvRecorder recorder(c, trace_layer, chunk, recorded, options.pre_rope_keys);
        const int sequence = writer.add_sequence(TokenizedText::trace_sequence_name(options.input.text_path, i), length);
        llama.reset();
        for (int start = 0; start < length; start += chunk) {
            const int n = std::min(chunk, length - start);
            recorder.start_chunk(start, n);
            try {
                // No logits: the trace records Q, K and V, and the classifier would be a fifth of the
                // work for a 1B model with a 128K vocabulary.
                llama.forward_batch(std::span<const int>(tokens).subspan(static_cast<std::size_t>(start), n), start,
                                    &recorder, /*logits=*/false);
            } catch (const model::NonFiniteError& error) {
                throw error.in_sequence(sequence_name);  // the trace is left unwritten
            }
            for (int layer = 0; layer < recorded; ++layer)
                writer.write_qkv_rows(sequence, layer, start, recorder.layer(layer), options.dtype);
        }
        writer.write_tokens(sequence, std::vector<int32_t>(tokens.begin(), tokens.end()));
        ++summary.sequences;
        summary.tokens += static_cast<long>(tokens.size());
    }
    writer.commit();
    return summary;
}

}  // namespace kvsim
