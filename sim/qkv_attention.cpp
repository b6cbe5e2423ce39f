#include "sim/qkv_attention.h"

#include <tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <string>

#include "base/errors.h"
#include "base/size_limits.h"

namespace kvsim {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using StridedRows = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
using ColumnMajorKeys = Eigen::Map<const Eigen::MatrixXf, 0, Eigen::OuterStride<>>;

void keys_by_feature(const QkvLayer& layer, const QkvShape& shape, KeysByFeature& out) {
    const int hkv = shape.num_kv_heads, d = shape.head_dim;
    const int64_t tokens = static_cast<int64_t>(layer.k.size()) / (static_cast<int64_t>(hkv) * d);
    out.tokens = tokens;
    out.values.resize(layer.k.size());
    // Tiles of 64 tokens: a tile's rows of K and its columns of the copy stay in cache.
    constexpr int64_t kTile = 64;
    const int64_t tiles = (tokens + kTile - 1) / kTile;
    tbb::parallel_for(int64_t{0}, hkv * tiles, [&](int64_t job) {
        const int g = static_cast<int>(job / tiles);
        const int64_t from = job % tiles * kTile, to = std::min(tokens, from + kTile);
        float* head = out.values.data() + static_cast<int64_t>(g) * d * tokens;
        for (int i = 0; i < d; ++i)  // a run of the tile's tokens per feature: whole cache lines written
            for (int64_t j = from; j < to; ++j) head[i * tokens + j] = layer.k[(j * hkv + g) * d + i];
    });
}

void attention_from_qkv(const QkvLayer& layer, const QkvShape& shape, int64_t first_step, int64_t end_step,
                        AttentionBlock& block, const std::string& where) {
    KeysByFeature keys;
    keys_by_feature(layer, shape, keys);
    attention_from_qkv(layer, keys, shape, first_step, end_step, block, where);
}

void attention_from_qkv(const QkvLayer& layer, const KeysByFeature& keys, const QkvShape& shape, int64_t first_step,
                        int64_t end_step, AttentionBlock& block, const std::string& where, const RowVisitor* visit) {
    const int hq = shape.num_query_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
    const int group = hq / hkv;
    const int64_t rows = end_step - first_step;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    block.first_step = first_step;
    block.end_step = end_step;
    block.rows.resize(hq);
    block.self_weight.resize(hq);
    // Per head, the first step whose logits are not all finite (-1: none); reported after the
    // parallel loop, lowest head first, so the message does not depend on the threads.
    std::vector<int64_t> overflow(hq, -1);

    tbb::parallel_for(0, hq, [&](int h) {
        const int g = h / group;
        // Q rows of this head for the block's steps: a strided view into [token][head][d].
        const StridedRows q(layer.q.data() + first_step * hq * d + static_cast<int64_t>(h) * d, rows, d,
                            Eigen::OuterStride<>(static_cast<int64_t>(hq) * d));
        // A buffer that only grows: a matrix resized to each block's shape was freed and
        // allocated again every block, and the allocator handed its pages back and forth with the
        // kernel. Aligned as a matrix's storage is (the softmax's sums depend on where rows start).
        thread_local std::vector<float, Eigen::aligned_allocator<float>> score_storage;
        if (score_storage.size() < static_cast<std::size_t>(rows * end_step)) score_storage.resize(rows * end_step);
        Eigen::Map<RowMatrix, Eigen::AlignedMax> scores(score_storage.data(), rows, end_step);
        if (rows > 1) {
            // Its keys for positions 0..end-1 as a column-major matrix: Eigen packs them with
            // straight copies (from token-major rows it gathered a third of the products' time).
            // The packed values, and so every score's bits, are the same.
            const ColumnMajorKeys k(keys.values.data() + static_cast<int64_t>(g) * d * keys.tokens, end_step, d,
                                    Eigen::OuterStride<>(keys.tokens));
            scores.noalias() = (q * scale) * k.transpose();
        } else {
            // One row is a matrix-vector product, whose arithmetic depends on the storage order:
            // the token-major keys, as before.
            const StridedRows k(layer.k.data() + static_cast<int64_t>(g) * d, end_step, d,
                                Eigen::OuterStride<>(static_cast<int64_t>(hkv) * d));
            scores.noalias() = (q * scale) * k.transpose();
        }

        std::vector<float>& packed = block.rows[h];
        packed.resize(attention_row_offset(end_step) - attention_row_offset(first_step));
        block.self_weight[h].resize(rows);
        float* out = packed.data();
        for (int64_t i = 0; i < rows; ++i) {
            const int64_t t = first_step + i;
            auto row = scores.row(i).head(t + 1).array();  // causal: positions 0..t
            // Finite Q and K (the reader checks them) can still overflow q.k to +-Inf, and the
            // softmax would turn that into NaN. x - x is 0 exactly for every finite x and NaN
            // otherwise: one vectorised pass, cheap beside the head_dim-long products behind it.
            if (!((row - row).sum() == 0.0f)) {
                overflow[h] = t;
                return;
            }
            const float peak = row.maxCoeff();
            row = (row - peak).exp();
            const float inv_total = 1.0f / row.sum();
            Eigen::Map<Eigen::ArrayXf>(out, t) = row.head(t) * inv_total;
            block.self_weight[h][i] = row(t) * inv_total;
            if (visit) (*visit)(h, i, {out, static_cast<std::size_t>(t)});
            out += t;
        }
    });
    for (int h = 0; h < hq; ++h)
        if (overflow[h] >= 0)
            throw InputError((where.empty() ? std::string("Q/K attention") : where) + ", head " + std::to_string(h) +
                             ", step " + std::to_string(overflow[h]) +
                             ": an attention logit q.k/sqrt(head_dim) is not finite (Q and K are finite, but too "
                             "large: their product overflows float32)");
}

double attention_flops(const QkvShape& shape, int64_t first_step, int64_t end_step) {
    return 2.0 * shape.num_query_heads * static_cast<double>(end_step - first_step) * end_step * shape.head_dim;
}

int64_t QkvSource::block_floats(int64_t wanted) const {
    int64_t longest = 0;
    for (int64_t length : shape_.sequence_lengths) longest = std::max(longest, length);
    // Saturates rather than wraps for absurd shapes: the replay's memory plan then refuses them.
    const int64_t per_head = int64_t{64} * longest;  // lengths are at most 2^30
    const int64_t heads = std::max(shape_.num_query_heads, 1);
    return std::max(wanted, per_head > INT64_MAX / heads ? INT64_MAX : per_head * heads);
}

const QkvLayer& QkvSource::layer_data(int sequence, int layer) {
    if (sequence != loaded_sequence_ || layer != loaded_layer_) {
        loaded_sequence_ = loaded_layer_ = -1;  // what loaded_ holds until the load succeeds
        keys_current_ = false;
        load_layer(sequence, layer, loaded_);
        loaded_sequence_ = sequence;
        loaded_layer_ = layer;
    }
    return loaded_;
}

void QkvSource::read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block) {
    read_block(sequence, layer, first_step, end_step, block, nullptr);
}

void QkvSource::read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block,
                           const RowVisitor& visit) {
    const QkvLayer& data = layer_data(sequence, layer);
    if (!keys_current_) {
        keys_by_feature(data, qkv_, keys_);
        keys_current_ = true;
    }
    attention_from_qkv(data, keys_, qkv_, first_step, end_step, block,
                       description() + ": sequence " + shape_.sequence_names.at(sequence) + ", layer " +
                           std::to_string(layer),
                       visit ? &visit : nullptr);
}

namespace {

class QkvFileSource : public QkvSource {
public:
    QkvFileSource(std::unique_ptr<TraceReader> reader, int64_t max_steps, const std::vector<int>& sequences)
        : reader_(std::move(reader)), file_index_(selected_sequences(*reader_, sequences)) {
        shape_ = trace_shape(*reader_, max_steps, sequences);
        qkv_ = {shape_.num_query_heads, shape_.num_kv_heads,
                checked_narrow<int>(reader_->metadata().head_dim, reader_->path() + ": root attribute 'head_dim'")};
    }
    std::string description() const override { return reader_->path(); }

protected:
    void load_layer(int sequence, int layer, QkvLayer& data) override {
        reader_->read_qkv(file_index_.at(sequence), layer, data);
    }

private:
    std::unique_ptr<TraceReader> reader_;
    std::vector<int> file_index_;
};

}  // namespace

std::unique_ptr<AttentionSource> make_qkv_source(std::unique_ptr<TraceReader> reader, int64_t max_steps,
                                                 const std::vector<int>& sequences) {
    return std::make_unique<QkvFileSource>(std::move(reader), max_steps, sequences);
}

}  // namespace kvsim
