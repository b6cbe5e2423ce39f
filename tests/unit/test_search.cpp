// kvsim search on traces where the answer is known: a layer (or KV head) whose attention is wide
// must get more tokens than one whose attention sits on a single sink token; the byte model must
// be the memory metric's count exactly; every method is held to the same bytes; profiles and the
// DuoAttention export read back to what was written.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "base/errors.h"
#include "helpers.h"
#include "search/allocation.h"
#include "search/export.h"
#include "search/profile.h"
#include "search/search.h"
#include "sim/replay.h"
#include "cache_math/streaming_heads.h"
#include "sim/sweep.h"
#include "sim/trace_store.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

constexpr int kDim = 8;

TraceMetadata one_query_head_per_kv_head(const std::string& name, int layers, int kv_heads) {
    TraceMetadata m;
    m.kind = TraceKind::qkv;
    m.model_name = name;
    m.num_layers = layers;
    m.num_query_heads = kv_heads;
    m.num_kv_heads = kv_heads;
    m.head_dim = kDim;
    m.source_kind = "synthetic";
    return m;
}

// A Q/K/V trace of `layers` layers and `kv_heads` KV heads (one query head each) whose
// (layer, KV head) streams are each "wide" (q = 0: uniform attention over every token, so
// whatever is evicted moves the output) or "narrow" (every query points at token 0's key, so the
// attention sits on that one sink token).
std::string write_shaped_trace(const std::string& name, int layers, int kv_heads, const std::vector<bool>& wide,
                               const std::vector<int64_t>& lengths) {
    const std::string path = temp_dir() + "/" + name + ".h5";
    TraceWriter writer(path, one_query_head_per_kv_head("shaped", layers, kv_heads));
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t s = 0; s < lengths.size(); ++s) {
        const int64_t T = lengths[s];
        const int seq = writer.add_sequence("seq" + std::to_string(s), T);
        for (int l = 0; l < layers; ++l) {
            QkvLayer layer;
            layer.tokens = T;
            layer.q.assign(T * kv_heads * kDim, 0.0f);
            layer.k.resize(T * kv_heads * kDim);
            layer.v.resize(T * kv_heads * kDim);
            for (float& x : layer.k) x = 0.3f * normal(rng);
            // Values around a common mean, so a wide head's output error falls smoothly with budget
            // (the mean of what is kept against the mean of everything).
            for (float& x : layer.v) x = 1.0f + normal(rng);
            for (int h = 0; h < kv_heads; ++h) {
                if (wide[static_cast<std::size_t>(l) * kv_heads + h]) continue;
                layer.k[(0 * kv_heads + h) * kDim] = 12.0f;  // token 0's key ...
                for (int64_t t = 0; t < T; ++t) layer.q[(t * kv_heads + h) * kDim] = 12.0f;  // ... is every query's
            }
            writer.write_qkv(seq, l, layer, TensorDtype::float32);
        }
    }
    writer.commit();
    return path;
}

// StreamingLLM keeps the sink token, so a narrow stream needs almost nothing, and a recent
// window, whose error on a wide stream falls smoothly with the budget.
SearchSpec streaming_llm_search(std::vector<std::string> fits, std::vector<std::string> targets) {
    SearchSpec spec;
    spec.where = "test: search";
    spec.policy.name = "streaming_llm";
    spec.policy.params = {{"sinks", 1}};
    spec.policy.where = "test: search.policy";
    spec.heldout = {2};
    spec.split_where = "test: search.split";
    for (const std::string& t : targets)
        spec.targets.push_back({std::stod(t), 0, t, "test: search.target " + t});
    spec.fits = std::move(fits);
    return spec;
}

SearchRun run_on(const std::string& trace) {
    const std::string config = temp_dir() + "/search-config.yaml";
    std::ofstream(config) << "# the search's config, hashed into profiles\n";
    SearchRun run;
    run.config_file = config;
    run.trace_path = trace;
    return run;
}

const SearchRecord& record(const SearchOutcome& o, const std::string& method, const std::string& target) {
    for (const SearchRecord& r : o.records)
        if (r.method == method && r.target == target) return r;
    FAIL("no record " << method << " @ " << target);
    throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("the byte model counts exactly what the replay's memory metric measures") {
    const std::string path = write_shaped_trace("bytes", 1, 2, {true, false}, {70, 41});
    auto source = open_trace_source(path, 0);
    ReplayOptions options;
    options.memory = true;
    const std::vector<int> budgets = {3, 10, 40, 100};
    const auto combos = expand_sweep({entry("h2o", {{"recent_window", 2}})}, {}, budgets);
    const auto results = replay(*source, combos, options);
    const ByteModel model(source->shape().last_steps, kDim, static_cast<double>(results[0].policy_bytes_per_slot));
    for (std::size_t i = 0; i < budgets.size(); ++i) {
        const StreamMetrics& m = results[i].total;
        INFO("budget " << budgets[i]);
        CHECK(m.cache_bytes / m.context_tokens == doctest::Approx(model.bytes_per_token(budgets[i])).epsilon(1e-12));
        CHECK(m.fp16_bytes / m.context_tokens == doctest::Approx(model.full_fp16_bytes_per_token()).epsilon(1e-12));
    }
}

TEST_CASE("marginal-gain allocation: the steeper curve gets the bytes, the total stays within the target") {
    const std::vector<int> grid = budget_grid(2, 60);
    const ByteModel bytes({60, 60}, kDim, 8);
    UnitCurve steep{"steep", {}}, flat{"flat", {}};
    for (int b : grid) {
        steep.error.push_back(100.0 / b);
        flat.error.push_back(1.0 / b);
    }
    const double target = bytes.bytes_per_token(20);
    const Allocation a = allocate_by_marginal_gain({steep, flat}, grid, bytes, target);
    CHECK(a.budgets[0] > a.budgets[1]);
    CHECK(a.bytes_per_token <= target * (1 + 1e-9));
    // Nothing that fits is left: one more grid step of either unit would pass the target.
    for (int u = 0; u < 2; ++u) {
        const auto next = std::upper_bound(grid.begin(), grid.end(), a.budgets[u]);
        if (next == grid.end()) continue;
        const double more = (bytes.bytes_per_token(*next) - bytes.bytes_per_token(a.budgets[u])) / 2;
        CHECK(a.bytes_per_token + more > target);
    }
    // The same curves by brute force over every pair of grid budgets: the greedy is optimal here.
    double best = INFINITY;
    for (std::size_t i = 0; i < grid.size(); ++i)
        for (std::size_t j = 0; j < grid.size(); ++j)
            if ((bytes.bytes_per_token(grid[i]) + bytes.bytes_per_token(grid[j])) / 2 <= target * (1 + 1e-9))
                best = std::min(best, steep.error[i] + flat.error[j]);
    CHECK(a.error == doctest::Approx(best).epsilon(1e-12));
}

TEST_CASE("marginal-gain choice over options in any order matches brute force on convex curves") {
    // Three units, ten options each at 1..10 bytes in a scrambled order, errors c / bytes (convex,
    // falling): with equal byte steps the greedy is optimal, whatever order the options come in.
    const double scale[3] = {1.0, 4.0, 9.0};
    const int order[10] = {7, 2, 9, 0, 5, 3, 8, 1, 6, 4};
    std::vector<UnitOptions> units(3);
    for (int u = 0; u < 3; ++u)
        for (int i : order) {
            units[u].bytes.push_back(i + 1.0);
            units[u].error.push_back(scale[u] / (i + 1.0));
        }
    for (double target : {1.0, 2.5, 4.0, 7.0, 10.0}) {
        const std::vector<std::size_t> pick = choose_by_marginal_gain(units, target);
        double error = 0, bytes = 0;
        for (int u = 0; u < 3; ++u) error += units[u].error[pick[u]], bytes += units[u].bytes[pick[u]];
        double best = INFINITY;
        for (int a = 0; a < 10; ++a)
            for (int b = 0; b < 10; ++b)
                for (int c = 0; c < 10; ++c)
                    if ((units[0].bytes[a] + units[1].bytes[b] + units[2].bytes[c]) / 3 <= target * (1 + 1e-9))
                        best = std::min(best, units[0].error[a] + units[1].error[b] + units[2].error[c]);
        INFO("target " << target);
        CHECK(bytes / 3 <= target * (1 + 1e-9));
        CHECK(error == doctest::Approx(best).epsilon(1e-12));
    }
    // The unit whose error falls fastest gets the most bytes.
    const std::vector<std::size_t> pick = choose_by_marginal_gain(units, 5.0);
    CHECK(units[2].bytes[pick[2]] > units[0].bytes[pick[0]]);
}

TEST_CASE("a refined grid: stride indices, the brackets around a choice, and curves measured in part") {
    using Indices = std::vector<std::size_t>;
    CHECK(grid_stride_indices(10, 4) == Indices{0, 4, 8, 9});
    CHECK(grid_stride_indices(9, 4) == Indices{0, 4, 8});
    CHECK(grid_stride_indices(3, 1) == Indices{0, 1, 2});
    CHECK_THROWS_AS(grid_stride_indices(3, 0), std::invalid_argument);
    CHECK(refine_bracket(8, 4, 2, 20) == Indices{6, 8, 10});
    CHECK(refine_bracket(8, 2, 1, 20) == Indices{7, 8, 9});
    CHECK(refine_bracket(8, 3, 1, 20) == Indices{6, 7, 8, 9, 10});
    CHECK(refine_bracket(1, 8, 2, 20) == Indices{1, 3, 5, 7});   // nothing below 0
    CHECK(refine_bracket(18, 4, 1, 20) == Indices{15, 16, 17, 18, 19});  // nothing past the last
    CHECK_THROWS_AS(refine_bracket(8, 2, 2, 20), std::invalid_argument);
    CHECK_THROWS_AS(refine_bracket(20, 2, 1, 20), std::invalid_argument);

    // A curve measured at some budgets only: the allocation chooses among those, as it would on
    // the grid of them; reading an unmeasured budget is refused.
    const std::vector<int> grid = budget_grid(2, 60);
    const ByteModel bytes({60, 60}, kDim, 8);
    UnitCurve steep{"steep", {}}, flat{"flat", {}};
    std::vector<int> measured_grid;
    for (std::size_t i = 0; i < grid.size(); ++i) {
        const bool measured = i % 3 == 0 || i + 1 == grid.size();
        if (measured) measured_grid.push_back(grid[i]);
        steep.error.push_back(measured ? 100.0 / grid[i] : NAN);
        flat.error.push_back(measured ? 1.0 / grid[i] : NAN);
    }
    UnitCurve steep_part = steep, flat_part = flat;
    steep_part.error.clear(), flat_part.error.clear();
    for (int b : measured_grid) steep_part.error.push_back(100.0 / b), flat_part.error.push_back(1.0 / b);
    const double target = bytes.bytes_per_token(20);
    const Allocation a = allocate_by_marginal_gain({steep, flat}, grid, bytes, target);
    const Allocation b = allocate_by_marginal_gain({steep_part, flat_part}, measured_grid, bytes, target);
    CHECK(a.budgets == b.budgets);
    CHECK(a.error == b.error);
    CHECK(allocation_error({steep, flat}, grid, a.budgets) == a.error);
    CHECK_THROWS_AS(allocation_error({steep, flat}, grid, {grid[1], grid[0]}), std::logic_error);
    const CurveShape shape = curve_shape(steep, grid, bytes), part = curve_shape(steep_part, measured_grid, bytes);
    CHECK(shape.above_hull == part.above_hull);
    CHECK(shape.rising == part.rising);
}

TEST_CASE("error above the hull: zero on the falling lower hull, the gap to it elsewhere, in any order") {
    // bytes 1..6, errors 10, 6, 5, 3, 4, 3.5: the falling hull runs (1, 10), (2, 6), (4, 3); (3, 5)
    // is 0.5 above the chord at 4.5; past the last hull point the floor is its error, 3.
    const std::vector<double> bytes = {1, 2, 3, 4, 5, 6}, error = {10, 6, 5, 3, 4, 3.5};
    const std::vector<double> want = {0, 0, 0.5, 0, 1, 0.5};
    const int order[6] = {4, 0, 5, 2, 3, 1};
    UnitOptions scrambled;
    for (int i : order) scrambled.bytes.push_back(bytes[i]), scrambled.error.push_back(error[i]);
    const std::vector<double> above = error_above_hull(scrambled);
    REQUIRE(above.size() == 6);
    for (int k = 0; k < 6; ++k) {
        CAPTURE(order[k]);
        CHECK(above[k] == doctest::Approx(want[order[k]]).epsilon(1e-12));
    }
    CHECK_THROWS_AS(error_above_hull(UnitOptions{}), std::invalid_argument);

    // Screening keeps the hull, thinned where it is too long (the inner point (2, 6) lies 1.67
    // below the chord from (1, 10) to (4, 3); dropping (4, 3) would lose 3), then the options
    // nearest above it; and the option asked for, always.
    const UnitOptions in_order{bytes, error};
    using Kept = std::vector<std::size_t>;
    CHECK(screen_options(in_order, 2, 0) == Kept{0, 3});
    CHECK(screen_options(in_order, 3, 0) == Kept{0, 1, 3});
    CHECK(screen_options(in_order, 4, 0) == Kept{0, 1, 2, 3});  // (3, 5) and (6, 3.5) tie 0.5 above: the first
    CHECK(screen_options(in_order, 3, 4) == Kept{0, 3, 4});
    CHECK(screen_options(in_order, 2, 3) == Kept{0, 3});
    CHECK(screen_options(in_order, 9, 0) == Kept{0, 1, 2, 3, 4, 5});
    CHECK_THROWS_AS(screen_options(in_order, 2, 6), std::invalid_argument);
}

TEST_CASE("shape allocations follow their weights and meet the same bytes") {
    const std::vector<int> grid = budget_grid(4, 400);
    const ByteModel bytes({400, 300}, kDim, 8);
    const double target = bytes.full_fp16_bytes_per_token() / 3.0;
    const Allocation uniform = allocate_by_shape(std::vector<double>(6, 1.0), grid, bytes, target);
    const Allocation pyramid = allocate_by_shape(pyramid_weights(6, 8), grid, bytes, target);
    const Allocation inverted = allocate_by_shape(inverted_weights(6, 0.8), grid, bytes, target);
    for (const Allocation* a : {&uniform, &pyramid, &inverted}) {
        CHECK(a->bytes_per_token <= target * (1 + 1e-9));
        CHECK(a->bytes_per_token >= target * 0.99);
    }
    CHECK(*std::max_element(uniform.budgets.begin(), uniform.budgets.end()) -
              *std::min_element(uniform.budgets.begin(), uniform.budgets.end()) <= 8);
    CHECK(std::is_sorted(pyramid.budgets.rbegin(), pyramid.budgets.rend()));  // deeper layers keep less
    CHECK(std::is_sorted(inverted.budgets.begin(), inverted.budgets.end()));  // early layers keep less
    CHECK(pyramid.budgets.front() > 3 * pyramid.budgets.back());
}

TEST_CASE("a search's shard units are numbered layer by layer, pass by pass within a layer, every unit once") {
    using Pass = SearchUnit::Pass;
    const Pass passes[] = {Pass::grid, Pass::tier_bytes, Pass::tier_errors, Pass::streaming, Pass::rank_errors};
    struct Case {
        SearchPassPlans plans;
        int layers;
    };
    for (const Case c : {Case{{5, 0, 0, 0, 0}, 3}, Case{{0, 7, 4, 0, 0}, 3}, Case{{5, 7, 4, 1, 6}, 2},
                         Case{{0, 0, 0, 1, 0}, 4}, Case{{2, 0, 0, 1, 0}, 1}, Case{{0, 0, 0, 0, 9}, 2}}) {
        CAPTURE(c.plans[0]);
        CAPTURE(c.plans[1]);
        CAPTURE(c.plans[3]);
        CAPTURE(c.plans[4]);
        std::set<std::tuple<int, int, std::size_t>> seen;
        std::size_t index = 0;
        for (int layer = 0; layer < c.layers; ++layer)
            for (std::size_t p = 0; p < 5; ++p)
                for (std::size_t plan = 0; plan < c.plans[p]; ++plan, ++index) {
                    const SearchUnit u = search_unit(index, c.plans, c.layers);
                    CHECK(u.pass == passes[p]);
                    CHECK(u.layer == layer);
                    CHECK(u.plan == plan);
                    seen.insert({static_cast<int>(u.pass), u.layer, u.plan});
                }
        CHECK(seen.size() == index);
        CHECK_THROWS_AS(search_unit(index, c.plans, c.layers), std::out_of_range);
    }
}

TEST_CASE("search gives a wide-attention layer more cache than a sink-only one, on held-out sequences") {
    // Layer 0 and 2 wide, layer 1 narrow; three sequences, the last held out. Long enough that one
    // token of one layer is well under 1% of the bytes (the granularity of equal bytes).
    const std::string path = write_shaped_trace("layers", 3, 1, {true, false, true}, {400, 360, 380});
    const SearchOutcome o = run_search(streaming_llm_search({"layer_budgets"}, {"2", "4"}), run_on(path));
    CHECK(o.heldout_sequences == std::vector<std::string>{"seq2"});
    for (const char* target : {"2", "4"}) {
        const SearchRecord& fitted = record(o, "fitted layer budgets", target);
        const SearchRecord& uniform = record(o, "uniform", target);
        INFO("target " << std::string(target) << ": fitted " << fitted.layer_budgets[0] << " " << fitted.layer_budgets[1] << " "
                       << fitted.layer_budgets[2]);
        CHECK(fitted.layer_budgets[1] < fitted.layer_budgets[0]);
        CHECK(fitted.layer_budgets[1] < fitted.layer_budgets[2]);
        CHECK(fitted.heldout < uniform.heldout);
        // Every method of a target holds the same bytes, within 1%.
        for (const SearchRecord& r : o.records)
            if (r.target == target) CHECK(std::abs(r.bytes_per_token / uniform.bytes_per_token - 1) < 0.01);
    }
    // Profiles for the fitted method, one per target, carrying what the search measured.
    REQUIRE(o.profiles.size() == 2);
    CHECK(o.profiles[0].layer_budgets == record(o, "fitted layer budgets", "2").layer_budgets);
    CHECK(o.profiles[0].heldout_value == record(o, "fitted layer budgets", "2").heldout);
    CHECK(o.profiles[0].model.same_as(ModelShape{"", 3, 1, 1, kDim}));
}

TEST_CASE("a refined grid's search: the same figures wherever it chose what every budget's search chose") {
    // Two layers of three KV heads, wide and narrow mixed; the last sequence held out.
    const std::string path =
        write_shaped_trace("refined", 2, 3, {true, false, true, false, true, true}, {300, 260, 280});
    const SearchSpec every = streaming_llm_search({"layer_budgets", "head_budgets"}, {"2", "3"});
    SearchSpec coarse = every;
    coarse.coarse_grid = 8;
    coarse.coarse_grid_where = "test: search.coarse_grid";
    const SearchOutcome full = run_search(every, run_on(path));
    const SearchOutcome refined = run_search(coarse, run_on(path));
    CHECK(refined.grid == full.grid);
    REQUIRE(refined.records.size() == full.records.size());
    std::size_t same = 0;
    for (std::size_t i = 0; i < full.records.size(); ++i) {
        const SearchRecord &f = full.records[i], &r = refined.records[i];
        INFO(r.method << " @ " << r.target);
        // The best PyramidKV ratio and inverted slope are chosen on the first pass's curves, and
        // may differ; every other method is the same.
        if (r.method.find("(best") == std::string::npos) CHECK(r.method == f.method);
        // Measured, never interpolated: where both chose the same budgets, the same figures (a
        // layer's sum of its heads is added in another order than the replay's: to rounding).
        if (r.layer_budgets == f.layer_budgets && r.head_budgets == f.head_budgets) {
            ++same;
            CHECK(r.fitting == doctest::Approx(f.fitting).epsilon(1e-12));
            CHECK(r.heldout == f.heldout);
        }
        if (r.method.rfind("fitted", 0) == 0) CHECK(r.fitting <= f.fitting * 1.01);
    }
    CHECK(same >= 4);  // uniform and PyramidKV's schedule at both targets are allocated by bytes alone
    bool noted = false;
    for (const std::string& n : refined.notes) noted = noted || contains(n, "search.coarse_grid");
    CHECK(noted);

    coarse.fits = {"streaming"};
    coarse.policy.name.clear();
    try {
        run_search(coarse, run_on(path));
        FAIL("a coarse grid without budget fits was not refused");
    } catch (const InputError& e) {
        CHECK(contains(e.what(), "test: search.coarse_grid: refines the budget fits' grid"));
    }
}

TEST_CASE("head budgets: within a layer, the wide KV head gets more than the narrow one") {
    const std::string path = write_shaped_trace("heads", 1, 2, {false, true}, {120, 100, 110});
    const SearchOutcome o = run_search(streaming_llm_search({"head_budgets"}, {"3"}), run_on(path));
    const SearchRecord& fitted = record(o, "fitted head budgets", "3");
    REQUIRE(fitted.head_budgets.size() == 2);
    CHECK(fitted.head_budgets[0] < fitted.head_budgets[1]);
    CHECK(fitted.heldout < record(o, "uniform", "3").heldout);
}

// Two KV heads: head 0 attends uniformly over its whole past (q = 0); head 1's logits fall
// linearly with distance, q.k / sqrt(d) = -rate (t - j), so its attention decays by exp(-rate)
// per step, the decay a linear state's lambda models.
std::string write_memory_trace(const std::string& name, const std::vector<int64_t>& lengths, float rate) {
    const std::string path = temp_dir() + "/" + name + ".h5";
    TraceWriter writer(path, one_query_head_per_kv_head("memory", 1, 2));
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float scale = std::sqrt(static_cast<float>(kDim));
    for (std::size_t s = 0; s < lengths.size(); ++s) {
        const int64_t T = lengths[s];
        const int seq = writer.add_sequence("seq" + std::to_string(s), T);
        QkvLayer layer;
        layer.tokens = T;
        layer.q.assign(T * 2 * kDim, 0.0f);
        layer.k.assign(T * 2 * kDim, 0.0f);
        layer.v.resize(T * 2 * kDim);
        for (float& x : layer.v) x = 1.0f + normal(rng);
        for (int64_t t = 0; t < T; ++t) {
            for (int c = 2; c < kDim; ++c) layer.k[(t * 2 + 0) * kDim + c] = 0.1f * normal(rng);
            // head 1: q_t = (1, -t) * rate * sqrt(d), k_j = (j, 1): q.k / sqrt(d) = -rate (t - j)
            layer.q[(t * 2 + 1) * kDim + 0] = rate * scale;
            layer.q[(t * 2 + 1) * kDim + 1] = -rate * scale * static_cast<float>(t);
            layer.k[(t * 2 + 1) * kDim + 0] = static_cast<float>(t);
            layer.k[(t * 2 + 1) * kDim + 1] = 1.0f;
        }
        writer.write_qkv(seq, 0, layer, TensorDtype::float32);
    }
    writer.commit();
    return path;
}

TEST_CASE("streaming heads: the fitted lambda follows how fast a head's attention decays") {
    SearchSpec spec = streaming_llm_search({"streaming"}, {"2"});
    spec.streaming_sinks = 1;
    spec.streaming_recent = 4;
    spec.streaming_where = "test: search.streaming";
    std::vector<double> decayed;
    for (float rate : {3.0f / 64, 8.0f / 64}) {
        const std::string path = write_memory_trace("memory", {160, 140, 150}, rate);
        const SearchOutcome o = run_search(spec, run_on(path));
        const SearchRecord& fitted = record(o, "streaming heads, fitted lambda or stateless", "2");
        const SearchRecord& published = record(o, "streaming heads, lambda 0.99", "2");
        REQUIRE(fitted.lambda.size() == 2);
        INFO("rate " << rate << ": lambdas " << fitted.lambda[0] << " " << fitted.lambda[1]);
        CHECK(fitted.lambda[0] > 0.99);  // uniform attention: the state must remember everything
        CHECK(fitted.lambda[1] == doctest::Approx(std::exp(-rate)).epsilon(0.03));  // the head's own decay
        CHECK(fitted.stateless == std::vector<uint8_t>{0, 0});  // both heads need what they fold
        CHECK(fitted.heldout <= published.heldout);
        CHECK(fitted.bytes_per_token == published.bytes_per_token);  // the same heads stream
        REQUIRE(o.profiles.size() == 1);
        REQUIRE(o.profiles[0].streaming);
        CHECK(o.profiles[0].streaming->lambda == fitted.lambda);
        decayed.push_back(fitted.lambda[1]);
    }
    CHECK(decayed[1] < decayed[0]);  // faster decay, smaller lambda
}

TEST_CASE("streaming heads: a head whose attention stays in its window streams without a state") {
    // Head 1's attention falls by e^-2 a step: past its window of 4 almost nothing is left, and
    // any state, even at lambda 0 (the last token folded), adds weight the softmax would not.
    SearchSpec spec = streaming_llm_search({"streaming"}, {"1.2"});
    spec.streaming_sinks = 1;
    spec.streaming_recent = 4;
    spec.streaming_where = "test: search.streaming";
    const SearchOutcome o = run_search(spec, run_on(write_memory_trace("local", {160, 140, 150}, 2.0f)));
    const SearchRecord& fitted = record(o, "streaming heads, fitted lambda or stateless", "1.2");
    CHECK(fitted.stateless == std::vector<uint8_t>{0, 1});  // uniform head: a state; local head: none
    CHECK(fitted.streaming_heads == std::vector<uint8_t>{0, 1});  // and the local head streams
    const SearchRecord& published = record(o, "streaming heads, lambda 0.99", "1.2");
    CHECK(fitted.heldout < published.heldout);
    CHECK(fitted.bytes_per_token < published.bytes_per_token);  // a stateless head holds no state
    const SearchRecord& stateless = record(o, "streaming heads, stateless", "1.2");
    CHECK(stateless.stateless == std::vector<uint8_t>{1, 1});
    REQUIRE(o.profiles.size() == 1);
    REQUIRE(o.profiles[0].streaming);
    CHECK(o.profiles[0].streaming->stateless == fitted.stateless);
    bool said = false;
    for (const std::string& n : o.notes) said |= contains(n, "At 1.2: stateless layer 0: 1; with a state none.");
    CHECK(said);
}

TEST_CASE("search refuses what it cannot fit, naming the key") {
    const std::string path = write_shaped_trace("refuse", 1, 1, {true}, {60, 50});
    auto error_of = [&](SearchSpec spec) {
        try {
            run_search(spec, run_on(path));
        } catch (const InputError& e) {
            return std::string(e.what());
        }
        return std::string();
    };
    SearchSpec spec = streaming_llm_search({"layer_budgets"}, {"2"});
    spec.heldout = {0, 1};
    CHECK(contains(error_of(spec), "test: search.split: the split leaves no fitting sequence"));
    spec.heldout = {5};
    CHECK(contains(error_of(spec), "test: search.split: sequence 5 is not in"));
    spec = streaming_llm_search({"layer_budgets"}, {"40"});
    spec.heldout = {1};
    CHECK(contains(error_of(spec), "test: search.target 40: 40 ("));
    CHECK(contains(error_of(spec), "is below the"));
    spec = streaming_llm_search({"layer_budgets"}, {"2"});
    spec.heldout = {1};
    spec.policy.name = "full";
    CHECK(contains(error_of(spec), "full keeps every token"));
}

TEST_CASE("a profile round-trips through its JSON, and a DuoAttention export reads back to the same plan") {
    Profile p;
    p.name = "round-trip";
    p.model = {"m", 2, 4, 2, 8};
    p.policy = "h2o";
    p.params = {{"recent_window", 4}};
    p.method = "fitted head budgets";
    p.target = "2x";
    p.layer_budgets = {10, 20};
    p.head_budgets = {9, 11, 18, 22};
    p.layer_kept_fraction = {0.25, 0.5};
    p.heldout_value = 0.125;
    const std::string file = temp_dir() + "/round-trip.json";
    write_profile(p, file);
    const Profile q = load_profile(file);
    CHECK(q.name == p.name);
    CHECK(q.model.same_as(p.model));
    CHECK(q.params == p.params);
    CHECK(q.layer_budgets == p.layer_budgets);
    CHECK(q.head_budgets == p.head_budgets);
    CHECK(q.heldout_value == p.heldout_value);

    // Streaming heads are a streaming_attention profile's, without budgets (search/profile.h).
    Profile streaming = p;
    streaming.policy = "streaming_attention";
    streaming.params = {};
    streaming.layer_budgets.clear();
    streaming.head_budgets.clear();
    streaming.streaming = StreamingHeads{4, 16, {1, 0, 0, 1}, {0.9, 0.99, 0.5, 0.0}, {}, {}};
    const std::string streaming_file = temp_dir() + "/round-trip-streaming.json";
    write_profile(streaming, streaming_file);
    const Profile r = load_profile(streaming_file);
    REQUIRE(r.streaming);
    CHECK(r.streaming->heads == streaming.streaming->heads);
    CHECK(r.streaming->lambda == streaming.streaming->lambda);

    const std::string dir = temp_dir() + "/duo-export";
    std::filesystem::remove_all(dir);
    export_duo_pattern(r, streaming_file, dir);
    const StreamingPlan plan = load_duo_attention_pattern(dir + "/full_attention_heads.tsv", 2, 2, 0.99);
    for (int l = 0; l < 2; ++l)
        for (int kv = 0; kv < 2; ++kv) CHECK(plan.is_streaming(l, kv) == (streaming.streaming->heads[l * 2 + kv] == 1));

    const std::string ratios = temp_dir() + "/ratios.json";
    export_layer_ratios(q, file, ratios);
    std::ifstream in(ratios);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    CHECK(text == "[0.75,0.5]\n");
}
