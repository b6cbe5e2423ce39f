#include "sim/heavy_hitters.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <climits>
#include <functional>

namespace kvsim {
namespace {

// Weights are ranked by an integer key: IEEE 754 totalOrder (-NaN < -Inf < ... < -0 < +0 < ... <
// +Inf < +NaN). Integer comparisons form a strict weak order on any bits, so the heap and the
// counts below stay consistent on NaN, Inf, negative or denormal input (float comparisons do not:
// a NaN threshold once let the tie fill read past its list). For finite weights >= +0, the
// attention a trace holds, the key is the float's bit pattern, which orders and ties exactly as
// the floats do: results on valid input are unchanged.
inline int32_t rank_key(float x) {
    int32_t bits;
    std::memcpy(&bits, &x, 4);
    return bits ^ ((bits >> 31) & INT32_MAX);  // negative floats order in reverse; branch-free
}

// Whether any of row[0..16) may have a key above (or, or_equal, at) floor_key. A float with the sign
// bit clear has its bits as its key, and one with it set has a negative key and negative bits, so
// for floor_key >= 0 comparing the raw bits as integers (which vectorises, where NaN rules keep
// float comparisons from it) is exact; a negative floor only costs a scan.
inline bool block_may_pass(const float* row, int32_t floor_key, bool or_equal) {
    if (floor_key < 0) return true;
    const int32_t floor_bits = or_equal ? floor_key - 1 : floor_key;  // x >= f <=> x > f - 1 (no wrap: f >= 0)
#if defined(__AVX512F__)
    const __m512i block = _mm512_loadu_si512(row);
    return _mm512_cmpgt_epi32_mask(block, _mm512_set1_epi32(floor_bits)) != 0;
#elif defined(__AVX2__)
    const __m256i f = _mm256_set1_epi32(floor_bits);
    const __m256i lo = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), f);
    const __m256i hi = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8)), f);
    return !_mm256_testz_si256(_mm256_or_si256(lo, hi), _mm256_or_si256(lo, hi));
#else
    int32_t bits[16];
    std::memcpy(bits, row, sizeof bits);
    int any = 0;
    for (int l = 0; l < 16; ++l) any |= bits[l] > floor_bits;
    return any != 0;
#endif
}

// keys[i] = the key of row[candidates[i]].
void keys_of(std::span<const float> row, std::span<const int32_t> candidates, std::vector<int32_t>& keys) {
    keys.resize(candidates.size());
    for (std::size_t i = 0; i < candidates.size(); ++i) keys[i] = rank_key(row[candidates[i]]);
}

// Appends to `out` the positions of `candidates` (ascending; keys[i] is candidates[i]'s key) with
// a key above `threshold`, then those equal to it, in ascending order, until `want` are chosen:
// the reference's tie rule. With AVX-512 the two are sorted apart with vector comparisons and
// compressions, in the same order, without a branch per candidate to mispredict.
void emit_selection(std::span<const int32_t> candidates, const int32_t* keys, int32_t threshold, std::size_t want,
                    std::vector<int32_t>& out) {
#if defined(__AVX512F__)
    const std::size_t first_out = out.size(), n = candidates.size();
    thread_local std::vector<int32_t> ties;
    // Room for a whole vector's store past the last candidate taken.
    out.resize(first_out + n + 16);
    ties.resize(n + 16);
    int32_t* above = out.data() + first_out;
    int32_t* tied = ties.data();
    const __m512i at = _mm512_set1_epi32(threshold);
    for (std::size_t i = 0; i < n; i += 16) {
        const __mmask16 in = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
        const __m512i key = _mm512_maskz_loadu_epi32(in, keys + i);
        const __m512i position = _mm512_maskz_loadu_epi32(in, candidates.data() + i);
        const __mmask16 is_above = _mm512_mask_cmpgt_epi32_mask(in, key, at);
        const __mmask16 is_tied = _mm512_mask_cmpeq_epi32_mask(in, key, at);
        _mm512_storeu_si512(above, _mm512_maskz_compress_epi32(is_above, position));
        _mm512_storeu_si512(tied, _mm512_maskz_compress_epi32(is_tied, position));
        above += __builtin_popcount(is_above);
        tied += __builtin_popcount(is_tied);
    }
    const std::size_t taken = static_cast<std::size_t>(above - (out.data() + first_out));
    out.resize(first_out + taken);
    out.insert(out.end(), ties.begin(), ties.begin() + static_cast<std::ptrdiff_t>(want - taken));
#else
    const std::size_t first_out = out.size();
    thread_local std::vector<int32_t> ties;
    ties.clear();
    for (std::size_t i = 0; i < candidates.size(); ++i) {
        if (keys[i] > threshold)
            out.push_back(candidates[i]);
        else if (keys[i] == threshold)
            ties.push_back(candidates[i]);
    }
    const std::size_t ties_needed = want - (out.size() - first_out);
    out.insert(out.end(), ties.begin(), ties.begin() + static_cast<std::ptrdiff_t>(ties_needed));
#endif
}

// The hint for the next row: this row's threshold lowered by half a binade (2^22 units of a
// float's bits, a factor of about 0.7). On the Llama-1B-shaped synthetic trace the next row's
// threshold then falls below the hint in 1.6% of rows (27% at an eighth of a binade), and the
// hint passes about 60 candidates for k = 32 (105 at a whole binade).
int32_t lowered_hint(int32_t threshold) {
    return threshold > (1 << 22) ? threshold - (1 << 22) : kNoTopKHint;
}

// The k-th largest key (with multiplicity) of a row: a min-heap of the k largest seen so far.
int32_t kth_largest_key(std::span<const float> row, std::size_t want) {
    const std::size_t n = row.size();
    // Most weights fail the first comparison, so this is about one comparison per weight.
    int32_t heap[256];
    std::vector<int32_t> big_heap;
    int32_t* h = heap;
    if (want > 256) {
        big_heap.resize(want);
        h = big_heap.data();
    }
    // Scanned from the newest position back: attention is heaviest on recent tokens, so the heap's
    // floor rises at once and few older weights get past it. The threshold is the same either way.
    std::transform(row.end() - static_cast<std::ptrdiff_t>(want), row.end(), h, rank_key);
    std::make_heap(h, h + want, std::greater<int32_t>());
    auto offer = [&](float x) {
        const int32_t key = rank_key(x);
        if (key > h[0]) {
            std::pop_heap(h, h + want, std::greater<int32_t>());
            h[want - 1] = key;
            std::push_heap(h, h + want, std::greater<int32_t>());
        }
    };
    // Blocks of 16 are tested with one vectorised comparison: once the heap holds large weights,
    // almost every block is skipped whole.
    std::size_t end = n - want;  // positions [0, end) remain
    for (; end >= 16; end -= 16)
        if (block_may_pass(row.data() + end - 16, h[0], false))
            for (int l = 15; l >= 0; --l) offer(row[end - 16 + l]);
    while (end > 0) offer(row[--end]);
    return h[0];
}

}  // namespace

// Skips blocks of 16 with none (one vector compare each); the buffer grows only.
std::span<const int32_t> positions_at_or_above(std::span<const float> row, int32_t floor_key) {
    const std::size_t n = row.size();
    thread_local std::vector<int32_t> buffer;
    if (buffer.size() < n + 16) buffer.resize(n + 16);  // room for a whole vector past the last
    int32_t* const out = buffer.data();
    std::size_t count = 0;
    auto take = [&](std::size_t j) {
        out[count] = static_cast<int32_t>(j);
        count += rank_key(row[j]) >= floor_key;
    };
    std::size_t j = 0;
#if defined(__AVX512F__)
    if (floor_key >= 0) {
        // Each block of 16: one comparison of the raw bits (exact for floor_key >= 0, as in
        // block_may_pass), then the passing lanes' positions packed together and stored at once,
        // instead of sixteen scalar tests wherever one lane passes. Stored whether or not any
        // passes: which blocks pass follows no pattern a branch predictor learns.
        const __m512i floor_bits = _mm512_set1_epi32(floor_key - 1);
        const __m512i sixteen = _mm512_set1_epi32(16);
        __m512i positions = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (; j + 16 <= n; j += 16) {
            const __mmask16 pass = _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(row.data() + j), floor_bits);
            _mm512_storeu_si512(out + count, _mm512_maskz_compress_epi32(pass, positions));
            count += static_cast<std::size_t>(__builtin_popcount(pass));
            positions = _mm512_add_epi32(positions, sixteen);
        }
        for (; j < n; ++j) take(j);
        return {out, count};
    }
#endif
    for (; j + 16 <= n; j += 16)
        if (block_may_pass(row.data() + j, floor_key, true))
            for (int l = 0; l < 16; ++l) take(j + l);
    for (; j < n; ++j) take(j);
    return {out, count};
}

namespace {

// The row's top `want` positions given its k-th largest key. Fewer than `want` keys lie above it
// and at least `want` at or above it, so the ties always cover what is missing.
void select_at_threshold(std::span<const float> row, int32_t threshold, std::size_t want, std::vector<int32_t>& out) {
    const std::span<const int32_t> candidates = positions_at_or_above(row, threshold);
    thread_local std::vector<int32_t> keys;
    keys_of(row, candidates, keys);
    emit_selection(candidates, keys.data(), threshold, want, out);
}

// The want-th largest of `keys` (with multiplicity; 1 <= want <= keys.size()); keys keep their order.
int32_t kth_largest_of(const std::vector<int32_t>& keys, std::size_t want) {
#if defined(__AVX512F__)
    // A quickselect whose partitions are vector comparisons and compressions, sixteen keys at a
    // time: the keys above a pivot and those below go to two buffers, and the selection goes on in
    // the part that holds the want-th largest (or ends at the pivot, where its copies cover it).
    // Each round removes the pivot's copies at least. Sixteen or fewer are finished by counting,
    // for each, the keys above it: the least key with fewer than `want` above is the want-th.
    const std::size_t n0 = keys.size();
    thread_local std::vector<int32_t> buffers;
    const std::size_t room = n0 + 16;  // a whole vector's store past a part's end
    if (buffers.size() < 4 * room) buffers.resize(4 * room);
    const int32_t* in = keys.data();
    std::size_t n = n0;
    int round = 0;
    while (n > 16) {
        int32_t* above = buffers.data() + (round % 2) * 2 * room;
        int32_t* below = above + room;
        ++round;
        // The median of the first, middle and last keys.
        const int32_t a = in[0], b = in[n / 2], c = in[n - 1];
        const int32_t pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
        const __m512i p = _mm512_set1_epi32(pivot);
        std::size_t n_above = 0, n_below = 0;
        for (std::size_t i = 0; i < n; i += 16) {
            const __mmask16 lanes = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
            const __m512i key = _mm512_maskz_loadu_epi32(lanes, in + i);
            const __mmask16 up = _mm512_mask_cmpgt_epi32_mask(lanes, key, p);
            const __mmask16 down = _mm512_mask_cmplt_epi32_mask(lanes, key, p);
            _mm512_storeu_si512(above + n_above, _mm512_maskz_compress_epi32(up, key));
            _mm512_storeu_si512(below + n_below, _mm512_maskz_compress_epi32(down, key));
            n_above += static_cast<std::size_t>(__builtin_popcount(up));
            n_below += static_cast<std::size_t>(__builtin_popcount(down));
        }
        const std::size_t n_equal = n - n_above - n_below;
        if (want <= n_above) {
            in = above;
            n = n_above;
        } else if (want <= n_above + n_equal) {
            return pivot;
        } else {
            want -= n_above + n_equal;
            in = below;
            n = n_below;
        }
    }
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
    const __m512i all = _mm512_maskz_loadu_epi32(lanes, in);
    int32_t threshold = INT32_MAX;
    for (std::size_t i = 0; i < n; ++i) {
        const int above = __builtin_popcount(_mm512_mask_cmpgt_epi32_mask(lanes, all, _mm512_set1_epi32(in[i])));
        if (static_cast<std::size_t>(above) < want) threshold = std::min(threshold, in[i]);
    }
    return threshold;
#else
    thread_local std::vector<int32_t> selected;
    selected.assign(keys.begin(), keys.end());
    std::nth_element(selected.begin(), selected.begin() + static_cast<std::ptrdiff_t>(want - 1), selected.end(),
                     std::greater<int32_t>());
    return selected[want - 1];
#endif
}

}  // namespace

void top_k_positions(std::span<const float> row, int k, std::vector<int32_t>& out) {
    const std::size_t want = k > 0 ? std::min<std::size_t>(static_cast<std::size_t>(k), row.size()) : 0;
    if (want == 0) return;
    select_at_threshold(row, kth_largest_key(row, want), want, out);
}

void top_k_positions(std::span<const float> row, int k, std::vector<int32_t>& out, int32_t& floor_hint) {
    const std::size_t want = k > 0 ? std::min<std::size_t>(static_cast<std::size_t>(k), row.size()) : 0;
    if (want == 0) return;
    // One pass gathers every position at or above the hint. When there are at least `want`, the
    // k-th largest key is among them: a selection over those few finds it, and they hold every
    // position the output takes. Otherwise the hint was too high, and the heap finds it.
    if (floor_hint > 0)
        top_k_positions(row, k, out, floor_hint, positions_at_or_above(row, floor_hint));
    else
        top_k_positions(row, k, out, floor_hint, {});
}

void top_k_positions(std::span<const float> row, int k, std::vector<int32_t>& out, int32_t& floor_hint,
                     std::span<const int32_t> candidates) {
    const std::size_t want = k > 0 ? std::min<std::size_t>(static_cast<std::size_t>(k), row.size()) : 0;
    if (want == 0) return;
    thread_local std::vector<int32_t> keys;
    if (floor_hint > 0 && candidates.size() >= want) {
        keys_of(row, candidates, keys);
        const int32_t threshold = kth_largest_of(keys, want);  // keys stay in candidates' order
        emit_selection(candidates, keys.data(), threshold, want, out);
        floor_hint = lowered_hint(threshold);
        return;
    }
    const int32_t threshold = kth_largest_key(row, want);
    select_at_threshold(row, threshold, want, out);
    floor_hint = lowered_hint(threshold);
}

}  // namespace kvsim
