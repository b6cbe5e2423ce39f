// Prefill-time compression as NVIDIA kvpress's presses do it (github.com/NVIDIA/kvpress, its
// ScorerPress): once the prompt is in, a scorer gives every prompt position of a KV head a score
// read off the whole prompt (its queries, keys, values and their attention), the head keeps its
// int(prompt * (1 - ratio)) highest-scoring positions (kvpress's torch.topk), and decoding then
// appends every new token without evicting. The selection is scored_eviction.h's (the lowest
// scores go, ties to the lower position), so a press here is its scorer alone; each press's file
// follows that press's score() and is checked against kept sets recorded from kvpress's own code
// (tests/unit/test_prompt_press.cpp).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "policies/scored_eviction.h"

namespace kvsim {

// kvpress's count of the prompt tokens a head keeps at a compression ratio: int(k_len * (1 -
// ratio)), in doubles and truncated as Python computes it (10 tokens at 0.9 keep 0, not 1); the
// whole prompt at ratio 0.
int kvpress_kept_tokens(int64_t prompt_length, double ratio);

// The causal softmax attention of query head `head` at prompt position t over positions 0..t,
// into out (t + 1 floats): logits q.k / sqrt(head_dim) and the softmax in float32, as kvpress's
// attention (and an eager attention layer) computes it.
void prompt_attention_row(const PromptView& prompt, int head, int64_t t, float* out);

class PromptPress : public ScoredEviction<double> {
public:
    explicit PromptPress(int capacity);

    bool reads_attention() const final { return false; }  // it reads the prompt instead
    bool reads_prompt() const final { return true; }
    void score_prompt(const PromptView& prompt) final;
    // kvpress's cache holds each kept token's K and V and nothing else.
    std::size_t bytes_per_slot() const final { return 0; }

protected:
    // One score per prompt position (prompt.length of them) for KV head prompt.kv_head; higher
    // is kept first.
    virtual void score(const PromptView& prompt, std::vector<double>& scores) = 0;

private:
    void observe(std::span<const float>) final {}
    void admit() final { scores_.push_back(0.0); }  // a token after the prompt is never evicted
    std::span<const double> scores() final { return scores_; }
    void drop_state(std::span<const std::size_t> evicted) final { scores_.erase(evicted); }
    std::size_t state_bytes_per_slot() const final { return 0; }

    SlotArray<double> scores_;
    std::vector<double> computed_;
};

// What every press's descriptor shares: a prompt press, scored, with no recent window of its own.
PolicyDescriptor prompt_press_descriptor(std::string name, std::string paper, std::vector<ParamSpec> params,
                                         std::function<std::unique_ptr<Policy>(const ParamValues&, const PolicyContext&)> make);

}  // namespace kvsim
