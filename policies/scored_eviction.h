// The mechanism shared by most eviction policies: each cached position carries a score, and
// eviction removes the lowest-scoring positions outside a protected window of the most recent
// ones. A policy supplies only how its per-slot state is updated and turned into a score.
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "policies/policy.h"

namespace kvsim {

// A score equal to this value marks a slot that may not be evicted yet (TOVA's unobserved token).
template <class Score>
constexpr Score kNotEvictable = std::numeric_limits<Score>::has_infinity
                                    ? std::numeric_limits<Score>::infinity()
                                    : std::numeric_limits<Score>::max();

// a < b in the eviction order: every NaN first, then the numbers as < orders them; ties go to
// the lower position. One order for a head's own eviction and for Ada-KV's across heads.
template <class Score>
bool evicted_before(Score a, Score b) {
    if constexpr (std::numeric_limits<Score>::has_quiet_NaN)
        if (a != a) return b == b;
    return a < b;
}

// The first i in [0, n) with score[i] == value (n if none): std::find, with eight doubles or
// sixteen int32s (the scores policies use) to a comparison where AVX-512 is built in (NaN equals
// nothing, -0 equals +0, either way).
template <class Score>
std::size_t first_equal(const Score* score, std::size_t n, Score value) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Score, double>) {
        const __m512d wanted = _mm512_set1_pd(value);
        std::size_t i = 0;
        for (; i + 8 <= n; i += 8)
            if (const __mmask8 hit = _mm512_cmp_pd_mask(_mm512_loadu_pd(score + i), wanted, _CMP_EQ_OQ))
                return i + static_cast<std::size_t>(__builtin_ctz(hit));
        return static_cast<std::size_t>(std::find(score + i, score + n, value) - score);
    } else if constexpr (std::is_same_v<Score, int32_t>) {
        const __m512i wanted = _mm512_set1_epi32(value);
        std::size_t i = 0;
        for (; i + 16 <= n; i += 16)
            if (const __mmask16 hit = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(score + i), wanted))
                return i + static_cast<std::size_t>(__builtin_ctz(hit));
        return static_cast<std::size_t>(std::find(score + i, score + n, value) - score);
    }
#endif
    return static_cast<std::size_t>(std::find(score, score + n, value) - score);
}

// The least of score[0, n) (n >= 1), or NaN where any is NaN: what Eigen's
// minCoeff<PropagateNaN> gives, but for which of two zeros (== does not tell them apart). With
// AVX-512, doubles go four vectors at a time, the minimum and the NaN test in separate chains
// (Eigen's NaN-propagating minimum chained a test and a blend through every vector).
template <class Score>
Score lowest_score(const Score* score, std::size_t n) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Score, double>) {
        if (n >= 32) {
            __m512d low[4];
            __mmask8 nan = 0;
            for (int a = 0; a < 4; ++a) {
                low[a] = _mm512_loadu_pd(score + 8 * a);
                nan |= _mm512_cmp_pd_mask(low[a], low[a], _CMP_UNORD_Q);
            }
            std::size_t i = 32;
            for (; i + 32 <= n; i += 32)
                for (int a = 0; a < 4; ++a) {
                    const __m512d x = _mm512_loadu_pd(score + i + 8 * a);
                    low[a] = _mm512_min_pd(low[a], x);
                    nan |= _mm512_cmp_pd_mask(x, x, _CMP_UNORD_Q);
                }
            for (; i < n; i += 8) {
                const __mmask8 lanes = n - i >= 8 ? static_cast<__mmask8>(0xFF) : static_cast<__mmask8>((1u << (n - i)) - 1);
                const __m512d x = _mm512_maskz_loadu_pd(lanes, score + i);
                low[0] = _mm512_mask_min_pd(low[0], lanes, low[0], x);
                nan |= _mm512_mask_cmp_pd_mask(lanes, x, x, _CMP_UNORD_Q);
            }
            if (nan) return std::numeric_limits<double>::quiet_NaN();
            return _mm512_reduce_min_pd(_mm512_min_pd(_mm512_min_pd(low[0], low[1]), _mm512_min_pd(low[2], low[3])));
        }
    }
#endif
    using Array = Eigen::Array<Score, Eigen::Dynamic, 1>;
    const auto all = Eigen::Map<const Array>(score, static_cast<Eigen::Index>(n));
    if constexpr (std::numeric_limits<Score>::has_quiet_NaN)
        return all.template minCoeff<Eigen::PropagateNaN>();
    else
        return all.minCoeff();
}

template <class Score>
class ScoredEviction : public Policy {
public:
    ScoredEviction(int capacity, int recent_window) : capacity_(capacity), recent_window_(recent_window) {
        positions_.reserve(capacity);
        positions_.push_back(0);
    }

    void on_decode_step(int32_t pos, std::span<const float> attn) final {
        observe(attn.first(std::min(attn.size(), positions_.size())));
        if (static_cast<int>(positions_.size()) >= capacity_)
            throw std::logic_error("admitted past its capacity of " + std::to_string(capacity_));
        positions_.push_back(pos);
        admit();
    }

    // Argmin selection as the reference harness defines it: repeat `needed` times, scan the
    // evictable slots (all but the protected recent tail, which includes the slot admitted this
    // step) and take the smallest score; strict < sends ties to the lower position. Scores with
    // NaN (a policy fed NaN attention; the replay refuses such input) still give slots in range.
    void evict(int budget, std::vector<int32_t>& victims) final { evict_to(eviction_target(budget), victims); }

    void evict_to(int keep, std::vector<int32_t>& victims) final {
        const std::size_t size = positions_.size();
        const std::size_t target = static_cast<std::size_t>(std::max(keep, 0));
        if (size <= target) return;
        const std::size_t needed = size - target;
        const std::size_t evictable_end = size - std::min<std::size_t>(std::max(recent_window_, 0), size);
        if (evictable_end == 0) return;
        const std::span<const Score> all = scores();
        if (all.size() < evictable_end) throw std::logic_error("has fewer scores than cached positions");
        const Score* score = all.data();

        chosen_.clear();
        if (needed == 1) {
            // The common case, one victim per step: a vectorised minimum, then its first slot. With
            // NaN among the scores (only NaN fed in makes one) the minimum is NaN, which no ==
            // finds; and it is kNotEvictable where every slot is protected: both go to
            // select_total, which ranks NaN lowest and never takes a protected slot.
            const Score lowest = lowest_score(score, evictable_end);
            const std::size_t slot = first_equal(score, evictable_end, lowest);
            if (slot == evictable_end || lowest == kNotEvictable<Score>)
                select_total(score, evictable_end, 1);
            else
                chosen_.push_back(slot);
        } else {
            select_total(score, evictable_end, needed);
        }
        std::sort(chosen_.begin(), chosen_.end());  // victims go out in ascending position order
        for (std::size_t slot : chosen_) victims.push_back(positions_[slot]);
        positions_.erase(chosen_);
        drop_state(chosen_);
    }

    // Its position and its state; a policy whose engine holds neither says so (prompt_press.h).
    std::size_t bytes_per_slot() const override {
        return sizeof(int32_t) + state_bytes_per_slot();
    }

    // The scores evict() ranks by; the recent window and kNotEvictable slots are protected.
    bool held_scores(HeldScores& out) final {
        const std::size_t size = positions_.size();
        const std::span<const Score> all = scores();
        if (all.size() < size) throw std::logic_error("has fewer scores than cached positions");
        const std::size_t evictable_end = size - std::min<std::size_t>(std::max(recent_window_, 0), size);
        out.position.assign(positions_.begin(), positions_.end());
        out.score.resize(size);
        out.protect.resize(size);
        for (std::size_t i = 0; i < size; ++i) {
            out.score[i] = static_cast<double>(all[i]);  // int32 votes convert exactly
            out.protect[i] = i >= evictable_end || all[i] == kNotEvictable<Score>;
        }
        return true;
    }

protected:
    // Updates the existing slots' state from this step's attention (index-aligned).
    virtual void observe(std::span<const float> attn) = 0;
    // Appends the state of the slot just admitted.
    virtual void admit() = 0;
    // One score per slot; kNotEvictable<Score> for a slot that must stay.
    virtual std::span<const Score> scores() = 0;
    // Removes the state of the evicted slots (ascending indices), keeping order.
    virtual void drop_state(std::span<const std::size_t> evicted) = 0;
    virtual std::size_t state_bytes_per_slot() const = 0;
    std::size_t size() const { return positions_.size(); }

private:
    // Up to `needed` slots of [0, evictable_end) lowest in the eviction order, ties to the lower
    // slot, never a kNotEvictable score: what taking the first lowest slot `needed` times gives,
    // in one selection (a rescan per victim cost PyramidKV's upper layers, which evict hundreds of
    // slots at once, a cubic time).
    void select_total(const Score* score, std::size_t evictable_end, std::size_t needed) {
        for (std::size_t i = 0; i < evictable_end; ++i)
            if (evicted_before(score[i], kNotEvictable<Score>)) chosen_.push_back(i);
        if (needed >= chosen_.size()) return;
        const auto lower = [score](std::size_t a, std::size_t b) {
            if (evicted_before(score[a], score[b])) return true;
            if (evicted_before(score[b], score[a])) return false;
            return a < b;
        };
        std::nth_element(chosen_.begin(), chosen_.begin() + static_cast<std::ptrdiff_t>(needed - 1), chosen_.end(),
                         lower);
        chosen_.resize(needed);
    }

    int capacity_;
    int recent_window_;
    SlotArray<int32_t> positions_;
    std::vector<std::size_t> chosen_;  // slots selected for eviction
};

}  // namespace kvsim
