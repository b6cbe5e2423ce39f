// Hostile traces and parameters: non-finite numbers, sizes the file does not back, sizes past the
// memory limit or past int. Each is one InputError naming the file and the dataset or key.
#include <doctest/doctest.h>

#include <filesystem>
#include <limits>

#include "helpers.h"
#include "hostile_traces.h"
#include "policies/pyramidkv.h"
#include "sim/qkv_attention.h"
#include "sim/synthetic_qkv.h"
#include "sim/trace_store.h"
#include "base/errors.h"
#include "base/size_limits.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

std::string hostile(const std::string& kind) {
    const std::string path = temp_dir() + "/hostile-" + kind + ".h5";
    write_hostile_trace(kind, path);
    return path;
}

// The InputError of opening and replaying a trace (two policies, one small budget), or "".
std::string replay_error(const std::string& path, AttentionView view = AttentionView::raw) {
    try {
        auto source = open_trace_source(path, 0);
        ReplayOptions options;
        options.harness.view = view;
        replay(*source, expand_sweep({entry("h2o", {{"recent_window", 4}}), entry("tova")}, {}, std::vector<int>{16}),
               options);
    } catch (const InputError& e) {
        return e.what();
    }
    return "";
}

// Sets the memory limit for one scope.
struct MemoryLimit {
    uint64_t saved = memory_limit_bytes();
    explicit MemoryLimit(uint64_t bytes) { set_memory_limit_bytes(bytes); }
    ~MemoryLimit() { set_memory_limit_bytes(saved); }
};


}  // namespace

TEST_CASE("the starting points of the hostile traces are valid and replay") {
    CHECK(replay_error(hostile("valid-qkv")) == "");
    CHECK(replay_error(hostile("valid-attention")) == "");
}

TEST_CASE("a layer loaded beside the work on another is the layer asked for, and its error comes when it is used") {
    // A replay starts each layer's load while the one before replays (QkvSource::prefetch).
    const std::string valid = hostile("valid-qkv");
    TraceReader reader(valid);
    auto source = open_trace_source(valid, 0);
    auto& qkv = dynamic_cast<QkvSource&>(*source);
    auto same = [](const QkvLayer& a, const QkvLayer& b) { return a.q == b.q && a.k == b.k && a.v == b.v; };
    const QkvLayer first = reader.read_qkv(0, 0), second = reader.read_qkv(0, 1);
    CHECK(same(qkv.layer_data(0, 0), first));
    qkv.prefetch(0, 1);
    CHECK(same(qkv.layer_data(0, 0), first));  // the layer held is still there while the next loads
    CHECK(same(qkv.layer_data(0, 1), second));
    qkv.prefetch(0, 0);
    CHECK(same(qkv.layer_data(0, 1), second));
    CHECK(same(qkv.layer_data(0, 0), first));  // taken from the load
    qkv.prefetch(0, 1);
    qkv.drop_prefetch();
    CHECK(same(qkv.layer_data(0, 1), second));  // loaded again in place

    // A NaN in layer 1's K: starting its load is quiet; asking for the layer throws the reader's
    // own error, and the layer is not taken as loaded.
    const std::string nan = hostile("qkv-nan");
    auto bad = open_trace_source(nan, 0);
    auto& bad_qkv = dynamic_cast<QkvSource&>(*bad);
    bad_qkv.layer_data(0, 0);
    CHECK_NOTHROW(bad_qkv.prefetch(0, 1));
    for (int attempt = 0; attempt < 2; ++attempt) {  // taken from the load, then loaded in place
        std::string error;
        try {
            bad_qkv.layer_data(0, 1);
        } catch (const InputError& e) {
            error = e.what();
        }
        CHECK(contains(error, nan + ": dataset '/sequences/000000/qkv/layer_001/k': element 1000 "));
    }
    // A load nobody asks for is dropped with its error, and the source can be destroyed while
    // one runs.
    bad_qkv.prefetch(0, 1);
    CHECK_NOTHROW(bad_qkv.drop_prefetch());
    CHECK(same(bad_qkv.layer_data(0, 0), TraceReader(nan).read_qkv(0, 0)));
    bad_qkv.prefetch(0, 1);
    CHECK_NOTHROW(bad.reset());
}

TEST_CASE("one NaN or Inf in Q, K or V is refused as it is read, naming the file, the dataset and the element") {
    const std::string nan = hostile("qkv-nan");
    const std::string error = replay_error(nan);
    CHECK(contains(error, nan + ": dataset '/sequences/000000/qkv/layer_001/k': element 1000 "));
    CHECK(contains(error, "(token 62, head 1, channel 0) is nan; Q, K and V must be finite"));
    // Opening does not read the data; reading the layer does.
    TraceReader reader(nan);
    CHECK_NOTHROW(reader.read_qkv(0, 0));
    CHECK_THROWS_AS(reader.read_qkv(0, 1), InputError);

    CHECK(contains(replay_error(hostile("qkv-inf")), "/qkv/layer_000/q': element 77 (token 2, head 1, channel 5) is inf"));
    CHECK(contains(replay_error(hostile("qkv-fp16-nan")), "/qkv/layer_000/v': element 500 "));
}

TEST_CASE("values past float16's range: valid as float32, refused when stored as float16, saturated in fp16 caches") {
    // The simulated fp16 cache (and the int8/int4 ones built on it) saturates at +-65504, so the
    // metrics stay finite where a GPU's cast would make Inf; see docs/bad-input.md.
    CHECK(replay_error(hostile("qkv-beyond-fp16")) == "");
    const std::string path = temp_dir() + "/hostile-qkv-beyond-fp16-stored-fp16.h5";
    std::filesystem::remove(path);
    try {
        write_hostile_trace("qkv-beyond-fp16-stored-fp16", path);
        FAIL("a value past float16's range was stored as float16");
    } catch (const InputError& e) {
        CHECK(contains(e.what(), path + ": k of /sequences/000000 layer 0 holds 100000.000000 (token 3, head 0, "
                                        "channel 2), beyond float16's range of +-65504; store float32 instead"));
    }
    CHECK_FALSE(std::filesystem::exists(path));
    for (const auto& entry : std::filesystem::directory_iterator(temp_dir()))  // nor its temporary file
        CHECK_FALSE(contains(entry.path().filename().string(), ".hostile-qkv-beyond-fp16-stored-fp16.h5.tmp"));
}

TEST_CASE("attention logits that overflow from finite Q and K name the trace, sequence, layer, head and step") {
    const std::string path = hostile("qkv-overflow");
    for (AttentionView view : {AttentionView::raw, AttentionView::renormalized}) {
        const std::string error = replay_error(path, view);
        CHECK(contains(error, path + ": sequence story, layer 1, head 3, step 5: an attention logit"));
        CHECK(contains(error, "is not finite"));
    }
}

TEST_CASE("attention weights must be finite, within [0, 1], and a row may sum to at most 1") {
    const std::string nan = hostile("attention-nan");
    CHECK(contains(replay_error(nan), nan + ": dataset '/sequences/000000/attention/layer_000/head_000': element " +
                                          std::to_string(attention_row_offset(10) + 3) +
                                          " (step 10, position 3) is nan"));
    CHECK(contains(replay_error(hostile("attention-above-one")), "(step 20, position 7) is 1.5; attention weights"));
    CHECK(contains(replay_error(hostile("attention-negative")), "(step 20, position 7) is -0.25"));
    CHECK(contains(replay_error(hostile("attention-row-sum")), "the row of step 30 (elements 435..464) sums to 1.5"));
}

TEST_CASE("a length the file does not hold is refused at open, naming the attribute or dataset and the size") {
    CHECK(contains(replay_error(hostile("length-2e31")),
                   "/sequences/000000: attribute 'length' = 2147483648 must be <= 1073741824"));
    // 2^20 tokens claimed, 63 rows written: one chunk of 8 million.
    const std::string unstored = replay_error(hostile("attention-unstored"));
    CHECK(contains(unstored, "dataset '/sequences/000000/attention/layer_000/head_000' [549755289600]"));
    CHECK(contains(unstored, "stores 1 of its 8388600 chunks: the file does not hold the data its shape implies"));
    const std::string qkv = replay_error(hostile("qkv-unstored"));
    CHECK(contains(qkv, "dataset '/sequences/000000/qkv/layer_000/q' [16777216, 4, 8] (2.0 GiB) stores 0 of its 65536 chunks"));
}

TEST_CASE("a chunk past the memory limit is refused before HDF5 inflates it") {
    const std::string path = hostile("big-chunk");
    {
        const MemoryLimit limit(16 << 20);
        const std::string error = replay_error(path);
        CHECK(contains(error, path + ": dataset '/sequences/000000/attention/layer_000/head_000' [8386560] in chunks "
                                     "of [8386560] needs 32.0 MiB, over the memory limit of 16.0 MiB"));
    }
    CHECK(replay_error(path) == "");  // under the default limit the zeros replay
}

TEST_CASE("counts past int and strings of several elements are refused, not narrowed or overrun") {
    CHECK(contains(replay_error(hostile("num-layers-2e32")), "attribute 'num_layers' = 4294967297 must be <= 2147483647"));
    CHECK(contains(replay_error(hostile("string-array")), "attribute 'model_name' is not one string"));
}

TEST_CASE("a recorded RoPE must be whole: head_dim / 2 positive frequencies, with its pairing, before keys claimed") {
    CHECK(contains(replay_error(hostile("rope-short")),
                   "root attribute 'rope_frequencies' must be 4 floating-point numbers (head_dim / 2)"));
    CHECK(contains(replay_error(hostile("rope-negative")),
                   "root attribute 'rope_frequencies': element 2 is -0.01; frequencies must be positive and finite"));
    CHECK(contains(replay_error(hostile("rope-half")),
                   "root attribute 'rope_frequencies' is missing (a trace records both RoPE attributes or neither)"));
    CHECK(contains(replay_error(hostile("pre-rope-keys-missing")),
                   "missing dataset '/sequences/000000/qkv/layer_000/k_pre_rope'"));
}

TEST_CASE("a trace cannot make the reader follow a link into another file") {
    CHECK(contains(replay_error(hostile("external-link")),
                   "'/sequences/000000/qkv/layer_001/k' is a soft or external link; a kvsim file holds its datasets itself"));
}

TEST_CASE("attention_row_offset is exact to 2^32 and the checked form refuses lengths past 2^30") {
    CHECK(attention_row_offset(int64_t{1} << 30) == (int64_t{1} << 29) * ((int64_t{1} << 30) - 1));
    CHECK(attention_row_offset(3037000500) == int64_t{1518500250} * 3037000499);  // the plain product wraps
    CHECK(attention_row_offset(int64_t{1} << 32) == (int64_t{1} << 31) * ((int64_t{1} << 32) - 1));  // the top of the range
    CHECK(attention_floats(4096, "x") == 4096 * 4095 / 2);
    CHECK_THROWS_WITH_AS(attention_floats((int64_t{1} << 30) + 1, "t.h5: length"),
                         "t.h5: length: 1073741825 tokens is outside [0, 1073741824]", InputError);
}

TEST_CASE("policy parameters that size memory are refused past the limit, naming their config key") {
    const MemoryLimit limit(uint64_t{1} << 30);
    auto source = make_policybook_source(PolicybookTraceSpec{}, 50);
    auto sweep_error = [&](const std::vector<PolicyEntry>& policies, const std::vector<GridAxis>& grid) {
        try {
            replay(*source, expand_sweep(policies, grid, std::vector<int>{256}), ReplayOptions{});
        } catch (const InputError& e) {
            return std::string(e.what());
        }
        return std::string();
    };
    PolicyEntry snapkv{"snapkv", {{"obs_window", 1e9}}, "c.yaml:5: policies[0].snapkv", {}, false, {}};
    CHECK(contains(sweep_error({snapkv}, {}),
                   "c.yaml:5: policies[0].snapkv.obs_window = 1000000000 (1000000000 steps of attention x 257 cached "
                   "tokens) needs"));
    // The same from a grid flag names the flag; a per-layer (PyramidKV) policy alike.
    const GridAxis axis{"snapkv", "obs_window", {16, 1e9}, "--set snapkv.obs_window"};
    CHECK(contains(sweep_error({entry("snapkv")}, {axis}), "--set snapkv.obs_window = 1000000000 ("));
    PolicyEntry pyramid{"pyramidkv", {{"obs_window", 1e9}}, "c.yaml:6: policies[1].pyramidkv", {}, false, {}};
    CHECK(contains(sweep_error({pyramid}, {}), "c.yaml:6: policies[1].pyramidkv.obs_window = 1000000000"));
    // ReplayCombo::make checks too, for callers that build a policy on their own.
    const auto combos = expand_sweep({snapkv}, {}, std::vector<int>{256});
    CHECK_THROWS_AS(combos[0].make(PolicyContext{256, 257, 0, 1, 0, 1, 0}), InputError);
}

TEST_CASE("a streaming head's exact tokens and state are sized against the limit, naming the key") {
    const MemoryLimit limit(uint64_t{1} << 30);
    auto source = make_synthetic_qkv_source(synthetic_qkv_trace("tiny-256", "test"), 40);
    PolicyEntry recent{"streaming_attention", {{"recent", 1e9}}, "c.yaml:4: policies[0].streaming_attention", {}, false, {}};
    std::string error;
    try {
        replay(*source, expand_sweep({recent}, {}, std::vector<int>{32}), ReplayOptions{});
    } catch (const InputError& e) {
        error = e.what();
    }
    CHECK(contains(error, "c.yaml:4: policies[0].streaming_attention.recent = 1000000000 (4 sinks + 1000000000 recent"));
}

TEST_CASE("sizes that only a config or trace could make huge allocate what the sequence needs") {
    // StreamingLLM with more sinks than the sequence has positions (the budget is larger still).
    auto source = make_policybook_source(PolicybookTraceSpec{}, 50);
    const auto rows = replay_rows(*source, {entry("streaming_llm", {{"sinks", 5000}})}, {8192});
    CHECK(rows.size() == 1);
    // A heavy-hitter k of 2^30 sizes no buffer by it and ranks as k = the row length.
    auto a = make_policybook_source(PolicybookTraceSpec{}, 200), b = make_policybook_source(PolicybookTraceSpec{}, 200);
    ReplayOptions huge_k, row_k;
    huge_k.heavy_hitter_k = 1 << 30;
    row_k.heavy_hitter_k = 200;
    const auto combos = expand_sweep({entry("h2o")}, {}, std::vector<int>{64});
    const auto x = replay(*a, combos, huge_k), y = replay(*b, combos, row_k);
    CHECK(x[0].total.heavy_hitter_hits == y[0].total.heavy_hitter_hits);
    CHECK(x[0].total.heavy_hitter_possible == y[0].total.heavy_hitter_possible);
}

TEST_CASE("a replay whose plan is over the memory limit is refused before the first step, naming the sequence") {
    auto source = make_policybook_source(PolicybookTraceSpec{}, 0);
    const MemoryLimit limit(1 << 18);  // the plan: a 256 KB block of rows, and the policy's state
    std::string error;
    try {
        replay(*source, expand_sweep({entry("h2o")}, {}, std::vector<int>{256}), ReplayOptions{});
    } catch (const InputError& e) {
        error = e.what();
    }
    CHECK(contains(error, "policybook/decode-4096 (generated in-process): sequence decode-4096 (4096 tokens), layer 0: "
                          "replaying 1 configurations over 1 KV heads needs"));
    CHECK(contains(error, "over the memory limit of 262144 bytes"));
}

TEST_CASE("PyramidKV's layer share does not overflow for the largest ratio and budget a config allows") {
    // 2 * 1e8 * (1e9 * 100) passes 2^63; the share is 2B r / (r + 1), just under 2e8.
    CHECK(pyramid_budget(100000000, 0, 101, 1000000000) == 199999999);
    CHECK(pyramid_budget(100000000, 100, 101, 1000000000) == 0);
}
