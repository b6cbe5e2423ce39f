// stratigraphic KV cache (per-head tiered precision, FP16 -> INT8 -> INT4 -> evicted)
// A published study on Llama-3.2-1B: +0.04 PPL at 2.2x compression. Per (layer, KV head), tokens
// ranked by cumulative attention fill zones sized as shares of the tokens seen; sinks, the recent
// window and anchors stay FP16; deeper layers get more FP16; a token only ever sinks.
//
// A consequence worth knowing: with cumulative attention as importance, a token leaving the recent
// window has had fewer steps to gather attention than older tokens, ranks below them, and sinks at
// once; the FP16 slots then go to old tokens that sank long ago and can never rise. So the FP16
// tier holds little beyond sinks, recent tokens and anchors, and the cache is smaller than the
// shares suggest. This follows the specification; the tests check the bounds sinking guarantees.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#if defined(__BMI2__)
#include <immintrin.h>
#endif

#include "policies/policy.h"
#include "policies/ranking.h"
#include "cache_math/tier_shares.h"

namespace kvsim {
namespace {

// A zone is a tier, plus one more stratum below the INT4 one: out of the cache.
constexpr uint8_t kFp16 = static_cast<uint8_t>(Tier::fp16);
constexpr uint8_t kInt8 = static_cast<uint8_t>(Tier::int8);
constexpr uint8_t kInt4 = static_cast<uint8_t>(Tier::int4);
constexpr uint8_t kEvicted = 3;

struct StratigraphicParams {
    double fp16_share;  // this layer's: surface * ((1 - slope) + slope * l / (L - 1))
    double int8_share;
    double int4_share;
    int sinks;
    int recent;
    double anchor_percentile;
    double anchor_max_frac;
    int rezone_every;
    TierFormat format;
};

// The position of x's k-th set bit (k from 0; x has more than k).
inline unsigned nth_set_bit(uint64_t x, std::size_t k) {
#if defined(__BMI2__)
    return static_cast<unsigned>(std::countr_zero(_pdep_u64(uint64_t{1} << k, x)));
#else
    for (; k > 0; --k) x &= x - 1;
    return static_cast<unsigned>(std::countr_zero(x));
#endif
}

// floor(share * seen), forgiving the last bit of rounding (0.29 * 100 is 28.999999999999996).
int64_t share_count(double share, int64_t seen) {
    return static_cast<int64_t>(std::floor(share * static_cast<double>(seen) + 1e-9));
}

class Stratigraphic : public Policy {
public:
    Stratigraphic(int capacity, const StratigraphicParams& params) : capacity_(capacity), p_(params) {
        // Everything a step sizes by the held count, at its largest once: no allocation per step.
        positions_.reserve(capacity);
        rank_tiers_.reserve(capacity);
        rank_keys_.reserve(capacity);
        rank_slots_.reserve(capacity);
        rank_of_slot_.reserve(capacity);
        sort_scratch_.reserve(capacity);
        descents_.reserve((static_cast<std::size_t>(capacity) + 63) / 64);
        protected_ranks_.reserve((static_cast<std::size_t>(capacity) + 63) / 64);
        slot_tiers_.reserve(capacity);
        gone_.reserve(capacity);
        gone_ranks_.reserve(capacity);
        value_after_.reserve(capacity);
        sunk_.reserve(capacity);
        admit(0);
    }

    void on_decode_step(int32_t pos, std::span<const float> attn) override {
        // Each held token's cumulative attention lives in its ranking key (rank_keys_): the step's
        // weight, found by the token's slot, is added to it where it lies in the ranking, so the
        // ranking reads its keys in order and never gathers them by slot.
        const std::size_t observed = std::min(attn.size(), positions_.size());
        uint64_t* key = rank_keys_.data();
        const uint32_t* slot = rank_slots_.data();
        const float* weight = attn.data();
        const std::size_t n = rank_keys_.size();
        if (observed == n) {
            add_weights_to_keys(key, slot, weight, n);
        } else {  // fewer weights than tokens: those past them take none
            for (std::size_t k = 0; k < n; ++k)
                if (slot[k] < observed) add_weights_to_keys(key + k, slot + k, weight, 1);
        }
        if (static_cast<int>(positions_.size()) >= capacity_)
            throw std::logic_error("admitted past its capacity of " + std::to_string(capacity_));
        admit(pos);
        step_ = pos;
    }

    void evict(int budget, std::vector<int32_t>& victims) override {
        const bool rezoning = step_ % p_.rezone_every == 0;
        // What assign_tiers reports: the tokens this step sinks (none unless it re-zones).
        sunk_.clear();
        const std::size_t target = static_cast<std::size_t>(std::max(budget, 0));
        if (!rezoning && positions_.size() <= target) return;  // tiers stay, nothing goes

        rank_by_importance();
        const Protected guard = find_protected();
        const std::size_t n = positions_.size();
        // Between re-zonings no zone moves a tier; a re-zoning sinks every token to its zone, and
        // the unprotected from the rank `zoned_out` on are out.
        gone_ranks_.clear();
        const std::size_t zoned_out = rezoning ? rezone(guard) : n;
        if (n - gone_ranks_.size() > target) trim_to_budget(guard, zoned_out, n - gone_ranks_.size() - target);
        if (gone_ranks_.empty()) return;

        std::sort(gone_ranks_.begin(), gone_ranks_.end());
        gone_.clear();
        for (const std::size_t k : gone_ranks_) {
            gone_.push_back(rank_slots_[k]);
            --tier_count_[rank_tiers_[k]];
        }
        std::sort(gone_.begin(), gone_.end());
        for (const std::size_t i : gone_) victims.push_back(positions_[i]);  // slots ascend, so positions do
        positions_.erase(gone_);
        close_ranking();
    }

    // The tiers were settled in evict(); this only reports them.
    void assign_tiers(int32_t t, std::span<const int32_t> held, std::span<uint8_t> key_tier,
                      std::span<uint8_t> value_tier) override {
        // After an eviction the harness holds what the policy holds, in the same order, and its
        // arrays hold the tiers reported before (Policy::assign_tiers): only the tokens sunk since
        // are written. Positions ascend, so the last is the largest.
        const std::size_t limit = std::min(key_tier.size(), value_tier.size());
        if (held.size() == positions_.size() &&
            (held.empty() || (held.front() >= 0 && static_cast<std::size_t>(held.back()) < limit)) &&
            std::equal(held.begin(), held.end(), positions_.begin())) {
            // A token sunk and then trimmed away in the same step is written too: not held, ignored.
            for (const auto& [position, tier] : sunk_) key_tier[position] = value_tier[position] = tier;
            sunk_.clear();
            return;
        }
        sunk_.clear();
        std::size_t slot = 0;
        for (int32_t pos : held) {
            // Both lists ascend: walk them together.
            while (slot < positions_.size() && positions_[slot] < pos) ++slot;
            if (slot == positions_.size() || positions_[slot] != pos)
                throw std::logic_error("asked at step " + std::to_string(t) + " for the tier of position " +
                                       std::to_string(pos) + ", which it does not hold");
            if (static_cast<std::size_t>(pos) >= key_tier.size() || static_cast<std::size_t>(pos) >= value_tier.size())
                throw std::logic_error("tier arrays too short for position " + std::to_string(pos));
            key_tier[pos] = value_tier[pos] = rank_tiers_[rank_of_slot_[slot]];
        }
    }

    const TierFormat* tier_format() const override { return &p_.format; }
    bool held_per_tier(std::array<int64_t, 3>& count) const override {
        count = tier_count_;
        return true;
    }
    bool sizes_itself() const override { return true; }

    std::size_t bytes_per_slot() const override {
        // The cumulative attention is a double a token, held as its ranking key.
        return sizeof(decltype(positions_)::value_type) + sizeof(double) + sizeof(decltype(rank_tiers_)::value_type);
    }

private:
    // Sinks, the recent window and anchors always sit in the FP16 zone. Positions ascend, so the
    // sinks are the slots below sinks_end and the recent window those from recent_begin; the
    // anchors are the first `anchors` tokens of the importance ranking.
    // 32-bit numbers and no branch, so that the loops asking it vectorise.
    struct Protected {
        uint32_t sinks_end, recent_begin, anchors;
        bool holds(uint32_t rank, uint32_t slot) const {
            return (rank < anchors) | (slot < sinks_end) | (slot >= recent_begin);
        }
    };

    void admit(int32_t pos) {
        positions_.push_back(pos);
        ++tier_count_[kFp16];  // a new token is recent, so FP16
        rank_keys_.push_back(~ascending_key(0.0));
        rank_tiers_.push_back(kFp16);
        rank_slots_.push_back(static_cast<uint32_t>(positions_.size() - 1));
        rank_of_slot_.push_back(static_cast<uint32_t>(rank_slots_.size() - 1));
    }

    // The ranking: every held token in importance order (higher cumulative attention first, the
    // lower position on ties, a NaN importance last), as pairs (key, slot) ascending in that order
    // (positions ascend with the slot, so the slot breaks ties), kept as two arrays so that the
    // keys are renewed (on_decode_step) and checked several at a time, with each slot's rank
    // beside them. Cumulative attention reorders few tokens a step, so last step's ranking, its
    // keys renewed, is almost sorted: an insertion sort finishes it in about one pass, where each
    // selection of a zone boundary was a pass of its own. The order is total, so the zones are the
    // same.
    void rank_by_importance() {
        uint64_t* key = rank_keys_.data();
        uint32_t* slot = rank_slots_.data();
        uint8_t* tier = rank_tiers_.data();
        const std::size_t n = rank_keys_.size();
        descents_.resize((n + 63) / 64);
        mark_descents(key, slot, n, descents_.data());
        // Moves bounded at a few per token: past that (attention reshuffled the order), a sort.
        std::size_t moves = 0;
        uint32_t* rank_of = rank_of_slot_.data();
        const auto descends = [&](std::size_t j) { return pair_before(key[j], slot[j], key[j - 1], slot[j - 1]); };
        // The ranking ascends up to `settled` (every pair up to it checked). An insertion at j
        // changes pairs up to j + 1 alone, and j + 1 is checked next, so a mark past `settled`
        // still says what it said when it was made.
        std::size_t settled = 0;
        for (std::size_t w = 0; w < descents_.size(); ++w) {
            for (uint64_t bits = descents_[w]; bits; bits &= bits - 1) {
                std::size_t j = 64 * w + static_cast<std::size_t>(std::countr_zero(bits));
                if (j <= settled) continue;
                for (; j < n && descends(j); ++j) {
                    const uint64_t x_key = key[j];
                    const uint32_t x_slot = slot[j];
                    const uint8_t x_tier = tier[j];
                    std::size_t k = j;
                    do {
                        key[k] = key[k - 1];
                        slot[k] = slot[k - 1];
                        tier[k] = tier[k - 1];
                        rank_of[slot[k]] = static_cast<uint32_t>(k);
                        --k;
                    } while (k > 0 && pair_before(x_key, x_slot, key[k - 1], slot[k - 1]));
                    key[k] = x_key;
                    slot[k] = x_slot;
                    tier[k] = x_tier;
                    rank_of[x_slot] = static_cast<uint32_t>(k);
                    moves += j - k;
                    if (moves > 8 * n) return sort_ranking();
                }
                settled = j;
            }
        }
    }

    // The ranking keeps its survivors, renumbered as the arrays closed up: the evicted (gone_ranks_
    // and gone_, the same tokens' ranks and slots, each ascending) leave the keys, slots and tiers
    // at their ranks and the ranks at their slots, one block move per gap, as positions_; then each
    // slot drops by the evicted slots below it and each rank by the evicted ranks below it. A step
    // evicts one or two tokens, so those counts are a few compares per token, which vectorise;
    // more, and a table gives them.
    void close_ranking() {
        rank_keys_.erase(gone_ranks_);
        rank_slots_.erase(gone_ranks_);
        rank_tiers_.erase(gone_ranks_);
        rank_of_slot_.erase(gone_);
        renumber(rank_slots_.data(), rank_slots_.size(), gone_);
        renumber(rank_of_slot_.data(), rank_of_slot_.size(), gone_ranks_);
    }

    // Each value less the count of `gone` (ascending, none equal to a value) below it.
    void renumber(uint32_t* value, std::size_t n, const std::vector<std::size_t>& gone) {
        constexpr std::size_t kFew = 8;
        if (gone.size() <= kFew) {
            // Largest first: a value above one removed is still above every smaller one once lowered.
            for (std::size_t e = gone.size(); e-- > 0;) {
                const auto g = static_cast<uint32_t>(gone[e]);
                for (std::size_t i = 0; i < n; ++i) value[i] -= value[i] > g ? 1 : 0;
            }
            return;
        }
        const std::size_t before = n + gone.size();
        value_after_.resize(before);
        uint32_t* after = value_after_.data();
        for (std::size_t v = 0, e = 0; v < before; ++v) {
            e += e < gone.size() && gone[e] < v ? 1 : 0;
            after[v] = static_cast<uint32_t>(v - e);
        }
        for (std::size_t i = 0; i < n; ++i) value[i] = after[value[i]];
    }

    void sort_ranking() {
        const std::size_t n = rank_keys_.size();
        sort_scratch_.resize(n);
        slot_tiers_.resize(n);  // the tiers by slot while the ranks move
        for (std::size_t k = 0; k < n; ++k) {
            sort_scratch_[k] = {rank_keys_[k], rank_slots_[k]};
            slot_tiers_[rank_slots_[k]] = rank_tiers_[k];
        }
        std::sort(sort_scratch_.begin(), sort_scratch_.end());
        for (std::size_t k = 0; k < n; ++k) {
            rank_keys_[k] = sort_scratch_[k].first;
            rank_slots_[k] = sort_scratch_[k].second;
            rank_tiers_[k] = slot_tiers_[rank_slots_[k]];
            rank_of_slot_[rank_slots_[k]] = static_cast<uint32_t>(k);
        }
    }

    // The ascending key of the below-th least important token (0: the least).
    uint64_t key_from_least(std::size_t below) const { return ~rank_keys_[rank_keys_.size() - 1 - below]; }

    Protected find_protected() const {
        const std::size_t n = positions_.size();
        const int32_t* first = positions_.begin();
        const int32_t* sinks_end = std::lower_bound(first, positions_.end(), p_.sinks);
        const int32_t* recent_begin = std::upper_bound(first, positions_.end(), int64_t{step_} - p_.recent,
                                                       [](int64_t bound, int32_t pos) { return bound < pos; });
        Protected guard{static_cast<uint32_t>(sinks_end - first), static_cast<uint32_t>(recent_begin - first), 0};
        // Anchors: at or above the percentile (linear between order statistics), at most a fraction.
        const std::size_t max_anchors =
            static_cast<std::size_t>(std::floor(p_.anchor_max_frac * static_cast<double>(n) + 1e-9));
        if (max_anchors == 0) return guard;
        const double rank = p_.anchor_percentile / 100.0 * static_cast<double>(n - 1);
        const std::size_t below = static_cast<std::size_t>(std::floor(rank));
        const double low = from_ascending_key(key_from_least(below));
        const double high = below + 1 < n ? from_ascending_key(key_from_least(below + 1)) : low;
        const double threshold = low + (rank - static_cast<double>(below)) * (high - low);
        // Those at or above it lead the ranking; the most important max_anchors of them.
        while (guard.anchors < std::min(max_anchors, n) && from_ascending_key(~rank_keys_[guard.anchors]) >= threshold)
            ++guard.anchors;
        return guard;
    }

    // A re-zoning: every token sunk to its zone. Protected ones are FP16; the rest fill, in
    // importance order, what the shares of the t + 1 tokens seen leave of FP16, INT8 and INT4, and
    // then are out. Appends the ranks of those out to gone_ranks_ and returns the first rank out
    // (n where none is).
    std::size_t rezone(const Protected& guard) {
        const int64_t seen = int64_t{step_} + 1;
        const std::size_t n = positions_.size();
        // The protected ranks as bits (rank k: bit k % 64 of word k / 64): the anchors lead the
        // ranking, and the sinks and the recent window are a few dozen slots, each set by its rank.
        // (Early on the sinks and the recent window overlap: every slot.) The boundaries below are
        // then found by counting the clear bits a word at a time, where a pass over every rank
        // asked each whether it was protected.
        const std::size_t words = (n + 63) / 64;
        protected_ranks_.assign(words, 0);
        uint64_t* bits = protected_ranks_.data();
        for (std::size_t w = 0; w < guard.anchors / 64; ++w) bits[w] = ~uint64_t{0};
        if (guard.anchors % 64) bits[guard.anchors / 64] |= (uint64_t{1} << (guard.anchors % 64)) - 1;
        const uint32_t* rank_of = rank_of_slot_.data();
        const auto protect = [&](uint32_t from, uint32_t to) {
            for (uint32_t i = from; i < to; ++i) bits[rank_of[i] / 64] |= uint64_t{1} << (rank_of[i] % 64);
        };
        if (guard.recent_begin > guard.sinks_end) {
            protect(0, guard.sinks_end);
            protect(guard.recent_begin, static_cast<uint32_t>(n));
        } else {
            protect(0, static_cast<uint32_t>(n));
        }
        std::size_t protected_count = 0;
        for (std::size_t w = 0; w < words; ++w) protected_count += static_cast<std::size_t>(std::popcount(bits[w]));
        // The unprotected tokens' ranks where FP16, INT8 and INT4 end.
        const std::size_t fp16_end = static_cast<std::size_t>(
            std::max<int64_t>(share_count(p_.fp16_share, seen) - static_cast<int64_t>(protected_count), 0));
        const std::size_t int8_end = fp16_end + static_cast<std::size_t>(share_count(p_.int8_share, seen));
        const std::size_t int4_end = int8_end + static_cast<std::size_t>(share_count(p_.int4_share, seen));
        // The rank of the unprotected token that starts INT8, INT4 and the evicted (n where too few
        // are unprotected): an unprotected token's zone is how many of them its rank reaches.
        const std::size_t starts[3] = {fp16_end, int8_end, int4_end};
        std::size_t zone_start[4] = {n, n, n, n};
        std::size_t unprotected = 0, next = 0;
        while (next < 3 && starts[next] == 0) zone_start[next++] = 0;
        for (std::size_t w = 0; w < words && next < 3; ++w) {
            uint64_t clear = ~bits[w];  // the word's unprotected ranks
            if (n - 64 * w < 64) clear &= (uint64_t{1} << (n - 64 * w)) - 1;
            const auto in_word = static_cast<std::size_t>(std::popcount(clear));
            for (; next < 3 && unprotected + in_word > starts[next]; ++next)
                zone_start[next] = 64 * w + nth_set_bit(clear, starts[next] - unprotected);
            unprotected += in_word;
        }
        // The tiers lie in ranking order (rank_tiers_), so each zone is a run of ranks: within it,
        // the unprotected tokens at a finer tier sink, found 64 ranks at a time. An FP16 zone moves
        // nothing, so the ranks before INT8's start are never read; a re-zoning sinks about one
        // token of the 1,500 to 4,000 held, where a pass over every slot gave each its zone.
        uint8_t* tier = rank_tiers_.data();
        for (uint8_t zone = kInt8; zone <= kEvicted; ++zone) {
            const std::size_t from = zone_start[zone - 1], to = zone_start[zone];
            for (std::size_t w = from / 64; w < words && 64 * w < to; ++w) {
                const std::size_t first = 64 * w;
                uint64_t sinking = finer_than(tier + first, std::min<std::size_t>(64, n - first), zone) & ~bits[w];
                if (from > first) sinking &= ~uint64_t{0} << (from - first);
                if (to - first < 64) sinking &= (uint64_t{1} << (to - first)) - 1;
                for (; sinking; sinking &= sinking - 1) {
                    const std::size_t k = first + static_cast<std::size_t>(std::countr_zero(sinking));
                    if (zone == kEvicted) {  // counted out, at its tier, with the trimmed
                        gone_ranks_.push_back(k);
                        continue;
                    }
                    --tier_count_[tier[k]];
                    ++tier_count_[zone];
                    tier[k] = zone;
                    sunk_.emplace_back(positions_[rank_slots_[k]], zone);
                }
            }
        }
        return zone_start[2];
    }

    // Bit j set where tier[j] < zone, for j < count (at most 64).
    static uint64_t finer_than(const uint8_t* tier, std::size_t count, uint8_t zone) {
#if defined(__AVX512BW__)
        if (count == 64)
            return _mm512_cmplt_epu8_mask(_mm512_loadu_si512(tier), _mm512_set1_epi8(static_cast<char>(zone)));
#endif
        uint64_t bits = 0;
        for (std::size_t j = 0; j < count; ++j) bits |= uint64_t{tier[j] < zone} << j;
        return bits;
    }

    // Still over the harness budget: the least important unprotected tokens not already out (those
    // from rank zoned_out on) go next. Should the protected ones alone exceed it, the budget wins:
    // the least important of them go, never the token just admitted. Appends their ranks to
    // gone_ranks_.
    void trim_to_budget(const Protected& guard, std::size_t zoned_out, std::size_t excess) {
        for (std::size_t k = std::min(zoned_out, rank_slots_.size()); k-- > 0 && excess > 0;)
            if (!guard.holds(static_cast<uint32_t>(k), rank_slots_[k])) {
                gone_ranks_.push_back(k);
                --excess;
            }
        for (std::size_t k = rank_slots_.size(); k-- > 0 && excess > 0;) {
            const uint32_t i = rank_slots_[k];
            if (guard.holds(static_cast<uint32_t>(k), i) && positions_[i] != step_) {
                gone_ranks_.push_back(k);
                --excess;
            }
        }
    }

    int capacity_;
    StratigraphicParams p_;
    int32_t step_ = 0;               // the latest position admitted
    SlotArray<int32_t> positions_;  // ascending
    std::array<int64_t, 3> tier_count_{};  // held tokens per tier: FP16, INT8, INT4
    // The ranking, kept between steps. Its keys are the tokens' cumulative attention (the query
    // group's mean weight summed over the steps), each as ~ascending_key: the algorithm's state,
    // counted by bytes_per_slot as the double it encodes. The tokens' tiers (Tier as uint8_t; a
    // tier only ever grows coarser) lie beside the keys, in ranking order, so that a zone's tokens
    // are a run of them. The slots and ranks are an index (left out, as scratch is).
    SlotArray<uint64_t> rank_keys_;
    SlotArray<uint8_t> rank_tiers_;
    SlotArray<uint32_t> rank_slots_;
    SlotArray<uint32_t> rank_of_slot_;  // the inverse: each slot's rank
    // Scratch of one evict() call, kept to reuse its memory.
    std::vector<uint64_t> descents_;         // mark_descents' bits
    std::vector<uint64_t> protected_ranks_;  // rezone's bits
    std::vector<std::pair<uint64_t, uint32_t>> sort_scratch_;
    std::vector<uint8_t> slot_tiers_;  // sort_ranking's
    std::vector<std::size_t> gone_;
    std::vector<std::size_t> gone_ranks_;
    std::vector<uint32_t> value_after_;  // renumber's table
    // The tokens sunk since the last assign_tiers: (position, tier).
    std::vector<std::pair<int32_t, uint8_t>> sunk_;
};

std::string format_number(double v) {
    std::ostringstream out;
    out << v;
    return out.str();
}

std::string check_stratigraphic(const ParamValues& p, int /*budget*/) {
    const double shares = p.at("surface") + p.at("int8_share") + p.at("int4_share");
    if (shares > 1 + 1e-12)
        return "shares sum to " + format_number(shares) + " > 1 (surface + int8_share + int4_share)";
    if (p.at("slope") > 1) return "slope = " + format_number(p.at("slope")) + " must be within [0, 1]";
    if (p.at("anchor_percentile") > 100)
        return "anchor_percentile = " + format_number(p.at("anchor_percentile")) + " must be at most 100";
    if (p.at("anchor_max_frac") > 1)
        return "anchor_max_frac = " + format_number(p.at("anchor_max_frac")) + " must be at most 1";
    return {};
}

}  // namespace

PolicyDescriptor stratigraphic_descriptor() {
    PolicyDescriptor d{"stratigraphic",
            "Stratigraphic KV cache (per-head tiered precision, FP16 -> INT8 -> INT4 -> evicted): published study "
            "on Llama-3.2-1B, +0.04 PPL at 2.2x compression",
            {{"surface", 0.30, false, 0, "FP16 share of the tokens seen at the deepest layer"},
             {"slope", 0.6, false, 0, "how much less FP16 share the first layer gets, as a fraction of surface"},
             {"int8_share", 0.30, false, 0, "INT8 share of the tokens seen"},
             {"int4_share", 0.25, false, 0, "INT4 share of the tokens seen"},
             {"sinks", 4, true, 0, "first positions kept at FP16"},
             {"recent", 64, true, 0, "most recent positions kept at FP16"},
             {"anchor_percentile", 99, false, 0, "importance percentile at or above which a token is an anchor"},
             {"anchor_max_frac", 0.05, false, 0, "most anchors, as a fraction of held tokens"},
             {"rezone_every", 1, true, 1, "steps between re-zonings"},
             {"value_group", 128, true, 1, "channels sharing a per-token value scale"},
             {"profile", 0, false, 0, "per-(layer, KV head) shares instead of surface, slope, int8_share and "
                                      "int4_share: a profile.json or YAML with tiers: {fp16, int8, int4}, one row "
                                      "per layer", false, true}},
            [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                const double depth = ctx.num_layers > 1 ? static_cast<double>(ctx.layer) / (ctx.num_layers - 1) : 1.0;
                const double slope = p.at("slope");
                StratigraphicParams params{};
                params.fp16_share = p.at("surface") * ((1 - slope) + slope * depth);
                params.int8_share = p.at("int8_share");
                params.int4_share = p.at("int4_share");
                if (ctx.files && ctx.files->count("profile")) {  // a few hundred bytes, read per head at start
                    const TierShares shares = load_tier_shares(ctx.files->at("profile"), ctx.num_layers, ctx.num_kv_heads);
                    const std::size_t i = shares.index(ctx.layer, ctx.kv_head);
                    params.fp16_share = shares.fp16[i];
                    params.int8_share = shares.int8[i];
                    params.int4_share = shares.int4[i];
                }
                params.sinks = param_int(p, "sinks");
                params.recent = param_int(p, "recent");
                params.anchor_percentile = p.at("anchor_percentile");
                params.anchor_max_frac = p.at("anchor_max_frac");
                params.rezone_every = param_int(p, "rezone_every");
                // Neighbouring tokens sit at different tiers, so keys take per-token scales (the key
                // group is then unused); INT4 tokens sank from INT8 and are requantised from it.
                params.format.value_group = param_int(p, "value_group");
                params.format.per_token_keys = true;
                params.format.int4_from_int8 = true;
                return std::make_unique<Stratigraphic>(ctx.capacity, params);
            },
            check_stratigraphic};
    d.keeps_everything = true;  // its shares size it; a token budget does not apply
    d.changes_values = true;
    return d;
}

}  // namespace kvsim
