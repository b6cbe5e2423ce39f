// Lockstep replay: one pass over a trace drives every (policy, parameters, budget) combination
// side by side. Each block of steps of a layer is read (or computed from Q and K) once, and its
// shared per-step work (each query head's heavy hitters, each KV head's combined row) is done
// once; then every (KV head, combination) pair advances through the block in parallel, except
// that an Ada-KV combination's KV heads, which share their layer's budget, advance together as one
// job. Each job owns its state and results are summed in a fixed order, so they do not depend on
// the number of threads.
#pragma once
#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "base/errors.h"
#include "base/size_limits.h"
#include "policies/adakv.h"
#include "policies/policy.h"
#include "policies/prompt_press.h"
#include "sim/attention_source.h"
#include "sim/harness.h"
#include "sim/experiment_spec.h"

namespace kvsim {

struct ReplayCombo {
    const PolicyDescriptor* policy = nullptr;
    ParamValues params;
    int budget = 0;                  // tokens per (layer, KV head)
    std::vector<int> layer_budgets;  // per layer, when a profile sets them; overrides budget
    double compression = 0;          // > 0: the budget is sized per sequence to this compression ratio
    std::string budget_label;        // table column: "256", or the profile's name
    std::string label;               // table row, e.g. "h2o(recent_window=64)"
    std::optional<QuantizeRule> quantize;  // {evict: ..., quantize: ...}: what is kept, held coarser
    std::map<std::string, std::string> files;  // file parameters
    std::string where;                          // the config entry, e.g. "FILE:LINE: policies[2].snapkv"
    std::map<std::string, std::string> param_where;  // where a parameter's value was set, by name
    std::vector<int> head_budgets;  // per (layer, KV head), layer * num_kv_heads + kv; overrides the rest
    // {evict: ..., adakv: {...}}: the layer's KV heads share the sum of their budgets (Ada-KV), so
    // they replay together, step by step, as one job.
    std::optional<AdaKvRule> adakv;
    // {evict: ..., project: {lowrank: {...}}}: each kept token held through a projection policy.
    const PolicyDescriptor* project = nullptr;
    ParamValues project_params;
    std::map<std::string, std::string> project_files;
    std::string project_where;
    // A deployment's prompt split (kvpress): each sequence's prompt, compressed once at its end;
    // empty: the replay's prefill_tokens. With prompt_ratios (per layer, kvpress's compression
    // ratios), each (layer, KV head) keeps kvpress_kept_tokens(prompt, ratio) of its prompt.
    PromptSplit prompt{};
    std::vector<double> prompt_ratios{};
    bool bookkeeping = true;  // the memory metric counts the policy's bookkeeping (HarnessOptions)

    // The config key of a parameter ("...policies[2].snapkv.obs_window", "--set snapkv.obs_window").
    std::string key_of(const std::string& param) const {
        if (param.empty()) return where;
        const auto it = param_where.find(param);
        return it != param_where.end() ? it->second : where + "." + param;
    }
    // The prompt of a sequence: the combination's own split, or the replay's prefill_tokens.
    int prompt_length(int64_t sequence_length, int prefill_tokens) const {
        return prompt.empty() ? prefill_tokens
                              : checked_narrow<int>(prompt.prompt_length(sequence_length), label + ": prompt length");
    }
    // Tokens a (layer, KV head) may hold; a policy that keeps everything holds the whole sequence.
    // `prompt_tokens`: the sequence's prompt, which prompt_ratios are shares of.
    int budget_for(int layer, int kv, int num_kv_heads, int64_t sequence_length, int prompt_tokens = 0) const {
        if (!prompt_ratios.empty()) return kvpress_kept_tokens(prompt_tokens, prompt_ratios.at(layer));
        if (policy->keeps_everything) return checked_narrow<int>(sequence_length, label + ": sequence length");
        if (compression > 0) return budget_for_compression(compression, sequence_length);
        if (!head_budgets.empty()) return head_budgets.at(static_cast<std::size_t>(layer) * num_kv_heads + kv);
        return layer_budgets.empty() ? budget : layer_budgets.at(layer);
    }
    // The most positions one KV head may hold: its budget, or with Ada-KV the layer's total.
    int capacity_budget(int layer, int kv, int num_kv_heads, int64_t sequence_length, int prompt_tokens = 0) const {
        // A prompt press holds every token decoded after its prompt.
        if (policy->prompt_press) return checked_narrow<int>(sequence_length, label + ": sequence length");
        if (!adakv) return budget_for(layer, kv, num_kv_heads, sequence_length, prompt_tokens);
        int64_t total = 0;
        for (int h = 0; h < num_kv_heads; ++h) total += budget_for(layer, h, num_kv_heads, sequence_length);
        return static_cast<int>(std::min<int64_t>(total, sequence_length));
    }
    // Bytes one instance takes that its parameters size: InputError naming the parameter's key when
    // they are over the memory limit, before anything is allocated.
    uint64_t check_param_memory(const PolicyContext& ctx, uint64_t instances = 1) const {
        if (!policy->param_memory) return 0;
        const ParamMemory m = policy->param_memory(params, ctx);
        const uint64_t bytes = checked_mul(m.bytes, instances, key_of(m.param));
        const auto value = m.param.empty() ? params.end() : params.find(m.param);
        check_memory(bytes, key_of(m.param) +
                                (value != params.end() ? " = " + std::to_string(static_cast<int64_t>(value->second)) : "") +
                                " (" + m.detail + (instances > 1 ? ", x " + std::to_string(instances) + " streams" : "") +
                                ")");
        return bytes;
    }
    // The policy instance for one (layer, KV head) stream, composed with its quantisation rule.
    std::unique_ptr<Policy> make(PolicyContext ctx) const {
        ctx.files = &files;
        if (policy->check_context) {
            const auto [param, problem] = policy->check_context(params, ctx);
            if (!problem.empty()) throw InputError(key_of(param) + ": " + problem);
        }
        check_param_memory(ctx);
        std::unique_ptr<Policy> p = policy->make(params, ctx);
        if (project) {
            PolicyContext projected = ctx;
            projected.files = &project_files;
            const auto [param, problem] = project->check_context(project_params, projected);
            if (!problem.empty()) throw InputError(project_where + (param.empty() ? "" : "." + param) + ": " + problem);
            p = make_projected(std::move(p), project->projection(project_params, projected));
        }
        return quantize ? make_quantized(std::move(p), *quantize) : std::move(p);
    }
};

// The full cache's attention outputs at the measured steps of a Q/K/V source's streams, kept
// across replays that measure the same steps of the same source: a search passes over its fitting
// sequences some forty times (every fit, and each of the streaming fit's lambda probes), and the
// full cache's output is the same every time. With the memo each is computed once. Bounded: a
// stream whose outputs would take it past max_bytes is computed as without it. Replays give the
// same bits with or without it. Every source it serves must outlive it; one replay at a time.
class FullOutputMemo {
public:
    explicit FullOutputMemo(std::size_t max_bytes) : max_bytes_(max_bytes) {}
    std::size_t bytes() const { return bytes_; }

    // One (source, sequence, layer, KV head): the steps whose outputs it holds (`every`: each step
    // from 1, else the marked ones), and per such step, in order, each query head's output.
    struct Stream {
        bool every = false;
        std::vector<uint8_t> steps;
        std::vector<float> outputs;  // [measured step][query head of the group][d]
        std::size_t floats = 0;      // what outputs holds once complete
        bool complete = false;       // filled by a replay that reached the stream's last step
    };
    // The stream to read (complete, measuring the same steps), or to fill (new, and room for
    // `floats`); nullptr for neither.
    Stream* find(const AttentionSource* source, int sequence, int layer, int kv, bool every,
                 const std::vector<uint8_t>& steps, std::size_t floats, bool& fill);
    // The stream kept for (source, sequence, layer, KV head), complete or not; nullptr if none.
    Stream* stream(const AttentionSource* source, int sequence, int layer, int kv);

private:
    std::size_t max_bytes_, bytes_ = 0;
    std::mutex mutex_;
    std::map<std::tuple<const AttentionSource*, int, int, int>, Stream> streams_;
};

struct ReplayOptions {
    int heavy_hitter_k = 32;
    HarnessOptions harness;
    int64_t block_floats = 1 << 22;  // attention weights per block, all query heads of a layer together
    bool output_error = false;       // Q/K/V traces: the cached attention output against the full cache's
    bool memory = false;             // Q/K/V traces: bytes held per token and the compression ratio
    // Output error measured on this fraction of each stream's decode steps (at least 2), one step
    // from each of as many runs of consecutive steps (sim/step_sample.h), drawn from
    // output_error_seed; 1: every step. The policies still see every step.
    double output_error_sample = 1.0;
    uint64_t output_error_seed = 0;
    std::function<void(double done_fraction)> progress;  // called between blocks, from the calling thread
    // The layers replayed, in order (empty: every layer). A shard of a sweep replays some layers of
    // some combinations; its per-stream metrics are summed with the others' afterwards.
    std::vector<int> layers;
    // The layer the caller replays next on the same Q/K/V source, from its first sequence, or -1:
    // its load starts while this replay's last layer runs (memory allowing) and is taken by the
    // next replay. Until then the caller must not read the source's file.
    int next_layer = -1;
    // Where given, the full cache's outputs are read from it where it holds them, and kept in it
    // where it has room (see FullOutputMemo).
    FullOutputMemo* full_outputs = nullptr;
};

struct ComboResult {
    StreamMetrics total;                  // over every sequence, layer and head
    std::vector<StreamMetrics> by_layer;  // over every sequence and head of one layer
    std::vector<StreamMetrics> by_head;   // per (layer, KV head), layer * num_kv_heads + kv, over every sequence
    std::vector<StreamMetrics> by_sequence;  // over every layer and head of one sequence
    // Per stream, (sequence * layers + layer) * num_kv_heads + kv: what the sums above are made of
    // (zero for layers not replayed).
    std::vector<StreamMetrics> by_stream;
    std::size_t policy_bytes_per_slot = 0;
};

// Fills total, by_layer, by_head and by_sequence from by_stream, always adding in (sequence, layer,
// KV head) order: floating-point sums that do not depend on which process or thread replayed which
// stream, so a sweep run in shards sums to the same bits as one run.
void sum_streams(ComboResult& result, std::size_t sequences, int layers, int kv_heads);

std::vector<ComboResult> replay(AttentionSource& source, const std::vector<ReplayCombo>& combos,
                                const ReplayOptions& options);

}  // namespace kvsim
