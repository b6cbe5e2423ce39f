// SnapKV: Li et al. 2024 (NeurIPS); the algorithm is described in snapkv.h.
#include "policies/snapkv.h"

#include <algorithm>
#include <cstring>
#include <limits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvsim {

namespace {
// The bits of the smallest weight w for which any `steps` weights, each +0 or in [w, 2), sum
// exactly in double in any order. For w = 2^e a weight's last bit is at least 2^(e - 23), so every
// partial sum is a multiple of it below 2 * steps, and a double holds every such multiple below
// 2^(e + 30) exactly: the least e with 2 * steps <= 2^(e + 30). At most 2.0f: only +0 then.
uint32_t smallest_summable_bits(int steps) {
    int log2_bound = 0;
    while (log2_bound < 32 && (int64_t{1} << log2_bound) < 2 * int64_t{steps}) ++log2_bound;
    const int e = std::min(log2_bound - 30, 1);
    return static_cast<uint32_t>(127 + e) << 23;
}
}  // namespace

SnapKV::SnapKV(int capacity, int recent_window, int obs_window, int pool_kernel)
    : ScoredEviction(capacity, recent_window), pool_radius_((pool_kernel - 1) / 2), window_(obs_window),
      smallest_summable_bits_(smallest_summable_bits(obs_window)) {
    for (auto& column : window_) {
        column.reserve(capacity);
        column.push_back(0.0f);
    }
    running_.reserve(capacity);
    running_.push_back(0.0);
    unsummable_.reserve(capacity);
    unsummable_.push_back(0);
}

void SnapKV::observe(std::span<const float> attn) {
    float* column = window_[write_index_].data();
    double* running = running_.data();
    int32_t* unsummable = unsummable_.data();
    const uint32_t low = smallest_summable_bits_, span = 0x40000000u - low;  // [low, 2.0f)
    // +0, or in [low, 2): the entries every addition of a window sums exactly.
    auto not_summable = [low, span](float x) {  // branch-free, so that the loop vectorises
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        return static_cast<int32_t>((bits != 0) & (bits - low >= span));
    };
    // The entry the ring overwrites leaves each sum and the new one joins it, exactly where both
    // counts are 0. A slot whose count was or is above 0 gets NaN instead, and where its count has
    // just fallen to 0 the sum is redone from its window.
    std::size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512VL__)
    // The loops below, eight slots at a time.
    const __m256i low8 = _mm256_set1_epi32(static_cast<int32_t>(low));
    const __m256i span8 = _mm256_set1_epi32(static_cast<int32_t>(span));
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
    const __m512d nan = _mm512_set1_pd(std::numeric_limits<double>::quiet_NaN());
    auto not_summable8 = [&](__m256i bits) {
        return static_cast<__mmask8>(_mm256_test_epi32_mask(bits, bits) &
                                     _mm256_cmpge_epu32_mask(_mm256_sub_epi32(bits, low8), span8));
    };
#endif
    if (unsummable_total_ == 0) {
        // No slot's window holds an entry that is not summable, the old entries included: a count
        // rises only where the new entry is not summable, and no count falls.
#if defined(__AVX512F__) && defined(__AVX512VL__)
        for (; i + 8 <= attn.size(); i += 8) {
            const __m256 old = _mm256_loadu_ps(column + i), now = _mm256_loadu_ps(attn.data() + i);
            _mm256_storeu_ps(column + i, now);
            const __mmask8 raised = not_summable8(_mm256_castps_si256(now));
            const __m512d updated =
                _mm512_add_pd(_mm512_sub_pd(_mm512_loadu_pd(running + i), _mm512_cvtps_pd(old)), _mm512_cvtps_pd(now));
            _mm512_storeu_pd(running + i, _mm512_mask_blend_pd(raised, updated, nan));
            if (raised) {
                _mm256_mask_storeu_epi32(unsummable + i, raised, one);
                unsummable_total_ += __builtin_popcount(raised);
            }
        }
#elif defined(__AVX2__)
        // The same with AVX2, eight slots at a time: x >= span unsigned is max(x, span) == x.
        const __m256i low8 = _mm256_set1_epi32(static_cast<int32_t>(low));
        const __m256i span8 = _mm256_set1_epi32(static_cast<int32_t>(span));
        const __m256d nan = _mm256_set1_pd(std::numeric_limits<double>::quiet_NaN());
        for (; i + 8 <= attn.size(); i += 8) {
            const __m256 old = _mm256_loadu_ps(column + i), now = _mm256_loadu_ps(attn.data() + i);
            _mm256_storeu_ps(column + i, now);
            const __m256i bits = _mm256_castps_si256(now), offset = _mm256_sub_epi32(bits, low8);
            const __m256i raised = _mm256_andnot_si256(_mm256_cmpeq_epi32(bits, _mm256_setzero_si256()),
                                                       _mm256_cmpeq_epi32(_mm256_max_epu32(offset, span8), offset));
            for (int half = 0; half < 2; ++half) {
                const __m128 old4 = half ? _mm256_extractf128_ps(old, 1) : _mm256_castps256_ps128(old);
                const __m128 now4 = half ? _mm256_extractf128_ps(now, 1) : _mm256_castps256_ps128(now);
                const __m128i raised4 = half ? _mm256_extracti128_si256(raised, 1) : _mm256_castsi256_si128(raised);
                double* at = running + i + 4 * half;
                const __m256d updated =
                    _mm256_add_pd(_mm256_sub_pd(_mm256_loadu_pd(at), _mm256_cvtps_pd(old4)), _mm256_cvtps_pd(now4));
                _mm256_storeu_pd(at, _mm256_blendv_pd(updated, nan, _mm256_castsi256_pd(_mm256_cvtepi32_epi64(raised4))));
            }
            if (!_mm256_testz_si256(raised, raised)) {
                // Every count is 0 on this path: less a raised lane's -1, its count becomes 1.
                const __m256i counts = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unsummable + i));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(unsummable + i), _mm256_sub_epi32(counts, raised));
                unsummable_total_ += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(raised))));
            }
        }
#endif
        for (; i < attn.size(); ++i) {
            const float old = column[i], now = attn[i];
            column[i] = now;
            const int32_t after = not_summable(now);
            unsummable[i] = after;
            unsummable_total_ += after;
            const double updated = (running[i] - static_cast<double>(old)) + static_cast<double>(now);
            running[i] = after == 0 ? updated : std::numeric_limits<double>::quiet_NaN();
        }
    } else {
        bool any_redone = false;
        int64_t total = 0;
#if defined(__AVX512F__) && defined(__AVX512VL__)
        __mmask8 redone = 0;
        __m256i counts = zero;
        for (; i + 8 <= attn.size(); i += 8) {
            const __m256 old = _mm256_loadu_ps(column + i), now = _mm256_loadu_ps(attn.data() + i);
            _mm256_storeu_ps(column + i, now);
            const __m256i before = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unsummable + i));
            __m256i after = _mm256_mask_add_epi32(before, not_summable8(_mm256_castps_si256(now)), before, one);
            after = _mm256_mask_sub_epi32(after, not_summable8(_mm256_castps_si256(old)), after, one);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(unsummable + i), after);
            counts = _mm256_add_epi32(counts, after);
            const __m512d updated =
                _mm512_add_pd(_mm512_sub_pd(_mm512_loadu_pd(running + i), _mm512_cvtps_pd(old)), _mm512_cvtps_pd(now));
            const __mmask8 clean = _mm256_cmpeq_epi32_mask(_mm256_or_si256(before, after), zero);
            _mm512_storeu_pd(running + i, _mm512_mask_blend_pd(clean, nan, updated));
            redone |= static_cast<__mmask8>(_mm256_cmpneq_epi32_mask(before, zero) & _mm256_cmpeq_epi32_mask(after, zero));
        }
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), counts);
        for (int32_t c : lanes) total += c;
        any_redone = redone != 0;
#endif
        for (; i < attn.size(); ++i) {
            const float old = column[i], now = attn[i];
            column[i] = now;
            const int32_t before = unsummable[i];
            const int32_t after = before + not_summable(now) - not_summable(old);
            unsummable[i] = after;
            total += after;
            const double updated = (running[i] - static_cast<double>(old)) + static_cast<double>(now);
            running[i] = (before | after) == 0 ? updated : std::numeric_limits<double>::quiet_NaN();
            any_redone |= (before != 0) & (after == 0);
        }
        // Slots past the attention shown (none, as ScoredEviction calls it) keep their counts.
        for (std::size_t j = attn.size(); j < unsummable_.size(); ++j) total += unsummable[j];
        unsummable_total_ = total;
        if (any_redone)
            for (std::size_t j = 0; j < attn.size(); ++j)
                if (unsummable[j] == 0 && running[j] != running[j]) running[j] = ring_order_sum(j);
    }
    write_index_ = (write_index_ + 1) % static_cast<int>(window_.size());
}

// A slot's window summed in ring-index order from a cleared sum (0.0 + x: -0 included, the
// reference's bits).
double SnapKV::ring_order_sum(std::size_t slot) const {
    double sum = 0.0;
    for (const auto& column : window_) sum += column[slot];
    return sum;
}

// A new token has seen no steps: score 0 until the next one, protected only by the recent window.
void SnapKV::admit() {
    for (auto& column : window_) column.push_back(0.0f);
    running_.push_back(0.0);
    unsummable_.push_back(0);
}

std::span<const double> SnapKV::scores() {
    const std::size_t n = size();
    // The reference sums in ring-index order (not chronological). Where every entry of a slot's
    // window is summable, any order gives those bits, and the running sum is taken; the rest are
    // summed here in ring order (copied only where there are any).
    const double* sums = running_.data();
    if (unsummable_total_ != 0) {
        window_sum_.assign(running_.begin(), running_.begin() + static_cast<std::ptrdiff_t>(n));
        for (std::size_t i = 0; i < n; ++i)
            if (unsummable_[i] != 0) window_sum_[i] = ring_order_sum(i);
        sums = window_sum_.data();
    }
    // Max-pool over neighbouring cached tokens (adjacent kept entries, not adjacent positions):
    // each slot's sum against its neighbours at distance 1, 2, ..., the one after before the one
    // before, in one pass. std::max's rule (the first unless the second is larger) makes NaN and
    // signed zeros come out as they did from whole-array passes in that order.
    pooled_.resize(n);
    double* pooled = pooled_.data();
    const std::size_t radius = static_cast<std::size_t>(pool_radius_);
    auto pool_at = [&](std::size_t i) {
        double best = sums[i];
        for (std::size_t d = 1; d <= radius && d < n; ++d) {
            if (i + d < n) best = std::max(best, sums[i + d]);
            if (i >= d) best = std::max(best, sums[i - d]);
        }
        return best;
    };
    std::size_t i = 0;
    for (; i < std::min(radius, n); ++i) pooled[i] = pool_at(i);
#if defined(__AVX512F__)
    // Slots with every neighbour present, eight at a time: max_pd(b, a) is std::max(a, b).
    for (; i + 8 + radius <= n; i += 8) {
        __m512d best = _mm512_loadu_pd(sums + i);
        for (std::size_t d = 1; d <= radius; ++d) {
            best = _mm512_max_pd(_mm512_loadu_pd(sums + i + d), best);
            best = _mm512_max_pd(_mm512_loadu_pd(sums + i - d), best);
        }
        _mm512_storeu_pd(pooled + i, best);
    }
#elif defined(__AVX2__)
    for (; i + 4 + radius <= n; i += 4) {  // the same, four at a time
        __m256d best = _mm256_loadu_pd(sums + i);
        for (std::size_t d = 1; d <= radius; ++d) {
            best = _mm256_max_pd(_mm256_loadu_pd(sums + i + d), best);
            best = _mm256_max_pd(_mm256_loadu_pd(sums + i - d), best);
        }
        _mm256_storeu_pd(pooled + i, best);
    }
#endif
    for (; i < n; ++i) pooled[i] = pool_at(i);
    return pooled_;
}

void SnapKV::drop_state(std::span<const std::size_t> evicted) {
    for (std::size_t slot : evicted) unsummable_total_ -= unsummable_[slot];
    for (auto& column : window_) column.erase(evicted);
    running_.erase(evicted);
    unsummable_.erase(evicted);
}

std::size_t SnapKV::state_bytes_per_slot() const {
    return window_.size() * sizeof(float) + sizeof(double) /*window_sum_*/ + sizeof(double) /*pooled_*/;
}


ParamMemory snapkv_memory(const ParamValues& p, const PolicyContext& ctx) {
    // One column of floats per step of the window, each reserved for twice every slot the stream
    // may hold (a SlotArray's room to move its start).
    const uint64_t steps = static_cast<uint64_t>(p.at("obs_window"));
    const uint64_t slots = static_cast<uint64_t>(std::max(ctx.capacity, 1));
    return {steps * (2 * slots * sizeof(float) + sizeof(SlotArray<float>)), "obs_window",
            std::to_string(steps) + " steps of attention x " + std::to_string(slots) + " cached tokens"};
}

PolicyDescriptor snapkv_descriptor() {
    PolicyDescriptor d{"snapkv", "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation (NeurIPS)",
            {{"recent_window", 32, true, 0, "most recent tokens never evicted"},
             {"obs_window", 16, true, 1, "steps of attention summed into the score"},
             {"pool_kernel", 7, true, 1, "width of the max-pooling over neighbouring cached tokens", true}},
            [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                return std::make_unique<SnapKV>(ctx.capacity, param_int(p, "recent_window"),
                                                param_int(p, "obs_window"), param_int(p, "pool_kernel"));
            },
            check_recent_window_fits, false, snapkv_memory};
    d.scored = true;
    return d;
}

}  // namespace kvsim
