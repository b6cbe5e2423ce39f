#include "search/allocation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "policies/prompt_press.h"

namespace kvsim {

ByteModel::ByteModel(std::vector<int64_t> last_steps, int head_dim, double slot_bytes)
    : last_steps_(std::move(last_steps)), head_dim_(head_dim), slot_bytes_(slot_bytes) {
    for (int64_t T : last_steps_) context_tokens_ += static_cast<double>(T) * (T + 1) / 2.0 + static_cast<double>(T);
    if (context_tokens_ <= 0) throw std::invalid_argument("ByteModel: no decode steps");
}

double ByteModel::kept_share(int budget) const {
    double held = 0;  // sum over sequences and steps t = 1..T of min(t, budget) + 1
    for (int64_t T : last_steps_) {
        const double m = static_cast<double>(std::min<int64_t>(budget, T));
        held += m * (m + 1) / 2.0 + (static_cast<double>(T) - m) * budget + static_cast<double>(T);
    }
    return held / context_tokens_;
}

double ByteModel::bytes_per_token(int budget) const {
    return (4.0 * head_dim_ + slot_bytes_) * kept_share(budget);
}

PromptByteModel::PromptByteModel(std::vector<int64_t> prompts, std::vector<int64_t> last_steps, int head_dim)
    : prompts_(std::move(prompts)), last_steps_(std::move(last_steps)), head_dim_(head_dim) {
    if (prompts_.size() != last_steps_.size()) throw std::invalid_argument("PromptByteModel: prompts and sequences differ");
    for (std::size_t s = 0; s < prompts_.size(); ++s)
        for (int64_t t = prompts_[s]; t <= last_steps_[s]; ++t) context_tokens_ += static_cast<double>(t + 1);
    if (context_tokens_ <= 0) throw std::invalid_argument("PromptByteModel: no step after a prompt");
}

double PromptByteModel::bytes_per_token(int kept_thousandths) const {
    const double ratio = kvpress_ratio(kept_thousandths);
    double held = 0;  // at step t: the prompt's kept tokens, those decoded since, and t itself
    for (std::size_t s = 0; s < prompts_.size(); ++s) {
        const double kept = kvpress_kept_tokens(prompts_[s], ratio);
        for (int64_t t = prompts_[s]; t <= last_steps_[s]; ++t) held += kept + static_cast<double>(t - prompts_[s] + 1);
    }
    return 4.0 * head_dim_ * held / context_tokens_;
}

double kvpress_ratio(int kept_thousandths) { return static_cast<double>(1000 - kept_thousandths) / 1000.0; }

namespace {

// Slack for comparing sums of bytes: far below one token's bytes, far above rounding.
constexpr double kByteSlack = 1e-9;

// Each grid budget's bytes per token.
std::vector<double> grid_bytes(const std::vector<int>& grid, const UnitBytes& bytes) {
    std::vector<double> x(grid.size());
    for (std::size_t i = 0; i < grid.size(); ++i) x[i] = bytes.bytes_per_token(grid[i]);
    return x;
}

// Indices of the lower convex hull of (x, y) from the first point, kept while y falls.
std::vector<std::size_t> falling_lower_hull(const std::vector<double>& x, const std::vector<double>& y) {
    std::vector<std::size_t> hull;
    for (std::size_t i = 0; i < x.size(); ++i) {
        while (hull.size() >= 2) {
            const std::size_t a = hull[hull.size() - 2], b = hull.back();
            // b is above the chord from a to i: not on the lower hull.
            const double cross = (x[b] - x[a]) * (y[i] - y[a]) - (y[b] - y[a]) * (x[i] - x[a]);
            if (cross <= 0) hull.pop_back(); else break;
        }
        hull.push_back(i);
    }
    // Past the lowest error the hull rises: those steps would only cost bytes.
    std::size_t keep = 1;
    while (keep < hull.size() && y[hull[keep]] < y[hull[keep - 1]]) ++keep;
    hull.resize(keep);
    return hull;
}

// A unit's options in ascending bytes (ties in their given order): their indices, bytes and
// errors, and the falling lower hull of them (positions in that order).
struct OptionsByBytes {
    std::vector<std::size_t> order;
    std::vector<double> x, y;
    std::vector<std::size_t> hull;
};

OptionsByBytes options_by_bytes(const UnitOptions& o, const char* caller) {
    if (o.bytes.empty() || o.bytes.size() != o.error.size())
        throw std::invalid_argument(std::string(caller) + ": a unit without options, or bytes and errors differ in size");
    OptionsByBytes s;
    s.order.resize(o.bytes.size());
    std::iota(s.order.begin(), s.order.end(), std::size_t{0});
    std::stable_sort(s.order.begin(), s.order.end(), [&](std::size_t a, std::size_t b) { return o.bytes[a] < o.bytes[b]; });
    for (std::size_t i : s.order) s.x.push_back(o.bytes[i]), s.y.push_back(o.error[i]);
    s.hull = falling_lower_hull(s.x, s.y);
    return s;
}

// The error of the chord from position a to position c at bytes x (a's error where both hold
// the same bytes).
double chord_at(const OptionsByBytes& s, std::size_t a, std::size_t c, double x) {
    return s.x[c] > s.x[a] ? s.y[a] + (s.y[c] - s.y[a]) * (x - s.x[a]) / (s.x[c] - s.x[a]) : s.y[a];
}

// Per option (by index), how far its error lies above `hull` at its bytes; past the hull's last
// point, above that point's error.
std::vector<double> above(const OptionsByBytes& s, const std::vector<std::size_t>& hull) {
    std::vector<double> out(s.x.size());
    std::size_t segment = 0;  // the hull segment [hull[segment], hull[segment + 1]] that x[i] falls in
    for (std::size_t i = 0; i < s.x.size(); ++i) {
        while (segment + 1 < hull.size() && s.x[hull[segment + 1]] <= s.x[i]) ++segment;
        const double floor =
            segment + 1 < hull.size() ? chord_at(s, hull[segment], hull[segment + 1], s.x[i]) : s.y[hull[segment]];
        out[s.order[i]] = std::max(0.0, s.y[i] - floor);
    }
    return out;
}

}  // namespace

CurveShape curve_shape(const UnitCurve& curve, const std::vector<int>& grid, const UnitBytes& bytes) {
    // Over the budgets measured: a refined search leaves the rest unmeasured (NaN).
    std::vector<double> x, y;
    std::vector<int> budgets;
    for (std::size_t i = 0; i < grid.size(); ++i)
        if (!std::isnan(curve.error.at(i)))
            x.push_back(bytes.bytes_per_token(grid[i])), y.push_back(curve.error[i]), budgets.push_back(grid[i]);
    CurveShape shape;
    if (x.empty()) return shape;
    const std::vector<std::size_t> hull = falling_lower_hull(x, y);
    for (std::size_t i = 1; i < x.size(); ++i) {
        if (y[i] > y[i - 1]) shape.rising.push_back(budgets[i]);
        if (i < hull.back() && !std::binary_search(hull.begin(), hull.end(), i)) shape.above_hull.push_back(budgets[i]);
    }
    return shape;
}

std::vector<std::size_t> choose_by_marginal_gain(const std::vector<UnitOptions>& units, double target_bytes_per_token) {
    const std::size_t count = units.size();
    const double capacity = target_bytes_per_token * static_cast<double>(count) * (1 + kByteSlack);

    // Per unit, its options in ascending bytes (ties in their given order), and the lower hull.
    std::vector<std::vector<std::size_t>> order(count), hulls(count);
    std::vector<std::vector<double>> x(count), y(count);
    std::vector<std::size_t> at(count, 0);      // index into the unit's hull
    std::vector<std::size_t> chosen(count, 0);  // index into the unit's order
    double used = 0;
    for (std::size_t u = 0; u < count; ++u) {
        OptionsByBytes sorted = options_by_bytes(units[u], "choose_by_marginal_gain");
        order[u] = std::move(sorted.order);
        x[u] = std::move(sorted.x);
        y[u] = std::move(sorted.y);
        hulls[u] = std::move(sorted.hull);
        used += x[u][0];
    }

    // Hull steps, best gain per byte first, while they fit. A step that does not fit now never
    // will (the room only shrinks), so its unit stops there.
    std::vector<bool> blocked(count, false);
    for (;;) {
        std::size_t best = count;
        double best_slope = 0;
        for (std::size_t u = 0; u < count; ++u) {
            if (blocked[u] || at[u] + 1 >= hulls[u].size()) continue;
            const std::size_t i = hulls[u][at[u]], j = hulls[u][at[u] + 1];
            const double slope = (y[u][j] - y[u][i]) / (x[u][j] - x[u][i]);
            if (best == count || slope < best_slope) best = u, best_slope = slope;
        }
        if (best == count) break;
        const std::size_t i = hulls[best][at[best]], j = hulls[best][at[best] + 1];
        if (used + x[best][j] - x[best][i] > capacity) {
            blocked[best] = true;
            continue;
        }
        used += x[best][j] - x[best][i];
        ++at[best];
        chosen[best] = j;
    }
    // What is left: any single upgrade that fits and cuts error, best per byte first.
    for (;;) {
        std::size_t best_u = count, best_j = 0;
        double best_slope = 0;
        for (std::size_t u = 0; u < count; ++u)
            for (std::size_t j = chosen[u] + 1; j < x[u].size(); ++j) {
                const double cost = x[u][j] - x[u][chosen[u]], gain = y[u][j] - y[u][chosen[u]];
                if (used + cost > capacity || gain >= 0) continue;
                if (best_u == count || gain / cost < best_slope) best_u = u, best_j = j, best_slope = gain / cost;
            }
        if (best_u == count) break;
        used += x[best_u][best_j] - x[best_u][chosen[best_u]];
        chosen[best_u] = best_j;
    }
    std::vector<std::size_t> result(count);
    for (std::size_t u = 0; u < count; ++u) result[u] = order[u][chosen[u]];
    return result;
}

std::vector<double> error_above_hull(const UnitOptions& o) {
    const OptionsByBytes sorted = options_by_bytes(o, "error_above_hull");
    return above(sorted, sorted.hull);
}

std::vector<std::size_t> screen_options(const UnitOptions& o, std::size_t keep, std::size_t always) {
    const OptionsByBytes s = options_by_bytes(o, "screen_options");
    const std::size_t count = o.bytes.size();
    if (always >= count) throw std::invalid_argument("screen_options: no such option to keep");
    keep = std::max<std::size_t>(1, std::min(keep, count));
    const std::vector<double> gap = above(s, s.hull);  // before thinning: the nearest above the whole hull
    std::vector<std::size_t> hull = s.hull;
    const bool always_on_hull = std::any_of(hull.begin(), hull.end(), [&](std::size_t h) { return s.order[h] == always; });
    const std::size_t hull_room = always_on_hull ? keep : keep - 1;
    // Thinned one point at a time, never the cheapest nor `always`.
    while (hull.size() > std::max<std::size_t>(hull_room, 1)) {
        std::size_t drop = 0;
        double least = 0;
        for (std::size_t i = 1; i < hull.size(); ++i) {
            if (s.order[hull[i]] == always) continue;
            // What the greedy loses without the point.
            const double loss = i + 1 == hull.size() ? s.y[hull[i - 1]] - s.y[hull[i]]
                                                     : chord_at(s, hull[i - 1], hull[i + 1], s.x[hull[i]]) - s.y[hull[i]];
            if (drop == 0 || loss < least) least = loss, drop = i;
        }
        if (drop == 0) break;  // only the cheapest and `always` left
        hull.erase(hull.begin() + static_cast<std::ptrdiff_t>(drop));
    }
    std::vector<std::size_t> kept;
    std::vector<bool> taken(count, false);
    for (std::size_t h : hull) kept.push_back(s.order[h]), taken[s.order[h]] = true;
    if (!taken[always] && kept.size() < keep) kept.push_back(always), taken[always] = true;
    std::vector<std::size_t> rest;
    for (std::size_t i = 0; i < count; ++i)
        if (!taken[i]) rest.push_back(i);
    std::stable_sort(rest.begin(), rest.end(), [&](std::size_t a, std::size_t b) { return gap[a] < gap[b]; });
    for (std::size_t i = 0; kept.size() < keep; ++i) kept.push_back(rest[i]);
    std::sort(kept.begin(), kept.end());
    return kept;
}

Allocation allocate_by_marginal_gain(const std::vector<UnitCurve>& curves, const std::vector<int>& grid,
                                     const UnitBytes& bytes, double target_bytes_per_token) {
    const std::vector<double> x = grid_bytes(grid, bytes);
    // Each unit's options: the grid budgets its curve measured (every one, unless refined).
    std::vector<std::vector<std::size_t>> measured(curves.size());
    std::vector<UnitOptions> units(curves.size());
    for (std::size_t u = 0; u < curves.size(); ++u) {
        if (curves[u].error.size() != grid.size())
            throw std::invalid_argument("allocate_by_marginal_gain: curve and grid differ in size");
        for (std::size_t i = 0; i < grid.size(); ++i)
            if (!std::isnan(curves[u].error[i]))
                measured[u].push_back(i), units[u].bytes.push_back(x[i]), units[u].error.push_back(curves[u].error[i]);
    }
    const std::vector<std::size_t> chosen = choose_by_marginal_gain(units, target_bytes_per_token);
    Allocation result;
    for (std::size_t u = 0; u < curves.size(); ++u) {
        const std::size_t i = measured[u][chosen[u]];
        result.budgets.push_back(grid[i]);
        result.error += curves[u].error[i];
        result.bytes_per_token += x[i];
    }
    result.bytes_per_token /= static_cast<double>(curves.size());
    return result;
}

Allocation allocate_by_shape(const std::vector<double>& weights, const std::vector<int>& grid,
                             const UnitBytes& bytes, double target_bytes_per_token) {
    const std::size_t units = weights.size(), points = grid.size();
    const std::vector<double> x = grid_bytes(grid, bytes);
    const double capacity = target_bytes_per_token * static_cast<double>(units) * (1 + kByteSlack);
    const double mean_weight = std::accumulate(weights.begin(), weights.end(), 0.0) / static_cast<double>(units);
    auto snapped = [&](double budget) {  // the largest grid index at or below budget (0 at least)
        const auto it = std::upper_bound(grid.begin(), grid.end(), budget + 1e-9);
        return it == grid.begin() ? std::size_t{0} : static_cast<std::size_t>(it - grid.begin() - 1);
    };
    auto cost_at = [&](double scale) {
        double sum = 0;
        for (double w : weights) sum += x[snapped(scale * w / mean_weight)];
        return sum;
    };
    double low = 0, high = 2.0 * grid.back() * (1 + *std::max_element(weights.begin(), weights.end()) / mean_weight);
    for (int iteration = 0; iteration < 100; ++iteration) {
        const double mid = (low + high) / 2;
        (cost_at(mid) <= capacity ? low : high) = mid;
    }
    std::vector<std::size_t> chosen(units);
    double used = 0;
    for (std::size_t u = 0; u < units; ++u) used += x[chosen[u] = snapped(low * weights[u] / mean_weight)];
    // Up one grid step at a time, the unit furthest below its share first, while it fits.
    for (;;) {
        std::size_t best = units;
        double best_deficit = -std::numeric_limits<double>::infinity();
        for (std::size_t u = 0; u < units; ++u) {
            if (chosen[u] + 1 >= points || used + x[chosen[u] + 1] - x[chosen[u]] > capacity) continue;
            const double share = low * weights[u] / mean_weight;
            const double deficit = (share - grid[chosen[u]]) / std::max(share, 1.0);
            if (deficit > best_deficit) best = u, best_deficit = deficit;
        }
        if (best == units) break;
        used += x[chosen[best] + 1] - x[chosen[best]];
        ++chosen[best];
    }
    Allocation result;
    for (std::size_t u = 0; u < units; ++u) {
        result.budgets.push_back(grid[chosen[u]]);
        result.bytes_per_token += x[chosen[u]];
    }
    result.bytes_per_token /= static_cast<double>(units);
    return result;
}

double allocation_error(const std::vector<UnitCurve>& curves, const std::vector<int>& grid,
                        const std::vector<int>& budgets) {
    double sum = 0;
    for (std::size_t u = 0; u < curves.size(); ++u) {
        const auto it = std::lower_bound(grid.begin(), grid.end(), budgets.at(u));
        if (it == grid.end() || *it != budgets[u])
            throw std::invalid_argument("allocation_error: budget " + std::to_string(budgets[u]) + " is not on the grid");
        const double error = curves[u].error[static_cast<std::size_t>(it - grid.begin())];
        if (std::isnan(error))
            throw std::logic_error("allocation_error: " + curves[u].name + " was not measured at budget " +
                                   std::to_string(budgets[u]));
        sum += error;
    }
    return sum;
}

std::vector<double> pyramid_weights(int num_layers, int ratio) {
    // PyramidKV's arithmetic schedule (pyramid_budget): layer l keeps in proportion to
    // ratio * (L - 1) - l * (ratio - 1), so the last layer keeps 1/ratio of the first's.
    std::vector<double> w(num_layers, 1.0);
    if (num_layers <= 1) return w;
    for (int l = 0; l < num_layers; ++l) w[l] = static_cast<double>(ratio) * (num_layers - 1) - static_cast<double>(l) * (ratio - 1);
    return w;
}

std::vector<double> inverted_weights(int num_layers, double slope) {
    // The stratigraphic study's depth rule: (1 - slope) + slope * l / (L - 1); the first layer
    // keeps (1 - slope) of the last layer's share.
    std::vector<double> w(num_layers, 1.0);
    if (num_layers <= 1) return w;
    for (int l = 0; l < num_layers; ++l) w[l] = (1 - slope) + slope * l / (num_layers - 1.0);
    return w;
}

std::vector<int> budget_grid(int lowest, int highest, int units) {
    const double growth = 1.0 + std::min(0.04, 0.005 * std::max(units, 1));
    std::vector<int> grid;
    for (int b = std::max(lowest, 1); b <= highest;) {
        grid.push_back(b);
        b = std::max(b + 1, static_cast<int>(std::floor(b * growth)));
    }
    if (grid.empty() || grid.back() != highest) grid.push_back(std::max(highest, std::max(lowest, 1)));
    std::sort(grid.begin(), grid.end());
    grid.erase(std::unique(grid.begin(), grid.end()), grid.end());
    return grid;
}

std::vector<std::size_t> grid_stride_indices(std::size_t size, int stride) {
    if (stride < 1) throw std::invalid_argument("grid_stride_indices: stride must be >= 1");
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < size; i += static_cast<std::size_t>(stride)) out.push_back(i);
    if (size > 0 && out.back() != size - 1) out.push_back(size - 1);
    return out;
}

std::vector<std::size_t> refine_bracket(std::size_t chosen, int step, int next, std::size_t size) {
    if (next < 1 || next >= step || chosen >= size) throw std::invalid_argument("refine_bracket: bad stride or index");
    std::vector<std::size_t> out;
    const auto s = static_cast<std::size_t>(step), n = static_cast<std::size_t>(next);
    // Down from the chosen index while less than `step` away, then up likewise.
    for (std::size_t d = (s - 1) / n * n; d > 0; d -= n)
        if (d <= chosen) out.push_back(chosen - d);
    out.push_back(chosen);
    for (std::size_t d = n; d < s && chosen + d < size; d += n) out.push_back(chosen + d);
    return out;
}

}  // namespace kvsim
