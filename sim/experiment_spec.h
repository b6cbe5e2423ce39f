// What a replay is asked to run, as plain data: the policy entries, the grid axes and the budget
// columns. The config parser (src/config.h) and search (search/) fill these; sim/ expands and
// replays them without knowing where they came from.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvsim {

// A policy as the config names it, with the parameters the config gives (defaults come later).
struct PolicyEntry {
    std::string name;
    std::map<std::string, double> params;
    std::string where;                       // "FILE:LINE: policies[2]" for error messages
    std::map<std::string, std::string> files;  // file parameters: name -> path
    bool quantized = false;                  // {evict: NAME, quantize: {...}}
    std::map<std::string, double> quantize;  // bits, older_than, key_group, value_group
};

// One sweep axis: a policy parameter and the values it takes.
struct GridAxis {
    std::string policy;
    std::string param;
    std::vector<double> values;
    std::string where;
};

// A budget column: one budget for every layer, or a per-layer profile.
struct BudgetColumn {
    std::string label;               // "256", or the profile's name
    int budget = 0;                  // tokens per (layer, KV head); for a profile, the mean
    std::vector<int> layer_budgets;  // empty for a scalar budget
    std::string where;
    double compression = 0;  // > 0: each sequence's budget gives this compression ratio in tokens
};

// The budget label of a baseline that holds at every budget (the full cache).
inline constexpr const char* kEveryBudget = "full";

// The budget whose cache, over a pure decode of `sequence_length` tokens, holds on average
// `ratio` times fewer tokens than the full cache (the current token counted as held).
int budget_for_compression(double ratio, int64_t sequence_length);

}  // namespace kvsim
