#include "model/weight_matrix.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvsim::model {

namespace {
// Products smaller than this many multiply-adds stay on the calling thread: below it, handing
// work to the second core costs more than it saves.
constexpr int64_t kParallelMinMacs = int64_t{1} << 18;
}  // namespace

WeightMatrix WeightMatrix::from_floats(RowMatrix values) {
    WeightMatrix w;
    w.rows_ = static_cast<int>(values.rows());
    w.cols_ = static_cast<int>(values.cols());
    w.floats_ = std::make_shared<const RowMatrix>(std::move(values));
    return w;
}

WeightMatrix WeightMatrix::from_blocks(const BlockFormat& format, int rows, int cols, std::vector<uint8_t> bytes) {
    if (rows < 0 || cols < 0 || cols % format.block_elements != 0)
        throw std::invalid_argument("WeightMatrix: a row is not a whole number of blocks");
    WeightMatrix w;
    w.rows_ = rows;
    w.cols_ = cols;
    w.format_ = &format;
    w.row_bytes_ = static_cast<size_t>(cols / format.block_elements) * static_cast<size_t>(format.block_bytes);
    if (bytes.size() != w.row_bytes_ * static_cast<size_t>(rows))
        throw std::invalid_argument("WeightMatrix: byte count does not match the shape");
    w.bytes_ = std::make_shared<const std::vector<uint8_t>>(std::move(bytes));
    return w;
}

uint64_t WeightMatrix::memory_bytes() const {
    if (empty()) return 0;
    return format_ ? bytes_->size() : static_cast<uint64_t>(floats_->size()) * sizeof(float);
}

void WeightMatrix::decode_rows(int first_row, int count, float* out) const {
    format_->dequantize(bytes_->data() + static_cast<size_t>(first_row) * row_bytes_,
                        static_cast<size_t>(count) * static_cast<size_t>(cols_ / format_->block_elements), out);
}

void WeightMatrix::decode_row(int r, float* out) const {
    if (r < 0 || r >= rows_) throw std::out_of_range("WeightMatrix::decode_row: no such row");
    if (format_ == nullptr) {
        std::copy_n(floats_->row(r).data(), cols_, out);
        return;
    }
    decode_rows(r, 1, out);
}

int64_t WeightMatrix::first_non_finite() const {
    const auto scan = [&](const float* values, int64_t count, int64_t base) -> int64_t {
        for (int64_t i = 0; i < count; ++i)
            if (!std::isfinite(values[i])) return base + i;
        return -1;
    };
    if (empty()) return -1;
    if (format_ == nullptr) return scan(floats_->data(), floats_->size(), 0);
    const int tile_rows = tile_rows_for(rows_, cols_);
    std::vector<float> tile(static_cast<size_t>(tile_rows) * cols_);
    for (int r = 0; r < rows_; r += tile_rows) {
        const int count = std::min(tile_rows, rows_ - r);
        decode_rows(r, count, tile.data());
        if (const int64_t bad = scan(tile.data(), int64_t{count} * cols_, int64_t{r} * cols_); bad >= 0) return bad;
    }
    return -1;
}

template <bool kAccumulate>
void WeightMatrix::multiply_impl(const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y) const {
    // One Eigen product per tile of tile_rows() rows (output features) over every row of x, the
    // same tiles for fp32 and encoded weights: an encoded tile is decoded into this thread's
    // scratch first. Identical operands in identical products make a quantised model's results
    // equal, bit for bit, to those of its weights dequantised to F32, whatever thread runs which tile.
    const int tile_rows = tile_rows_for(rows_, cols_);
    const auto tile_product = [&](int tile) {
        const int first_row = tile * tile_rows;
        const int count = std::min(tile_rows, rows_ - first_row);
        const auto product = [&](const auto& w) {
            if constexpr (kAccumulate) {
                y.middleCols(first_row, count).noalias() += x * w.transpose();
            } else {
                y.middleCols(first_row, count).noalias() = x * w.transpose();
            }
        };
        using Tile = Eigen::Map<const RowMatrix>;  // the same expression type for both sources
        if (format_ == nullptr) {
            product(Tile(floats_->data() + static_cast<size_t>(first_row) * cols_, count, cols_));
            return;
        }
        thread_local std::vector<float> scratch;  // grows to the largest tile this thread decodes, once
        scratch.resize(std::max(scratch.size(), static_cast<size_t>(tile_rows) * cols_));
        decode_rows(first_row, count, scratch.data());
        product(Tile(scratch.data(), count, cols_));
    };
    const int tiles = (rows_ + tile_rows - 1) / tile_rows;
    if (int64_t{x.rows()} * rows_ * cols_ < kParallelMinMacs) {
        for (int tile = 0; tile < tiles; ++tile) tile_product(tile);
    } else {
        tbb::parallel_for(0, tiles, tile_product);
    }
}

void WeightMatrix::multiply(const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y) const {
    multiply_impl<false>(x, y);
}
void WeightMatrix::multiply_add(const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y) const {
    multiply_impl<true>(x, y);
}

}  // namespace kvsim::model
