// Budget allocation under a byte target: how many tokens each unit (a layer, or a (layer, KV head)
// pair) may hold so that the cache's mean bytes per token of context meet a target.
//
// A unit's cost is what kvsim's memory metric counts for an eviction policy: at decode step t it
// holds min(t, budget) cached tokens plus the current one, each at fp16 K and V (4 * head_dim
// bytes) plus the policy's bookkeeping per slot. Units are independent on a trace (a layer's
// attention comes from recorded Q and K, whatever other layers evict), so the objective of any
// allocation is the sum of the units' own objectives, read off per-unit curves measured once on a
// grid of budgets.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kvsim {

// Bytes per token of context of one unit at a grid value (a budget, say), over a set of sequences:
// what the allocators below trade error against.
class UnitBytes {
public:
    virtual ~UnitBytes() = default;
    virtual double bytes_per_token(int grid_value) const = 0;
};

// kvsim's decode-time eviction: a unit at budget B holds min(t, B) tokens and the current one.
class ByteModel : public UnitBytes {
public:
    // last_steps: per sequence, the last decode step replayed (steps 1..last are measured).
    ByteModel(std::vector<int64_t> last_steps, int head_dim, double slot_bytes);
    double bytes_per_token(int budget) const override;
    // The share of the context's tokens held at a budget (the current token counted as held).
    double kept_share(int budget) const;
    double full_fp16_bytes_per_token() const { return 4.0 * head_dim_; }  // the uncompressed cache
    double slot_bytes() const { return slot_bytes_; }

private:
    std::vector<int64_t> last_steps_;
    int head_dim_;
    double slot_bytes_;
    double context_tokens_ = 0;  // sum over sequences and steps of t + 1
};

// kvpress's prefill-time compression: a layer keeps kvpress_kept_tokens(prompt, ratio) of each
// sequence's prompt and appends every token after it; only the steps after the prompt are
// measured, and K and V alone are held. Grid values are kept shares of the prompt in thousandths
// (1000: the whole prompt); kvpress_ratio() gives the ratio a value stands for.
class PromptByteModel : public UnitBytes {
public:
    // Per sequence: its prompt and the last decode step replayed (steps prompt..last measured).
    PromptByteModel(std::vector<int64_t> prompts, std::vector<int64_t> last_steps, int head_dim);
    double bytes_per_token(int kept_thousandths) const override;
    double full_fp16_bytes_per_token() const { return 4.0 * head_dim_; }
    const std::vector<int64_t>& prompts() const { return prompts_; }

private:
    std::vector<int64_t> prompts_, last_steps_;
    int head_dim_;
    double context_tokens_ = 0;  // sum over sequences and measured steps of t + 1
};

// The kvpress compression ratio a grid value of PromptByteModel stands for: 1 - value / 1000.
double kvpress_ratio(int kept_thousandths);

// One unit's objective (lower is better, summed over its measured steps) at each grid budget.
struct UnitCurve {
    std::string name;            // "layer 3" or "layer 3, KV head 1"
    std::vector<double> error;   // index-aligned with the grid; NaN: a budget not measured (a refined grid)
};

struct Allocation {
    std::vector<int> budgets;      // per unit, each a grid budget
    double bytes_per_token = 0;    // mean over units
    double error = 0;              // sum over units (when curves were given)
};

// Greedy by marginal gain on each unit's lower convex hull of (bytes, error): from the smallest
// grid budget everywhere, repeatedly take the hull step that cuts the most error per byte and
// still fits; then spend what is left on any single upgrade that fits and cuts error. A unit's
// options are the budgets its curve measured.
Allocation allocate_by_marginal_gain(const std::vector<UnitCurve>& curves, const std::vector<int>& grid,
                                     const UnitBytes& bytes, double target_bytes_per_token);

// The same greedy over any options: per unit, options with their bytes per token and error (in
// any order); returns each unit's chosen option, from its cheapest, so that the units' mean bytes
// stay within the target. What a tier profile is fitted with (options: zone shares).
struct UnitOptions {
    std::vector<double> bytes, error;
};
std::vector<std::size_t> choose_by_marginal_gain(const std::vector<UnitOptions>& units, double target_bytes_per_token);

// Per option, how far its error lies above the unit's falling lower hull of (bytes, error) at its
// bytes (0 on the hull; past the hull's last point, the distance above that point's error): how
// nearly the greedy above could want it. What a screening pass ranks options by.
std::vector<double> error_above_hull(const UnitOptions& unit);

// The `keep` options of a unit most worth measuring again, indices ascending: option `always`,
// and its falling lower hull, thinned while too long by dropping the point whose loss costs least
// (an inner point: its depth below the chord of its neighbours; the last: how much lower its error
// is than the point before; never the cheapest), then the options nearest above the hull.
std::vector<std::size_t> screen_options(const UnitOptions& unit, std::size_t keep, std::size_t always);

// Where a curve departs from diminishing returns: grid budgets above its lower convex hull (the
// greedy steps over them) and budgets where the objective rises although the cache grew; over the
// budgets the curve measured.
struct CurveShape {
    std::vector<int> above_hull;
    std::vector<int> rising;
};
CurveShape curve_shape(const UnitCurve& curve, const std::vector<int>& grid, const UnitBytes& bytes);

// The allocation that follows a shape (relative budgets per unit, e.g. PyramidKV's schedule):
// budgets proportional to the weights, scaled as far as the target allows, each snapped down to
// the grid; then units furthest below their share move up one grid step while the target allows.
Allocation allocate_by_shape(const std::vector<double>& weights, const std::vector<int>& grid,
                             const UnitBytes& bytes, double target_bytes_per_token);

// The summed error of an allocation read off the curves (every budget must be a grid budget, and
// measured: std::logic_error otherwise).
double allocation_error(const std::vector<UnitCurve>& curves, const std::vector<int>& grid,
                        const std::vector<int>& budgets);

// Layer weights of the schedules the fitted profiles are compared with.
std::vector<double> pyramid_weights(int num_layers, int ratio);        // PyramidKV: deeper layers keep less
std::vector<double> inverted_weights(int num_layers, double slope);    // early layers keep less, linear in depth

// A budget grid from lowest to highest, dense enough that one step of one unit moves the mean
// bytes of `units` units by at most about 0.5%: every integer while that holds, then steps of
// min(4%, 0.5% * units) (always distinct, ascending).
std::vector<int> budget_grid(int lowest, int highest, int units = 8);

// Coarse to fine over a grid of `size` points: every stride-th index from 0, and the last.
std::vector<std::size_t> grid_stride_indices(std::size_t size, int stride);

// The indices a refinement from stride `step` to stride `next` (1 <= next < step) measures
// around a chosen index: those less than `step` away on either side, `next` apart and aligned on
// it, inside the grid (the chosen one included). Where a fit chose `chosen` among points `step`
// apart, its choice among points `next` apart lies in this bracket wherever its curve is convex.
std::vector<std::size_t> refine_bracket(std::size_t chosen, int step, int next, std::size_t size);

}  // namespace kvsim
