// A weight matrix [rows][cols] as the model holds it in memory. F32 weights are an Eigen matrix;
// every other GGUF type (F16, BF16 and the block formats) stays in its file encoding, row after
// row, and is decoded a tile of rows at a time inside the matrix products: a Q4_K_M model then
// takes about 4.5-5 bits a weight in memory instead of fp32's 32.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <memory>
#include <vector>

#include "model/ggml_blocks.h"

namespace kvsim::model {

class WeightMatrix {
  public:
    using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

    // Rows decoded together inside a product: each tile's product is one Eigen call over the same
    // rows whichever thread runs it, so results do not depend on the number of threads. Eigen
    // packs the whole of x once per call, so a large matrix takes kLargeTileRows a tile (x packed
    // a quarter as often; a 256 x 8192 tile decodes into 8 MB of scratch per thread). Matrices of
    // at most kSmallMatrixWeights weights keep 64-row tiles: within a tile Eigen's kernels sum a
    // row's products in an order that depends on the row's place in the tile, and the results of
    // small models (stories260K's, the tests') stay as they were.
    static constexpr int kSmallTileRows = 64;
    static constexpr int kLargeTileRows = 256;
    static constexpr int64_t kSmallMatrixWeights = int64_t{1} << 20;
    static int tile_rows_for(int rows, int cols) {
        return int64_t{rows} * cols <= kSmallMatrixWeights ? kSmallTileRows : kLargeTileRows;
    }
    int tile_rows() const { return tile_rows_for(rows_, cols_); }

    // Copies share the weights (they are never changed after loading): a model copied per thread
    // holds its weights once.
    WeightMatrix() = default;
    static WeightMatrix from_floats(RowMatrix values);
    // bytes: rows x (cols / format.block_elements) blocks; cols must be a whole number of blocks.
    static WeightMatrix from_blocks(const BlockFormat& format, int rows, int cols, std::vector<uint8_t> bytes);

    int rows() const { return rows_; }
    int cols() const { return cols_; }
    bool empty() const { return rows_ == 0; }
    const BlockFormat* format() const { return format_; }  // nullptr when held as fp32
    uint64_t memory_bytes() const;

    // Row r as cols_ floats into out.
    void decode_row(int r, float* out) const;
    // The index (row * cols + column) of the first weight that is not finite, or -1.
    int64_t first_non_finite() const;

    // y = x · Wᵀ (or y += x · Wᵀ) for x [n][cols], y [n][rows]. Large products run tiles of rows
    // on TBB's threads.
    void multiply(const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y) const;
    void multiply_add(const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y) const;

  private:
    template <bool kAccumulate>
    void multiply_impl(const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y) const;
    void decode_rows(int first_row, int count, float* out) const;

    int rows_ = 0, cols_ = 0;
    std::shared_ptr<const RowMatrix> floats_;             // when format_ is nullptr
    const BlockFormat* format_ = nullptr;
    std::shared_ptr<const std::vector<uint8_t>> bytes_;  // when format_ is set
    size_t row_bytes_ = 0;
};

}  // namespace kvsim::model
