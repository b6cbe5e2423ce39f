#include "sim/qkv_attention.h"

#include <tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "base/errors.h"
#include "base/size_limits.h"
#include "sim/heavy_hitters.h"
#include "cache_math/softmax_exp.h"

namespace kvsim {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using StridedRows = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
using ColumnMajorKeys = Eigen::Map<const Eigen::MatrixXf, 0, Eigen::OuterStride<>>;

// kvsim's own kernel for the score products: Eigen 3.4's bits, faster. With FMA, Eigen multiplies
// a product's keys (its rows: it computes the transposed product) in panels of three vectors
// (3 x 16 keys with AVX-512, 3 x 8 with AVX2) by 4 queries. Each score is one chain of fused
// multiply-adds over the features in order from zero, then scaled by the factor Eigen takes out
// of (q * scale): fma(sum, scale, 0). So is every score of a key below the last whole panel of 48
// (end_step rounded down; 48 is a whole number of Eigen's panels either way), whatever the
// queries; the last keys go through other paths (two accumulators, or sums across a vector),
// which Eigen itself still computes here. Eigen packed the keys once per product, four times per
// KV head and block; the kernel reads a per-layer copy already in blocks. Another Eigen, or a
// build without AVX2 and FMA, takes Eigen's products: the tests compare every score's bits.
#if defined(__FMA__) && (defined(__AVX512F__) || defined(__AVX2__)) && EIGEN_VERSION_AT_LEAST(3, 4, 0) && \
    !EIGEN_VERSION_AT_LEAST(3, 4, 90)
#define KVSIM_SCORE_PANELS 1
#endif

namespace {

#if defined(KVSIM_SCORE_PANELS)
// One vector of floats, as Eigen's products use them in this build, and the kernel's tile: a
// block of kBlockVectors vectors of keys by kQueryGroup queries, its accumulators, the block's
// vectors and a broadcast query held in registers.
#if defined(__AVX512F__)
using Floats = __m512;
#define KVSIM_FLOATS(op) _mm512_##op
// 48 keys by 8 queries: 24 accumulators of 32 registers.
constexpr int kBlockVectors = 3, kQueryGroup = 8;
#else
using Floats = __m256;
#define KVSIM_FLOATS(op) _mm256_##op
// 16 keys by 6 queries: 12 accumulators, 2 keys' vectors and a broadcast of 16 registers. Eigen's
// own 24 by 4 leaves no register to hold the keys, so each multiply-add reloads them: a kernel
// of that shape ran at 0.55x this one's speed on an AVX2 machine (AMD EPYC, Zen 3).
constexpr int kBlockVectors = 2, kQueryGroup = 6;
#endif
inline Floats floats_load(const float* p) { return KVSIM_FLOATS(loadu_ps)(p); }
inline void floats_store(float* p, Floats v) { KVSIM_FLOATS(storeu_ps)(p, v); }
inline Floats floats_set1(float x) { return KVSIM_FLOATS(set1_ps)(x); }
inline Floats floats_fma(Floats a, Floats b, Floats c) { return KVSIM_FLOATS(fmadd_ps)(a, b, c); }
#undef KVSIM_FLOATS
constexpr int kFloatLanes = sizeof(Floats) / sizeof(float);
constexpr int kBlockTokens = kBlockVectors * kFloatLanes;
static_assert(Eigen::internal::gebp_traits<float, float>::mr == 3 * kFloatLanes &&
              Eigen::internal::gebp_traits<float, float>::nr == 4 &&
              kScorePanelTokens % (3 * kFloatLanes) == 0 && kScorePanelTokens % kBlockTokens == 0);

// Scores of `count` (1 to kQueryGroup) queries against one block of keys: out[r * stride + j],
// from queries packed [feature][kQueryGroup] and the block [feature][kBlockTokens].
template <int count>
void score_block(const float* queries, const float* block, int d, Floats scale, float* out, int64_t stride) {
    Floats sum[count][kBlockVectors];
    const Floats zero = floats_set1(0.0f);
    for (int r = 0; r < count; ++r)
        for (int c = 0; c < kBlockVectors; ++c) sum[r][c] = zero;
    for (int f = 0; f < d; ++f) {
        Floats k[kBlockVectors];
        for (int c = 0; c < kBlockVectors; ++c) k[c] = floats_load(block + f * kBlockTokens + c * kFloatLanes);
        for (int r = 0; r < count; ++r) {
            const Floats q = floats_set1(queries[f * kQueryGroup + r]);
            for (int c = 0; c < kBlockVectors; ++c) sum[r][c] = floats_fma(k[c], q, sum[r][c]);
        }
    }
    for (int r = 0; r < count; ++r)
        for (int c = 0; c < kBlockVectors; ++c)
            floats_store(out + r * stride + c * kFloatLanes, floats_fma(sum[r][c], scale, zero));
}

using BlockKernel = void (*)(const float*, const float*, int, Floats, float*, int64_t);
// for_count[count]: the kernel for a group of `count` queries. (A plain array in a struct: a
// std::array of these pointers drops the vector type's alignment attribute, with a warning.)
struct BlockKernels {
    BlockKernel for_count[kQueryGroup + 1];
};
template <std::size_t... count>
constexpr BlockKernels block_kernels(std::index_sequence<count...>) {
    return {{(count == 0 ? nullptr : &score_block<count == 0 ? 1 : static_cast<int>(count)>)...}};
}
constexpr BlockKernels kBlockKernels = block_kernels(std::make_index_sequence<kQueryGroup + 1>());
#endif

}  // namespace

bool score_panels_serve(int head_dim) {
#if defined(KVSIM_SCORE_PANELS)
    // Each score is one chain where Eigen takes all the features in one sweep: its depth blocking
    // (from the L1 size it finds: about 300 features with AVX-512, 288 with AVX2 and a 32 KB L1)
    // leaves them whole.
    Eigen::Index depth = head_dim, keys = 4096, queries = 64;
    Eigen::internal::computeProductBlockingSizes<float, float, 1, Eigen::Index>(depth, keys, queries, 1);
    return head_dim >= 1 && depth == head_dim;
#else
    (void)head_dim;
    return false;
#endif
}

void keys_by_feature(const QkvLayer& layer, const QkvShape& shape, KeysByFeature& out) {
    const int hkv = shape.num_kv_heads, d = shape.head_dim;
    const int64_t tokens = static_cast<int64_t>(layer.k.size()) / (static_cast<int64_t>(hkv) * d);
    out.tokens = tokens;
    out.panels = score_panels_serve(d);
    // Tiles of 48 or 64 tokens: a tile's rows of K and its columns of the copy stay in cache.
    const int64_t tile = out.panels ? kScorePanelTokens : 64;
    const int64_t tiles = (tokens + tile - 1) / tile;
    out.values.resize(out.panels ? static_cast<std::size_t>(hkv) * tiles * tile * d : layer.k.size());
    tbb::parallel_for(int64_t{0}, hkv * tiles, [&](int64_t job) {
        const int g = static_cast<int>(job / tiles);
        const int64_t from = job % tiles * tile, to = std::min(tokens, from + tile);
#if defined(KVSIM_SCORE_PANELS)
        if (out.panels) {  // [kv head][panel][block][feature][width]: a panel a job, zeros past the last token
            float* panel = out.values.data() + job * tile * d;
            for (int64_t first = 0; first < tile; first += kBlockTokens) {
                float* block = panel + first * d;
                for (int i = 0; i < d; ++i)
                    for (int64_t j = from + first; j < from + first + kBlockTokens; ++j)
                        block[i * kBlockTokens + j - from - first] = j < to ? layer.k[(j * hkv + g) * d + i] : 0.0f;
            }
            return;
        }
#endif
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

namespace {

// The largest of a row's n scores, or NaN where one is not finite (for finite x, x - x is 0;
// otherwise NaN): the overflow check and the softmax's peak in one pass. The maximum of finite
// numbers is the same in any order (but for the sign of a zero peak, which no x - peak shows).
float finite_peak(const float* x, int64_t n) {
#if defined(__AVX512F__)
    __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __mmask16 not_finite = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i), zero_if_finite = _mm512_sub_ps(v, v);
        peak = _mm512_max_ps(peak, v);
        not_finite |= _mm512_cmp_ps_mask(zero_if_finite, zero_if_finite, _CMP_UNORD_Q);
    }
    if (i < n) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(peak, tail, x + i), zero_if_finite = _mm512_sub_ps(v, v);
        peak = _mm512_max_ps(peak, v);
        not_finite |= _mm512_mask_cmp_ps_mask(tail, zero_if_finite, zero_if_finite, _CMP_UNORD_Q);
    }
    return not_finite ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(peak);
#elif defined(__AVX2__)
    __m256 peak8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), not_finite8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i), zero_if_finite = _mm256_sub_ps(v, v);
        peak8 = _mm256_max_ps(peak8, v);
        not_finite8 = _mm256_or_ps(not_finite8, _mm256_cmp_ps(zero_if_finite, zero_if_finite, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, peak8);
    float peak = lanes[0];
    for (int l = 1; l < 8; ++l) peak = std::max(peak, lanes[l]);
    bool not_finite = _mm256_movemask_ps(not_finite8) != 0;
    for (; i < n; ++i) {
        peak = std::max(peak, x[i]);
        not_finite |= !(x[i] - x[i] == 0.0f);
    }
    return not_finite ? std::numeric_limits<float>::quiet_NaN() : peak;
#else
    const auto row = Eigen::Map<const Eigen::ArrayXf>(x, n);
    return (row - row).sum() == 0.0f ? row.maxCoeff() : std::numeric_limits<float>::quiet_NaN();
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// For each mask of eight lanes, the set lanes' numbers in ascending order, a byte each: what
// AVX-512's compress does with a mask, as a table of 2 KB for AVX2.
struct PassingLanes {
    long long of[256];
};
constexpr PassingLanes passing_lanes() {
    PassingLanes table{};
    for (unsigned mask = 0; mask < 256; ++mask) {
        unsigned long long packed = 0;
        int next = 0;
        for (unsigned lane = 0; lane < 8; ++lane)
            if (mask >> lane & 1u) packed |= static_cast<unsigned long long>(lane) << (8 * next++);
        table.of[mask] = static_cast<long long>(packed);
    }
    return table;
}
constexpr PassingLanes kPassingLanes = passing_lanes();

// first + l for each lane l set in `pass` (eight lanes), ascending, to out[0..); eight positions
// are written whatever passes (the caller has room), so no branch depends on the mask. Returns
// how many passed.
std::size_t store_passing_positions(int32_t* out, unsigned pass, int32_t first) {
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(kPassingLanes.of[pass]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_add_epi32(lanes, _mm256_set1_epi32(first)));
    return static_cast<std::size_t>(std::popcount(pass));
}
#endif

// out[j] = e[j] * scale for j < n, the elementwise product Eigen's arrays give (the same bits).
// Where floor_key > 0, also every j whose out[j] has bits at least floor_key, ascending, into `at`
// (room for n + 16; written over past the count): heavy_hitters.h's positions_at_or_above, found
// while the weights are in registers. Returns how many.
std::size_t scale_row(const float* e, int64_t n, float scale, float* out, int32_t floor_key, int32_t* at) {
#if defined(__AVX512F__)
    if (floor_key > 0) {
        const __m512 factor = _mm512_set1_ps(scale);
        const __m512i floor_bits = _mm512_set1_epi32(floor_key - 1);  // bits >= f <=> bits > f - 1
        const __m512i sixteen = _mm512_set1_epi32(16);
        __m512i positions = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        std::size_t count = 0;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(e + j), factor);
            _mm512_storeu_ps(out + j, w);
            const __mmask16 pass = _mm512_cmpgt_epi32_mask(_mm512_castps_si512(w), floor_bits);
            _mm512_storeu_si512(at + count, _mm512_maskz_compress_epi32(pass, positions));
            count += static_cast<std::size_t>(__builtin_popcount(pass));
            positions = _mm512_add_epi32(positions, sixteen);
        }
        if (j < n) {
            const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
            const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, e + j), factor);
            _mm512_mask_storeu_ps(out + j, tail, w);
            const __mmask16 pass = _mm512_mask_cmpgt_epi32_mask(tail, _mm512_castps_si512(w), floor_bits);
            _mm512_storeu_si512(at + count, _mm512_maskz_compress_epi32(pass, positions));
            count += static_cast<std::size_t>(__builtin_popcount(pass));
        }
        return count;
    }
#elif defined(__AVX2__)
    if (floor_key > 0) {  // the same, eight weights at a time, with AVX2's stand-in for a compress
        const __m256 factor = _mm256_set1_ps(scale);
        const __m256i floor_bits = _mm256_set1_epi32(floor_key - 1);
        std::size_t count = 0;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 w = _mm256_mul_ps(_mm256_loadu_ps(e + j), factor);
            _mm256_storeu_ps(out + j, w);
            const unsigned pass = static_cast<unsigned>(
                _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_castps_si256(w), floor_bits))));
            // Not a branch per pass: mispredicted, it was a third of this loop's time (perf, Zen 3).
            count += store_passing_positions(at + count, pass, static_cast<int32_t>(j));
        }
        for (; j < n; ++j) {
            out[j] = e[j] * scale;
            if (std::bit_cast<int32_t>(out[j]) >= floor_key) at[count++] = static_cast<int32_t>(j);
        }
        return count;
    }
#endif
    Eigen::Map<Eigen::ArrayXf>(out, n) = Eigen::Map<const Eigen::ArrayXf>(e, n) * scale;
    if (floor_key <= 0) return 0;
    const std::span<const int32_t> found = positions_at_or_above({out, static_cast<std::size_t>(n)}, floor_key);
    std::copy(found.begin(), found.end(), at);
    return found.size();
}

}  // namespace

#if defined(KVSIM_SCORE_PANELS)
namespace {

// Scores of one query head's block rows against keys [0, panel_keys) of KV head g, into
// scores[row * end_step + key]: only where a row's step reaches (causal), block by block so that
// each block of keys stays in cache while every row that needs it passes.
void panel_scores(const StridedRows& q, const KeysByFeature& keys, int g, int d, int64_t first_step, int64_t end_step,
                  int64_t panel_keys, float scale, float* scores) {
    const int64_t rows = q.rows();
    const int64_t groups = (rows + kQueryGroup - 1) / kQueryGroup;
    // The block's queries by group, [group][feature][kQueryGroup], zero past the last row.
    thread_local std::vector<float, Eigen::aligned_allocator<float>> packed;
    packed.resize(static_cast<std::size_t>(groups) * kQueryGroup * d);
    for (int64_t group = 0; group < groups; ++group) {
        float* to = packed.data() + group * kQueryGroup * d;
        for (int r = 0; r < kQueryGroup; ++r) {
            const int64_t row = group * kQueryGroup + r;
            for (int f = 0; f < d; ++f) to[f * kQueryGroup + r] = row < rows ? q(row, f) : 0.0f;
        }
    }
    const int64_t panels_of_head = (keys.tokens + kScorePanelTokens - 1) / kScorePanelTokens;
    const float* head_panels = keys.values.data() + static_cast<int64_t>(g) * panels_of_head * kScorePanelTokens * d;
    const Floats scale_vector = floats_set1(scale);
    for (int64_t first_key = 0; first_key < panel_keys; first_key += kBlockTokens) {
        // Rows whose step comes before the block need none of it; rows are in step order.
        const int64_t first_row = std::max<int64_t>(0, first_key - first_step);
        for (int64_t group = first_row / kQueryGroup; group < groups; ++group) {
            const int64_t row = group * kQueryGroup;
            const int count = static_cast<int>(std::min<int64_t>(kQueryGroup, rows - row));
            kBlockKernels.for_count[count](packed.data() + group * kQueryGroup * d, head_panels + first_key * d, d,
                                           scale_vector, scores + row * end_step + first_key, end_step);
        }
    }
}

}  // namespace
#endif

void start_attention_block(const QkvShape& shape, int64_t first_step, int64_t end_step, AttentionBlock& block) {
    block.first_step = first_step;
    block.end_step = end_step;
    block.rows.resize(shape.num_query_heads);
    block.self_weight.resize(shape.num_query_heads);
}

int64_t attention_rows_of_head(const QkvLayer& layer, const KeysByFeature& keys, const QkvShape& shape, int h,
                               AttentionBlock& block, const RowVisitor* visit) {
    const int hq = shape.num_query_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
    const int group = hq / hkv;
    const int64_t first_step = block.first_step, end_step = block.end_step;
    const int64_t rows = end_step - first_step;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
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
    // Keys [from, end_step) of this KV head as the trace stores them, token after token.
    auto token_major_keys = [&](int64_t from) {
        return StridedRows(layer.k.data() + (from * hkv + g) * d, end_step - from, d,
                           Eigen::OuterStride<>(static_cast<int64_t>(hkv) * d));
    };
    const int64_t panel_keys = keys.panels && rows > 1 ? end_step / kScorePanelTokens * kScorePanelTokens : 0;
    if (panel_keys > 0) {
#if defined(KVSIM_SCORE_PANELS)
        panel_scores(q, keys, g, d, first_step, end_step, panel_keys, scale, scores.data());
#endif
        // The last keys (fewer than a panel) by Eigen, from the trace's token-major keys (Eigen packs
        // either layout into the same values). A product of one key would be a matrix-vector
        // product, with other arithmetic: then the whole panel before it is taken again.
        if (end_step > panel_keys) {
            const int64_t from = end_step - panel_keys >= 2 ? panel_keys : panel_keys - kScorePanelTokens;
            Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>> tail(scores.data() + from, rows, end_step - from,
                                                                 Eigen::OuterStride<>(end_step));
            tail.noalias() = (q * scale) * token_major_keys(from).transpose();
        }
    } else if (rows > 1 && !keys.panels) {
        // Its keys for positions 0..end-1 as a column-major matrix: Eigen packs them with
        // straight copies (from token-major rows it gathered a third of the products' time).
        // The packed values, and so every score's bits, are the same.
        const ColumnMajorKeys k(keys.values.data() + static_cast<int64_t>(g) * d * keys.tokens, end_step, d,
                                Eigen::OuterStride<>(keys.tokens));
        scores.noalias() = (q * scale) * k.transpose();
    } else {
        // One row is a matrix-vector product, whose arithmetic depends on the storage order:
        // the token-major keys, as before. So are blocks shorter than a panel where the keys
        // are in panels (Eigen packs either layout into the same values).
        scores.noalias() = (q * scale) * token_major_keys(0).transpose();
    }

    // Only grows: a layer's first block is its smallest, and growing back each layer cleared
    // every head's buffer again (0.7% of the Llama-1B-shaped replay's CPU in memset).
    std::vector<float>& packed = block.rows[h];
    const std::size_t floats = attention_row_offset(end_step) - attention_row_offset(first_step);
    if (packed.size() < floats) packed.resize(floats);
    block.self_weight[h].resize(rows);
    float* out = packed.data();
    thread_local std::vector<int32_t> at_or_above;  // grows only
    if (visit && visit->gather_floor && at_or_above.size() < static_cast<std::size_t>(end_step) + 16)
        at_or_above.resize(end_step + 16);
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = first_step + i;
        auto row = scores.row(i).head(t + 1).array();  // causal: positions 0..t
        // Finite Q and K (the reader checks them) can still overflow q.k to +-Inf, and the
        // softmax would turn that into NaN: checked in the pass that finds the peak.
        const float peak = finite_peak(row.data(), t + 1);
        if (std::isnan(peak)) return t;
        const float inv_total = 1.0f / exp_minus_peak_and_sum(row.data(), t + 1, peak);
        const int32_t floor = visit && visit->gather_floor ? visit->gather_floor(h) : 0;
        const std::size_t gathered = scale_row(row.data(), t, inv_total, out, floor, at_or_above.data());
        block.self_weight[h][i] = row(t) * inv_total;
        if (visit) visit->visit(h, i, {out, static_cast<std::size_t>(t)}, {at_or_above.data(), gathered});
        out += t;
    }
    return -1;
}

void throw_logit_overflow(const std::string& where, int head, int64_t step) {
    throw InputError((where.empty() ? std::string("Q/K attention") : where) + ", head " + std::to_string(head) +
                     ", step " + std::to_string(step) +
                     ": an attention logit q.k/sqrt(head_dim) is not finite (Q and K are finite, but too "
                     "large: their product overflows float32)");
}

void attention_from_qkv(const QkvLayer& layer, const KeysByFeature& keys, const QkvShape& shape, int64_t first_step,
                        int64_t end_step, AttentionBlock& block, const std::string& where, const RowVisitor* visit) {
    const int hq = shape.num_query_heads;
    start_attention_block(shape, first_step, end_step, block);
    // Per head, the first step whose logits are not all finite (-1: none); reported after the
    // parallel loop, lowest head first, so the message does not depend on the threads.
    std::vector<int64_t> overflow(hq, -1);
    tbb::parallel_for(0, hq, [&](int h) { overflow[h] = attention_rows_of_head(layer, keys, shape, h, block, visit); });
    for (int h = 0; h < hq; ++h)
        if (overflow[h] >= 0) throw_logit_overflow(where, h, overflow[h]);
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
        if (prefetching_ && prefetch_sequence_ == sequence && prefetch_layer_ == layer) {
            prefetching_ = false;
            loading_->wait();  // throws the load's own error, if it failed
            std::swap(loaded_, prefetched_);
        } else {
            drop_prefetch();
            load_layer(sequence, layer, loaded_);
        }
        loaded_sequence_ = sequence;
        loaded_layer_ = layer;
    }
    return loaded_;
}

void QkvSource::prefetch(int sequence, int layer) {
    if (prefetching_ || (sequence == loaded_sequence_ && layer == loaded_layer_)) return;
    prefetch_sequence_ = sequence;
    prefetch_layer_ = layer;
    prefetching_ = true;
    loading_->run([this, sequence, layer] { load_layer(sequence, layer, prefetched_); });
}

void QkvSource::drop_prefetch() {
    if (!prefetching_) return;
    prefetching_ = false;
    try {
        loading_->wait();
    } catch (...) {  // nothing asked for that layer: its error goes with it
    }
}

QkvSource::~QkvSource() { drop_prefetch(); }

void QkvSource::read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block) {
    ready_layer(sequence, layer);  // attention_from_qkv sets the block's steps itself
    attention_from_qkv(loaded_, keys_, qkv_, first_step, end_step, block, where(sequence, layer));
}

void QkvSource::read_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block,
                           const RowVisitor& visit) {
    ready_layer(sequence, layer);  // attention_from_qkv sets the block's steps itself
    attention_from_qkv(loaded_, keys_, qkv_, first_step, end_step, block, where(sequence, layer), &visit);
}

void QkvSource::begin_block(int sequence, int layer, int64_t first_step, int64_t end_step, AttentionBlock& block) {
    ready_layer(sequence, layer);
    start_attention_block(qkv_, first_step, end_step, block);
}

void QkvSource::ready_layer(int sequence, int layer) {
    const QkvLayer& data = layer_data(sequence, layer);
    if (!keys_current_) {
        keys_by_feature(data, qkv_, keys_);
        keys_current_ = true;
    }
}

int64_t QkvSource::head_rows(int head, AttentionBlock& block, const RowVisitor* visit) const {
    return attention_rows_of_head(loaded_, keys_, qkv_, head, block, visit);
}

void QkvSource::report_overflow(int sequence, int layer, int head, int64_t step) const {
    throw_logit_overflow(where(sequence, layer), head, step);
}

std::string QkvSource::where(int sequence, int layer) const {
    return description() + ": sequence " + shape_.sequence_names.at(sequence) + ", layer " + std::to_string(layer);
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
    ~QkvFileSource() override { drop_prefetch(); }  // before the reader a load may still use goes
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
