// A readable fp32 CPU forward pass for Llama-architecture GGUF models, in the spirit of
// llama2.c's run.c (Karpathy): RMSNorm, rotary position embedding (RoPE), grouped-query
// attention over the model's own KV cache, SwiGLU feed-forward, tied or separate classifier.
// Matrix products use Eigen; a chunk of tokens is processed with matrix-matrix products.
// Two GGUF architectures share it: `llama` (Llama 1-3, Mistral, SmolLM; Llama 3.1's RoPE
// frequency scaling) and `qwen2` (biases on Q, K and V, RoPE over the two halves of a head).
//
// References: Touvron et al. 2023, "Llama 2" (architecture); Zhang & Sennrich 2019 (RMSNorm);
// Su et al. 2021, "RoFormer" (RoPE); Ainslie et al. 2023, "GQA"; Shazeer 2020 (SwiGLU);
// Meta 2024, "The Llama 3 Herd of Models" and its reference code (RoPE frequency scaling);
// Qwen team 2024, "Qwen2 Technical Report".
#pragma once

#include <Eigen/Core>
#include <cstdint>

#include "base/errors.h"
#include "cache_math/rope.h"
#include "model/weight_matrix.h"
#include <span>
#include <string>
#include <vector>

namespace kvsim::model {

class GgufFile;

using kvsim::RopePairing;  // cache_math/rope.h: which elements of a head RoPE rotates together

// RoPE frequency scaling from the metadata (`<arch>.rope.scaling.*`). A `rope_freqs.weight`
// tensor, as llama.cpp's converter writes for Llama 3.1, divides the frequencies further
// (LlamaModel::load), replacing llama3 metadata (kvsim's older dialect of the same scaling).
struct RopeScaling {
    enum class Kind { none, linear, llama3 } kind = Kind::none;
    double factor = 1.0;            // rope.scaling.factor
    double low_freq_factor = 1.0;   // rope.scaling.low_freq_factor (llama3)
    double high_freq_factor = 4.0;  // rope.scaling.high_freq_factor (llama3)
    int original_context = 0;       // rope.scaling.original_context_length (llama3)
};

struct LlamaConfig {
    // The metadata keys below are read under the architecture's prefix ("llama.", "qwen2.").
    std::string architecture = "llama";  // general.architecture
    int dim = 0;             // residual stream width (llama.embedding_length)
    int hidden_dim = 0;      // SwiGLU width (llama.feed_forward_length)
    int n_layers = 0;        // llama.block_count
    int n_heads = 0;         // query heads (llama.attention.head_count)
    int n_kv_heads = 0;      // key/value heads (llama.attention.head_count_kv; GQA when < n_heads)
    int head_dim = 0;        // llama.attention.key_length, else dim / n_heads
    int vocab_size = 0;      // rows of token_embd.weight
    int context_length = 0;  // llama.context_length
    float rope_theta = 10000.0f;  // llama.rope.freq_base
    float norm_eps = 1e-5f;       // llama.attention.layer_norm_rms_epsilon
    RopePairing rope_pairing = RopePairing::adjacent;  // halves for qwen2
    RopeScaling rope_scaling;
    bool qkv_bias = false;  // blk.N.attn_{q,k,v}.bias present (required for qwen2)
    // llama.attention.sliding_window (Mistral): 0 when absent. Recorded, not applied: kvsim
    // captures full attention (as llama.cpp runs such files), and the window goes into the
    // trace's provenance.
    int sliding_window = 0;

    // Per RoPE pair i < head_dim/2: the rotation's angular frequency (radians per position),
    // rope_theta^(-2i/head_dim) divided by the scaling's factor for that pair.
    std::vector<double> rope_frequencies() const;

    // from_gguf checks that both fit in an int.
    int q_dim() const { return n_heads * head_dim; }
    int kv_dim() const { return n_kv_heads * head_dim; }
    // Weights in the model, counting the classifier once more when it is not tied.
    int64_t parameter_count(bool tied_output) const;
    // Multiply-adds x2 of the weight matrix products for one token (classifier included),
    // excluding attention over the cache.
    int64_t matmul_flops_per_token() const;
    // Multiply-adds x2 of forward_batch over `tokens` positions from start_pos: the weight products
    // (the classifier only with logits) and attention's q·k and weights·v over the positions each
    // token sees.
    double chunk_flops(int start_pos, int tokens, bool logits) const;

    // Reads and range-checks the llama.* metadata and checks that every weight tensor the model
    // needs is present with the shape the metadata implies; throws InputError naming the file and
    // the key or tensor. Reads no tensor data.
    static LlamaConfig from_gguf(const GgufFile& file);
};

// The forward pass met a value that is not finite (NaN or infinity) at a layer and position, in
// the query, key or value, the attention scores, or the logits. Nothing past that position has
// been computed; what follows from such a value would be meaningless (and a policy shown NaN
// attention has no defined order to keep positions in), so it is bad input: the model file's
// weights with this text. layer is -1 for the logits.
class NonFiniteError : public InputError {
  public:
    NonFiniteError(const std::string& model_path, const std::string& quantity, int layer, int position);

    const std::string& model_path() const { return model_path_; }
    const std::string& quantity() const { return quantity_; }  // "query", "attention scores", "logits", ...
    int layer() const { return layer_; }
    int position() const { return position_; }

    // The same error naming the sequence too: "<model>: <sequence>, layer 3, position 17: ...".
    InputError in_sequence(const std::string& sequence) const;

  private:
    std::string model_path_, quantity_;
    int layer_, position_;
};

// Lets a caller observe and control the model's own KV cache. Hooks are called on the thread
// that called forward()/forward_batch(), one call at a time.
struct ForwardHooks {
    virtual ~ForwardHooks() = default;
    // Called once per layer per token, after RoPE, before the K/V rows are stored in the cache.
    // q: [n_heads*head_dim], k, v: [n_kv_heads*head_dim], head after head. q, k and v may be
    // modified in place (e.g. quantised): what is left is what attention uses and the cache stores.
    virtual void after_qkv(int layer, int pos, float* q, float* k, float* v) {
        (void)layer, (void)pos, (void)q, (void)k, (void)v;
    }
    // Called once per layer per token before RoPE with the key row (n_kv_heads*head_dim), for a
    // capture that records keys as they were before rotation (read only).
    virtual void before_rope(int layer, int pos, const float* k) { (void)layer, (void)pos, (void)k; }
    // Positions that this layer's KV head may attend to at this step: nullptr = all 0..pos; else a
    // mask of length pos+1 (1 = kept), read before the next hook call. Masked positions are left out
    // of the softmax (renormalised over kept ones); if none is kept the head's output is zero.
    virtual const uint8_t* attention_mask(int layer, int kv_head, int pos) {
        (void)layer, (void)kv_head, (void)pos;
        return nullptr;
    }
    // Called after the model's own attention for each position and KV head: q holds the group's
    // query heads (heads_per_kv_head * head_dim floats) and out their attention outputs. A hook
    // that simulates a cache the model cannot hold (quantised keys and values, a streaming head's
    // linear state) writes its own outputs into out and returns true.
    virtual bool attention_output(int layer, int kv_head, int pos, const float* q, float* out) {
        (void)layer, (void)kv_head, (void)pos, (void)q, (void)out;
        return false;
    }
    // A hook that holds the whole KV cache itself (kvsim's runtime) returns true: the model then
    // neither stores K and V nor attends, and every attention output comes from attention_output.
    virtual bool holds_the_cache() const { return false; }
};

// Not thread-safe: one sequence at a time per model object. Large matrix products and attention
// heads run on TBB's worker threads (limit them with tbb::global_control).
class LlamaModel {
  public:
    using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

    // Loads weights (F32 as they are; other types kept in the file's encoding and decoded tile by
    // tile inside the matrix products, see weight_matrix.h) and allocates a KV cache for the GGUF's context_length,
    // or for max_context positions when 0 < max_context < context_length: pass the positions
    // actually needed, since a header may claim a context of 2^31 positions. Throws InputError
    // naming the file and the key or tensor: a tensor whose weights are not all finite, or a plan
    // (weights, KV cache) over the memory limit (base/size_limits.h), before allocating it.
    static LlamaModel load(const std::string& path, int max_context = 0);
    static LlamaModel load(const GgufFile& file, int max_context = 0);

    const std::string& path() const { return path_; }
    const LlamaConfig& config() const { return config_; }
    // The RoPE this model applies: its pairing and per-pair frequencies (from the metadata, or
    // rope_freqs.weight), as a capture records it in the trace.
    const Rope& rope() const { return rope_; }
    int max_positions() const { return max_positions_; }  // positions the KV cache holds
    bool tied_output() const { return tied_output_; }
    // Bytes the weights, RoPE tables and KV cache take, the cache counted whether or not it has
    // been allocated yet (a model allocates it at its first forward pass).
    uint64_t memory_bytes() const;
    // Bytes of the weight matrices alone: copies of a model share them, so a copy costs
    // memory_bytes() - weight_bytes().
    uint64_t weight_bytes() const;

    // Runs one token at position pos through the model, using and extending its KV cache; returns
    // the logits (vocab_size floats, valid until the next call). Throws NonFiniteError when the
    // query, key or value of a position (checked before after_qkv sees them), its attention
    // scores or its logits are not finite. Positions 0..pos-1 must already be
    // in the cache (pos <= the next free position); running an earlier pos again rewinds to it.
    const float* forward(int token, int pos, ForwardHooks* hooks = nullptr);

    // Runs tokens at positions start_pos, start_pos+1, ... as one chunk (matrix-matrix products);
    // returns logits [tokens.size()][vocab_size], row-major, valid until the next call. The result
    // equals calling forward() token by token. Hook calls for a layer come in the same order as
    // with forward() (per position: after_qkv, then attention_mask for each KV head), but layer by
    // layer: layer 0 for every token of the chunk, then layer 1, and so on. With logits false
    // the classifier is not run (a capture of Q/K/V needs none) and it returns nullptr.
    const float* forward_batch(std::span<const int> tokens, int start_pos, ForwardHooks* hooks = nullptr,
                               bool logits = true);

    void reset();  // clears the KV cache for a new sequence

    // Teacher-forced summed negative log-likelihood (nats) of tokens[1..] given their prefixes,
    // tokens[0] being BOS; log-softmax in double. Resets the cache first and runs chunks of
    // chunk_size tokens through forward_batch (chunk_size 1: strictly token by token). With
    // token_nll, each predicted token's NLL too (tokens.size() - 1 of them, tokens[1] first): a
    // part of the sequence (a prompt's continuation) is scored from them.
    double sequence_nll(const std::vector<int>& tokens, ForwardHooks* hooks = nullptr, int chunk_size = 128,
                        std::vector<double>* token_nll = nullptr);

    // The cached key / value (head_dim floats) of a layer, KV head and position already stored:
    // inside forward_batch, a hook may read the chunk's earlier positions of the current layer.
    const float* cached_key(int layer, int kv_head, int pos) const;
    const float* cached_value(int layer, int kv_head, int pos) const;
    // The keys of positions first..first+count-1: count rows of head_dim floats, one after another.
    const float* cached_keys(int layer, int kv_head, int first, int count) const {
        cached_key(layer, kv_head, first + count - 1);  // throws unless every one is stored
        return cached_key(layer, kv_head, first);
    }

  private:
    struct Layer {
        Eigen::VectorXf attn_norm, ffn_norm;  // RMSNorm gains [dim]
        WeightMatrix wq, wk, wv, wo;          // [q_dim][dim], [kv_dim][dim] x2, [dim][q_dim]
        WeightMatrix w_gate, w_up, w_down;    // [hidden][dim] x2, [dim][hidden]
        Eigen::RowVectorXf bq, bk, bv;        // Q/K/V biases when config.qkv_bias, else empty
    };

    LlamaModel() = default;
    const WeightMatrix& classifier() const { return tied_output_ ? token_embedding_ : output_; }
    // Sizes the chunk's activations for n_tokens rows and `slots` score buffers (at least what
    // they hold now), checked against the memory limit first.
    void ensure_chunk_capacity(int n_tokens, int slots);
    // Score buffers attention uses at once: one per worker thread, at most one per query head.
    int score_slots() const;
    void attention(int layer, int n_tokens, int start_pos, ForwardHooks* hooks);
    size_t cache_offset(int layer, int kv_head, int pos) const;

    std::string path_;
    LlamaConfig config_;
    int max_positions_ = 0;
    int next_pos_ = 0;  // first position not yet in the cache
    std::vector<int> cached_positions_;  // per layer: positions 0..N-1 hold this forward pass's K and V
    bool tied_output_ = false;

    WeightMatrix token_embedding_;  // [vocab][dim]
    std::vector<Layer> layers_;
    Eigen::VectorXf output_norm_;
    WeightMatrix output_;  // [vocab][dim]; empty when tied to token_embedding_

    // RoPE rotation of pair i at position p: rope_cos_(p, i), rope_sin_(p, i).
    RowMatrix rope_cos_, rope_sin_;
    Rope rope_;  // the pairing and per-pair frequencies the tables were computed from

    // KV cache: [layer][kv_head][position][head_dim], so one head's keys are one contiguous matrix.
    // Allocated by the first forward pass: a copy of a model not yet run costs little.
    std::vector<float> key_cache_, value_cache_;
    size_t cache_floats() const;

    // Activations for a chunk of tokens, one row per token (capacity grows with the chunk size).
    int chunk_capacity_ = 0;
    RowMatrix x_, xb_, q_, k_, v_, attn_out_, gate_, up_, logits_;
    std::vector<RowMatrix> scores_;          // per slot (score_slots()): [chunk][positions]
    std::vector<uint8_t> masks_;             // per KV head and chunk row: [positions], copied from hooks
    std::vector<uint8_t> has_mask_;          // per KV head and chunk row: 0 = attend to all
    std::vector<int> first_bad_row_;         // per query head: first chunk row with non-finite scores
};

}  // namespace kvsim::model
