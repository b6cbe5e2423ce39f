#include "src/capture.h"

#include <cstring>
#include <filesystem>

#include "src/model/llama.h"
#include "src/model/tokenizer.h"
#include "src/model_text.h"
#include "base/sha256.h"
#include "base/size_limits.h"

namespace kvsim {
namespace {

// Copies each layer's Q, K and V of every position into [token][head][d] buffers.
class QkvRecorder : public model::ForwardHooks {
public:
    QkvRecorder(const model::LlamaConfig& config, int tokens) : config_(config), layers_(config.n_layers) {
        for (QkvLayer& layer : layers_) {
            layer.tokens = tokens;
            layer.q.resize(static_cast<std::size_t>(tokens) * config.q_dim());
            layer.k.resize(static_cast<std::size_t>(tokens) * config.kv_dim());
            layer.v.resize(static_cast<std::size_t>(tokens) * config.kv_dim());
        }
    }
    void after_qkv(int layer, int pos, float* q, float* k, float* v) override {
        QkvLayer& out = layers_[layer];
        std::memcpy(out.q.data() + static_cast<std::size_t>(pos) * config_.q_dim(), q, config_.q_dim() * sizeof(float));
        std::memcpy(out.k.data() + static_cast<std::size_t>(pos) * config_.kv_dim(), k, config_.kv_dim() * sizeof(float));
        std::memcpy(out.v.data() + static_cast<std::size_t>(pos) * config_.kv_dim(), v, config_.kv_dim() * sizeof(float));
    }
    const QkvLayer& layer(int l) const { return layers_[l]; }

private:
    const model::LlamaConfig& config_;
    std::vector<QkvLayer> layers_;
};

}  // namespace

CaptureSummary capture_trace(const CaptureOptions& options) {
    LoadedInput loaded = load_model_input(options.input);
    model::LlamaModel& llama = loaded.model;
    const TokenizedText& text = loaded.text;
    const std::string& model_path = options.input.model_path;
    const model::LlamaConfig& c = llama.config();

    TraceMetadata m;
    m.kind = TraceKind::qkv;
    m.model_name = std::filesystem::path(model_path).stem().string();
    m.num_layers = c.n_layers;
    m.num_query_heads = c.n_heads;
    m.num_kv_heads = c.n_kv_heads;
    m.head_dim = c.head_dim;
    m.source_kind = "model";
    m.source_model_file = std::filesystem::path(model_path).filename().string();
    m.source_model_sha256 = sha256_file(model_path);
    m.source_text_sha256 = text.text_sha256;
    TraceWriter writer(options.output_path, m);

    CaptureSummary summary;
    for (std::size_t i = 0; i < text.sequences.size(); ++i) {
        const std::vector<int>& tokens = text.sequences[i];
        const std::string sequence_name = text.sequence_name(options.input.text_path, i);
        // Q, K and V of every layer and token, held until written, next to the model itself.
        const std::string what =
            model_path + ": Q/K/V of " + sequence_name + " (" + std::to_string(tokens.size()) + " tokens)";
        const uint64_t per_token_bytes = checked_mul(
            static_cast<uint64_t>(c.n_layers), (static_cast<uint64_t>(c.q_dim()) + 2ull * c.kv_dim()) * sizeof(float), what);
        check_memory(checked_add(checked_mul(per_token_bytes, tokens.size(), what), llama.memory_bytes(), what), what);
        QkvRecorder recorder(c, static_cast<int>(tokens.size()));
        llama.reset();
        try {
            llama.forward_batch(tokens, 0, &recorder);
        } catch (const model::NonFiniteError& error) {
            throw error.in_sequence(sequence_name);  // the trace is left unwritten
        }
        const int sequence = writer.add_sequence(TokenizedText::trace_sequence_name(options.input.text_path, i),
                                                 static_cast<int64_t>(tokens.size()));
        for (int layer = 0; layer < c.n_layers; ++layer)
            writer.write_qkv(sequence, layer, recorder.layer(layer), options.dtype);
        writer.write_tokens(sequence, std::vector<int32_t>(tokens.begin(), tokens.end()));
        ++summary.sequences;
        summary.tokens += static_cast<long>(tokens.size());
    }
    writer.commit();
    return summary;
}

}  // namespace kvsim
