// kvsim search: fit per-layer and per-(layer, KV head) budgets of an eviction policy to a memory
// target from a trace, compare them at equal bytes with the schedules in use (uniform, PyramidKV,
// the inverted depth schedule), and report every figure on held-out sequences.
//
// How: the trace's sequences are split into a fitting and a held-out set. One lockstep replay of
// the fitting set measures every unit's objective (each layer's, each KV head's) at every budget
// of a grid side by side; units are independent on a trace, so the objective of any allocation is
// read off these curves. Allocations are fitted by marginal gain (search/allocation.h), baselines
// are scaled to the same bytes, and one more replay of the held-out set measures them all.
#pragma once
#include <array>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "search/profile.h"
#include "search/search_spec.h"
#include "cache_math/tier_shares.h"
#include "sim/attention_source.h"
#include "sim/harness.h"
#include "sim/replay.h"
#include "cache_math/lowrank.h"
#include "policies/mixed.h"
#include "search/allocation.h"

namespace kvsim {

// The safeguard of the Ada-KV baseline that fit: [head_budgets] reports (Feng et al.'s default).
inline constexpr double kSearchAdaKvFloor = 0.2;
// The most the search keeps of the full cache's outputs between its replays (FullOutputMemo), and
// never over a quarter of the memory limit.
inline constexpr std::size_t kSearchFullOutputBytes = std::size_t{3} << 29;  // 1.5 GiB

struct SearchRecord {
    std::string method;      // "uniform", "PyramidKV schedule (ratio 20)", "fitted layer budgets", ...
    std::string fit;         // the fit it belongs to: layer_budgets or head_budgets
    std::string target;      // the target's label
    std::string objective;   // output_rel_error or retained_mass
    double fitting = 0;      // the objective on the fitting sequences
    double heldout = 0;      // ... and on the held-out ones, what the tables report
    // search.sample: the half-width of the held-out figure's 95% interval (0: every step measured).
    double heldout_interval = 0;
    double bytes_per_token = 0;    // measured on the held-out sequences
    double compression_ratio = 0;  // measured on the held-out sequences
    double delta_ppl = std::numeric_limits<double>::quiet_NaN();  // with the model in the loop
    std::vector<int> layer_budgets;  // per layer (with head budgets, each layer's mean)
    // deploy kvpress: per layer, the compression ratio of each sequence's prompt (kvpress's).
    std::vector<double> prompt_ratios;
    std::vector<int> head_budgets;   // per (layer, KV head), empty for a layer allocation
    bool adakv = false;              // Ada-KV (floor kSearchAdaKvFloor) at layer_budgets' per-layer totals
    // Streaming heads (fit: streaming): which (layer, KV head) streams, its lambda, and which
    // streaming heads keep no linear state (empty: every one keeps it).
    std::vector<uint8_t> streaming_heads;
    std::vector<double> lambda;
    std::vector<uint8_t> stateless;
    int streaming_sinks = 0, streaming_recent = 0;
    // deploy duo: every head's gate in [0, 1], lowest first in the order the fit streams them
    // (streaming heads below 0.5, the rest above), for DuoAttention's quantile threshold.
    std::vector<double> gates;
    // Tier profiles (fit: tiers): the per-head zone shares replayed (tiers.num_layers is 0 for
    // every other record).
    TierShares tiers;
    // Streaming and tier records: every parameter of the policy they replay (streaming_attention,
    // stratigraphic); budget records replay the search's own policy.
    ParamValues replay_params;
    // Rank records (fit: ranks): the projection policy replayed (lowrank, group_heads) and, for
    // lowrank, its ranks per (layer, KV head), or per layer for a joint latent (joint in replay_params).
    std::string replay_policy;
    std::vector<int> key_rank, value_rank;
    // Mixed records (fit: mixed): each head's method and level.
    std::optional<MixedPlan> mixed;
    bool writes_profile = false;  // a fitted method: run_search writes its profile
};

struct SearchOutcome {
    std::string trace;
    std::string deploy = "kvsim";  // the target the search fitted for (SearchSpec::deploy)
    std::string objective;
    ModelShape shape;
    std::vector<std::string> fitting_sequences, heldout_sequences;
    std::vector<int> fitting_indices, heldout_indices;  // the two sets' indices in the trace
    // The view the search's replays showed each policy (SearchRun::attention_view): the model in
    // the loop shows it the same.
    std::string attention_view;
    // search.sample: the share of decode steps whose output error was measured (1: every step).
    double sample_steps = 1.0;
    uint64_t sample_seed = 0;
    std::vector<int> grid;
    std::vector<SearchRecord> records;
    std::vector<Profile> profiles;     // one per fitted method and target
    std::shared_ptr<const KvBases> bases;  // fit: ranks: the bases fitted on the fitting sequences
    KvBasesFormat bases_format = KvBasesFormat::json;  // the form they are written in (search.ranks.bases_format)
    std::vector<std::string> notes;    // non-convex curves, the direction of the layer profile, ...
    std::vector<SparsityPoint> sparsity_curve;  // deploy duo: the fitted ranking at each sparsity
    double seconds = 0;
    // Wall seconds of the setup and of each fit, in the order they ran: where a long search's
    // time went, and what leaving a fit out would save.
    std::vector<std::pair<std::string, double>> stage_seconds;
};

struct SearchUnitResult;

struct SearchRun {
    std::string config_file;
    std::string trace_path;
    int64_t max_steps = 0;
    std::string attention_view;         // "raw", "renormalized", "cached", or "" for the trace kind's default
    std::string group_reduce = "mean";  // "mean", "max" or "sum"
    std::function<void(double)> progress;
    // The units measured already by shards (SearchShardWork), indexed by unit: run_search sums them
    // instead of replaying the grid, the tier fit's passes, the streaming fit's lambda searches and
    // the rank fit's fitting pass, and does the rest as it would.
    const std::vector<SearchUnitResult>* measured_units = nullptr;
};

SearchOutcome run_search(const SearchSpec& spec, const SearchRun& run);

// A record of a method fitted by output error: its held-out figure, bytes and compression from the
// held-out replay's totals, and its fitting figure from its errors summed over the fitting steps.
SearchRecord output_error_record(std::string method, std::string fit, const std::string& target,
                                 double fitting_errors, double fitting_steps, const StreamMetrics& heldout);

// A figure in a fit's notes, to three significant digits ("0.35", "3.9", "1.2e+03").
std::string format_three_digits(double x);

// The held-out sequences' indices (ascending) that run_search chooses on a trace of `count`
// sequences: the split's list, or its seeded draw. InputError naming `trace` for a split it
// cannot give.
std::vector<int> search_heldout_indices(const SearchSpec& spec, int count, const std::string& trace);

struct SearchSetup;
struct TierMeasurements;  // search/tier_fit.h

// The streaming fit's lambda searches on the fitting sequences, for one (layer, KV head): what the
// fit then chooses from (search/streaming_fit.h). Measured a layer at a time by a search's shards.
struct StreamingHeadFit {
    double lambda = 0, error = 0, error_sum = 0;  // its own lambda, with the config's sinks and window
    double calibrated_lambda = 0;                 // fitted with nothing kept exactly
    // Its mean output error (and summed, stateless) streaming at 0.99, at the calibrated lambda, and with no state.
    double error_099 = 0, error_calibrated = 0, error_stateless = 0, error_stateless_sum = 0;
};

// What one work unit measured (SearchUnit).
struct SearchUnitResult {
    std::vector<StreamMetrics> streams;  // grid and tier units: per (sequence, KV head), sequence-major
    std::vector<StreamingHeadFit> heads;  // streaming units: per KV head of the layer
    // Tier units of a screened fit (search.screen): per KV head of the layer, its options'
    // candidate indices (TierOptions::kept), so the merge need not screen the layer again.
    std::vector<std::vector<std::size_t>> tier_options;
};

// What one work unit of a search's shards measures: one layer, every KV head, of
//  - grid: one grid budget of the budget fits, on the fitting sequences;
//  - tier_bytes: one plan of the tier fit (TierFitPlans), its bytes on the held-out sequences;
//  - tier_errors: one candidate of the tier fit, its output errors on the fitting sequences;
//  - streaming: the streaming fit's lambda searches, on the fitting sequences;
//  - rank_errors: one (key rank, value rank) plan of the rank fit, its errors on the fitting sequences.
// Units are numbered layer by layer, and within a layer pass by pass in that order (unit = layer *
// units a layer + the pass's offset + plan): contiguous shares of a search's units then hold whole
// layers of every pass alike, and a search of budgets alone numbers them as a sweep's shard does.
struct SearchUnit {
    enum class Pass { grid, tier_bytes, tier_errors, streaming, rank_errors };
    Pass pass = Pass::grid;
    int layer = 0;
    std::size_t plan = 0;  // the grid budget's place in the grid, the tier or rank plan's in its fit's
};

// Each pass's plans a layer, in SearchUnit::Pass order: grid budgets, tier plans, tier
// candidates, 1 for the streaming fit, rank plans; 0 for a pass the search does not make.
using SearchPassPlans = std::array<std::size_t, 5>;

// Unit `index` of a search's shards whose passes hold `plans` a layer. std::out_of_range past the
// last.
SearchUnit search_unit(std::size_t index, const SearchPassPlans& plans, int layers);

// A search's big replays, divided into work units (SearchUnit) for shards (kvsim search --shard):
// the budget fits' grid replay and the tier fit's two passes over its plans. The fits choose across
// every layer and head at once, so a shard of a search is a share of these units; the fits, their
// baselines, the held-out confirmation and the other fits run once every unit is measured
// (SearchRun::measured_units).
class SearchShardWork {
public:
    // Checks the search as run_search does; InputError also when it has no fit shards divide.
    SearchShardWork(const SearchSpec& spec, const SearchRun& run);
    ~SearchShardWork();

    // The grid budgets the grid units measure: every one, or search.coarse_grid's first pass (the
    // merge measures the refinements); empty without budget fits.
    const std::vector<int>& grid() const;
    const SearchPassPlans& pass_plans() const;
    int num_layers() const;
    int num_kv_heads() const;
    std::size_t unit_count() const;
    SearchUnit unit(std::size_t index) const;
    const std::vector<std::string>& fitting_sequences() const;
    const std::vector<std::string>& heldout_sequences() const;
    // What the units are, for messages: "grid budgets x layers", ...
    std::string unit_description() const;

    // Replays `units` a layer and a pass at a time (one lockstep replay each), calling layer_done
    // with each one's units and their streams. Before any tier unit, refuses (InputError) a target
    // that no tier plan reaches, and before any streaming unit one that no set of streaming heads
    // reaches, as the whole search does. Rank units read bases the shard fits first, as the fit does.
    using LayerDone = std::function<void(const std::vector<std::size_t>& units, std::vector<SearchUnitResult>& results)>;
    void run_units(const std::vector<std::size_t>& units, const LayerDone& layer_done);

private:
    std::unique_ptr<SearchSetup> setup_;
    SearchSpec spec_;
    std::string trace_path_;
    int64_t max_steps_ = 0;
    std::function<void(double)> progress_;
    SearchPassPlans pass_plans_{};
};

// What each family measured per (layer, KV head), for fit: mixed: per head, the family's options
// with their bytes per token on the held-out sequences and their output error summed over the
// fitting steps. Filled by the fits as they run (a family that did not run leaves its table
// empty), so the mixed fit replays nothing a family already measured.
struct MixedTables {
    // Eviction: the budget fit's per-head curves (options: the grid budgets measured, per head in
    // evict_budgets: every one, or a refined grid's).
    std::string evict_policy;
    ParamValues evict_params;
    std::vector<std::vector<int>> evict_budgets;
    std::vector<UnitOptions> evict;
    // Tiers: per head, the share triples of its options (every candidate, or the screen's survivors).
    ParamValues tier_params;
    std::vector<std::vector<std::array<double, 3>>> tier_shares;
    std::vector<UnitOptions> tiers;
    // Streaming: one option per head, its fitted lambda or no state, whichever erred less.
    int sinks = 0, recent = 0;
    std::vector<double> lambda;
    std::vector<uint8_t> stateless;
    std::vector<UnitOptions> streaming;
    // The full cache: its bytes per token (every head the same; error 0).
    double full_bytes = 0;
};

// What a fit beside the budget fits (streaming heads, tier profiles) replays with.
struct FitInput {
    const SearchSpec* spec = nullptr;
    AttentionSource* fitting = nullptr;
    AttentionSource* heldout = nullptr;
    ModelShape shape;
    HarnessOptions harness;
    std::string scratch_folder;  // where plan files are written (and removed with it)
    std::function<void(double)> progress;  // the fit's share done, 0..1; may be empty
    std::string trace_path;      // the trace, and the fitting sequences' indices in it (fit: ranks)
    std::vector<int> fitting_indices;
    MixedTables* mixed = nullptr;  // fit: mixed: where the fit leaves its per-head options
    FullOutputMemo* full_outputs = nullptr;  // the search's, for every replay of fitting and heldout
    const TierMeasurements* tier_measured = nullptr;  // fit: tiers: its passes measured by shards
    const std::vector<StreamingHeadFit>* streaming_measured = nullptr;  // fit: streaming: per (layer, KV head), by shards
    const std::vector<ComboResult>* rank_measured = nullptr;  // fit: ranks: its fitting pass, per plan, by shards
    // The decode steps replayed of each sequence (SearchRun::max_steps; 0: every one). Read by the
    // tier fit's screen, which opens the trace again; set where a tier fit runs.
    int64_t max_steps = 0;
};

// The half-width of the 95% interval of a sampled output error's mean (StreamMetrics), normal
// approximation: 1.96 standard errors; 0 where every step was measured.
double output_error_interval(const StreamMetrics& m);

// A search's replay options: its harness, the metrics asked, and its output-error sample
// (search.sample), which every replay of a search shares.
ReplayOptions search_replay_options(const SearchSpec& spec, const HarnessOptions& harness, bool output_error,
                                    bool memory);

// The held-out table for a terminal: one block per target, one row per method.
std::string format_search_table(const SearchOutcome& outcome);

// search.json, search.csv, report.md and the profiles (profile.json is the first target's finest
// fit; profile-<fit>-<target>.json each), every file written atomically.
void write_search_outputs(const SearchOutcome& outcome, const std::string& dir);

}  // namespace kvsim
