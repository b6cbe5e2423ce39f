// What a replay is asked to run, as plain data: the policy entries, the grid axes and the budget
// columns. The config parser (src/config.h) and search (search/) fill these; sim/ expands and
// replays them without knowing where they came from.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvsim {

// The largest budget and sequence length a config or flag may name: far beyond any model's
// context, small enough that budget + 1 and products with head counts cannot overflow an int.
inline constexpr int kMaxBudgetTokens = 100000000;
inline constexpr int kMaxSequenceTokens = 1 << 30;

// The shape of the model a profile was fitted to; a trace or model of another shape cannot use it.
struct ModelShape {
    std::string name;
    int num_layers = 0, num_query_heads = 0, num_kv_heads = 0, head_dim = 0;
    bool same_as(const ModelShape& o) const {
        return num_layers == o.num_layers && num_query_heads == o.num_query_heads && num_kv_heads == o.num_kv_heads &&
               head_dim == o.head_dim;
    }
    std::string describe() const {  // "5 layers, 8 query heads, 4 KV heads, head size 8"
        return std::to_string(num_layers) + " layers, " + std::to_string(num_query_heads) + " query heads, " +
               std::to_string(num_kv_heads) + " KV heads, head size " + std::to_string(head_dim);
    }
};

// How each sequence divides into a prompt, which a prefill-time compressor (kvpress's presses)
// compresses once at its end, and the continuation decoded after it: the steps measured. Either
// the first `tokens` of every sequence, or all but its last `continuation`.
struct PromptSplit {
    int tokens = 0;
    int continuation = 0;
    bool empty() const { return tokens == 0 && continuation == 0; }
    // The prompt of a sequence of `sequence_length` tokens (0 when no split is given).
    int64_t prompt_length(int64_t sequence_length) const {
        return tokens > 0 ? tokens : continuation > 0 ? sequence_length - continuation : 0;
    }
    std::string describe() const {  // "the first 300 tokens", "all but the last 64 tokens"
        return tokens > 0 ? "the first " + std::to_string(tokens) + " tokens"
                          : "all but the last " + std::to_string(continuation) + " tokens";
    }
};

// A budget column: one budget for every layer, or a per-layer profile.
struct BudgetColumn {
    std::string label;               // "256", or the profile's name
    int budget = 0;                  // tokens per (layer, KV head); for a profile, the mean
    std::vector<int> layer_budgets;  // empty for a scalar budget
    std::string where;
    double compression = 0;  // > 0: each sequence's budget gives this compression ratio in tokens
    // Per (layer, KV head), index layer * num_kv_heads + kv, when a profile fits each head its own
    // budget; overrides layer_budgets (which then hold each layer's mean, for the tables).
    std::vector<int> head_budgets{};
    // Per layer, kvpress's compression ratios: each (layer, KV head) keeps int(prompt * (1 -
    // ratio)) of each sequence's prompt (policies/prompt_press.h); overrides the rest.
    std::vector<double> prompt_ratios{};
};

// The column of a per-layer profile (non-empty layer_budgets), with per-(layer, KV head) budgets
// when it has them; its scalar budget is the layers' mean, rounded, for the tables.
inline BudgetColumn profile_budget_column(std::string label, std::string where, std::vector<int> layer_budgets,
                                          std::vector<int> head_budgets = {}) {
    int64_t total = 0;
    for (int b : layer_budgets) total += b;
    const auto layers = static_cast<int64_t>(layer_budgets.size());
    const int mean = static_cast<int>((total + layers / 2) / layers);
    return {std::move(label), mean, std::move(layer_budgets), std::move(where), 0, std::move(head_budgets)};
}

// A policy as the config names it, with the parameters the config gives (defaults come later).
struct PolicyEntry {
    // Every member has an initialiser, so that a brace list naming the first few is complete.
    std::string name{};
    std::map<std::string, double> params{};
    std::string where{};                         // "FILE:LINE: policies[2]" for error messages
    std::map<std::string, std::string> files{};  // file parameters: name -> path
    bool quantized = false;                      // {evict: NAME, quantize: {...}}
    std::map<std::string, double> quantize{};    // bits, older_than, key_group, value_group
    bool adakv = false;                          // {evict: NAME, adakv: {floor: 0.2}}: Ada-KV across KV heads
    std::map<std::string, double> adakv_params{};  // floor
    std::string adakv_where{};                     // "FILE:LINE: policies[2].adakv"
    // {evict: NAME, project: {lowrank: {...}}}: each kept token held through a projection policy.
    std::string project{};  // lowrank or group_heads; empty for none
    std::map<std::string, double> project_params{};
    std::map<std::string, std::string> project_files{};
    std::string project_where{};  // "FILE:LINE: policies[2].project.lowrank"
    // {profile: FILE}: a fitted profile brings its own budgets (its one column) and the shape
    // of the model it was fitted to.
    std::vector<BudgetColumn> profile_budgets{};  // empty, or the profile's one column
    ModelShape profile_shape{};
    // Where the profile is deployed, when not in kvsim: its prompt split (kvpress: each sequence's
    // prompt, compressed once) and whether its engine holds the policy's bookkeeping.
    PromptSplit prompt{};
    bool bookkeeping = true;
};

// One sweep axis: a policy parameter and the values it takes.
struct GridAxis {
    std::string policy;
    std::string param;
    std::vector<double> values;
    std::string where;
};

// The budget label of a baseline that holds at every budget (the full cache).
inline constexpr const char* kEveryBudget = "full";

// The budget whose cache, over a pure decode of `sequence_length` tokens, holds on average
// `ratio` times fewer tokens than the full cache (the current token counted as held).
int budget_for_compression(double ratio, int64_t sequence_length);

}  // namespace kvsim
