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
#include <cstring>
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
        tier_.reserve(capacity);
        rank_keys_.reserve(capacity);
        rank_slots_.reserve(capacity);
        rank_of_slot_.reserve(capacity);
        sort_scratch_.reserve(capacity);
        descents_.reserve((static_cast<std::size_t>(capacity) + 63) / 64);
        protected_ranks_.reserve((static_cast<std::size_t>(capacity) + 63) / 64);
        zone_.reserve(capacity);
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
        zone_.resize(n);
        // Between re-zonings no zone moves a tier; a re-zoning gives every token its zone, and a
        // token's tier is the coarser of where it was and where its zone is (sinking).
        std::size_t evicted = 0;
        if (rezoning)
            evicted = assign_zones(guard);
        else
            std::fill(zone_.begin(), zone_.end(), kFp16);
        if (n - evicted > target) evicted += trim_to_budget(guard, n - evicted - target);
        if (evicted == 0) return;

        // The evicted are few a step: memchr finds them without a branch per token.
        gone_.clear();
        const uint8_t *zone = zone_.data(), *zone_end = zone + n;
        for (const uint8_t* at = zone; (at = static_cast<const uint8_t*>(std::memchr(at, kEvicted, zone_end - at))); ++at) {
            const auto i = static_cast<std::size_t>(at - zone);
            gone_.push_back(i);
            --tier_count_[tier_[i]];  // kEvicted where its zone evicted it, its tier where trimmed
            victims.push_back(positions_[i]);  // slots ascend, so positions do
        }
        positions_.erase(gone_);
        tier_.erase(gone_);
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
            key_tier[pos] = tier_[slot];
            value_tier[pos] = tier_[slot];
        }
    }

    const TierFormat* tier_format() const override { return &p_.format; }
    bool held_per_tier(std::array<int64_t, 3>& count) const override {
        std::copy(tier_count_.begin(), tier_count_.begin() + 3, count.begin());
        return true;
    }
    bool sizes_itself() const override { return true; }

    std::size_t bytes_per_slot() const override {
        // The cumulative attention is a double a token, held as its ranking key.
        return sizeof(decltype(positions_)::value_type) + sizeof(double) + sizeof(decltype(tier_)::value_type);
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
        tier_.push_back(kFp16);  // a new token is recent, so FP16
        ++tier_count_[kFp16];
        rank_keys_.push_back(~ascending_key(0.0));
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
                    std::size_t k = j;
                    do {
                        key[k] = key[k - 1];
                        slot[k] = slot[k - 1];
                        rank_of[slot[k]] = static_cast<uint32_t>(k);
                        --k;
                    } while (k > 0 && pair_before(x_key, x_slot, key[k - 1], slot[k - 1]));
                    key[k] = x_key;
                    slot[k] = x_slot;
                    rank_of[x_slot] = static_cast<uint32_t>(k);
                    moves += j - k;
                    if (moves > 8 * n) return sort_ranking();
                }
                settled = j;
            }
        }
    }

    // The ranking keeps its survivors, renumbered as the arrays closed up: the evicted (gone_,
    // ascending slots) leave the keys and slots at their ranks and the ranks at their slots, one
    // block move per gap, as the other arrays; then each slot drops by the evicted slots below it
    // and each rank by the evicted ranks below it. A step evicts one or two tokens, so those
    // counts are a few compares per token, which vectorise; more, and a table gives them.
    void close_ranking() {
        uint32_t* rank_of = rank_of_slot_.data();
        gone_ranks_.clear();
        for (const std::size_t i : gone_) gone_ranks_.push_back(rank_of[i]);
        std::sort(gone_ranks_.begin(), gone_ranks_.end());
        rank_keys_.erase(gone_ranks_);
        rank_slots_.erase(gone_ranks_);
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
        for (std::size_t k = 0; k < n; ++k) sort_scratch_[k] = {rank_keys_[k], rank_slots_[k]};
        std::sort(sort_scratch_.begin(), sort_scratch_.end());
        for (std::size_t k = 0; k < n; ++k) {
            rank_keys_[k] = sort_scratch_[k].first;
            rank_slots_[k] = sort_scratch_[k].second;
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

    // The zones of a re-zoning step, and each token sunk to its zone: protected ones FP16, the
    // rest in importance order into what the shares of the t + 1 tokens seen leave (FP16, INT8,
    // INT4), then out. Returns how many are out.
    std::size_t assign_zones(const Protected& guard) {
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
        std::size_t zone_start[3] = {n, n, n};
        const auto narrow = [](std::size_t x) { return static_cast<uint32_t>(x); };
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
        // Then every token by slot, in a loop without branches that the compiler takes many slots
        // at a time (32-bit numbers throughout, copied out of what a byte store could alias): its
        // zone.
        uint8_t *zone = zone_.data(), *tier = tier_.data();
        const Protected fixed = guard;
        const uint32_t int8_start = narrow(zone_start[0]), int4_start = narrow(zone_start[1]),
                       evicted_start = narrow(zone_start[2]), count = narrow(n);
        for (uint32_t i = 0; i < count; ++i) {
            const uint32_t k = rank_of[i];
            // Zones are numbered as tiers, kEvicted one past INT4.
            zone[i] = fixed.holds(k, i) ? kFp16
                                        : static_cast<uint8_t>((k >= int8_start) + (k >= int4_start) + (k >= evicted_start));
        }
        // Each token sinks to its zone. Thirty-two slots are tested at a time for one that sinks;
        // each such is counted at its new tier, and kept for assign_tiers where it stays (an
        // evicted token's tier, kEvicted, is read again only to count it out).
        constexpr uint32_t kSinkBlock = 32;
        for (uint32_t first = 0; first < count; first += kSinkBlock) {
            const uint32_t last = std::min(first + kSinkBlock, count);
            uint8_t sinks = 0;
            for (uint32_t i = first; i < last; ++i) sinks |= static_cast<uint8_t>(zone[i] > tier[i]);
            if (sinks)
                for (uint32_t i = first; i < last; ++i) {
                    if (zone[i] <= tier[i]) continue;
                    --tier_count_[tier[i]];
                    ++tier_count_[zone[i]];
                    if (zone[i] != kEvicted) sunk_.emplace_back(positions_[i], zone[i]);
                }
            for (uint32_t i = first; i < last; ++i) tier[i] = std::max(tier[i], zone[i]);
        }
        // The evicted: the unprotected from the int4_end-th on (zone_start[2] is that one's rank).
        const std::size_t unprotected_count = n - protected_count;
        return unprotected_count > int4_end ? unprotected_count - int4_end : 0;
    }

    // Still over the harness budget: the least important unprotected tokens go next. Should the
    // protected ones alone exceed it, the budget wins: the least important of them go, never the
    // token just admitted. Returns how many went.
    std::size_t trim_to_budget(const Protected& guard, std::size_t excess) {
        const std::size_t wanted = excess;
        for (const bool from_protected : {false, true}) {
            for (std::size_t k = rank_slots_.size(); k-- > 0 && excess > 0;) {
                const uint32_t i = rank_slots_[k];
                if (zone_[i] == kEvicted || guard.holds(static_cast<uint32_t>(k), i) != from_protected ||
                    (from_protected && positions_[i] == step_))
                    continue;
                zone_[i] = kEvicted;
                --excess;
            }
            if (excess == 0) break;
        }
        return wanted - excess;
    }

    int capacity_;
    StratigraphicParams p_;
    int32_t step_ = 0;               // the latest position admitted
    SlotArray<int32_t> positions_;  // ascending
    SlotArray<uint8_t> tier_;       // Tier as uint8_t; only ever grows (coarser)
    // Held slots per tier_ value: fp16, INT8, INT4, and kEvicted for those a re-zoning evicted
    // until evict() lets them go (none between calls).
    std::array<int64_t, 4> tier_count_{};
    // The ranking, kept between steps. Its keys are the tokens' cumulative attention (the query
    // group's mean weight summed over the steps), each as ~ascending_key: the algorithm's state,
    // counted by bytes_per_slot as the double it encodes. The slots and ranks are an index (left
    // out, as scratch is).
    SlotArray<uint64_t> rank_keys_;
    SlotArray<uint32_t> rank_slots_;
    SlotArray<uint32_t> rank_of_slot_;  // the inverse: each slot's rank
    // Scratch of one evict() call, kept to reuse its memory.
    std::vector<uint64_t> descents_;         // mark_descents' bits
    std::vector<uint64_t> protected_ranks_;  // assign_zones' bits
    std::vector<std::pair<uint64_t, uint32_t>> sort_scratch_;
    std::vector<uint8_t> zone_;
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
