// Fewer dimensions per token: low-rank K/V latents (Palu, Eigen Attention, LoRC; a joint latent
// across a layer's KV heads as in DeepSeek's multi-head latent attention) and KV-head grouping
// (MHA to GQA/MQA by mean-pooling heads). The bases are fitted once from the fitting sequences,
// written to a file, and read by the `lowrank` and `group_heads` policies; the replay and
// `kvsim eval` then attend to the K and V the cache reconstructs.
#pragma once
#include <Eigen/Core>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache_math/qkv_layer.h"
#include "cache_math/tier_format.h"
#include "cache_math/rope.h"

namespace kvsim {

struct TierArrays;  // cache_math/tiers.h

// Principal directions of a set of vectors, centred: the eigenvectors of their covariance, columns
// by descending eigenvalue, each of unit length, and their mean. The cache stores c = B^T (x - mean)
// and attends to mean + B c. Centred, because keys share a large common direction (on stories260K
// the uncentred first component holds 72 to 80% of a head's key energy) that adds the same amount to
// every logit of a query and so moves no attention weight: an uncentred basis spends its first
// rank on it and drops directions that do (on stories260K centring changed the output error
// little, 0.662 to 0.660 at key rank 7). The mean costs n numbers per head once, not per token.
struct PcaBasis {
    Eigen::MatrixXd vectors;  // n x n
    Eigen::VectorXd energy;   // n eigenvalues of the covariance, descending (>= 0 up to rounding)
    Eigen::VectorXd mean;     // n
};
// The basis of a covariance matrix (vectors and energy; mean left empty).
PcaBasis pca_from_second_moment(const Eigen::MatrixXd& second_moment);

// What a fit writes and the policies read: per (layer, KV head) bases of keys and values (head
// size square), per layer joint bases over the layer's KV heads concatenated (num_kv_heads x head
// size square), and per layer the pairwise distance between KV heads that a fitted grouping uses.
struct KvBases {
    int num_layers = 0, num_kv_heads = 0, head_dim = 0;
    // What the key bases were fitted on: the keys as recorded (post_rope), or before RoPE
    // (pre_rope; `rope` then rotates reconstructed keys into place and recorded keys back).
    std::string keys = "post_rope";
    Rope rope;  // pre_rope only
    std::vector<PcaBasis> key, value;             // per layer * num_kv_heads + kv
    std::vector<PcaBasis> joint_key, joint_value; // per layer; empty when fitted without (KeyFrame... joint)
    std::vector<Eigen::MatrixXd> head_distance;   // per layer: num_kv_heads square, symmetric, zero diagonal
    std::vector<int> fitted_sequences;            // trace indices the bases were fitted on
};

// Accumulates second moments and head distances layer by layer over the fitting sequences.
class KvBasesFitter {
public:
    // A known `rope`: key bases are fitted before RoPE (Palu's way): on the keys recorded before
    // RoPE where add() is given them, else on the recorded keys rotated back.
    // joint = false leaves the joint bases out: a joint latent over 8 KV heads of 128 is 1,024 wide,
    // and its bases (two 1,024-square matrices per layer) outweigh every per-head basis together.
    KvBasesFitter(int num_layers, int num_kv_heads, int head_dim, Rope rope = {}, bool joint = true);
    // Every token of one sequence's layer; keys_before_rope: the trace's k_pre_rope of it, if any.
    void add(int layer, const QkvLayer& data, const std::vector<float>* keys_before_rope = nullptr);
    KvBases finish(std::vector<int> fitted_sequences) const;

private:
    int layers_, heads_, dim_;
    Rope rope_;
    bool joint_;
    std::vector<Eigen::MatrixXd> key_moment_, value_moment_, joint_key_moment_, joint_value_moment_;
    std::vector<Eigen::VectorXd> key_sum_, value_sum_;    // per layer: summed rows (every head's)
    std::vector<Eigen::MatrixXd> key_diff_, value_diff_;  // per layer: summed |x_a - x_b|^2
    std::vector<Eigen::VectorXd> key_norm_, value_norm_;  // per layer: summed |x_a|^2 per head
    std::vector<int64_t> tokens_;                         // per layer
};

// The bases file comes in two forms holding the same numbers and attributes (docs/lowrank.md):
// JSON, and HDF5 (float64 datasets; 38% of the JSON's bytes at the Llama-3.2-1B shape).
enum class KvBasesFormat { json, hdf5 };
// The form a path asks for: hdf5 for a name ending .h5 or .hdf5, else json.
KvBasesFormat kv_bases_format_of(const std::string& path);
// Writes the bases (atomically) in the form kv_bases_format_of(path) names; reads them back in
// either form, told apart by HDF5's signature (not the name), validating every shape against the
// trace's (num_layers, num_kv_heads, head_dim): InputError naming the file and the key, dataset
// or attribute. Reads are cached by path for the process, since every (layer, KV head) stream of a
// run asks for the file.
void write_kv_bases(const std::string& path, const KvBases& bases);
std::string kv_bases_json(const KvBases& bases);  // the JSON form's text
std::string kv_bases_hdf5(const KvBases& bases);  // the HDF5 form's bytes
std::string kv_bases_file(const KvBases& bases, KvBasesFormat format);
// The numbers a bases file holds (vectors, energies, means and distances).
int64_t kv_bases_numbers(const KvBases& bases);
// Where a search (search.ranks.bases_format: auto) writes HDF5 rather than JSON: past a million
// numbers, about 24 MB of JSON (stories260K's bases hold 14 thousand; the 1B shape's 33.6 million).
inline constexpr int64_t kAutoHdf5BasesNumbers = 1000000;
std::shared_ptr<const KvBases> load_kv_bases(const std::string& path, int num_layers, int num_kv_heads, int head_dim);
// The file read and checked as load_kv_bases reads it, every time (no cache), with its own shape.
std::shared_ptr<const KvBases> read_kv_bases(const std::string& path);

// Ranks fitted per (layer, KV head), or per layer for a joint latent: what kvsim search writes
// (ranks.json) and the lowrank policy's `ranks` file reads, validated against the trace's shape.
struct FittedRanks {
    bool joint = false;
    std::vector<int> key_rank, value_rank;  // per layer * num_kv_heads + kv, or per layer (joint)
};
void write_fitted_ranks(const std::string& path, const FittedRanks& ranks, int num_layers, int num_kv_heads,
                        int head_dim);
std::string fitted_ranks_json(const FittedRanks& ranks, int num_layers, int num_kv_heads, int head_dim);
FittedRanks load_fitted_ranks(const std::string& path, int num_layers, int num_kv_heads, int head_dim);

// Groups of `group_size` KV heads of one layer: contiguous (heads 0..g-1, g..2g-1, ...) without a
// distance matrix; with one, greedily by similarity: the lowest-numbered free head takes the free
// heads nearest (by summed distance) to its group one at a time. Returns each head's group index.
std::vector<int> group_heads_of_layer(int num_kv_heads, int group_size, const Eigen::MatrixXd* distance);

// How a policy's cache holds each token in fewer numbers, and what it reconstructs.
struct KvProjection {
    enum class Kind : uint8_t { low_rank, joint_low_rank, grouping };
    Kind kind = Kind::low_rank;
    std::shared_ptr<const KvBases> bases;  // low rank (null only for contiguous grouping)
    // low_rank: per layer * num_kv_heads + kv; joint_low_rank: per layer (latent width).
    std::vector<int> key_rank, value_rank;
    int group_size = 1;      // grouping: KV heads sharing one K and V
    bool fitted_groups = false;  // grouping: by head distance (bases) rather than contiguous
    bool operator==(const KvProjection& o) const {
        return kind == o.kind && bases == o.bases && key_rank == o.key_rank && value_rank == o.value_rank &&
               group_size == o.group_size && fitted_groups == o.fitted_groups;
    }

    // Numbers a token's key (value) takes in the cache, and the share of them one KV head of the
    // layer carries (a joint latent is shared by the layer's heads, a grouped K/V by the group).
    int stored_key_dim(int layer, int kv, int head_dim) const;
    int stored_value_dim(int layer, int kv, int head_dim) const;
    double share(int num_kv_heads) const;
    // The up-projections this KV head's cache needs, at fp16, its share of a joint basis: memory
    // held whatever the context, so the harness counts it once per step (amortised over context).
    double basis_bytes(int layer, int kv, int num_kv_heads, int head_dim) const;
};

// Checks ranks against the head size (or the joint width): an empty string when fine, else what is
// wrong, naming `what` ("key_rank").
std::string check_rank(int rank, int most, const std::string& what);

// The latents of `count` tokens' keys (key) or values, rows of num_kv_heads * head_dim floats in
// and out: per head its first rank coordinates, the rest zero; a joint latent's first rank
// coordinates of the row; for grouping, each head's slot holds its group's mean.
// Keys of pre-RoPE bases are rotated back first (the tokens sit at positions first_pos, ...).
void project_tokens(const KvProjection& p, int layer, int num_kv_heads, int head_dim, bool key, const float* x,
                    float* latent, int64_t count, int64_t first_pos = 0);
// Keys (values) reconstructed from latents laid out as project_tokens writes them. With
// `original`, a head at full rank (or a joint latent at the layer's width) is copied from it: a
// cache that keeps every dimension stores the vectors themselves.
// Keys of pre-RoPE bases are rotated by RoPE after reconstruction.
void reconstruct_tokens(const KvProjection& p, int layer, int num_kv_heads, int head_dim, bool key,
                        const float* latent, const float* original, float* out, int64_t count, int64_t first_pos = 0);

// The latent coordinates of one layer's K and V ([token][kv][d] each, the first rank coordinates of
// each head, the rest zero; for a joint latent [token][kv * d] with the first rank coordinates
// set): what the cache stores, before any quantisation.
void project_layer(const KvProjection& p, int layer, const QkvLayer& data, int num_kv_heads, int head_dim,
                   std::vector<float>& key_latent, std::vector<float>& value_latent);
// K and V reconstructed from latents laid out as project_layer writes them.
void reconstruct_layer(const KvProjection& p, int layer, int64_t tokens, int num_kv_heads, int head_dim,
                       const std::vector<float>& key_latent, const std::vector<float>& value_latent,
                       std::vector<float>& key_out, std::vector<float>& value_out);

// The tiers a projected cache serves for one layer: the reconstruction of its latents (or of its
// group means) at fp16, and where `format` is given, of its int8 and int4 forms, which quantise the
// latents themselves (what the cache stores). A head kept at full rank without a joint latent is
// its own values (a rotation stores nothing less), so its fp16 tier is exact.
void build_projected_arrays(const KvProjection& p, int layer, const QkvLayer& data, int num_kv_heads, int head_dim,
                            const TierFormat* format, TierArrays& arrays);

// The grouping of one layer's heads a projection uses.
std::vector<int> projection_groups(const KvProjection& p, int layer, int num_kv_heads);

}  // namespace kvsim
