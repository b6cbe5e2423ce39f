#include "runtime/attention_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "cache_math/numerics.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSIM_VECTOR_KERNELS 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VBMI__)
#define KVSIM_AVX512_KERNELS 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVSIM_AMX_KERNELS 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#endif

namespace kvsim::runtime {
namespace {

// Row r's per-channel scales (KIVI keys), or null where the row carries its own group scales.
const float* row_channel_scales(const TierRows& t, std::size_t r) {
    if (!t.channel_scales) return nullptr;
    const int32_t p = t.position_of_slot[t.slot_of_row[r]];
    return t.channel_scales + static_cast<std::size_t>(p / t.key_group) * t.head_dim;
}

// Channel c of row r as attention reads it: numerics.h's definitions, one number at a time.
float element(const TierRows& t, std::size_t r, int c, const float* channel_scales) {
    if (t.tier == 0) return half_bits_to_float(t.half[r * t.head_dim + c]);
    const uint8_t* row = t.levels + r * t.row_bytes;
    const int level = t.tier == 1 ? static_cast<int8_t>(row[c]) : int4_level(row, c);
    const float scale =
        channel_scales ? channel_scales[c] : half_bits_to_float(t.scales[r * t.groups + c / t.group_channels]);
    return dequantize_level(static_cast<float>(level), scale);
}

// Row r, every channel, into `row`.
void dequantise_row(const TierRows& t, std::size_t r, float* row) {
    const float* channel_scales = row_channel_scales(t, r);
    for (int c = 0; c < t.head_dim; ++c) row[c] = element(t, r, c, channel_scales);
}

void check_rows(const TierRows& t) {
    if (t.tier != 0 && t.groups == 0 && (!t.channel_scales || !t.position_of_slot))
        throw std::logic_error("attention kernels: a tier without row scales needs per-channel scales");
}

}  // namespace

void score_rows_portable(const TierRows& t, const float* q, int group, float scale, float* scores, std::size_t stride,
                         float* peaks, float* scratch) {
    check_rows(t);
    const int d = t.head_dim;
    float* row = scratch;
    for (int r = 0; r < t.count; ++r) {
        dequantise_row(t, r, row);
        for (int h = 0; h < group; ++h) {
            const float* qh = q + static_cast<std::size_t>(h) * d;
            float dot = 0.0f;
            for (int c = 0; c < d; ++c) dot += qh[c] * row[c];
            const float s = dot * scale;
            scores[h * stride + r] = s;
            peaks[h] = std::max(peaks[h], s);
        }
    }
}

void accumulate_rows_portable(const TierRows& t, const float* weights, std::size_t stride,
                              const int32_t* index_of_slot, int group, float* out, float* scratch) {
    check_rows(t);
    const int d = t.head_dim;
    float* row = scratch;
    for (int r = 0; r < t.count; ++r) {
        dequantise_row(t, r, row);
        const std::size_t i = static_cast<std::size_t>(index_of_slot[t.slot_of_row[r]]);
        for (int h = 0; h < group; ++h) {
            const float w = weights[h * stride + i];
            float* o = out + static_cast<std::size_t>(h) * d;
            for (int c = 0; c < d; ++c) o[c] += w * row[c];
        }
    }
}

#if defined(KVSIM_VECTOR_KERNELS)
namespace {

// How a tier's rows are scaled: FP16 not at all; INT8/INT4 by a scale per group of channels
// (a multiple of 8 channels: one broadcast per 8), or per channel (KIVI keys, and groups that are
// not a multiple of 8, spread over the channels a block at a time).
enum class ScaleKind { none, group, channel };

constexpr int kMaxChunks = 256;  // head sizes up to 2048 (eight channels a chunk)

// Where row r's numbers start: its half bits, or its levels.
template <int Tier>
inline const void* row_data(const TierRows& t, std::size_t r) {
    if constexpr (Tier == 0) return t.half + r * t.head_dim;
    return t.levels + r * t.row_bytes;
}

// Channels c..c+7 of a row: FP16 values, or INT8/INT4 levels, as floats (exact).
template <int Tier>
inline __m256 widen8(const void* row, int c) {
    if constexpr (Tier == 0) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + c)));
    } else if constexpr (Tier == 1) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(row) + c));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    } else {
        // Four bytes hold eight nibbles, channel c + i in nibble i: each lane shifts its nibble to
        // the top and back down arithmetically, which sign-extends it (int4_level, eight at once).
        uint32_t word;
        std::memcpy(&word, static_cast<const uint8_t*>(row) + c / 2, sizeof word);
        const __m256i top = _mm256_sllv_epi32(_mm256_set1_epi32(static_cast<int>(word)),
                                              _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
        return _mm256_cvtepi32_ps(_mm256_srai_epi32(top, 28));
    }
}

// Everything a block of rows shares: per row, its scales as floats.
struct Block {
    int first = 0, rows = 0;
    const float* scales = nullptr;  // group: `groups` a row; channel (not KIVI): head_dim a row
    int scale_stride = 0;
};

void halves_to_floats(const uint16_t* in, std::size_t n, float* out) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
    for (; i < n; ++i) out[i] = half_bits_to_float(in[i]);
}

// The block's scales, converted once (a block's rows' scales lie together).
template <ScaleKind K>
Block prepare(const TierRows& t, int first, int rows, float* scratch) {
    Block b{first, rows, nullptr, 0};
    if constexpr (K == ScaleKind::none) return b;
    if (t.channel_scales) return b;  // KIVI: each row finds its position group's scales
    float* group_scales = scratch;
    halves_to_floats(t.scales + static_cast<std::size_t>(first) * t.groups, static_cast<std::size_t>(rows) * t.groups,
                     group_scales);
    if constexpr (K == ScaleKind::group) {
        b.scales = group_scales, b.scale_stride = t.groups;
    } else {
        float* spread = scratch + static_cast<std::size_t>(kKernelBlock) * (t.groups + 8);
        const int d = t.head_dim;
        for (int i = 0; i < rows; ++i)
            for (int g = 0; g < t.groups; ++g) {
                const int end = std::min(d, (g + 1) * t.group_channels);
                std::fill(spread + static_cast<std::size_t>(i) * d + g * t.group_channels,
                          spread + static_cast<std::size_t>(i) * d + end, group_scales[i * t.groups + g]);
            }
        b.scales = spread, b.scale_stride = d;
    }
    return b;
}

template <ScaleKind K>
inline const float* scales_of(const TierRows& t, const Block& b, int i) {
    if constexpr (K == ScaleKind::none) return nullptr;
    if (t.channel_scales) return row_channel_scales(t, static_cast<std::size_t>(b.first + i));
    return b.scales + static_cast<std::size_t>(i) * b.scale_stride;
}

// Eight levels times their scales: dequantize_level, eight at once.
template <ScaleKind K>
inline __m256 scaled(__m256 x, const float* scales, int j, const int* chunk_group) {
    if constexpr (K == ScaleKind::group) return _mm256_mul_ps(x, _mm256_broadcast_ss(scales + chunk_group[j]));
    if constexpr (K == ScaleKind::channel) return _mm256_mul_ps(x, _mm256_loadu_ps(scales + 8 * j));
    return x;
}

// Channel c of a row (past the last whole eight) with the block's scales.
template <ScaleKind K>
inline float tail_element(const TierRows& t, std::size_t r, int c, const float* scales) {
    if constexpr (K == ScaleKind::group) {
        const uint8_t* row = t.levels + r * t.row_bytes;
        const int level = t.tier == 1 ? static_cast<int8_t>(row[c]) : int4_level(row, c);
        return dequantize_level(static_cast<float>(level), scales[c / t.group_channels]);
    }
    return element(t, r, c, K == ScaleKind::channel ? scales : nullptr);
}

// Rows start loading (into L2) this many blocks before they are computed: with one block ahead a
// stream of FP16 rows arrived late on a 2-core Zen 5 (one thread's score pass over cold rows read
// 8-13 GB/s with one block ahead, 12-15 GB/s with four; bench_runtime measures the whole).
constexpr int kPrefetchBlocks = 4;

// While the block from row `computing` is computed, the block kPrefetchBlocks ahead starts loading.
void prefetch_rows(const TierRows& t, int computing) {
    const int first = computing + kPrefetchBlocks * kKernelBlock;
    const int rows = std::min(kKernelBlock, t.count - first);
    if (rows <= 0) return;
    const char* begin;
    std::size_t bytes;
    if (t.tier == 0) {
        begin = reinterpret_cast<const char*>(t.half + static_cast<std::size_t>(first) * t.head_dim);
        bytes = static_cast<std::size_t>(rows) * t.head_dim * 2;
    } else {
        begin = reinterpret_cast<const char*>(t.levels + static_cast<std::size_t>(first) * t.row_bytes);
        bytes = static_cast<std::size_t>(rows) * t.row_bytes;
        if (t.groups > 0) {
            const char* scales = reinterpret_cast<const char*>(t.scales + static_cast<std::size_t>(first) * t.groups);
            for (std::size_t at = 0; at < static_cast<std::size_t>(rows) * t.groups * 2; at += 64)
                _mm_prefetch(scales + at, _MM_HINT_T1);
        }
    }
    for (std::size_t at = 0; at < bytes; at += 64) _mm_prefetch(begin + at, _MM_HINT_T1);
}

// The four lanes' sums of four vectors, in one vector: [sum a0, sum a1, sum a2, sum a3].
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

template <int G, int H>
inline __m256 head_or_zero(const __m256 (&acc)[G]) {
    if constexpr (H < G) return acc[H];
    return _mm256_setzero_ps();
}

// Rows a score pass takes side by side, and so the accumulators in flight (rows x query heads):
// enough to cover the FMA's latency on both pipes, within AVX2's sixteen registers; each query
// load then serves every row of the pass.
template <int G>
constexpr int kRowsAtOnce = G <= 2 ? 4 : G == 3 ? 3 : G == 4 ? 2 : 1;

// Scores of RW rows of a block, i0.. (peak: each head's largest score so far, lanes 0..7).
template <int Tier, ScaleKind K, int G, int RW>
inline void score_rows_at(const TierRows& t, const Block& b, int i0, const float* q, float scale, float* scores,
                          std::size_t stride, __m128 (&peak)[2], const int* chunk_group) {
    const int d = t.head_dim, chunks = d / 8;
    const void* row[RW];
    const float* sc[RW];
#pragma GCC unroll 8
    for (int w = 0; w < RW; ++w) {
        row[w] = row_data<Tier>(t, static_cast<std::size_t>(b.first + i0 + w));
        sc[w] = scales_of<K>(t, b, i0 + w);
    }
    __m256 acc[RW][G];
#pragma GCC unroll 8
    for (int w = 0; w < RW; ++w)
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) acc[w][h] = _mm256_setzero_ps();
    for (int j = 0; j < chunks; ++j) {
        __m256 k[RW];
#pragma GCC unroll 8
        for (int w = 0; w < RW; ++w) k[w] = scaled<K>(widen8<Tier>(row[w], 8 * j), sc[w], j, chunk_group);
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) {
            const __m256 qh = _mm256_loadu_ps(q + static_cast<std::size_t>(h) * d + 8 * j);
#pragma GCC unroll 8
            for (int w = 0; w < RW; ++w) acc[w][h] = _mm256_fmadd_ps(qh, k[w], acc[w][h]);
        }
    }
    const __m128 scale4 = _mm_set1_ps(scale);
#pragma GCC unroll 8
    for (int w = 0; w < RW; ++w) {
        const std::size_t r = static_cast<std::size_t>(b.first + i0 + w);
        alignas(16) float dot[8];
        _mm_store_ps(dot, sum4(acc[w][0], head_or_zero<G, 1>(acc[w]), head_or_zero<G, 2>(acc[w]),
                               head_or_zero<G, 3>(acc[w])));
        if constexpr (G > 4)
            _mm_store_ps(dot + 4, sum4(acc[w][4], head_or_zero<G, 5>(acc[w]), head_or_zero<G, 6>(acc[w]),
                                       head_or_zero<G, 7>(acc[w])));
        for (int c = 8 * chunks; c < d; ++c) {  // channels past the last eight, one by one
            const float x = tail_element<K>(t, r, c, sc[w]);
            for (int h = 0; h < G; ++h) dot[h] += q[static_cast<std::size_t>(h) * d + c] * x;
        }
        const __m128 lo = _mm_mul_ps(_mm_load_ps(dot), scale4);
        peak[0] = _mm_max_ps(peak[0], lo);
        _mm_store_ps(dot, lo);
        if constexpr (G > 4) {
            const __m128 hi = _mm_mul_ps(_mm_load_ps(dot + 4), scale4);
            peak[1] = _mm_max_ps(peak[1], hi);
            _mm_store_ps(dot + 4, hi);
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) scores[h * stride + r] = dot[h];
    }
}

template <int Tier, ScaleKind K, int G>
void score_block(const TierRows& t, const Block& b, const float* q, float scale, float* scores, std::size_t stride,
                 __m128 (&peak)[2], const int* chunk_group) {
    constexpr int RW = kRowsAtOnce<G>;
    int i = 0;
    for (; i + RW <= b.rows; i += RW) score_rows_at<Tier, K, G, RW>(t, b, i, q, scale, scores, stride, peak, chunk_group);
    for (; i < b.rows; ++i) score_rows_at<Tier, K, G, 1>(t, b, i, q, scale, scores, stride, peak, chunk_group);
}

// Chunks of eight channels a value pass keeps in flight for every query head (chunks x heads
// accumulators), one row after another through the block: the block's rows stay in L1 between
// the passes over its channels.
template <int G>
constexpr int kChunksAtOnce = G >= 5 ? 1 : G >= 3 ? 2 : 8 / G;

// out += w * v for S chunks of eight channels from j0, over the block's rows; `weights`: G a row.
template <int Tier, ScaleKind K, int G, int S>
inline void accumulate_slice(const TierRows& t, const Block& b, int j0, const float* weights, float* out,
                             const int* chunk_group) {
    const int d = t.head_dim;
    __m256 acc[S][G];
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) acc[s][h] = _mm256_loadu_ps(out + static_cast<std::size_t>(h) * d + 8 * (j0 + s));
    for (int i = 0; i < b.rows; ++i) {
        const void* row = row_data<Tier>(t, static_cast<std::size_t>(b.first + i));
        const float* sc = scales_of<K>(t, b, i);
        __m256 w[G];
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) w[h] = _mm256_broadcast_ss(weights + i * G + h);
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) {
            const __m256 v = scaled<K>(widen8<Tier>(row, 8 * (j0 + s)), sc, j0 + s, chunk_group);
#pragma GCC unroll 8
            for (int h = 0; h < G; ++h) acc[s][h] = _mm256_fmadd_ps(w[h], v, acc[s][h]);
        }
    }
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) _mm256_storeu_ps(out + static_cast<std::size_t>(h) * d + 8 * (j0 + s), acc[s][h]);
}

template <int Tier, ScaleKind K, int G>
void accumulate_block(const TierRows& t, const Block& b, const float* weights, float* out, const int* chunk_group) {
    constexpr int S = kChunksAtOnce<G>;
    const int d = t.head_dim, chunks = d / 8;
    int j = 0;
    for (; j + S <= chunks; j += S) accumulate_slice<Tier, K, G, S>(t, b, j, weights, out, chunk_group);
    for (; j < chunks; ++j) accumulate_slice<Tier, K, G, 1>(t, b, j, weights, out, chunk_group);
    for (int c = 8 * chunks; c < d; ++c)
        for (int i = 0; i < b.rows; ++i) {
            const float x = tail_element<K>(t, static_cast<std::size_t>(b.first + i), c, scales_of<K>(t, b, i));
            for (int h = 0; h < G; ++h) out[static_cast<std::size_t>(h) * d + c] += weights[i * G + h] * x;
        }
}

// The scale group of each chunk of `Lanes` channels (group scales: a whole number of chunks a group).
template <int Lanes = 8>
void chunk_groups(const TierRows& t, int* chunk_group) {
    const int chunks = t.head_dim / Lanes;
    for (int j = 0; j < chunks; ++j)
        chunk_group[j] = t.group_channels > 0 && t.groups > 0 ? Lanes * j / t.group_channels : 0;
}

template <int Tier, ScaleKind K, int G>
void score_tier(const TierRows& t, const float* q, float scale, float* scores, std::size_t stride, float* peaks,
                float* scratch) {
    int chunk_group[kMaxChunks];
    chunk_groups(t, chunk_group);
    __m128 peak[2] = {_mm_set1_ps(-INFINITY), _mm_set1_ps(-INFINITY)};
    for (int first = 0; first < t.count; first += kKernelBlock) {
        const int rows = std::min(kKernelBlock, t.count - first);
        prefetch_rows(t, first);
        const Block b = prepare<K>(t, first, rows, scratch);
        score_block<Tier, K, G>(t, b, q, scale, scores, stride, peak, chunk_group);
    }
    alignas(16) float lanes[8];
    _mm_store_ps(lanes, peak[0]);
    _mm_store_ps(lanes + 4, peak[1]);
    for (int h = 0; h < G; ++h) peaks[h] = std::max(peaks[h], lanes[h]);
}

template <int Tier, ScaleKind K, int G>
void accumulate_tier(const TierRows& t, const float* weights, std::size_t stride, const int32_t* index_of_slot,
                     float* out, float* scratch) {
    int chunk_group[kMaxChunks];
    chunk_groups(t, chunk_group);
    float* block_weights = scratch + static_cast<std::size_t>(kKernelBlock) * (t.groups + 8 + t.head_dim);
    for (int first = 0; first < t.count; first += kKernelBlock) {
        const int rows = std::min(kKernelBlock, t.count - first);
        prefetch_rows(t, first);
        const Block b = prepare<K>(t, first, rows, scratch);
        for (int i = 0; i < rows; ++i) {  // each row's weights, wherever its key's score lies
            const std::size_t at = static_cast<std::size_t>(index_of_slot[t.slot_of_row[first + i]]);
            for (int h = 0; h < G; ++h) block_weights[i * G + h] = weights[h * stride + at];
        }
        accumulate_block<Tier, K, G>(t, b, block_weights, out, chunk_group);
    }
}

// A group scale serves whole chunks of `Lanes` channels; any other grouping is spread per channel.
template <int Lanes = 8>
ScaleKind scale_kind(const TierRows& t) {
    if (t.tier == 0) return ScaleKind::none;
    if (t.groups == 0 || t.group_channels % Lanes != 0) return ScaleKind::channel;
    return ScaleKind::group;
}

// One call for a group of up to eight query heads: the tier, its scales and the group size
// chosen at compile time.
template <int G>
void score_group(const TierRows& t, const float* q, float scale, float* scores, std::size_t stride, float* peaks,
                 float* scratch) {
    switch (t.tier * 3 + static_cast<int>(scale_kind(t))) {
        case 0: return score_tier<0, ScaleKind::none, G>(t, q, scale, scores, stride, peaks, scratch);
        case 4: return score_tier<1, ScaleKind::group, G>(t, q, scale, scores, stride, peaks, scratch);
        case 5: return score_tier<1, ScaleKind::channel, G>(t, q, scale, scores, stride, peaks, scratch);
        case 7: return score_tier<2, ScaleKind::group, G>(t, q, scale, scores, stride, peaks, scratch);
        case 8: return score_tier<2, ScaleKind::channel, G>(t, q, scale, scores, stride, peaks, scratch);
        default: throw std::logic_error("attention kernels: unknown tier");
    }
}

template <int G>
void accumulate_group(const TierRows& t, const float* weights, std::size_t stride, const int32_t* index_of_slot,
                      float* out, float* scratch) {
    switch (t.tier * 3 + static_cast<int>(scale_kind(t))) {
        case 0: return accumulate_tier<0, ScaleKind::none, G>(t, weights, stride, index_of_slot, out, scratch);
        case 4: return accumulate_tier<1, ScaleKind::group, G>(t, weights, stride, index_of_slot, out, scratch);
        case 5: return accumulate_tier<1, ScaleKind::channel, G>(t, weights, stride, index_of_slot, out, scratch);
        case 7: return accumulate_tier<2, ScaleKind::group, G>(t, weights, stride, index_of_slot, out, scratch);
        case 8: return accumulate_tier<2, ScaleKind::channel, G>(t, weights, stride, index_of_slot, out, scratch);
        default: throw std::logic_error("attention kernels: unknown tier");
    }
}

template <class Call>
void by_group_size(int group, Call&& call) {
    switch (group) {
        case 1: return call(std::integral_constant<int, 1>{});
        case 2: return call(std::integral_constant<int, 2>{});
        case 3: return call(std::integral_constant<int, 3>{});
        case 4: return call(std::integral_constant<int, 4>{});
        case 5: return call(std::integral_constant<int, 5>{});
        case 6: return call(std::integral_constant<int, 6>{});
        case 7: return call(std::integral_constant<int, 7>{});
        default: return call(std::integral_constant<int, 8>{});
    }
}

void score_rows_avx2(const TierRows& t, const float* q, int group, float scale, float* scores, std::size_t stride,
                     float* peaks, float* scratch) {
    // More than eight query heads a KV head: eight at a time, each a pass over the rows.
    for (int h0 = 0; h0 < group; h0 += 8) {
        const int g = std::min(8, group - h0);
        by_group_size(g, [&](auto size) {
            score_group<decltype(size)::value>(t, q + static_cast<std::size_t>(h0) * t.head_dim, scale,
                                               scores + h0 * stride, stride, peaks + h0, scratch);
        });
    }
}

void accumulate_rows_avx2(const TierRows& t, const float* weights, std::size_t stride, const int32_t* index_of_slot,
                          int group, float* out, float* scratch) {
    for (int h0 = 0; h0 < group; h0 += 8) {
        const int g = std::min(8, group - h0);
        by_group_size(g, [&](auto size) {
            accumulate_group<decltype(size)::value>(t, weights + h0 * stride, stride, index_of_slot,
                                                    out + static_cast<std::size_t>(h0) * t.head_dim, scratch);
        });
    }
}

#if defined(KVSIM_AVX512_KERNELS)
// The same passes sixteen channels a vector, for head sizes that are whole sixteens: twice the
// channels an instruction, and thirty-two registers to keep more rows and heads in flight. Summed
// in sixteen lanes, then across them.
namespace avx512 {

// Channels c..c+15 of a row: FP16 values, or INT8/INT4 levels, as floats (exact).
template <int Tier>
inline __m512 widen16(const void* row, int c) {
    if constexpr (Tier == 0) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + c)));
    } else if constexpr (Tier == 1) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(row) + c));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    } else {
        // Eight bytes hold sixteen nibbles, channel c + i in bits 4i..4i+3 of the word. Lane i's top
        // byte takes the eight bits from 4i - 4 (rotating within the word), which puts nibble i in
        // the lane's top four bits; shifting back arithmetically sign-extends it (int4_level).
        uint64_t word;
        std::memcpy(&word, static_cast<const uint8_t*>(row) + c / 2, sizeof word);
        const __m512i control = _mm512_setr_epi32(60 << 24, 0 << 24, 4 << 24, 8 << 24, 12 << 24, 16 << 24, 20 << 24,
                                                  24 << 24, 28 << 24, 32 << 24, 36 << 24, 40 << 24, 44 << 24, 48 << 24,
                                                  52 << 24, 56 << 24);
        const __m512i picked = _mm512_multishift_epi64_epi8(control, _mm512_set1_epi64(static_cast<long long>(word)));
        return _mm512_cvtepi32_ps(_mm512_srai_epi32(picked, 28));
    }
}

template <ScaleKind K>
inline __m512 scaled(__m512 x, const float* scales, int j, const int* chunk_group) {
    if constexpr (K == ScaleKind::group) return _mm512_mul_ps(x, _mm512_set1_ps(scales[chunk_group[j]]));
    if constexpr (K == ScaleKind::channel) return _mm512_mul_ps(x, _mm512_loadu_ps(scales + 16 * j));
    return x;
}

// Chunk j of a row (channels 16j..16j+15) as attention reads it: level * scale. An INT4 row with
// group scales looks its nibbles up in a table of the sixteen levels times the group's scale: a
// multiply and a permute for sixteen channels in place of a shift, a conversion and a multiply
// (the same exact products; the score and value passes ran ~17% faster, bench_runtime's kernels
// alone on L2-resident rows). Tables built once a block and loaded instead ran slower.
template <int Tier, ScaleKind K>
inline __m512 values16(const void* row, int j, const float* scales, const int* chunk_group) {
    if constexpr (Tier == 2 && K == ScaleKind::group) {
        uint64_t word;
        std::memcpy(&word, static_cast<const uint8_t*>(row) + 8 * j, sizeof word);
        // Lane i's low byte takes bits 4i..4i+7: nibble i in its low four bits, all the permute reads.
        const __m512i control = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);
        const __m512i nibbles = _mm512_multishift_epi64_epi8(control, _mm512_set1_epi64(static_cast<long long>(word)));
        const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
        const __m512 table = _mm512_mul_ps(levels, _mm512_set1_ps(scales[chunk_group[j]]));
        return _mm512_permutexvar_ps(nibbles, table);
    } else {
        return scaled<K>(widen16<Tier>(row, 16 * j), scales, j, chunk_group);
    }
}

// Sixteen lanes to eight (the halves added), for sum4.
inline __m256 halves(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}

template <int G, int H>
inline __m256 head_or_zero(const __m512 (&acc)[G]) {
    if constexpr (H < G) return halves(acc[H]);
    return _mm256_setzero_ps();
}

// Rows a score pass takes side by side: up to sixteen accumulators (rows x heads) in flight.
template <int G>
constexpr int kRowsAtOnce = G <= 2 ? 8 : G <= 4 ? 4 : 2;

template <int Tier, ScaleKind K, int G, int RW>
inline void score_rows_at(const TierRows& t, const Block& b, int i0, const float* q, float scale, float* scores,
                          std::size_t stride, __m128 (&peak)[2], const int* chunk_group) {
    const int d = t.head_dim, chunks = d / 16;
    const void* row[RW];
    const float* sc[RW];
#pragma GCC unroll 8
    for (int w = 0; w < RW; ++w) {
        row[w] = row_data<Tier>(t, static_cast<std::size_t>(b.first + i0 + w));
        sc[w] = scales_of<K>(t, b, i0 + w);
    }
    // These rows' successors a block ahead start coming into L1 (as the value pass's).
    const std::size_t row_bytes = Tier == 0 ? static_cast<std::size_t>(d) * 2 : static_cast<std::size_t>(t.row_bytes);
#pragma GCC unroll 8
    for (int w = 0; w < RW; ++w) {
        if (b.first + i0 + w + kKernelBlock >= t.count) break;
        const char* ahead = static_cast<const char*>(row_data<Tier>(t, static_cast<std::size_t>(b.first + i0 + w + kKernelBlock)));
        for (std::size_t at = 0; at < row_bytes; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
    }
    __m512 acc[RW][G];
#pragma GCC unroll 8
    for (int w = 0; w < RW; ++w)
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) acc[w][h] = _mm512_setzero_ps();
    for (int j = 0; j < chunks; ++j) {
        __m512 k[RW];
#pragma GCC unroll 8
        for (int w = 0; w < RW; ++w) k[w] = values16<Tier, K>(row[w], j, sc[w], chunk_group);
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) {
            __m512 qh = _mm512_loadu_ps(q + static_cast<std::size_t>(h) * d + 16 * j);
            // Held in a register: GCC otherwise folds the load into each row's FMA, RW loads of
            // the same numbers where one serves (the score pass ran ~1.4x slower with them).
            asm("" : "+v"(qh));
#pragma GCC unroll 8
            for (int w = 0; w < RW; ++w) acc[w][h] = _mm512_fmadd_ps(qh, k[w], acc[w][h]);
        }
    }
    const __m128 scale4 = _mm_set1_ps(scale);
#pragma GCC unroll 8
    for (int w = 0; w < RW; ++w) {
        const std::size_t r = static_cast<std::size_t>(b.first + i0 + w);
        alignas(16) float dot[8];
        __m128 lo = _mm_mul_ps(sum4(halves(acc[w][0]), head_or_zero<G, 1>(acc[w]), head_or_zero<G, 2>(acc[w]),
                                    head_or_zero<G, 3>(acc[w])),
                               scale4);
        peak[0] = _mm_max_ps(peak[0], lo);
        _mm_store_ps(dot, lo);
        if constexpr (G > 4) {
            const __m128 hi = _mm_mul_ps(sum4(halves(acc[w][4]), head_or_zero<G, 5>(acc[w]), head_or_zero<G, 6>(acc[w]),
                                              head_or_zero<G, 7>(acc[w])),
                                         scale4);
            peak[1] = _mm_max_ps(peak[1], hi);
            _mm_store_ps(dot + 4, hi);
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) scores[h * stride + r] = dot[h];
    }
}

template <int Tier, ScaleKind K, int G>
void score_tier(const TierRows& t, const float* q, float scale, float* scores, std::size_t stride, float* peaks,
                float* scratch) {
    constexpr int RW = kRowsAtOnce<G>;
    int chunk_group[kMaxChunks];
    chunk_groups<16>(t, chunk_group);
    __m128 peak[2] = {_mm_set1_ps(-INFINITY), _mm_set1_ps(-INFINITY)};
    for (int first = 0; first < t.count; first += kKernelBlock) {
        const int rows = std::min(kKernelBlock, t.count - first);
        prefetch_rows(t, first);
        const Block b = prepare<K>(t, first, rows, scratch);
        int i = 0;
        for (; i + RW <= rows; i += RW)
            avx512::score_rows_at<Tier, K, G, RW>(t, b, i, q, scale, scores, stride, peak, chunk_group);
        for (; i < rows; ++i)
            avx512::score_rows_at<Tier, K, G, 1>(t, b, i, q, scale, scores, stride, peak, chunk_group);
    }
    alignas(16) float lanes[8];
    _mm_store_ps(lanes, peak[0]);
    _mm_store_ps(lanes + 4, peak[1]);
    for (int h = 0; h < G; ++h) peaks[h] = std::max(peaks[h], lanes[h]);
}

// Chunks of sixteen channels a value pass keeps in flight for every head: up to sixteen accumulators.
template <int G>
constexpr int kChunksAtOnce = G >= 5 ? 2 : G >= 3 ? 4 : 16 / (2 * G);

template <int Tier, ScaleKind K, int G, int S>
inline void accumulate_slice(const TierRows& t, const Block& b, int j0, const float* weights, float* out,
                             const int* chunk_group) {
    const int d = t.head_dim;
    __m512 acc[S][G];
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) acc[s][h] = _mm512_loadu_ps(out + static_cast<std::size_t>(h) * d + 16 * (j0 + s));
    // The slice's bytes of the row a block ahead start coming into L1, one row an iteration (a
    // whole block's at once filled the core's line buffers ahead of its own loads).
    constexpr int kBytesPerChannel2 = Tier == 0 ? 4 : Tier == 1 ? 2 : 1;  // twice the bytes a channel
    const std::size_t slice_offset = static_cast<std::size_t>(16 * j0) * kBytesPerChannel2 / 2;
    const std::size_t slice_bytes = static_cast<std::size_t>(16 * S) * kBytesPerChannel2 / 2;
    for (int i = 0; i < b.rows; ++i) {
        const void* row = row_data<Tier>(t, static_cast<std::size_t>(b.first + i));
        if (b.first + i + kKernelBlock < t.count) {
            const char* ahead =
                static_cast<const char*>(row_data<Tier>(t, static_cast<std::size_t>(b.first + i + kKernelBlock))) +
                slice_offset;
            for (std::size_t at = 0; at < slice_bytes; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
        }
        const float* sc = scales_of<K>(t, b, i);
        __m512 w[G];
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) {
            w[h] = _mm512_set1_ps(weights[i * G + h]);
            asm("" : "+v"(w[h]));  // one broadcast a row, not one per FMA (as the query above)
        }
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) {
            const __m512 v = values16<Tier, K>(row, j0 + s, sc, chunk_group);
#pragma GCC unroll 8
            for (int h = 0; h < G; ++h) acc[s][h] = _mm512_fmadd_ps(w[h], v, acc[s][h]);
        }
    }
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) _mm512_storeu_ps(out + static_cast<std::size_t>(h) * d + 16 * (j0 + s), acc[s][h]);
}

template <int Tier, ScaleKind K, int G>
void accumulate_tier(const TierRows& t, const float* weights, std::size_t stride, const int32_t* index_of_slot,
                     float* out, float* scratch) {
    constexpr int S = kChunksAtOnce<G>;
    const int chunks = t.head_dim / 16;
    int chunk_group[kMaxChunks];
    chunk_groups<16>(t, chunk_group);
    float* block_weights = scratch + static_cast<std::size_t>(kKernelBlock) * (t.groups + 8 + t.head_dim);
    for (int first = 0; first < t.count; first += kKernelBlock) {
        const int rows = std::min(kKernelBlock, t.count - first);
        prefetch_rows(t, first);
        const Block b = prepare<K>(t, first, rows, scratch);
        for (int i = 0; i < rows; ++i) {  // each row's weights, wherever its key's score lies
            const std::size_t at = static_cast<std::size_t>(index_of_slot[t.slot_of_row[first + i]]);
            for (int h = 0; h < G; ++h) block_weights[i * G + h] = weights[h * stride + at];
        }
        int j = 0;
        for (; j + S <= chunks; j += S) avx512::accumulate_slice<Tier, K, G, S>(t, b, j, block_weights, out, chunk_group);
        for (; j < chunks; ++j) avx512::accumulate_slice<Tier, K, G, 1>(t, b, j, block_weights, out, chunk_group);
    }
}

template <int G>
void score_group(const TierRows& t, const float* q, float scale, float* scores, std::size_t stride, float* peaks,
                 float* scratch) {
    switch (t.tier * 3 + static_cast<int>(scale_kind<16>(t))) {
        case 0: return avx512::score_tier<0, ScaleKind::none, G>(t, q, scale, scores, stride, peaks, scratch);
        case 4: return avx512::score_tier<1, ScaleKind::group, G>(t, q, scale, scores, stride, peaks, scratch);
        case 5: return avx512::score_tier<1, ScaleKind::channel, G>(t, q, scale, scores, stride, peaks, scratch);
        case 7: return avx512::score_tier<2, ScaleKind::group, G>(t, q, scale, scores, stride, peaks, scratch);
        case 8: return avx512::score_tier<2, ScaleKind::channel, G>(t, q, scale, scores, stride, peaks, scratch);
        default: throw std::logic_error("attention kernels: unknown tier");
    }
}

template <int G>
void accumulate_group(const TierRows& t, const float* weights, std::size_t stride, const int32_t* index_of_slot,
                      float* out, float* scratch) {
    switch (t.tier * 3 + static_cast<int>(scale_kind<16>(t))) {
        case 0: return avx512::accumulate_tier<0, ScaleKind::none, G>(t, weights, stride, index_of_slot, out, scratch);
        case 4: return avx512::accumulate_tier<1, ScaleKind::group, G>(t, weights, stride, index_of_slot, out, scratch);
        case 5: return avx512::accumulate_tier<1, ScaleKind::channel, G>(t, weights, stride, index_of_slot, out, scratch);
        case 7: return avx512::accumulate_tier<2, ScaleKind::group, G>(t, weights, stride, index_of_slot, out, scratch);
        case 8: return avx512::accumulate_tier<2, ScaleKind::channel, G>(t, weights, stride, index_of_slot, out, scratch);
        default: throw std::logic_error("attention kernels: unknown tier");
    }
}

}  // namespace avx512

void score_rows_avx512(const TierRows& t, const float* q, int group, float scale, float* scores, std::size_t stride,
                       float* peaks, float* scratch) {
    for (int h0 = 0; h0 < group; h0 += 8) {
        const int g = std::min(8, group - h0);
        by_group_size(g, [&](auto size) {
            avx512::score_group<decltype(size)::value>(t, q + static_cast<std::size_t>(h0) * t.head_dim, scale,
                                                       scores + h0 * stride, stride, peaks + h0, scratch);
        });
    }
}

void accumulate_rows_avx512(const TierRows& t, const float* weights, std::size_t stride, const int32_t* index_of_slot,
                            int group, float* out, float* scratch) {
    for (int h0 = 0; h0 < group; h0 += 8) {
        const int g = std::min(8, group - h0);
        by_group_size(g, [&](auto size) {
            avx512::accumulate_group<decltype(size)::value>(t, weights + h0 * stride, stride, index_of_slot,
                                                            out + static_cast<std::size_t>(h0) * t.head_dim, scratch);
        });
    }
}
#endif

#if defined(KVSIM_AMX_KERNELS)
// INT8 and INT4 keys scored by the CPU's tile unit (AMX: Sapphire Rapids and later), which takes a
// 16 x 64 block of int8 times a 64 x 16 one in one instruction: sixteen rows against sixteen
// columns. The columns are a query group's heads, each split exactly into four int8 parts
// (q_h = a_h (p0 + p1 2^-7 + p2 2^-14 + p3 2^-21) to within a_h 2^-22, a_h a power of two with
// |q_h| <= 127 a_h), so the integer sums are the stored levels' dot products with the query to
// 2^-29 of its largest number: below float rounding, where one int8 query (2^-8) is not. Each
// scale group's sums become floats and take the row's scale; the four parts then add. The
// weighted values are the AVX-512 pass: a row's weights differ for every head and scale group.
namespace amx {

// Whether the CPU has the tile unit and Linux lets this process use it (its state is large, so a
// process asks for it once).
bool usable() {
    static const bool granted = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
        constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
        constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
        return tile && int8 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
    }();
    return granted;
}

// The tile unit's shapes (palette 1): tile 0 the sums (16 rows x 16 int32), tile 1 sixteen rows'
// levels (16 x K bytes), tile 2 the query's parts (K/4 rows x 16 columns of 4 bytes).
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_a_row[16] = {};
    uint8_t rows[16] = {};
};

// Scale groups a row may have for the tile path: each group's sums have a tile of their own (0-3).
constexpr int kMostTileGroups = 4;

// The channels one tile product takes (a scale group, or 64 of it), or 0 where tiles do not serve:
// per-channel (KIVI) scales, groups that do not divide the row in whole fours, INT4 rows that are
// not whole 64s of channels (the unpacking takes 64 at a time).
int channels_a_product(const TierRows& t) {
    if (t.tier == 0 || t.groups == 0 || t.channel_scales) return 0;
    const int group = t.group_channels, d = t.head_dim;
    if (group <= 0 || group % 4 != 0 || d % group != 0 || (t.tier == 2 && d % 64 != 0)) return 0;
    const int k = std::min(group, 64);
    return group % k == 0 && t.groups <= kMostTileGroups ? k : 0;
}

// Query heads q[0..n) (n <= 4) as the tile product's right-hand matrix, 16 columns: column 4s + h
// holds part s of head h (zero for h >= n), row k/4 holds channels k..k+3 of every column, four
// bytes a column. column_scale[4s + h] = a_h 2^-7s. False where a head is not finite or so large
// or small that a_h would leave float's range.
bool split_query(const float* q, int n, int d, int8_t* parts, int8_t* matrix, float* column_scale) {
    // Channels c..c+15 that the row has.
    const auto lanes_at = [d](int c) { return d - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - c)) - 1); };
    for (int h = 0; h < 4; ++h) {
        __m512 big = _mm512_setzero_ps();
        __mmask16 not_a_number = 0;
        for (int c = 0; h < n && c < d; c += 16) {
            const __m512 x = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes_at(c), q + h * d + c));
            big = _mm512_max_ps(big, x);
            not_a_number |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        }
        const float largest = _mm512_reduce_max_ps(big);
        if (not_a_number || !std::isfinite(largest)) return false;
        int e = 0;  // a_h = 2^e, the least power of two with 127 a_h >= the largest
        if (largest > 0.0f) {
            e = std::ilogb(largest) - 6;
            while (std::ldexp(127.0f, e) < largest) ++e;
            while (std::ldexp(127.0f, e - 1) >= largest) --e;
            if (e < -100 || e > 100) return false;
        }
        const __m512 inverse = _mm512_set1_ps(std::ldexp(1.0f, -e)), step = _mm512_set1_ps(128.0f);
        for (int c = 0; c < d; c += 16) {
            const __mmask16 lanes = lanes_at(c);
            __m512 y = h < n ? _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, q + h * d + c), inverse) : _mm512_setzero_ps();
            for (int s = 0; s < 4; ++s) {  // each part the nearest integer, the rest (exact) scaled up
                const __m512 part = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                y = _mm512_mul_ps(_mm512_sub_ps(y, part), step);
                _mm_mask_storeu_epi8(parts + (4 * s + h) * d + c, lanes, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(part)));
            }
        }
        for (int s = 0; s < 4; ++s) column_scale[4 * s + h] = h < n ? std::ldexp(1.0f, e - 7 * s) : 0.0f;
    }
    for (int k4 = 0; k4 < d / 4; ++k4)
        for (int column = 0; column < 16; ++column)
            std::memcpy(matrix + k4 * 64 + 4 * column, parts + column * d + 4 * k4, 4);
    return true;
}

// Sixteen INT4 rows from row `first` as signed bytes in channel order, d bytes a row.
void unpack_int4(const TierRows& t, int first, int8_t* out) {
    const int d = t.head_dim;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i level = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
    const __m512i first_half = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second_half = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int i = 0; i < 16; ++i) {
        const uint8_t* row = t.levels + static_cast<std::size_t>(first + i) * t.row_bytes;
        int8_t* to = out + static_cast<std::size_t>(i) * d;
        int c = 0;
        for (; c + 128 <= d; c += 128) {
            // Byte b holds channels 2b (low nibble) and 2b + 1: the nibbles looked up as levels, then
            // interleaved, which leaves each 128-bit lane's 32 channels split over two registers.
            const __m512i x = _mm512_loadu_si512(row + c / 2);
            const __m512i lo = _mm512_shuffle_epi8(level, _mm512_and_si512(x, low4));
            const __m512i hi = _mm512_shuffle_epi8(level, _mm512_and_si512(_mm512_srli_epi16(x, 4), low4));
            const __m512i u = _mm512_unpacklo_epi8(lo, hi), v = _mm512_unpackhi_epi8(lo, hi);
            _mm512_storeu_si512(to + c, _mm512_permutex2var_epi64(u, first_half, v));
            _mm512_storeu_si512(to + c + 64, _mm512_permutex2var_epi64(u, second_half, v));
        }
        if (c < d) {  // 64 channels left
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c / 2));
            const __m256i lo = _mm256_shuffle_epi8(_mm512_castsi512_si256(level), _mm256_and_si256(x, _mm512_castsi512_si256(low4)));
            const __m256i hi = _mm256_shuffle_epi8(_mm512_castsi512_si256(level),
                                                   _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm512_castsi512_si256(low4)));
            const __m256i u = _mm256_unpacklo_epi8(lo, hi), v = _mm256_unpackhi_epi8(lo, hi);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + c), _mm256_permute2x128_si256(u, v, 0x20));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + c + 32), _mm256_permute2x128_si256(u, v, 0x31));
        }
    }
}

// Sixteen rows' column sums (acc[r], lane 4s + h) to each head's sixteen scores, head[h] lane r:
// the four parts of a head added as (p0 + p2) + (p1 + p3).
inline void heads_of_columns(const __m512 (&acc)[16], __m512 (&head)[4]) {
    __m512 by_row[4];  // by_row[i] lane 4j + h: row 4i + j, head h
    for (int i = 0; i < 4; ++i) {
        __m512 pair[2];
        for (int p = 0; p < 2; ++p) {
            const __m512 a = acc[4 * i + 2 * p], b = acc[4 * i + 2 * p + 1];
            pair[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
        }
        by_row[i] = _mm512_add_ps(_mm512_shuffle_f32x4(pair[0], pair[1], 0x88),
                                  _mm512_shuffle_f32x4(pair[0], pair[1], 0xDD));
    }
    const __m512i heads01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i heads23 = _mm512_add_epi32(heads01, _mm512_set1_epi32(2));
    const __m512 lo_a = _mm512_permutex2var_ps(by_row[0], heads01, by_row[1]);
    const __m512 hi_a = _mm512_permutex2var_ps(by_row[0], heads23, by_row[1]);
    const __m512 lo_b = _mm512_permutex2var_ps(by_row[2], heads01, by_row[3]);
    const __m512 hi_b = _mm512_permutex2var_ps(by_row[2], heads23, by_row[3]);
    head[0] = _mm512_shuffle_f32x4(lo_a, lo_b, 0x44);
    head[1] = _mm512_shuffle_f32x4(lo_a, lo_b, 0xEE);
    head[2] = _mm512_shuffle_f32x4(hi_a, hi_b, 0x44);
    head[3] = _mm512_shuffle_f32x4(hi_a, hi_b, 0xEE);
}

// The tile unit's registers are named in its instructions: sums of up to four scale groups at once
// in tiles 0-3, a group's levels in tile 4, the query's parts in tile 5.
inline void zero_sums(int j) {
    switch (j) {
        case 0: _tile_zero(0); break;
        case 1: _tile_zero(1); break;
        case 2: _tile_zero(2); break;
        default: _tile_zero(3); break;
    }
}
inline void add_product(int j) {
    switch (j) {
        case 0: _tile_dpbssd(0, 4, 5); break;
        case 1: _tile_dpbssd(1, 4, 5); break;
        case 2: _tile_dpbssd(2, 4, 5); break;
        default: _tile_dpbssd(3, 4, 5); break;
    }
}
inline void store_sums(int j, int32_t* to) {
    switch (j) {
        case 0: _tile_stored(0, to, 64); break;
        case 1: _tile_stored(1, to, 64); break;
        case 2: _tile_stored(2, to, 64); break;
        default: _tile_stored(3, to, 64); break;
    }
}

// Scores of up to eight query heads over a quantised tier's whole sixteens of rows; the rows past
// them go to the AVX-512 kernels. False: nothing was written (the query is not finite, or too
// large or small for its parts). The tile unit's work for one set of sixteen rows and four heads
// is issued before the vector code turns the previous set's integer sums into scores, so the two
// overlap instead of each waiting on the other's stores.
template <int Tier>
bool score_heads(const TierRows& t, const float* q, int group, float scale, float* scores, std::size_t stride,
                 float* peaks, float* scratch, int k) {
    const int d = t.head_dim, groups = t.groups, products = t.group_channels / k, chunks = (group + 3) / 4;
    int8_t* matrix = reinterpret_cast<int8_t*>(scratch + static_cast<std::size_t>(kKernelBlock) * (groups + 8));
    int8_t* rows_or_parts = matrix + 2 * 16 * d;  // the query's parts first, then INT4 rows unpacked
    // Two sets of every group's 16 x 16 sums and their rows' scales: a fixed 8.5 KiB a thread, kept
    // out of each head's scratch (which grows with the head size only).
    alignas(64) static thread_local int32_t sums[2 * kMostTileGroups * 256];
    alignas(64) static thread_local float row_scales[2 * 16 * kMostTileGroups];
    __m512 column_scale[2];
    for (int c = 0; c < chunks; ++c) {
        alignas(64) float scales[16];
        if (!split_query(q + static_cast<std::size_t>(4 * c) * d, std::min(4, group - 4 * c), d, rows_or_parts,
                         matrix + c * 16 * d, scales))
            return false;
        column_scale[c] = _mm512_mul_ps(_mm512_load_ps(scales), _mm512_set1_ps(scale));
    }
    TileConfig config;
    for (int j = 0; j < 4; ++j) config.rows[j] = 16, config.bytes_a_row[j] = 64;
    config.rows[4] = 16, config.bytes_a_row[4] = static_cast<uint16_t>(k);
    config.rows[5] = static_cast<uint8_t>(k / 4), config.bytes_a_row[5] = 64;
    _tile_loadconfig(&config);

    // Rows from row0, query heads 4c..4c+3: every group's integer sums, into tiles 0..groups-1.
    auto multiply = [&](int row0, int c, int scales_set) {
        const int8_t* levels;
        long row_stride;
        if constexpr (Tier == 1) {
            levels = reinterpret_cast<const int8_t*>(t.levels) + static_cast<std::size_t>(row0) * t.row_bytes;
            row_stride = t.row_bytes;
        } else {
            if (c == 0) unpack_int4(t, row0, rows_or_parts);
            levels = rows_or_parts;
            row_stride = d;
        }
        for (int g = 0; g < groups; ++g) zero_sums(g);
        for (int g = 0; g < groups; ++g)
            for (int p = 0; p < products; ++p) {
                const int m = g * products + p;
                _tile_loadd(4, levels + m * k, row_stride);
                _tile_loadd(5, matrix + c * 16 * d + m * (k / 4) * 64, 64);
                add_product(g);
            }
        if (c == 0)
            halves_to_floats(t.scales + static_cast<std::size_t>(row0) * groups, 16 * groups,
                             row_scales + scales_set * 16 * groups);
    };
    auto store = [&](int set) {
        for (int g = 0; g < groups; ++g) store_sums(g, sums + set * kMostTileGroups * 256 + g * 256);
    };
    __m512 peak[8];
    for (__m512& p : peak) p = _mm512_set1_ps(-INFINITY);
    // Those sums, each group's times its rows' scales, to the four heads' scores.
    auto finish = [&](int row0, int c, int set, int scales_set) {
        const int32_t* from = sums + set * kMostTileGroups * 256;
        const float* scales_of_rows = row_scales + scales_set * 16 * groups;
        __m512 acc[16];
        for (__m512& a : acc) a = _mm512_setzero_ps();
        for (int g = 0; g < groups; ++g)
            for (int r = 0; r < 16; ++r)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(from + g * 256 + 16 * r)),
                                         _mm512_set1_ps(scales_of_rows[r * groups + g]), acc[r]);
        for (__m512& a : acc) a = _mm512_mul_ps(a, column_scale[c]);
        __m512 head[4];
        heads_of_columns(acc, head);
        for (int h = 0; h < std::min(4, group - 4 * c); ++h) {
            _mm512_storeu_ps(scores + static_cast<std::size_t>(4 * c + h) * stride + row0, head[h]);
            peak[4 * c + h] = _mm512_max_ps(peak[4 * c + h], head[h]);
        }
    };
    const int whole = t.count / 16 * 16;
    // The vector code reads a set's sums only after the tile unit has the next set's products in
    // hand: a load waits for every tile store before it, so the stores come after the reading.
    int previous_row = -1, previous_chunk = 0, previous_scales = 0, set = 0, scales_set = 0;
    for (int row0 = 0; row0 < whole; row0 += 16) {
        if (row0 % kKernelBlock == 0) prefetch_rows(t, row0);
        // Tile loads wait on each line they miss in L1, so sixteen rows come into L1 four sets ahead.
        if (row0 + 80 <= t.count) {
            const char* ahead = reinterpret_cast<const char*>(t.levels) + static_cast<std::size_t>(row0 + 64) * t.row_bytes;
            for (int at = 0; at < 16 * t.row_bytes; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
        }
        for (int c = 0; c < chunks; ++c) {
            if (c == 0) scales_set = (row0 / 16) & 1;
            multiply(row0, c, scales_set);
            if (previous_row >= 0) finish(previous_row, previous_chunk, set ^ 1, previous_scales);
            store(set);
            previous_row = row0, previous_chunk = c, previous_scales = scales_set, set ^= 1;
        }
    }
    if (previous_row >= 0) finish(previous_row, previous_chunk, set ^ 1, previous_scales);
    _tile_release();
    for (int h = 0; h < group; ++h) peaks[h] = std::max(peaks[h], _mm512_reduce_max_ps(peak[h]));
    if (whole < t.count) {
        TierRows rest = t;
        rest.count = t.count - whole;
        rest.levels = t.levels + static_cast<std::size_t>(whole) * t.row_bytes;
        rest.scales = t.scales + static_cast<std::size_t>(whole) * groups;
        rest.slot_of_row = t.slot_of_row + whole;
        score_rows_avx512(rest, q, group, scale, scores + whole, stride, peaks, scratch);
    }
    return true;
}

void score_rows_amx(const TierRows& t, const float* q, int group, float scale, float* scores, std::size_t stride,
                    float* peaks, float* scratch) {
    const int k = channels_a_product(t);
    for (int h0 = 0; h0 < group; h0 += 8) {
        const int g = std::min(8, group - h0);
        const float* qh = q + static_cast<std::size_t>(h0) * t.head_dim;
        const bool done = k > 0 && (t.tier == 1 ? score_heads<1>(t, qh, g, scale, scores + h0 * stride, stride,
                                                                 peaks + h0, scratch, k)
                                                : score_heads<2>(t, qh, g, scale, scores + h0 * stride, stride,
                                                                 peaks + h0, scratch, k));
        if (!done) score_rows_avx512(t, qh, g, scale, scores + h0 * stride, stride, peaks + h0, scratch);
    }
}

}  // namespace amx
#endif

}  // namespace

float reciprocal_of_sum(const float* x, std::size_t n) {
    __m256d sums[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int a = 0; a < 4; ++a) sums[a] = _mm256_add_pd(sums[a], _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * a)));
    const __m256d all = _mm256_add_pd(_mm256_add_pd(sums[0], sums[1]), _mm256_add_pd(sums[2], sums[3]));
    double lanes[4];
    _mm256_storeu_pd(lanes, all);
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; i < n; ++i) total += x[i];
    return static_cast<float>(1.0 / total);
}

#else

float reciprocal_of_sum(const float* x, std::size_t n) {
    double total = 0;
    for (std::size_t i = 0; i < n; ++i) total += x[i];
    return static_cast<float>(1.0 / total);
}

#endif

std::vector<KernelSet> kernel_sets() {
    std::vector<KernelSet> sets{KernelSet::portable};
#if defined(KVSIM_VECTOR_KERNELS)
    sets.push_back(KernelSet::avx2);
#endif
#if defined(KVSIM_AVX512_KERNELS)
    sets.push_back(KernelSet::avx512);
#endif
#if defined(KVSIM_AMX_KERNELS)
    if (amx::usable()) sets.push_back(KernelSet::amx);
#endif
    return sets;
}

const char* kernel_set_name(KernelSet set) {
    switch (set) {
        case KernelSet::avx2: return "AVX2+FMA+F16C";
        case KernelSet::avx512: return "AVX-512 (F, BW, DQ, VL, VBMI)";
        case KernelSet::amx: return "AVX-512 with AMX tiles for INT8/INT4 keys";
        default: return "portable";
    }
}

bool vector_kernels() { return kernel_sets().back() != KernelSet::portable; }

// Which kernels take a tier's rows: the set asked for where it serves this head size, else the
// next below it (AVX-512 takes whole sixteens of channels, AVX2 up to 2048).
void score_rows_with([[maybe_unused]] KernelSet set, const TierRows& t, const float* q, int group, float scale,
                     float* scores, std::size_t stride, float* peaks, float* scratch) {
    check_rows(t);
    if (t.count == 0) return;
#if defined(KVSIM_AVX512_KERNELS)
    if ((set == KernelSet::avx512 || set == KernelSet::amx) && t.head_dim % 16 == 0 && t.head_dim / 16 <= kMaxChunks) {
#if defined(KVSIM_AMX_KERNELS)
        if (set == KernelSet::amx && amx::usable())
            return amx::score_rows_amx(t, q, group, scale, scores, stride, peaks, scratch);
#endif
        return score_rows_avx512(t, q, group, scale, scores, stride, peaks, scratch);
    }
#endif
#if defined(KVSIM_VECTOR_KERNELS)
    if (set != KernelSet::portable && t.head_dim / 8 <= kMaxChunks)
        return score_rows_avx2(t, q, group, scale, scores, stride, peaks, scratch);
#endif
    score_rows_portable(t, q, group, scale, scores, stride, peaks, scratch);
}

void accumulate_rows_with([[maybe_unused]] KernelSet set, const TierRows& t, const float* weights,
                          std::size_t stride, const int32_t* index_of_slot, int group, float* out, float* scratch) {
    check_rows(t);
    if (t.count == 0) return;
#if defined(KVSIM_AVX512_KERNELS)
    if ((set == KernelSet::avx512 || set == KernelSet::amx) && t.head_dim % 16 == 0 && t.head_dim / 16 <= kMaxChunks)
        return accumulate_rows_avx512(t, weights, stride, index_of_slot, group, out, scratch);
#endif
#if defined(KVSIM_VECTOR_KERNELS)
    if (set != KernelSet::portable && t.head_dim / 8 <= kMaxChunks)
        return accumulate_rows_avx2(t, weights, stride, index_of_slot, group, out, scratch);
#endif
    accumulate_rows_portable(t, weights, stride, index_of_slot, group, out, scratch);
}

void score_rows(const TierRows& t, const float* q, int group, float scale, float* scores, std::size_t stride,
                float* peaks, float* scratch) {
    static const KernelSet best = kernel_sets().back();
    // Splitting the query for the tile unit costs about what 256 rows' scores gain (0.5-1 us a
    // KV head, bench_runtime's shape on a Xeon with AMX); shorter tiers take the vector kernels.
    constexpr int kLeastTileRows = 256;
    if (best == KernelSet::amx && t.count < kLeastTileRows)
        return score_rows_with(KernelSet::avx512, t, q, group, scale, scores, stride, peaks, scratch);
    score_rows_with(best, t, q, group, scale, scores, stride, peaks, scratch);
}

void accumulate_rows(const TierRows& t, const float* weights, std::size_t stride, const int32_t* index_of_slot,
                     int group, float* out, float* scratch) {
    static const KernelSet best = kernel_sets().back();
    accumulate_rows_with(best, t, weights, stride, index_of_slot, group, out, scratch);
}

}  // namespace kvsim::runtime
