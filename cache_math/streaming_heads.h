// Streaming heads: a KV head that keeps only a few sink tokens and a recent window exactly and
// folds every token that leaves the window into a fixed-size decayed linear-attention state.
// Head split after DuoAttention (Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM
// Inference with Retrieval and Streaming Heads"); the state is linear attention (Katharopoulos et
// al. 2020, "Transformers are RNNs") with the per-step decay of RetNet / Lightning Attention.
//
// Per (layer, KV head) with head size d, the state after folding token j at decode step t is
//     S_t = lambda^(t - t_prev) * S_prev + phi(k_j) v_j^T      (d x d)
//     z_t = lambda^(t - t_prev) * z_prev + phi(k_j)            (d)
//     phi(x) = elu(x) + 1 elementwise (x + 1 for x > 0, exp(x) otherwise), so phi > 0.
// Decay rule: on every admit() the whole state is multiplied by lambda once per decode step that
// has passed (lambda^(t - t_prev) when positions skip), and only THEN is the token that leaves the
// recent window at this step folded in with weight 1. So a token folded at step t and read at step
// t' weighs lambda^(t' - t); with recent = R a token at position j is folded at step j + R and
// weighs lambda^(t' - j - R) at step t'.
//
// Output for a query q (scores s_j = q.k_j / sqrt(d) over the exact set E, m = max s_j):
//     p_j = exp(s_j - m) / sum_E exp(s_i - m)          softmax among the exact tokens
//     K_E = sum_E phi(q).phi(k_j)                        kernel mass of the exact tokens
//     o   = (K_E * sum_E p_j v_j + S^T phi(q)) / (K_E + z.phi(q))
// Why this mix: the exact tokens keep their softmax distribution among themselves, and the split
// of mass between exact and folded tokens follows the kernel scores phi(q).phi(k), the only scale
// on which the folded tokens' mass z.phi(q) is known. Nothing folded gives exact softmax attention;
// an empty exact set gives the linear readout S^T phi(q) / max(z.phi(q), 1e-6).
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <Eigen/Dense>

namespace kvsim {

struct StreamingHeadParams {
    int sinks = 4;        // first tokens kept exactly for the whole sequence (attention sinks)
    int recent = 64;      // most recent tokens kept exactly; 0 folds each token at its own step
    double lambda = 0.99;  // per-step decay of the linear state, in [0, 1]
};

// Throws kvsim::InputError when sinks < 0, recent < 0 or lambda is outside [0, 1].
void validate_streaming_params(const StreamingHeadParams& params);

// phi(x) = elu(x) + 1, written as exp(x) for x <= 0 so tiny values do not cancel to 0.
inline double streaming_feature(double x) { return x > 0.0 ? x + 1.0 : std::exp(x); }

class StreamingHeadState {
public:
    static constexpr double kLinearEps = 1e-6;  // floor of z.phi(q) in the pure linear readout

    StreamingHeadState(int head_dim, const StreamingHeadParams& params);

    // Step t: admit token t's key/value (d floats each) into the exact window; fold whatever
    // leaves the window into the state, decay applied first. Positions must strictly increase
    // (std::invalid_argument otherwise); the first `sinks` tokens admitted become the sinks.
    void admit(int64_t t, const float* k, const float* v);

    // The head's attention output for query q (d floats) at the current step, into out (d floats).
    // With recent >= 1 the current token is in the window. Zeros before anything is admitted.
    void output(const float* q, float* out) const;

    // Positions held exactly (ascending): sinks then the recent window.
    std::vector<int64_t> exact_positions() const;

    // Bytes this head holds: exact tokens at fp16 (4*d bytes per token for K+V) plus the state
    // (d*d + d floats at fp32, counted from construction on since it is a fixed allocation).
    double bytes() const;

    int head_dim() const { return dim_; }
    const StreamingHeadParams& params() const { return params_; }
    int64_t folded_tokens() const { return folded_; }
    // The state as of the last admit(); kept in double so long decays do not lose precision
    // (bytes() still counts the fp32 footprint a deployment would hold).
    const Eigen::MatrixXd& state_matrix() const { return state_; }
    const Eigen::VectorXd& state_normaliser() const { return normaliser_; }

private:
    // Folds a token into the state: phi(k) given (an exact token's, computed when it arrived).
    void fold(const Eigen::Ref<const Eigen::VectorXd>& phi_k, const float* v);

    int dim_;
    StreamingHeadParams params_;
    Eigen::MatrixXd state_;       // S, d x d
    Eigen::VectorXd normaliser_;  // z, d
    // Exact tokens, one column each: sinks in admission order, recent as a ring buffer.
    Eigen::MatrixXf sink_keys_, sink_values_;
    std::vector<int64_t> sink_positions_;
    Eigen::MatrixXf recent_keys_, recent_values_;
    // phi of each exact token's key, by the same columns: computed once on arrival, where output()
    // took d exponentials per exact token at every step.
    Eigen::MatrixXd sink_phi_, recent_phi_;
    std::vector<int64_t> recent_positions_;  // ring slot -> position
    int recent_head_ = 0;                    // ring slot of the oldest recent token
    int recent_count_ = 0;
    int64_t last_position_ = -1;
    int64_t folded_ = 0;
    // Scratch of output() and fold(), sized once: a decode step allocates nothing.
    mutable Eigen::VectorXd query_, phi_q_, linear_num_, key_, softmax_acc_, phi_k_;
    mutable std::vector<double> scores_;
};

// Per-(layer, KV head) plan: which heads stream, each head's lambda, and which streaming heads
// keep no linear state at all (sinks and the recent window only, DuoAttention's own streaming
// heads), all indexed [layer * num_kv_heads + kv]. Retrieval heads keep their full cache; their
// lambda and stateless flag are unused, as a stateless head's lambda is.
struct StreamingPlan {
    int num_layers = 0, num_kv_heads = 0;
    std::vector<uint8_t> streaming;
    std::vector<double> lambda;
    std::vector<uint8_t> stateless;  // empty: every streaming head keeps its state

    bool is_streaming(int layer, int kv) const;
    double lambda_of(int layer, int kv) const;
    bool is_stateless(int layer, int kv) const;
    int64_t streaming_count() const;
};

// A DuoAttention pattern file (full_attention_heads.tsv): one row per layer, one tab-separated
// gate value per KV head. A gate > threshold keeps the head a retrieval head with its full cache;
// otherwise it streams with default_lambda. Blank trailing lines and trailing whitespace are fine.
// Throws kvsim::InputError, one line naming the file: missing file, a non-numeric cell, or a row
// or column count that disagrees with the model.
// A streaming-head profile (YAML, what a search fits and exports):
//   streaming: [[1, 0, ...], ...]   one row per layer, 1 = the KV head streams, 0 = it retrieves
//   lambda: 0.95 | [[0.99, ...], ...]  one decay for all, or one per (layer, KV head); default default_lambda
//   stateless: [[1, 0, ...], ...]   optional: 1 = the streaming head keeps no state (sinks and window only)
// Throws kvsim::InputError, one line naming the file and the key, for a shape that disagrees with
// the model, a value that is not 0/1, or a lambda outside [0, 1].
StreamingPlan load_streaming_profile(const std::string& path, int num_layers, int num_kv_heads,
                                     double default_lambda);

StreamingPlan load_duo_attention_pattern(const std::string& path, int num_layers, int num_kv_heads,
                                         double default_lambda, double threshold = 0.5);
// The pattern file's gates as written, [layer * num_kv_heads + kv]: what ranks heads by how much
// DuoAttention's training wanted them to keep their cache. The same checks as above.
std::vector<double> load_duo_attention_gates(const std::string& path, int num_layers, int num_kv_heads);

}  // namespace kvsim
