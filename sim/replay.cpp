#include "sim/replay.h"

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <optional>

#include "sim/heavy_hitters.h"
#include "cache_math/lowrank.h"
#include "cache_math/tiers.h"
#include "sim/qkv_attention.h"
#include "sim/rng.h"
#include "sim/step_sample.h"
#include "base/errors.h"
#include "base/size_limits.h"

namespace kvsim {
namespace {

// The replay of one trace: its shape, the combinations, and the buffers of the per-step work
// that every combination shares (reused from block to block).
class LockstepReplay {
    // A layer's jobs (layer_jobs): runs of combinations on one KV head, except that an Ada-KV
    // combination's heads step together, as one job (kv -1). The combinations of a run read each
    // step's rows in turn while they are in cache, rather than each from memory (a 64-step block
    // of the Llama-1B shape is 32 MB of rows); runs are sized to leave about four to eight jobs
    // per thread, to keep the threads busy. Harnesses are independent: how they are grouped never
    // changes a result.
    struct Job {
        std::vector<std::size_t> combos;
        int kv;
    };

public:
    LockstepReplay(AttentionSource& source, const std::vector<ReplayCombo>& combos, const ReplayOptions& options)
        : source_(source), shape_(source.shape()), combos_(combos), options_(options),
          query_heads_(shape_.num_query_heads), kv_heads_(shape_.num_kv_heads), group_(shape_.group_size()),
          k_(options.heavy_hitter_k), raw_view_(options.harness.view == AttentionView::raw),
          cached_view_(options.harness.view == AttentionView::cached),
          qkv_(dynamic_cast<QkvSource*>(&source)), jobs_(layer_jobs()), combined_(kv_heads_) {
        // Value-level metrics need the values: only a Q/K/V source has them.
        if ((options.output_error || options.memory) && !qkv_)
            throw InputError(source.description() +
                             ": output error and memory metrics need a Q/K/V trace (this one records attention only)");
        // The cached view attends to the cache as held: the output a step computes is what it shows.
        if (options.harness.view == AttentionView::cached) {
            if (!qkv_)
                throw InputError(source.description() + ": the cached attention view needs a Q/K/V trace");
            options_.output_error = true;
        }
        head_dim_ = qkv_ ? qkv_->qkv_shape().head_dim : 0;
        runs_of_kv_.resize(kv_heads_);
        for (std::size_t j = 0; j < jobs_.size(); ++j) {
            (jobs_[j].kv >= 0 ? runs_of_kv_[jobs_[j].kv] : layer_wide_jobs_).push_back(j);
            shared_runs_ |= jobs_[j].kv >= 0 && jobs_[j].combos.size() > 1;
        }
        // The per-step loops keep a group's rows in arrays of 64.
        if (group_ < 1 || group_ > 64)
            throw InputError(source.description() + ": " + std::to_string(group_) +
                             " query heads per KV head; kvsim handles 1 to 64");
    }

    std::vector<ComboResult> run() {
        std::vector<int> layers = options_.layers;
        if (layers.empty())
            for (int layer = 0; layer < shape_.num_layers; ++layer) layers.push_back(layer);
        for (int layer : layers)
            if (layer < 0 || layer >= shape_.num_layers)
                throw std::logic_error("replay: layer " + std::to_string(layer) + " out of range");
        const bool prefetch = check_memory_plan();
        const std::size_t sequences = shape_.sequence_lengths.size();
        std::vector<ComboResult> results(combos_.size());
        for (auto& r : results) r.by_stream.resize(sequences * shape_.num_layers * kv_heads_);
        for (int64_t last : shape_.last_steps) total_steps_ += last * static_cast<int64_t>(layers.size());

        // The (sequence, layer) pairs in the order they are replayed, then the caller's next one:
        // each one's load starts (memory allowing) while the one before replays.
        std::vector<std::pair<int, int>> order;
        for (std::size_t s = 0; s < sequences; ++s)
            for (int layer : layers) order.emplace_back(static_cast<int>(s), layer);
        const std::size_t replayed = order.size();
        if (options_.next_layer >= 0 && options_.next_layer < shape_.num_layers) order.emplace_back(0, options_.next_layer);
        // No load outlives a replay that throws; one for the caller's next replay outlives one that returns.
        struct DropPrefetch {
            QkvSource* source;
            const int uncaught = std::uncaught_exceptions();
            ~DropPrefetch() {
                if (source && std::uncaught_exceptions() > uncaught) source->drop_prefetch();
            }
        } drop_prefetch{qkv_};
        for (std::size_t at = 0; at < replayed; ++at) {
            const auto [s, layer] = order[at];
            std::vector<Harness> harnesses = make_harnesses(s, layer);
            if (options_.output_error || options_.memory) attach_values(s, layer, harnesses);
            attach_prompt(s, layer, harnesses);
            replay_layer(s, layer, harnesses,
                         prefetch && at + 1 < order.size() ? std::optional(order[at + 1]) : std::nullopt);
            for (int kv = 0; kv < kv_heads_; ++kv)
                for (std::size_t c = 0; c < combos_.size(); ++c) {
                    const Harness& harness = harnesses[kv * combos_.size() + c];
                    results[c].by_stream[(static_cast<std::size_t>(s) * shape_.num_layers + layer) * kv_heads_ + kv] = harness.metrics();
                    results[c].policy_bytes_per_slot = harness.policy().bytes_per_slot();
                }
        }
        for (auto& r : results) sum_streams(r, sequences, shape_.num_layers, kv_heads_);
        return results;
    }

private:
    // Packed weights per query head in one block: what the source allows, and always one row.
    int64_t block_floats_per_head() const {
        return std::max<int64_t>(1, source_.block_floats(options_.block_floats) / query_heads_);
    }

    // An upper bound of what replaying one (sequence, layer) holds at once, checked for every
    // sequence and layer before the first step: input that implies more than the memory limit is
    // one InputError naming the trace and the sequence (or the policy parameter that sizes it),
    // not an out-of-memory kill half-way through. Thread-independent, so is the verdict.
    // Returns whether a second layer's Q/K/V fits beside the plan's largest (sequence, layer):
    // then each layer's load runs while the one before replays.
    bool check_memory_plan() const {
        uint64_t most = 0, second_layer = 0;
        const uint64_t heads = static_cast<uint64_t>(query_heads_), kv = static_cast<uint64_t>(kv_heads_);
        const uint64_t per_head_wanted = static_cast<uint64_t>(block_floats_per_head());
        const bool values = options_.output_error || options_.memory;
        uint64_t tier_copies = 0;  // combinations that may hold quantised copies of the layer's K and V
        for (const ReplayCombo& c : combos_) {
            tier_copies += c.quantize.has_value() || c.policy->keeps_everything;
            // A projection's latents and reconstruction (cache_math/lowrank.h): about as many copies again.
            tier_copies += c.project != nullptr || c.policy->projection != nullptr;
        }
        for (std::size_t s = 0; s < shape_.sequence_lengths.size(); ++s) {
            const std::string what = source_.description() + ": sequence " + shape_.sequence_names[s] + " (" +
                                     std::to_string(shape_.sequence_lengths[s]) + " tokens)";
            auto mul = [&](uint64_t a, uint64_t b) { return checked_mul(a, b, what); };
            auto add = [&](uint64_t a, uint64_t b) { return checked_add(a, b, what); };
            const uint64_t length = static_cast<uint64_t>(shape_.sequence_lengths[s]);
            const uint64_t last = static_cast<uint64_t>(std::max<int64_t>(shape_.last_steps[s], 1));
            if (qkv_)
                second_layer = std::max(second_layer, mul(mul(length, mul(heads + 2 * kv, head_dim_)), sizeof(float)));
            // A block holds at most the floats asked for, or one row where a row is longer; its rows
            // r and last step e satisfy r * (e - 1) <= 2 * floats, which bounds the heavy hitters.
            const uint64_t per_head = std::max(per_head_wanted, last);
            const uint64_t rows = std::min(per_head, last);
            uint64_t block = mul(heads, per_head);                          // the rows
            block = add(block, mul(heads, rows));                          // self weights
            const uint64_t k = static_cast<uint64_t>(std::max(k_, 1));
            block = add(block, mul(heads, std::min(mul(2, per_head), mul(rows, k))));  // heavy hitters
            if (raw_view_ && group_ > 1) block = add(block, mul(kv, per_head));  // combined rows
            uint64_t shared = mul(block, sizeof(float));
            if (qkv_) {
                const uint64_t d = static_cast<uint64_t>(head_dim_);
                // Q, K, V and the keys by feature (in panels, up to 47 tokens of padding a KV head)
                const uint64_t layer_floats =
                    add(mul(length, mul(heads + 3 * kv, d)), mul(kv, mul(kScorePanelTokens - 1, d)));
                shared = add(shared, mul(layer_floats, sizeof(float)));
                shared = add(shared, mul(mul(heads, add(mul(2, per_head), rows)), sizeof(float)));  // score products
                if (values) {
                    shared = add(shared, mul(mul(tier_copies, 4), mul(mul(length, mul(kv, d)), sizeof(float))));
                    if (options_.output_error) {
                        shared = add(shared, mul(mul(heads, mul(rows, d)), sizeof(float)));
                        // scores: fp16, and INT8 and INT4 where tiered harnesses share them
                        shared = add(shared, mul(mul(mul(tier_copies > 0 ? 3 : 1, heads), add(per_head, mul(2, rows))),
                                                 sizeof(float)));
                    }
                    shared = add(shared, mul(length, sizeof(int32_t) + 1));
                }
            }
            for (int layer = 0; layer < shape_.num_layers; ++layer) {
                uint64_t total = shared;
                for (const ReplayCombo& c : combos_) {
                    // KV heads plan alike unless a profile gives each its own budget.
                    const int distinct = c.head_budgets.empty() ? 1 : kv_heads_;
                    const uint64_t copies = c.head_budgets.empty() ? kv : 1;
                    for (int head = 0; head < distinct; ++head) {
                        const PolicyContext ctx = context(c, static_cast<int>(s), layer, head);
                        // Per harness: flags and tiers by position, and per cached slot the harness's
                        // lists, the group's gathered weights and the policy's own bookkeeping.
                        const uint64_t slots = static_cast<uint64_t>(ctx.capacity);
                        uint64_t harness = mul(length, values || c.quantize || c.policy->keeps_everything ? 3 : 1);
                        harness = add(harness, mul(slots, 16 + 4 * static_cast<uint64_t>(group_) + 64));
                        total = add(total, add(mul(harness, copies), c.check_param_memory(ctx, copies)));
                    }
                }
                check_memory(total, what + ", layer " + std::to_string(layer) + ": replaying " +
                                        std::to_string(combos_.size()) + " configurations over " +
                                        std::to_string(kv_heads_) + " KV heads");
                most = std::max(most, total);
                if (std::all_of(combos_.begin(), combos_.end(),
                                [](const ReplayCombo& c) { return c.layer_budgets.empty() && c.head_budgets.empty(); }))
                    break;  // every layer plans alike
            }
        }
        return qkv_ && second_layer <= memory_limit_bytes() && most <= memory_limit_bytes() - second_layer;
    }

    // What a policy of combination c may know where it runs.
    PolicyContext context(const ReplayCombo& c, int s, int layer, int kv) const {
        const int64_t length = shape_.sequence_lengths[s];
        const int prompt = c.prompt_length(length, options_.harness.prefill_tokens);
        const int budget = c.budget_for(layer, kv, kv_heads_, length, prompt);
        const int most = c.capacity_budget(layer, kv, kv_heads_, length, prompt);
        const int capacity = static_cast<int>(std::min<int64_t>(std::max(most, prompt), length)) + 1;
        return PolicyContext{budget, capacity, layer, shape_.num_layers, kv, kv_heads_, head_dim_};
    }

    // The harness options of combination c on sequence s: its own prompt and byte model.
    HarnessOptions harness_options(const ReplayCombo& c, int s) const {
        HarnessOptions options = options_.harness;
        options.prefill_tokens = c.prompt_length(shape_.sequence_lengths[s], options_.harness.prefill_tokens);
        options.bookkeeping = options.bookkeeping && c.bookkeeping;
        return options;
    }

    // The config cannot know the trace's head size: every caller of replay (the program, search,
    // the fuzzer) gets the tier format's check here, before the layer's first step.
    void check_tier_format(const ReplayCombo& c, const Policy& policy) const {
        if (const TierFormat* f = policy.tier_format(); qkv_ && f)
            kvsim::check_tier_format(*f, head_dim_, c.where.empty() ? c.label : c.where + " (" + c.label + ")",
                                     source_.description());
    }

    // One harness per (KV head, combination), index kv_head * combinations + combination.
    std::vector<Harness> make_harnesses(int s, int layer) const {
        const int64_t length = shape_.sequence_lengths[s];
        std::vector<Harness> harnesses;
        harnesses.reserve(kv_heads_ * combos_.size());
        for (int kv = 0; kv < kv_heads_; ++kv)
            for (const ReplayCombo& c : combos_) {
                const HarnessOptions options = harness_options(c, s);
                const int budget = c.budget_for(layer, kv, kv_heads_, length, options.prefill_tokens);
                if (c.compression > 0 && c.policy->check_budget) {
                    const std::string problem = c.policy->check_budget(c.params, budget);
                    if (!problem.empty())
                        throw InputError(c.label + " at budget " + c.budget_label + ": sequence " +
                                         shape_.sequence_names[s] + " (" + std::to_string(length) + " tokens) gets " +
                                         std::to_string(budget) + " tokens, and " + problem);
                }
                const PolicyContext ctx = context(c, s, layer, kv);
                const std::string where = " (sequence " + shape_.sequence_names[s] + ", layer " +
                                          std::to_string(layer) + ", KV head " + std::to_string(kv) + ")";
                std::unique_ptr<Policy> policy = c.make(ctx);
                check_tier_format(c, *policy);
                harnesses.emplace_back(std::move(policy), budget, length, options, c.label, where);
            }
        return harnesses;
    }

    // A prompt press reads the prompt's queries, keys and values: the layer's, from the trace.
    void attach_prompt(int s, int layer, std::vector<Harness>& harnesses) {
        for (std::size_t job = 0; job < harnesses.size(); ++job) {
            if (!harnesses[job].policy().reads_prompt()) continue;
            if (!qkv_)
                throw InputError(source_.description() + ": " + combos_[job % combos_.size()].label +
                                 " reads the prompt's queries, keys and values, which this trace does not record");
            const QkvLayer& data = qkv_->layer_data(s, layer);
            PromptView view;
            view.layer = layer;
            view.num_layers = shape_.num_layers;
            view.kv_head = static_cast<int>(job / combos_.size());
            view.num_query_heads = query_heads_;
            view.num_kv_heads = kv_heads_;
            view.head_dim = head_dim_;
            view.queries = data.q.data();
            view.keys = data.k.data();
            view.values = data.v.data();
            harnesses[job].set_prompt(view);
        }
    }

    // The tiers each distinct precision format (and projection) serves for this layer, built once
    // and shared.
    const TierArrays* arrays_for(const TierFormat* format, const KvProjection* projection) {
        for (std::size_t i = 0; i < tier_arrays_.size(); ++i) {
            const TierArrays& a = *tier_arrays_[i];
            const KvProjection* built = array_projections_[i].get();
            if ((format == nullptr) != (a.k[1] == nullptr) || (format && !(a.format == *format))) continue;
            if ((projection == nullptr) != (built == nullptr) || (projection && !(*projection == *built))) continue;
            return &a;
        }
        auto arrays = std::make_unique<TierArrays>();
        if (projection) {
            build_projected_arrays(*projection, layer_index_, *layer_values_, kv_heads_, head_dim_, format, *arrays);
        } else {
            arrays->k[0] = layer_values_->k.data();
            arrays->v[0] = layer_values_->v.data();
            if (format) {
                arrays->format = *format;
                build_tier_arrays(*layer_values_, kv_heads_, head_dim_, *arrays);
            }
        }
        tier_arrays_.push_back(std::move(arrays));
        array_projections_.push_back(projection ? std::make_unique<KvProjection>(*projection) : nullptr);
        return tier_arrays_.back().get();
    }

    // How many of a stream's M measured steps its output error is measured on: n = ceil(f M), at
    // least 2 (at most M).
    int64_t sample_size(int64_t population) const {
        return std::min<int64_t>(population, std::max<int64_t>(2, static_cast<int64_t>(std::ceil(options_.output_error_sample * population))));
    }

    // The steps of a stream whose output error is measured (ReplayOptions::output_error_sample):
    // one of each of n strata of its M measured steps (first..last; sim/step_sample.h), drawn by
    // a generator seeded by the seed, the sequence, the layer, the KV head and the first step, so
    // every budget of a (layer, KV head) is measured on the same steps, on any machine or shard.
    // Empty where every step is measured.
    const std::vector<uint8_t>& sampled_steps(int s, int layer, int kv, int64_t first) {
        const int64_t last = shape_.last_steps[s], population = last - first + 1;
        const double fraction = options_.output_error_sample;
        const int64_t n = sample_size(population);
        std::vector<uint8_t>& steps = sample_masks_[{kv, first}];
        if (fraction >= 1 || n >= population) return steps;  // every step
        steps.assign(static_cast<std::size_t>(last + 1), 0);
        uint32_t seed = Xoshiro128::mix32(static_cast<uint32_t>(options_.output_error_seed) + 0x9E3779B9u);
        for (const int64_t key : {int64_t{s}, int64_t{layer}, int64_t{kv}, first})
            seed = Xoshiro128::mix32(seed ^ static_cast<uint32_t>(key));
        Xoshiro128 rng(seed);
        draw_stratified_steps(population, n, rng, steps.data() + first);
        std::vector<uint8_t>& needed = full_output_steps_[kv];
        if (needed.empty()) needed.assign(steps.size(), 0);
        for (std::size_t t = 0; t < steps.size(); ++t) needed[t] |= steps[t];
        return steps;
    }

    void attach_values(int s, int layer, std::vector<Harness>& harnesses) {
        memo_read_.assign(kv_heads_, nullptr);
        memo_fill_.assign(kv_heads_, nullptr);
        memo_cursor_.assign(kv_heads_, 0);
        last_step_ = shape_.last_steps[s];
        tier_arrays_.clear();
        array_projections_.clear();
        sample_masks_.clear();
        full_output_steps_.assign(kv_heads_, {});
        full_output_every_step_.assign(kv_heads_, options_.output_error_sample >= 1);
        layer_values_ = &qkv_->layer_data(s, layer);
        layer_index_ = layer;
        fp16_arrays_ = arrays_for(nullptr, nullptr);
        std::map<const TierArrays*, std::size_t> readers;  // harnesses per tiered arrays
        for (std::size_t job = 0; job < harnesses.size(); ++job) {
            const Policy& policy = harnesses[job].policy();
            const int kv = static_cast<int>(job / combos_.size());
            const TierArrays* arrays = arrays_for(policy.tier_format(), policy.projection());
            if (arrays->k[1] && arrays->k[2]) ++readers[arrays];
            CacheValues values{arrays, kv, kv_heads_, head_dim_, options_.output_error, options_.memory};
            values.outputs_when_measured = true;
            if (options_.output_error && options_.output_error_sample < 1) {
                const int64_t first = std::max<int64_t>(1, harnesses[job].prefill_tokens());
                const int64_t population = shape_.last_steps[s] - first + 1;
                const std::vector<uint8_t>& steps = sampled_steps(s, layer, kv, first);
                if (steps.empty()) full_output_every_step_[kv] = 1;
                values.sample = {steps.empty() ? nullptr : steps.data(), shape_.last_steps[s], population,
                                 sample_size(population)};
            }
            if (const KvProjection* p = policy.projection()) {
                values.key_dim = p->stored_key_dim(layer, kv, head_dim_);
                values.value_dim = p->stored_value_dim(layer, kv, head_dim_);
                values.byte_share = p->share(kv_heads_);
                values.fixed_bytes = p->basis_bytes(layer, kv, kv_heads_, head_dim_);
            }
            harnesses[job].set_values(values);
        }
        shared_tiers_ = nullptr;
        std::size_t most = 0;
        for (const auto& [arrays, count] : readers)  // by pointer order: any one of equal counts serves
            if (count > most) most = count, shared_tiers_ = arrays;
        if (most < 4 * static_cast<std::size_t>(kv_heads_)) shared_tiers_ = nullptr;
        // Whether a harness of each KV head attends through the shared scores: a streaming head
        // does not (its output is its state's), so where every one streams the scores are made
        // for the full cache's output alone.
        scores_wanted_.assign(kv_heads_, 0);
        for (std::size_t job = 0; job < harnesses.size(); ++job)
            if (!harnesses[job].policy().linear_state()) scores_wanted_[job / combos_.size()] = 1;
        if (options_.output_error && options_.full_outputs) find_memo_streams(s, layer);
    }

    // Per KV head, the memo's stream of this (sequence, layer) to read the full outputs from, or
    // to keep them in.
    void find_memo_streams(int s, int layer) {
        for (int kv = 0; kv < kv_heads_; ++kv) {
            std::size_t measured = 0;
            for (int64_t t = 1; t <= last_step_; ++t) measured += full_output_at(kv, t);
            bool fill = false;
            FullOutputMemo::Stream* stream = options_.full_outputs->find(
                &source_, s, layer, kv, full_output_every_step_[kv] != 0, full_output_steps_[kv],
                measured * static_cast<std::size_t>(group_) * static_cast<std::size_t>(head_dim_), fill);
            (fill ? memo_fill_ : memo_read_)[kv] = stream;
        }
    }

    // `load_next`: the (sequence, layer) whose load starts once this one's first block is read.
    void replay_layer(int s, int layer, std::vector<Harness>& harnesses, std::optional<std::pair<int, int>> load_next) {
        const int64_t length = shape_.sequence_lengths[s];
        const int64_t block_floats = block_floats_per_head();
        // A Q/K/V trace's attention rows are made only where something reads them: the attention
        // metrics, or a policy shown attention (search's streaming fit needs neither).
        rows_ = !qkv_ || options_.harness.attention_metrics ||
                std::any_of(harnesses.begin(), harnesses.end(), [](const Harness& h) { return h.policy().reads_attention(); });
        // The heavy hitters serve heavy-hitter recall alone: without the attention metrics (a
        // search's output-error passes) no row's top positions are looked for.
        heavy_hitters_ = rows_ && options_.harness.attention_metrics;
        for (int64_t first = 1; first <= shape_.last_steps[s];) {
            const int64_t end = attention_block_end(first, shape_.last_steps[s], block_floats);
            if (heavy_hitters_) size_heavy_hitters(first, end);
            if (qkv_) {
                qkv_->begin_block(s, layer, first, end, block_);  // the rows come KV head by KV head, below
            } else {
                source_.read_block(s, layer, first, end, block_);
                if (heavy_hitters_) heavy_hitters_of_block(first, end);
            }
            // The layer is loaded: the next one's load may start beside it.
            if (load_next) {
                qkv_->prefetch(load_next->first, load_next->second);
                load_next.reset();
            }
            recorded_self_ = rows_ && !block_.self_weight.empty();
            if (rows_ && !raw_view_ && !recorded_self_) self_weight_from_row_sums(block_);
            size_shared_work(first, end, length);
            // Each KV head in turn: a Q/K/V trace's rows of its query heads (each row's heavy
            // hitters found as it is written), the block's work its combinations share, then its
            // runs of combinations, which read the rows while they are still in cache (a block's
            // rows of every head, 32 MB on the Llama-1B shape, come back from memory).
            overflow_.assign(query_heads_, -1);
            tbb::parallel_for(0, kv_heads_, [&](int kv) {
                if (qkv_ && rows_)
                    for (int h = kv * group_; h < (kv + 1) * group_; ++h)
                        if ((overflow_[h] = qkv_->head_rows(h, block_, heavy_hitters_ ? &heavy_of_row_ : nullptr)) >= 0)
                            return;
                shared_work(kv, first, end);
                const std::vector<std::size_t>& runs = runs_of_kv_[kv];
                if (runs.size() == 1)
                    advance(harnesses, jobs_[runs.front()], first, end);
                else
                    tbb::parallel_for(std::size_t{0}, runs.size(),
                                      [&](std::size_t r) { advance(harnesses, jobs_[runs[r]], first, end); });
            });
            for (int h = 0; h < query_heads_; ++h)  // the lowest head first, whatever the threads
                if (overflow_[h] >= 0) qkv_->report_overflow(s, layer, h, overflow_[h]);
            // Ada-KV's combinations step all KV heads of the layer together, once every row is made.
            tbb::parallel_for(std::size_t{0}, layer_wide_jobs_.size(), [&](std::size_t j) {
                advance_layer(harnesses, jobs_[layer_wide_jobs_[j]].combos.front(), first, end);
            });
            steps_done_ += end - first;
            first = end;
            if (options_.progress) options_.progress(static_cast<double>(steps_done_) / total_steps_);
        }
    }

    // Room for the block's heavy hitters, before its rows arrive.
    void size_heavy_hitters(int64_t first, int64_t end) {
        block_rows_ = end - first;
        // No row of the block has more than end - 1 positions: a larger k (up to 2^30 from a
        // config) would only size the buffer, not change the heavy hitters.
        block_k_ = static_cast<int>(std::min<int64_t>(k_, end - 1));
        heavy_.resize(static_cast<std::size_t>(query_heads_) * block_rows_ * block_k_);
        heavy_count_.resize(static_cast<std::size_t>(query_heads_) * block_rows_);
        // Each row's threshold hints the next's (see top_k_positions), from block to block of a
        // (sequence, layer). Hints change how much of a row is scanned, never the positions chosen.
        if (first == 1) heavy_hint_.assign(query_heads_, kNoTopKHint);
    }

    // Row `index` of a block's rows of `head`: its heavy hitters, from the head's hint (and, where
    // given, the row's positions at or above it, gathered as the row was written).
    void heavy_hitters_of_row(int head, int64_t index, std::span<const float> row, int32_t& hint,
                              std::optional<std::span<const int32_t>> at_or_above = std::nullopt) {
        thread_local std::vector<int32_t> top;
        top.clear();
        if (at_or_above)
            top_k_positions(row, block_k_, top, hint, *at_or_above);
        else
            top_k_positions(row, block_k_, top, hint);
        const int64_t row_job = head * block_rows_ + index;
        std::copy(top.begin(), top.end(), heavy_.begin() + row_job * block_k_);
        heavy_count_[row_job] = static_cast<int32_t>(top.size());
    }

    // Every query head's heavy hitters of a block read whole (a source other than Q/K/V). A job
    // takes a run of one head's rows in order; a run starts from the hint the head's previous
    // block left, so a head's runs can go in parallel.
    void heavy_hitters_of_block(int64_t first, int64_t end) {
        const int64_t rows = end - first;
        heavy_next_hint_.resize(query_heads_);
        constexpr int64_t kRowsPerRun = 16;
        const int64_t runs = (rows + kRowsPerRun - 1) / kRowsPerRun;
        tbb::parallel_for(int64_t{0}, query_heads_ * runs, [&](int64_t job) {
            const int head = static_cast<int>(job / runs);
            const int64_t begin = job % runs * kRowsPerRun, stop = std::min(rows, begin + kRowsPerRun);
            int32_t hint = heavy_hint_[head];
            for (int64_t i = begin; i < stop; ++i)
                heavy_hitters_of_row(head, i, {block_.row(head, first + i), static_cast<std::size_t>(first + i)}, hint);
            if (stop == rows) heavy_next_hint_[head] = hint;
        });
        heavy_hint_.swap(heavy_next_hint_);
    }

    // Room for shared_work's results, before the KV heads' work runs in parallel.
    void size_shared_work(int64_t first, int64_t end, int64_t length) {
        if (options_.output_error) {
            full_output_.resize(static_cast<std::size_t>(query_heads_) * (end - first) * head_dim_);
            // Row t of the scores has t + 1 entries: laid out as attention row t + 1 would be.
            scores_span_ = attention_row_offset(end + 1) - attention_row_offset(first + 1);
            for (int tier = 0; tier < (shared_tiers_ ? 3 : 1); ++tier)
                tier_scores_[tier].resize(static_cast<std::size_t>(query_heads_) * scores_span_);
            if (every_position_.size() < static_cast<std::size_t>(length)) {
                every_position_.resize(length);
                for (int64_t p = 0; p < length; ++p) every_position_[p] = static_cast<int32_t>(p);
                all_fp16_.assign(length, 0);
            }
        }
        if (rows_ && raw_view_ && group_ > 1)
            for (auto& c : combined_) c.resize(attention_row_offset(end) - attention_row_offset(first));
    }

    // Whether harnesses of KV head kv attend at step t where the scores could be shared: where its
    // output error is measured, and in the cached view at every step where two or more
    // combinations share a run.
    bool shared_attention_at(int kv, int64_t t) const {
        return options_.output_error && ((cached_view_ && shared_runs_) || full_output_at(kv, t));
    }
    // Whether step t of KV head kv has its query heads' scores against every fp16 key made in
    // shared_work: where harnesses attend and one of them reads fp16 scores (it would make the
    // same ones), or where the full cache's output is made from them (not read from the memo).
    // Where every harness of the head streams (the streaming fit's probes), nothing else reads them.
    bool scores_made(int kv, int64_t t) const {
        return shared_attention_at(kv, t) && (scores_wanted_[kv] || (full_output_at(kv, t) && !memo_read_[kv]));
    }
    // Whether some stream of KV head kv measures the output error of step t (the full cache's
    // output is then made for it).
    bool full_output_at(int kv, int64_t t) const {
        return full_output_every_step_[kv] || full_output_steps_[kv][static_cast<std::size_t>(t)];
    }
    // Whether step t of KV head kv has its query heads' scores against shared_tiers_' INT8 and INT4
    // keys made in shared_work.
    bool tier_scores_made(int kv, int64_t t) const { return shared_tiers_ && shared_attention_at(kv, t); }
    // Where query head `head`'s scores of step t sit in tier_scores_[tier], in a block from `first`.
    std::size_t scores_at(int head, int64_t first, int64_t t) const {
        return static_cast<std::size_t>(head * scores_span_ + attention_row_offset(t + 1) - attention_row_offset(first + 1));
    }

    // Once per block and KV head for all its combinations: each query head's scores against every
    // fp16 key (score_rows_of_group), the full cache's output from them (for the output error), and (raw
    // view, grouped heads) its combined row. A combination's cache reads the same scores for the
    // keys it holds at fp16 (Harness::attend_cached): one dot product a key and step, not one a
    // combination.
    void shared_work(int kv, int64_t first, int64_t end) {
        const int64_t rows = end - first;
        if (options_.output_error) {
            // By the same arithmetic as a policy's cached output: the full cache errs by exactly 0.
            // A step's query heads at once: each key is read once for the group.
            tbb::parallel_for(int64_t{0}, rows, [&](int64_t row) {
                const int64_t t = first + row;
                const bool fp16 = scores_made(kv, t), tiers = tier_scores_made(kv, t);
                if (!fp16 && !tiers) return;
                thread_local std::vector<const float*> queries;
                thread_local std::vector<float*> scores;
                thread_local std::vector<CachedQuery> heads;
                queries.resize(group_);
                scores.resize(group_);
                for (int h = 0; h < group_; ++h)
                    queries[h] = layer_values_->q.data() + (t * query_heads_ + kv * group_ + h) * head_dim_;
                const auto score_tier = [&](int tier, const float* keys) {
                    for (int h = 0; h < group_; ++h)
                        scores[h] = tier_scores_[tier].data() + scores_at(kv * group_ + h, first, t);
                    score_rows_of_group(queries.data(), group_, keys, t + 1, kv, kv_heads_, head_dim_, scores.data());
                };
                if (tiers)
                    for (int tier = 1; tier < 3; ++tier) score_tier(tier, shared_tiers_->k[tier]);
                if (!fp16) return;
                score_tier(0, fp16_arrays_->k[0]);
                // Sampled: only the steps some stream of this KV head measures; the memo's are read below.
                if (!full_output_at(kv, t) || memo_read_[kv]) return;
                heads.clear();
                for (int h = 0; h < group_; ++h) {
                    const int64_t job = (kv * group_ + h) * rows + row;
                    heads.push_back({queries[h], full_output_.data() + job * head_dim_, nullptr, {scores[h], nullptr, nullptr}});
                }
                thread_local Eigen::ArrayXf scratch;
                cached_attention_outputs(heads, {every_position_.data(), static_cast<std::size_t>(t + 1)}, all_fp16_,
                                         all_fp16_, *fp16_arrays_, kv, kv_heads_, head_dim_, scratch);
            });
            if (memo_read_[kv] || memo_fill_[kv]) memo_outputs(kv, first, end);
        }
        if (rows_ && raw_view_ && group_ > 1) {
            for (int64_t t = first; t < end; ++t) {
                const float* rows_of_group[64];
                for (int h = 0; h < group_; ++h) rows_of_group[h] = block_.row(kv * group_ + h, t);
                combine_group_rows({rows_of_group, static_cast<std::size_t>(group_)}, t, options_.harness.reduce,
                                   combined_[kv].data() + attention_row_offset(t) - attention_row_offset(first));
            }
        }
    }

    // The block's full outputs of KV head kv from its memo stream, or into it, in step order.
    void memo_outputs(int kv, int64_t first, int64_t end) {
        FullOutputMemo::Stream* read = memo_read_[kv];
        FullOutputMemo::Stream* fill = memo_fill_[kv];
        const int64_t rows = end - first;
        const std::size_t d = static_cast<std::size_t>(head_dim_);
        std::size_t& cursor = memo_cursor_[kv];
        for (int64_t t = first; t < end; ++t) {
            if (!full_output_at(kv, t)) continue;
            for (int h = 0; h < group_; ++h) {
                float* full = full_output_.data() + ((kv * group_ + h) * rows + (t - first)) * d;
                if (read) {
                    if (cursor + d > read->outputs.size()) throw std::logic_error("replay: a memo stream ends early");
                    std::copy_n(read->outputs.data() + cursor, d, full);
                    cursor += d;
                } else {
                    fill->outputs.insert(fill->outputs.end(), full, full + d);
                }
            }
        }
        if (fill && end > last_step_) fill->complete = fill->outputs.size() == fill->floats;
    }

    // A job's combinations on one KV head through the block's steps, all of them at one step
    // before the next: each reads the step's rows while the one before left them in cache.
    void advance(std::vector<Harness>& harnesses, const Job& job, int64_t first, int64_t end) const {
        StepArrays arrays;
        // A group of four heads' rows, interleaved by position for the run's combinations to
        // share (sum_kept_weights), and the heavy hitters as bits: built once per step where two
        // or more read them.
        const bool shared = job.combos.size() > 1, interleave = group_ == 4 && shared && rows_;
        thread_local std::vector<float> interleaved;
        const float* scores_of_group[3][64];
        for (int64_t i = 0; i < end - first; ++i) {
            GroupStep step = group_step(job.kv, first, end, i, arrays, shared);
            if (interleave) {
                interleaved.resize(4 * static_cast<std::size_t>(step.t));
                step.interleaved_bounded = interleave_rows(step.rows, step.t, interleaved.data());
                step.interleaved = interleaved.data();
            }
            attach_shared_scores(step, job.kv, first, scores_of_group);
            if (options_.output_error && shared) share_value_sums(harnesses, job, step);
            for (std::size_t c : job.combos) harnesses[job.kv * combos_.size() + c].step(step);
        }
    }

    // The step's scores that shared_work made for KV head kv's query heads, for its caches to
    // read where they hold the keys they were made from; `scores_of_group` holds what the spans
    // point to.
    void attach_shared_scores(GroupStep& step, int kv, int64_t first, const float* (&scores_of_group)[3][64]) const {
        for (int tier = 0; tier < 3; ++tier) {
            if (!(tier == 0 ? scores_made(kv, step.t) : tier_scores_made(kv, step.t))) continue;
            for (int h = 0; h < group_; ++h)
                scores_of_group[tier][h] = tier_scores_[tier].data() + scores_at(kv * group_ + h, first, step.t);
            step.tier_scores[tier] = {scores_of_group[tier], static_cast<std::size_t>(group_)};
            step.tier_scores_keys[tier] = tier == 0 ? fp16_arrays_->k[0] : shared_tiers_->k[tier];
        }
    }

    // The step's cached outputs of the run's combinations, their value sums made together: a value
    // row one cache brought in serves the others holding it, where a call per harness read every
    // row again from memory (cached attention was about 30% of a budget fit's time, mostly those
    // sums). The same bits either way.
    void share_value_sums(std::vector<Harness>& harnesses, const Job& job, const GroupStep& step) const {
        thread_local std::vector<const CachedValueSums*> sums;
        thread_local std::vector<Harness*> owners;
        sums.clear();
        owners.clear();
        for (std::size_t c : job.combos) {
            Harness& harness = harnesses[job.kv * combos_.size() + c];
            if (const CachedValueSums* pending = harness.weights_for_shared_values(step)) {
                sums.push_back(pending);
                owners.push_back(&harness);
            }
        }
        cached_attention_values_of_caches(sums);
        for (Harness* harness : owners) harness->values_shared(step.t);
    }

    // An Ada-KV combination: every KV head of the layer through the block's steps together. Per
    // step each head observes and admits, the allocation shares the layer's total among them by
    // their scores, then each evicts down to its share.
    void advance_layer(std::vector<Harness>& harnesses, std::size_t c, int64_t first, int64_t end) const {
        const std::size_t combinations = combos_.size();
        std::vector<Policy*> policies(kv_heads_);
        std::vector<int> shares(kv_heads_), keep(kv_heads_);
        for (int kv = 0; kv < kv_heads_; ++kv) {
            Harness& harness = harnesses[kv * combinations + c];
            policies[kv] = &harness.policy();
            shares[kv] = harness.policy().eviction_target(harness.budget());
        }
        AdaKvAllocator allocator(*combos_[c].adakv);
        StepArrays arrays;
        const float* scores_of_group[3][64];
        for (int64_t i = 0; i < end - first; ++i) {
            const int32_t t = static_cast<int32_t>(first + i);
            for (int kv = 0; kv < kv_heads_; ++kv) {
                // Every KV head's shared_work is done: its scores serve here as in advance() (where
                // each cache made its own, a head-budget fit scored every held key again per budget).
                GroupStep step = group_step(kv, first, end, i, arrays);
                attach_shared_scores(step, kv, first, scores_of_group);
                harnesses[kv * combinations + c].observe(step);
            }
            if (t + 1 >= options_.harness.prefill_tokens) allocator.allocate(policies, shares, keep);
            for (int kv = 0; kv < kv_heads_; ++kv) harnesses[kv * combinations + c].evict_to(t, keep[kv]);
        }
    }

    // What step first + i of the block shows KV head kv; `arrays` hold what its spans point to.
    struct StepArrays {
        const float* rows_of_group[64];
        std::span<const int32_t> heavy_of_group[64];
        float self_of_group[64];
        const float* queries_of_group[64];
        const float* full_of_group[64];
        const uint64_t* heavy_bits_of_group[64];
        std::vector<uint64_t> heavy_bits;  // [head of the group][word]
    };
    // `heavy_as_bits`: the heavy hitters as bits too (for several harnesses: building them costs
    // about what one harness saves).
    GroupStep group_step(int kv, int64_t first, int64_t end, int64_t i, StepArrays& arrays,
                         bool heavy_as_bits = false) const {
        const int64_t rows = end - first;
        const std::size_t group = static_cast<std::size_t>(group_);
        auto& [rows_of_group, heavy_of_group, self_of_group, queries_of_group, full_of_group, heavy_bits_of_group,
               heavy_bits] = arrays;
        const int64_t t = first + i;
        // The heavy hitters as bits too, once for all the step's harnesses (Harness::observe).
        const std::size_t words = (static_cast<std::size_t>(t) + 63) / 64;
        heavy_as_bits = heavy_as_bits && heavy_hitters_;
        if (heavy_as_bits) heavy_bits.assign(group * words, 0);
        for (int h = 0; h < group_; ++h) {
            const int head = kv * group_ + h;
            const int64_t job_row = head * rows + i;
            if (rows_) {
                rows_of_group[h] = block_.row(head, t);
                heavy_of_group[h] = heavy_hitters_ ? std::span<const int32_t>{heavy_.data() + job_row * block_k_,
                                                                               static_cast<std::size_t>(heavy_count_[job_row])}
                                                   : std::span<const int32_t>{};
                if (heavy_as_bits) {
                    uint64_t* bits = heavy_bits.data() + h * words;
                    for (int32_t p : heavy_of_group[h]) bits[p >> 6] |= uint64_t{1} << (p & 63);
                    heavy_bits_of_group[h] = bits;
                }
                if (!raw_view_ || recorded_self_) self_of_group[h] = block_.self_weight[head][i];
            } else {  // nothing reads them: the step's rows and heavy hitters were not made
                rows_of_group[h] = nullptr;
                heavy_of_group[h] = {};
                self_of_group[h] = 0;
            }
            if (options_.output_error) {
                queries_of_group[h] = layer_values_->q.data() + (t * query_heads_ + head) * head_dim_;
                full_of_group[h] = full_output_.data() + job_row * head_dim_;
            }
        }
        GroupStep step;
        step.t = static_cast<int32_t>(t);
        step.rows = {rows_of_group, group};
        step.heavy = {heavy_of_group, group};
        if (heavy_as_bits) step.heavy_bits = {heavy_bits_of_group, group};
        if (!raw_view_) step.self_weight = {self_of_group, group};
        if (recorded_self_) step.own_weight = {self_of_group, group};
        if (options_.output_error) {
            step.queries = {queries_of_group, group};
            step.full_output = {full_of_group, group};
            step.full_output_arrays = fp16_arrays_;
        }
        if (raw_view_ && rows_)
            step.combined = group_ > 1 ? combined_[kv].data() + attention_row_offset(t) - attention_row_offset(first)
                                       : rows_of_group[0];
        return step;
    }

    std::vector<Job> layer_jobs() const {
        std::vector<Job> jobs;
        std::vector<std::size_t> stepping;  // combinations whose heads step on their own
        for (std::size_t c = 0; c < combos_.size(); ++c)
            if (combos_[c].adakv)
                jobs.push_back({{c}, -1});
            else
                stepping.push_back(c);
        if (stepping.empty()) return jobs;
        const std::size_t threads = static_cast<std::size_t>(std::max(1, tbb::this_task_arena::max_concurrency()));
        // A run interleaves a group of four's rows once per step for all its combinations, so there
        // runs are longer: about four jobs per thread (on the Llama-1B shape, one run per KV head).
        const std::size_t jobs_per_thread = group_ == 4 ? 4 : 8;
        const std::size_t per_run =
            std::max<std::size_t>(1, stepping.size() * kv_heads_ / (jobs_per_thread * threads));
        const std::size_t runs_per_head = (stepping.size() + per_run - 1) / per_run;
        for (int kv = 0; kv < kv_heads_; ++kv)
            for (std::size_t run = 0; run < runs_per_head; ++run) {
                // Runs of near-equal length: combination i goes to run i * runs / combinations.
                Job job{{}, kv};
                for (std::size_t i = 0; i < stepping.size(); ++i)
                    if (i * runs_per_head / stepping.size() == run) job.combos.push_back(stepping[i]);
                jobs.push_back(std::move(job));
            }
        return jobs;
    }

    AttentionSource& source_;
    const AttentionShape& shape_;
    const std::vector<ReplayCombo>& combos_;
    ReplayOptions options_;  // a copy: the cached view turns the output on
    const int query_heads_, kv_heads_, group_, k_;
    const bool raw_view_;
    const bool cached_view_;
    QkvSource* qkv_;
    int head_dim_ = 0;
    int64_t total_steps_ = 0, steps_done_ = 0;
    std::vector<Job> jobs_;
    std::vector<std::vector<std::size_t>> runs_of_kv_;  // per KV head, its jobs (indices in jobs_)
    std::vector<std::size_t> layer_wide_jobs_;          // Ada-KV's jobs, over every KV head
    std::vector<int64_t> overflow_;                     // per query head: the block's overflowing step, or -1

    AttentionBlock block_;
    int block_k_ = 0;  // heavy hitters per row in this block: k, or fewer where rows are shorter
    bool recorded_self_ = false;
    bool rows_ = true;  // this layer's attention rows are made (see replay_layer)
    bool heavy_hitters_ = true;  // and their heavy hitters found (see replay_layer)
    std::vector<int32_t> heavy_;                    // [query head][row][k]
    std::vector<int32_t> heavy_count_;              // [query head][row]
    std::vector<int32_t> heavy_hint_, heavy_next_hint_;  // per query head: top_k_positions' hints
    int64_t block_rows_ = 0;
    // A Q/K/V source's rows go to heavy_hitters_of_row as they are computed: one head's rows come
    // in order from one thread, so the head's hint passes straight from row to row.
    // Each row's candidates at or above its head's hint are gathered as the row is stored.
    const RowVisitor heavy_of_row_{
        [this](int head) { return heavy_hint_[head]; },
        [this](int head, int64_t index, std::span<const float> row, std::span<const int32_t> at_or_above) {
            heavy_hitters_of_row(head, index, row, heavy_hint_[head], at_or_above);
        }};
    std::vector<std::vector<float>> combined_;      // raw view with groups: reduced rows per KV head
    std::vector<float> full_output_;                // [query head][row][d]: the full cache's output
    // Per tier, [query head][row][t + 1]: scores against every fp16 key, and against every INT8
    // and INT4 key of shared_tiers_.
    std::array<std::vector<float>, 3> tier_scores_;
    int64_t scores_span_ = 0;                       // a query head's share of each
    // The quantised tiers whose scores shared_work makes: the format most harnesses of a KV head
    // read, where four or more do (fewer hold fewer quantised keys than a row scores); or none.
    const TierArrays* shared_tiers_ = nullptr;
    bool shared_runs_ = false;                      // some run steps two or more combinations
    std::vector<int32_t> every_position_;           // 0, 1, 2, ...: the full cache's positions
    std::vector<uint8_t> all_fp16_;
    const QkvLayer* layer_values_ = nullptr;
    std::vector<std::unique_ptr<TierArrays>> tier_arrays_;
    std::vector<std::unique_ptr<KvProjection>> array_projections_;  // index-aligned: what each was built for
    int layer_index_ = 0;
    const TierArrays* fp16_arrays_ = nullptr;
    // Output error on a sample of steps: per (KV head, first measured step) the steps drawn, and
    // per KV head the steps any of its streams measures (or every step).
    std::map<std::pair<int, int64_t>, std::vector<uint8_t>> sample_masks_;
    std::vector<std::vector<uint8_t>> full_output_steps_;
    std::vector<uint8_t> full_output_every_step_;
    int64_t last_step_ = 0;  // the replayed sequence's
    // Per KV head: the FullOutputMemo stream read or filled this (sequence, layer), how far it is
    // read, and whether a harness reads the shared fp16 scores.
    std::vector<FullOutputMemo::Stream*> memo_read_, memo_fill_;
    std::vector<std::size_t> memo_cursor_;
    std::vector<uint8_t> scores_wanted_;
};

}  // namespace

void sum_streams(ComboResult& result, std::size_t sequences, int layers, int kv_heads) {
    result.total = {};
    result.by_layer.assign(layers, {});
    result.by_head.assign(static_cast<std::size_t>(layers) * kv_heads, {});
    result.by_sequence.assign(sequences, {});
    for (std::size_t s = 0; s < sequences; ++s)
        for (int layer = 0; layer < layers; ++layer)
            for (int kv = 0; kv < kv_heads; ++kv) {
                const StreamMetrics& m = result.by_stream.at((s * layers + layer) * kv_heads + kv);
                result.by_layer[layer].add(m);
                result.by_head[static_cast<std::size_t>(layer) * kv_heads + kv].add(m);
                result.total.add(m);
                result.by_sequence[s].add(m);
            }
}

FullOutputMemo::Stream* FullOutputMemo::find(const AttentionSource* source, int sequence, int layer, int kv, bool every,
                                             const std::vector<uint8_t>& steps, std::size_t floats, bool& fill) {
    std::lock_guard lock(mutex_);
    fill = false;
    const auto key = std::make_tuple(source, sequence, layer, kv);
    if (auto it = streams_.find(key); it != streams_.end()) {
        Stream& stream = it->second;
        const bool same_steps = stream.every == every && (every || stream.steps == steps);
        return stream.complete && same_steps && stream.outputs.size() == floats ? &stream : nullptr;
    }
    const std::size_t bytes = floats * sizeof(float) + steps.size();
    if (floats == 0 || bytes_ + bytes > max_bytes_) return nullptr;
    bytes_ += bytes;
    Stream& stream = streams_[key];
    stream.every = every;
    stream.steps = steps;
    stream.outputs.reserve(floats);
    stream.floats = floats;
    fill = true;
    return &stream;
}

FullOutputMemo::Stream* FullOutputMemo::stream(const AttentionSource* source, int sequence, int layer, int kv) {
    std::lock_guard lock(mutex_);
    const auto it = streams_.find(std::make_tuple(source, sequence, layer, kv));
    return it == streams_.end() ? nullptr : &it->second;
}

std::vector<ComboResult> replay(AttentionSource& source, const std::vector<ReplayCombo>& combos,
                                const ReplayOptions& options) {
    return LockstepReplay(source, combos, options).run();
}

}  // namespace kvsim
