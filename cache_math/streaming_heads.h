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
// Decay rule: the whole state decays by lambda once per decode step that has passed (lambda^(t -
// t_prev) when positions skip), and a token that leaves the recent window at step t is folded in
// with weight 1 after that step's decay. So a token folded at step t and read at step t' weighs
// lambda^(t' - t); with recent = R a token at position j is folded at step j + R and weighs
// lambda^(t' - j - R) at step t'.
// The state is only read by output(), so the tokens folded since the last read wait beside it and
// enter together when it is read: S = lambda^(t - t_read) S + sum_j lambda^(t - t_j) phi(k_j) v_j^T,
// one matrix product instead of a pass over S per step. The sum is the rule above; its rounding
// depends on how often the state is read (one token at a time where every step is read, as the
// runtime and an unsampled replay read it: the same bits in both).
//
// Output for a query q (scores s_j = q.k_j / sqrt(d) over the exact set E, m = max s_j):
//     p_j = exp(s_j - m) / sum_E exp(s_i - m)          softmax among the exact tokens
//     K_E = sum_E phi(q).phi(k_j) = phi(q).sum_E phi(k_j)  kernel mass of the exact tokens
//     o   = (K_E * sum_E p_j v_j + S^T phi(q)) / (K_E + z.phi(q))
// Why this mix: the exact tokens keep their softmax distribution among themselves, and the split
// of mass between exact and folded tokens follows the kernel scores phi(q).phi(k), the only scale
// on which the folded tokens' mass z.phi(q) is known. Nothing folded gives exact softmax attention;
// an empty exact set gives the linear readout S^T phi(q) / max(z.phi(q), 1e-6).
#pragma once
#include <cmath>
#include <cstdint>
#include <span>
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

// phi(x) = elu(x) + 1, written as exp(x) for x <= 0 so tiny values do not cancel to 0. The state
// uses streaming_features below; this one element at a time, with std::exp, is what the tests'
// reference computation uses.
inline double streaming_feature(double x) { return x > 0.0 ? x + 1.0 : std::exp(x); }

// The same of n elements in vector code: exp(min(x, 0)) + max(x, 0), which is x + 1 for x > 0 and
// exp(x) otherwise. Every element takes the same path, eight at a time, so its bits depend on its
// value alone; the exponentials are Eigen's, within an ulp or two of std::exp's.
void streaming_features(const double* x, double* phi, std::size_t n);

class StreamingHeadState {
public:
    static constexpr double kLinearEps = 1e-6;  // floor of z.phi(q) in the pure linear readout
    static constexpr int kMaxWaiting = 32;      // folded tokens held beside the state before they enter

    StreamingHeadState(int head_dim, const StreamingHeadParams& params);

    // Step t: admit token t's key/value (d floats each) into the exact window; whatever leaves the
    // window is folded into the state (decay applied first). Positions must strictly increase
    // (std::invalid_argument otherwise); the first `sinks` tokens admitted become the sinks.
    void admit(int64_t t, const float* k, const float* v);

    // The head's attention output at the current step for each query of a group (d floats each),
    // into out (queries.size() * d floats, query by query). With recent >= 1 the current token is
    // in the window. Zeros before anything is admitted. The queries share the state's read and
    // the exact tokens' keys and values, so a group is one call.
    void output(std::span<const float* const> queries, float* out);
    void output(const float* q, float* out) { output(std::span<const float* const>(&q, 1), out); }

    // Positions held exactly (ascending): sinks then the recent window.
    std::vector<int64_t> exact_positions() const;

    // Bytes this head holds: exact tokens at fp16 (4*d bytes per token for K+V) plus the state
    // (d*d + d floats at fp32, counted from construction on since it is a fixed allocation).
    double bytes() const;

    int head_dim() const { return dim_; }
    const StreamingHeadParams& params() const { return params_; }
    int64_t folded_tokens() const { return folded_; }
    // The state S and z as of the last admit() (the waiting tokens enter first); kept in double so
    // long decays do not lose precision (bytes() still counts the fp32 footprint a deployment would
    // hold).
    Eigen::MatrixXd state_matrix();
    const Eigen::VectorXd& state_normaliser();

private:
    // Brings S and z to the last admitted step: the decay since they were last brought there,
    // then every waiting token at its own decay.
    void enter_waiting();

    int dim_;
    StreamingHeadParams params_;
    // S kept as S^T (d x d): output() reads S^T phi(q), a product that walks S^T by column.
    Eigen::MatrixXd state_transposed_;
    Eigen::VectorXd normaliser_;  // z, d
    int64_t state_step_ = -1;     // the step S and z stand at (meaningful once entered_ > 0)
    int64_t entered_ = 0;         // tokens in S and z
    // Exact tokens in slots, in double (each a float widened exactly): the sinks in slots [0,
    // sinks) in admission order, then the recent window as a ring in [sinks, sinks + recent). So
    // the tokens held are always the first sink_count_ + recent_count_ slots. Keys by row (a
    // slot's key is row `slot`: the scores are one product with the query), values by column.
    Eigen::MatrixXd exact_keys_, exact_values_;
    // phi of each exact token's key, a column a slot: computed once on arrival.
    Eigen::MatrixXd exact_phi_;
    std::vector<int64_t> exact_positions_;  // slot -> position
    int sink_count_ = 0;
    int recent_head_ = 0;  // ring slot (from 0) of the oldest recent token
    int recent_count_ = 0;
    int64_t last_position_ = -1;
    int64_t folded_ = 0;
    // Tokens folded but not yet in S: phi(k) and v a column each, the step each was folded at.
    Eigen::MatrixXd waiting_phi_, waiting_values_;
    std::vector<int64_t> waiting_steps_;
    int waiting_ = 0;
    // Scratch of admit() and output(), sized once per group size: a decode step allocates nothing.
    Eigen::ArrayXXd key_, phi_key_;
    Eigen::MatrixXd queries_, phi_queries_, linear_num_, scores_, weights_, softmax_acc_;
    Eigen::VectorXd phi_sum_;
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
