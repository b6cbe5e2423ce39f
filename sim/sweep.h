// A sweep: every policy of a config, crossed with its parameter grid, crossed with the budgets,
// checked and labelled, ready for one lockstep replay.
#pragma once
#include <string>
#include <vector>

#include "sim/replay.h"
#include "sim/experiment_spec.h"

namespace kvsim {

// Combinations in table order: policies as listed, each policy's grid points (axes in order,
// the last one fastest), then budgets. Throws InputError for an unknown policy or parameter,
// a grid axis naming no listed policy, a duplicate row, or a parameter that does not fit a budget.
std::vector<ReplayCombo> expand_sweep(const std::vector<PolicyEntry>& policies, const std::vector<GridAxis>& grid,
                                      const std::vector<BudgetColumn>& budgets);
// Scalar budgets only.
std::vector<ReplayCombo> expand_sweep(const std::vector<PolicyEntry>& policies, const std::vector<GridAxis>& grid,
                                      const std::vector<int>& budgets);

// "h2o" or "h2o(recent_window=64)": the name plus the parameters the user set away from their defaults.
std::string policy_label(const PolicyDescriptor& policy, const std::map<std::string, double>& given);

std::string format_param(double value);

}  // namespace kvsim
