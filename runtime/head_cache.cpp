#include "runtime/head_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "cache_math/tiers.h"
#include "cache_math/softmax_exp.h"
#include "cache_math/streaming_heads.h"

namespace kvsim::runtime {

HeadCache::HeadCache(const HeadPlan& plan, PolicyMaker make_policy)
    : plan_(plan), make_policy_(std::move(make_policy)),
      capacity_(std::min(std::max(plan.budget, plan.prefill), plan.max_context) + 1) {
    policy_ = make_policy_();
    format_ = policy_->tier_format();
    const int d = plan_.head_dim;
    kivi_ = format_ && !format_->per_token_keys;
    if (kivi_) {
        // KIVI keys: each channel's scale spans a group of key_group positions (aligned to 0), so
        // a group's keys are quantised once its last position has arrived; until then they wait
        // at FP16, and the group's keys are kept aside (evicted or not) to size its scales.
        key_group_ = format_->key_group;
        if (format_->int8_key_group && format_->int8_key_group != key_group_)
            throw std::invalid_argument("per-channel (KIVI) keys with different INT8 and INT4 key groups");
        if (format_->int4_from_int8)
            throw std::invalid_argument("per-channel (KIVI) keys requantised from INT8 to INT4");
        // A group longer than the context never completes: it needs no more rows than positions.
        group_keys_.assign(static_cast<std::size_t>(std::min(key_group_, plan_.max_context)) * d, 0.0f);
        const std::size_t groups = static_cast<std::size_t>(plan_.max_context) / key_group_ + 1;
        for (int tier = 1; tier < 3; ++tier) channel_scales_[tier].assign(groups * d, 0.0f);
    }
    for (int tier = 0; tier < 3; ++tier) {
        if (tier > 0 && !format_) break;
        const int group = !format_ ? d
                          : (tier == 1 && format_->int8_value_group) ? format_->int8_value_group
                                                                      : format_->value_group;
        // Streaming heads keep their exact tokens in the state's own buffers: no slots.
        const int rows = policy_->linear_state() ? 0 : capacity_;
        keys_[tier].plan(tier, rows, d, kivi_ && tier > 0 ? 0 : group);
        values_[tier].plan(tier, rows, d, group);
        key_bytes_[tier] = key_bytes(static_cast<Tier>(tier), d, format_);
        value_bytes_[tier] = value_bytes(static_cast<Tier>(tier), d, format_);
    }
    positions_.reserve(capacity_);
    slot_of_.reserve(capacity_);
    position_of_slot_.assign(capacity_, -1);
    free_slots_.reserve(capacity_);
    key_tier_.assign(plan_.max_context, 0);
    value_tier_.assign(plan_.max_context, 0);
    new_key_tier_.assign(plan_.max_context, 0);
    new_value_tier_.assign(plan_.max_context, 0);
    key_row_.resize(d);
    value_row_.resize(d);
    attn_.reserve(capacity_);
    victims_.reserve(capacity_ + 1);
    group_queries_.assign(static_cast<std::size_t>(plan_.group), nullptr);
    if (plan_.oracle) {
        weights_.reserve(static_cast<std::size_t>(plan_.group) * (capacity_ + 1));
        scores_.resize(capacity_ + 1);
    } else if (!policy_->linear_state()) {
        constexpr std::size_t kRowAlignFloats = kSoftmaxRowAlignBytes / sizeof(float);
        score_stride_ = (static_cast<std::size_t>(capacity_) + kRowAlignFloats - 1) / kRowAlignFloats * kRowAlignFloats;
        row_weights_.assign(static_cast<std::size_t>(plan_.group) * score_stride_ + kRowAlignFloats, 0.0f);
        const auto address = reinterpret_cast<std::uintptr_t>(row_weights_.data());
        constexpr std::size_t kAlign = kSoftmaxRowAlignBytes;
        score_offset_ = ((kAlign - address % kAlign) % kAlign) / sizeof(float);  // a float's address is a multiple of 4
        index_of_slot_.assign(capacity_, 0);
        row_means_.assign(capacity_, 0.0f);
        peaks_.assign(plan_.group, 0.0f);
        inverse_sums_.assign(plan_.group, 0.0f);
        int groups = 0;
        for (int tier = 1; tier < 3; ++tier) groups = std::max({groups, keys_[tier].groups(), values_[tier].groups()});
        kernel_scratch_.assign(kernel_scratch_floats(d, groups), 0.0f);
    }
    start();
}

void HeadCache::start() {
    // Both point into the policy, which reset() rebuilds.
    state_ = policy_->linear_state();
    format_ = policy_->tier_format();
    positions_.clear();
    slot_of_.clear();
    free_slots_.clear();
    for (int tier = 0; tier < 3; ++tier) keys_[tier].clear(), values_[tier].clear();
    for (int s = capacity_ - 1; s >= 0; --s) free_slots_.push_back(s);
    std::fill(key_tier_.begin(), key_tier_.end(), uint8_t{0});
    std::fill(value_tier_.begin(), value_tier_.end(), uint8_t{0});
    attending_bytes_ = 0;
    completed_key_groups_ = 0;
    if (mirrored_)
        for (int s = 0; s < capacity_; ++s) mark(s, kEmptyCode);
}

std::unique_ptr<Policy> HeadCache::fresh_policy() const { return make_policy_(); }

void HeadCache::reset(std::unique_ptr<Policy> fresh) {
    policy_ = std::move(fresh);  // a policy starts holding position 0, as the harness's does
    start();
}

void HeadCache::fail(int32_t t, const std::string& what) const {
    throw std::logic_error("layer " + std::to_string(plan_.layer) + ", KV head " + std::to_string(plan_.kv_head) +
                           ", position " + std::to_string(t) + ": " + what);
}

std::size_t HeadCache::reserved_bytes() const {
    std::size_t bytes = 0;
    for (int tier = 0; tier < 3; ++tier) bytes += keys_[tier].reserved_bytes() + values_[tier].reserved_bytes();
    bytes += group_keys_.size() * sizeof(float);
    bytes += (row_weights_.size() + row_means_.size() + kernel_scratch_.size()) * sizeof(float);
    bytes += (index_of_slot_.size() + position_of_slot_.size()) * sizeof(int32_t);
    for (const auto& scales : channel_scales_) bytes += scales.size() * sizeof(float);
    return bytes;
}

// A held token moves to a coarser tier: requantised from what the cache holds now (a token that
// sank to INT8 reaches INT4 from its INT8 form, as the simulator's int4_from_int8 tiers do).
void HeadCache::sink(std::size_t i, uint8_t key_tier, uint8_t value_tier) {
    const int slot = slot_of_[i];
    const int32_t p = positions_[i];
    // With int4_from_int8, a token that falls from FP16 straight to INT4 passes through its INT8
    // form, as the simulator's INT4 tier is built from its INT8 one.
    auto move = [&](TierStore* stores, uint8_t from, uint8_t to, std::vector<float>& row) {
        stores[from].read(slot, row.data());
        if (from == 0 && to == 2 && format_->int4_from_int8) {
            stores[1].add(slot);
            stores[1].write(slot, row.data());
            stores[1].read(slot, row.data());
            stores[1].remove(slot);
        }
        stores[to].add(slot);
        stores[to].write(slot, row.data());
        stores[from].remove(slot);
    };
    if (key_tier != key_tier_[p] && kivi_) {
        // A KIVI key leaves FP16 once, with its position group's per-channel scales.
        if (key_tier_[p] != 0) fail(p, "a per-channel (KIVI) key may only leave FP16, not sink further");
        if (p / key_group_ > completed_key_groups_ - 1)
            fail(p, "quantised a per-channel (KIVI) key before its position group was complete");
        keys_[0].read(slot, key_row_.data());
        keys_[key_tier].add(slot);
        keys_[key_tier].write_with_channel_scales(slot, key_row_.data(), group_scales(key_tier, p));
        keys_[0].remove(slot);
    } else if (key_tier != key_tier_[p]) {
        move(keys_, key_tier_[p], key_tier, key_row_);
    }
    if (value_tier != value_tier_[p]) move(values_, value_tier_[p], value_tier, value_row_);
    mark(slot, slot_code(key_tier, value_tier));
}

// The oracle: the simulator's two-pass softmax (cache_math/tiers.cpp) per query head, every row
// read from its tier; bit for bit what the simulator computes.
void HeadCache::attend_two_pass(int slot, const float* q, float* out) {
    const int d = plan_.head_dim, group = plan_.group;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const Eigen::Index n = static_cast<Eigen::Index>(positions_.size() + 1);
    weights_.resize(static_cast<std::size_t>(group) * n);
    for (int h = 0; h < group; ++h) {
        const float* qh = q + static_cast<std::size_t>(h) * d;
        scores_.resize(n);
        for (Eigen::Index j = 0; j < n; ++j) {
            const bool current = j == n - 1;
            if (current)
                keys_[0].read(slot, key_row_.data());
            else
                read_key(positions_[j], key_tier_[positions_[j]], slot_of_[j], key_row_.data());
            scores_[j] = fixed_order_dot(qh, key_row_.data(), d) * scale;
        }
        const float inv_total = softmax_numerators(scores_);
        float* o = out + static_cast<std::size_t>(h) * d;
        std::fill(o, o + d, 0.0f);
        for (Eigen::Index j = 0; j < n; ++j) {
            const bool current = j == n - 1;
            values_[current ? 0 : value_tier_[positions_[j]]].read(current ? slot : slot_of_[j], value_row_.data());
            const float w = scores_[j] * inv_total;
            weights_[static_cast<std::size_t>(h) * n + j] = w;
            for (int i = 0; i < d; ++i) o[i] += w * value_row_[i];
        }
    }
}

TierRows HeadCache::key_rows(int tier) const {
    const TierStore& store = keys_[tier];
    TierRows rows{tier, plan_.head_dim, store.rows(), store.row_bytes(), store.groups(), store.group_channels(),
                  store.half(), store.levels(), store.scales(), store.slot_of_row()};
    if (kivi_ && tier > 0) {
        rows.channel_scales = channel_scales_[tier].data();
        rows.position_of_slot = position_of_slot_.data();
        rows.key_group = key_group_;
    }
    return rows;
}

TierRows HeadCache::value_rows(int tier) const {
    const TierStore& store = values_[tier];
    return TierRows{tier, plan_.head_dim, store.rows(), store.row_bytes(), store.groups(), store.group_channels(),
                    store.half(), store.levels(), store.scales(), store.slot_of_row()};
}

// The serving path: attention read straight from the stored rows, for the whole query group at
// once, in three passes (runtime/attention_kernels.h):
//   1. every key tier's packed rows, one after another: each row's scores for every query head
//      of the group, and each head's peak;
//   2. each head's exponentials and their sum over those scores, in place (vector code with
//      Eigen's bits, cache_math/softmax_exp.h);
//   3. every value tier's packed rows: out += weight * row, each row's weight found where its
//      key's score lies; then each head's output divided by its sum.
// The policy's weights are the same exponentials, normalised and averaged over the group. Which
// order the rows come in changes nothing but rounding: the exact peak is known before any
// exponential, as in the oracle's two-pass softmax.
void HeadCache::attend_from_storage(const float* q, float* out) {
    const int d = plan_.head_dim, group = plan_.group;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const std::size_t stride = score_stride_;
    float* const scores = row_weights_.data() + score_offset_;
    std::fill(peaks_.begin(), peaks_.end(), -INFINITY);
    int n = 0;
    for (int tier = 0; tier < 3; ++tier) {
        const TierRows rows = key_rows(tier);
        score_rows(rows, q, group, scale, scores + n, stride, peaks_.data(), kernel_scratch_.data());
        for (int r = 0; r < rows.count; ++r) index_of_slot_[static_cast<std::size_t>(rows.slot_of_row[r])] = n + r;
        n += rows.count;
    }
    // The sum in double, as the oracle's softmax_numerators adds it: a float sum of thousands of
    // weights would be off by more than the rest of the path's rounding together.
    for (int h = 0; h < group; ++h) {
        exp_minus_peak(scores + h * stride, n, peaks_[h]);
        inverse_sums_[h] = reciprocal_of_sum(scores + h * stride, static_cast<std::size_t>(n));
    }
    std::fill(out, out + static_cast<std::size_t>(group) * d, 0.0f);
    for (int tier = 0; tier < 3; ++tier)
        accumulate_rows(value_rows(tier), scores, stride, index_of_slot_.data(), group, out, kernel_scratch_.data());
    for (int h = 0; h < group; ++h) {
        float* o = out + static_cast<std::size_t>(h) * d;
        for (int i = 0; i < d; ++i) o[i] *= inverse_sums_[h];
    }
    // What the policy sees: each head's weight on each held position, averaged over the group
    // (in the rows' order, then by position).
    float* const mean = row_means_.data();
    std::fill(mean, mean + n, 0.0f);
    for (int h = 0; h < group; ++h) {
        const float* w = scores + h * stride;
        const float inverse_sum = inverse_sums_[h];
        for (int i = 0; i < n; ++i) mean[i] += w[i] * inverse_sum;
    }
    const float inverse_group = 1.0f / static_cast<float>(group);
    attn_.resize(positions_.size());
    for (std::size_t j = 0; j < positions_.size(); ++j)
        attn_[j] = mean[index_of_slot_[static_cast<std::size_t>(slot_of_[j])]] * inverse_group;
}

void HeadCache::bench_fill(int tokens, const float* k, const float* v, const std::function<uint8_t(int)>& tier_of) {
    start();
    const int d = plan_.head_dim;
    for (int p = 0; p < tokens && !free_slots_.empty(); ++p) {
        const int slot = free_slots_.back();
        free_slots_.pop_back();
        const uint8_t tier = format_ ? tier_of(p) : 0;
        keys_[tier].add(slot);
        values_[tier].add(slot);
        keys_[tier].write(slot, k + static_cast<std::size_t>(p) * d);
        values_[tier].write(slot, v + static_cast<std::size_t>(p) * d);
        position_of_slot_[static_cast<std::size_t>(slot)] = p;
        key_tier_[p] = value_tier_[p] = new_key_tier_[p] = new_value_tier_[p] = tier;
        mark(slot, slot_code(tier, tier));
        positions_.push_back(p);
        slot_of_.push_back(slot);
    }
}

void HeadCache::bench_attend(const float* q, float* out, bool oracle) {
    if (!oracle) return attend_from_storage(q, out);
    const int32_t last = positions_.back();
    const int slot = slot_of_.back();
    positions_.pop_back();
    slot_of_.pop_back();
    attend_two_pass(slot, q, out);
    positions_.push_back(last);
    slot_of_.push_back(slot);
}

void HeadCache::decode(int32_t t, const float* q, const float* k, const float* v, float* out, bool defer_eviction) {
    if (state_) {
        // A streaming head: the state takes every token and folds what leaves its window.
        const int d = plan_.head_dim;
        state_->admit(t, k, v);
        for (int h = 0; h < plan_.group; ++h) group_queries_[h] = q + static_cast<std::size_t>(h) * d;
        state_->output(group_queries_, out);
        attending_bytes_ = state_->bytes() + static_cast<double>(policy_->bytes_per_slot()) * (positions_.size() + 1);
        complete(t, -1, defer_eviction);
        return;
    }
    const int slot = admit(t, k, v);
    if (plan_.oracle) {
        attend_two_pass(slot, q, out);
        // What the policy sees: each query head's weights on the held positions, averaged over the
        // group (the renormalised view computed from the cache itself).
        const std::size_t held = positions_.size(), n = held + 1;
        attn_.assign(held, 0.0f);
        for (int h = 0; h < plan_.group; ++h)
            for (std::size_t j = 0; j < held; ++j) attn_[j] += weights_[h * n + j];
        for (std::size_t j = 0; j < held; ++j) attn_[j] /= static_cast<float>(plan_.group);
    } else {
        attend_from_storage(q, out);  // and attn_, the same way
    }
    complete(t, slot, defer_eviction);
}

int HeadCache::admit(int32_t t, const float* k, const float* v) {
    // t enters at FP16, in a free slot (held <= budget, so one is free).
    if (free_slots_.empty()) fail(t, "no free slot: the policy holds more than its budget and prefill allow");
    const int slot = free_slots_.back();
    free_slots_.pop_back();
    keys_[0].add(slot);
    values_[0].add(slot);
    keys_[0].write(slot, k);
    values_[0].write(slot, v);
    position_of_slot_[static_cast<std::size_t>(slot)] = t;
    key_tier_[t] = value_tier_[t] = 0;
    new_key_tier_[t] = new_value_tier_[t] = 0;
    mark(slot, 0);
    if (kivi_) add_group_key(t, k);
    return slot;
}

// t's key joins its position group; when t completes the group, each channel's scale at INT8 and
// INT4 is sized from the group's keys at FP16, as the simulator's quantize_key_group does.
void HeadCache::add_group_key(int32_t t, const float* k) {
    const int d = plan_.head_dim;
    float* row = group_keys_.data() + static_cast<std::size_t>(t % key_group_) * d;
    for (int c = 0; c < d; ++c) row[c] = round_to_fp16(k[c]);
    if ((t + 1) % key_group_ != 0) return;
    const int group = t / key_group_;
    for (int tier = 1; tier < 3; ++tier) {
        const int qmax = quant_levels(tier == 1 ? 8 : 4);
        float* scales = channel_scales_[tier].data() + static_cast<std::size_t>(group) * d;
        for (int c = 0; c < d; ++c) {
            float max_abs = 0.0f;
            for (int r = 0; r < key_group_; ++r) max_abs = std::max(max_abs, std::abs(group_keys_[static_cast<std::size_t>(r) * d + c]));
            scales[c] = group_scale(max_abs, qmax);
        }
    }
    completed_key_groups_ = group + 1;
}

void HeadCache::read_key(int32_t p, uint8_t tier, int slot, float* out) const {
    if (kivi_ && tier != 0)
        keys_[tier].read_with_channel_scales(slot, group_scales(tier, p), out);
    else
        keys_[tier].read(slot, out);
}

void HeadCache::abandon(int slot) {
    keys_[0].remove(slot);
    values_[0].remove(slot);
    free_slots_.push_back(slot);
    mark(slot, kEmptyCode);
}

// An evicted position's slot: its rows leave their tiers, and the slot is free again.
void HeadCache::release(int slot, int32_t p) {
    keys_[key_tier_[p]].remove(slot);
    values_[value_tier_[p]].remove(slot);
    free_slots_.push_back(slot);
    mark(slot, kEmptyCode);
}

void HeadCache::complete_from_slot_weights(int32_t t, int slot, const float* slot_weights, bool defer_eviction) {
    attn_.resize(positions_.size());
    for (std::size_t j = 0; j < positions_.size(); ++j) attn_[j] = slot_weights[slot_of_[j]];
    complete(t, slot, defer_eviction);
}

// After attention: the step's bytes, t held, then the policy observes attn_ (the held positions'
// weights; zeros for a streaming head), evicts to its budget and reassigns tiers.
void HeadCache::complete(int32_t t, int slot, bool defer_eviction) {
    const std::size_t held = positions_.size();
    if (!state_) {
        // The held tokens and t, each at its tiers: what the tier stores hold now.
        double bytes = 0;
        for (int tier = 0; tier < 3; ++tier)
            bytes += keys_[tier].rows() * key_bytes_[tier] + values_[tier].rows() * value_bytes_[tier];
        attending_bytes_ = bytes + static_cast<double>(policy_->bytes_per_slot()) * static_cast<double>(held + 1);
    }
    if (t == 0) {  // the policy was built holding position 0; its tier as step 0 left it
        positions_.push_back(0);
        slot_of_.push_back(slot);
        assign_tiers(0);
        return;
    }
    if (state_) attn_.assign(held, 0.0f);
    positions_.push_back(t);  // a streaming head's policy holds positions like any other
    slot_of_.push_back(slot);
    policy_->on_decode_step(t, attn_);
    // Inside a prefill the cache grows freely; after its last token it is compressed once.
    if (!defer_eviction && (positions_.size() > static_cast<std::size_t>(plan_.budget) || policy_->sizes_itself())) {
        victims_.clear();
        policy_->evict(plan_.budget, victims_);
        // Victims ascend, as positions do: each found by bisection after the last, and the held
        // positions between two victims moved down in one block (a step evicts one or a few).
        std::size_t out_index = 0, from = 0;
        for (const int32_t victim : victims_) {
            const auto at = std::lower_bound(positions_.begin() + static_cast<std::ptrdiff_t>(from), positions_.end(), victim);
            if (at == positions_.end() || *at != victim) fail(t, "evicted a position it does not hold, or out of order");
            const std::size_t i = static_cast<std::size_t>(at - positions_.begin());
            if (slot_of_[i] >= 0) release(slot_of_[i], victim);
            std::copy(positions_.begin() + static_cast<std::ptrdiff_t>(from), at, positions_.begin() + static_cast<std::ptrdiff_t>(out_index));
            std::copy(slot_of_.begin() + static_cast<std::ptrdiff_t>(from), slot_of_.begin() + static_cast<std::ptrdiff_t>(i),
                      slot_of_.begin() + static_cast<std::ptrdiff_t>(out_index));
            out_index += i - from;
            from = i + 1;
        }
        std::copy(positions_.begin() + static_cast<std::ptrdiff_t>(from), positions_.end(), positions_.begin() + static_cast<std::ptrdiff_t>(out_index));
        std::copy(slot_of_.begin() + static_cast<std::ptrdiff_t>(from), slot_of_.end(), slot_of_.begin() + static_cast<std::ptrdiff_t>(out_index));
        out_index += positions_.size() - from;
        positions_.resize(out_index);
        slot_of_.resize(out_index);
        if (positions_.size() > static_cast<std::size_t>(plan_.budget))
            fail(t, "left " + std::to_string(positions_.size()) + " positions, over its budget of " +
                        std::to_string(plan_.budget));
    }
    assign_tiers(t);
}

void HeadCache::mirror_to_device(bool on) {
    mirrored_ = on && !state_;
    slot_code_.assign(mirrored_ ? capacity_ : 0, kEmptyCode);
    slot_dirty_.assign(mirrored_ ? capacity_ : 0, 0);
    dirty_slots_.clear();
    mark_all_dirty();  // every slot once: the device's table starts as the host's, all empty
}

void HeadCache::mark(int slot, uint8_t code) {
    if (!mirrored_) return;
    slot_code_[slot] = code;
    if (!slot_dirty_[slot]) slot_dirty_[slot] = 1, dirty_slots_.push_back(slot);
}

void HeadCache::mark_all_dirty() {
    for (int s = 0; mirrored_ && s < capacity_; ++s)
        if (!slot_dirty_[s]) slot_dirty_[s] = 1, dirty_slots_.push_back(s);
}

void HeadCache::take_dirty(const std::function<void(int slot, uint8_t code)>& send) {
    for (int slot : dirty_slots_) {
        send(slot, slot_code_[slot]);
        slot_dirty_[slot] = 0;
    }
    dirty_slots_.clear();
}

namespace {
// The first p in [from, end) where either pair of tier arrays differs; end if none. Thirty-two
// positions a test (a loop the compiler vectorises), then one at a time inside a block that
// differs: a step changes the tiers of a few positions among thousands.
int32_t first_tier_change(const uint8_t* key, const uint8_t* new_key, const uint8_t* value, const uint8_t* new_value,
                          int32_t from, int32_t end) {
    constexpr int32_t kBlock = 32;
    int32_t p = from;
    for (; p + kBlock <= end; p += kBlock) {
        uint8_t differ = 0;
        for (int32_t q = p; q < p + kBlock; ++q) differ |= static_cast<uint8_t>((key[q] ^ new_key[q]) | (value[q] ^ new_value[q]));
        if (differ) break;
    }
    for (; p < end; ++p)
        if (key[p] != new_key[p] || value[p] != new_value[p]) return p;
    return end;
}
}  // namespace

void HeadCache::assign_tiers(int32_t t) {
    if (!format_) return;
    // The policy writes the tier of every held position it changes; a change may only sink a
    // token. What it writes into starts as the current tiers: every position enters at FP16 in
    // both, and every change the loop below accepts is copied back. So the changes are where the
    // two differ, found by scanning the span of held positions (a position not held is never read
    // again; whatever the policy left there is put back).
    policy_->assign_tiers(t, positions_, new_key_tier_, new_value_tier_);
    if (positions_.empty()) return;
    uint8_t *key_tier = key_tier_.data(), *value_tier = value_tier_.data();
    uint8_t *new_key_tier = new_key_tier_.data(), *new_value_tier = new_value_tier_.data();
    const int32_t end = positions_.back() + 1;
    std::size_t i = 0;  // positions ascend: each change's index found after the last one's
    for (int32_t p = first_tier_change(key_tier, new_key_tier, value_tier, new_value_tier, positions_.front(), end);
         p < end; p = first_tier_change(key_tier, new_key_tier, value_tier, new_value_tier, p + 1, end)) {
        i = static_cast<std::size_t>(std::lower_bound(positions_.begin() + static_cast<std::ptrdiff_t>(i), positions_.end(), p) -
                                     positions_.begin());
        const uint8_t key = new_key_tier[p], value = new_value_tier[p];
        if (positions_[i] != p) {  // not held
            new_key_tier[p] = key_tier[p], new_value_tier[p] = value_tier[p];
            continue;
        }
        if (key < key_tier[p] || value < value_tier[p] || key > 2 || value > 2) {
            for (const int32_t q : positions_) new_key_tier[q] = key_tier[q], new_value_tier[q] = value_tier[q];
            fail(t, "moved position " + std::to_string(p) + " to a finer or unknown tier (a token only sinks)");
        }
        sink(i, key, value);
        key_tier[p] = key;
        value_tier[p] = value;
    }
}

}  // namespace kvsim::runtime
