// Streaming heads for a search. Deployed in kvsim: per (layer, KV head), the lambda in [0, 1] that
// minimises that head's output error when it streams (its sinks and recent window kept exactly,
// every other token folded into the decayed linear state of cache_math/streaming_heads.h), found
// by golden-section search on the fitting sequences, against the head keeping no state at all
// (sinks and window only), whichever errs less; then, per target, the heads that stream, smallest
// fitted error first, until the cache meets the target's bytes. Every head is searched at once:
// each step is one lockstep replay in which every head runs at its own probe lambda.
// Deployed in DuoAttention (search.deploy: duo): every streaming head is stateless, as
// DuoAttention's are, the bytes are K and V alone, and the heads are ranked by their stateless
// error; the ranking becomes DuoAttention gates, and the held-out figure is measured at a series
// of sparsities (SearchOutcome::sparsity_curve).
#pragma once
#include <string>
#include <vector>

#include "search/allocation.h"
#include "search/search.h"
#include "search/search_spec.h"
#include "sim/attention_source.h"
#include "sim/harness.h"

namespace kvsim {

// A streaming plan written where streaming_attention's `profile` parameter reads it: a YAML file
// of per-(layer, KV head) gates and lambdas. Removed with the object.
class StreamingPlanFile {
public:
    // `stateless` empty: every streaming head keeps its state.
    StreamingPlanFile(const std::string& folder, const std::string& name, int num_layers, int num_kv_heads,
                      const std::vector<uint8_t>& streaming, const std::vector<double>& lambda,
                      const std::vector<uint8_t>& stateless = {});
    ~StreamingPlanFile();
    StreamingPlanFile(const StreamingPlanFile&) = delete;
    StreamingPlanFile& operator=(const StreamingPlanFile&) = delete;
    const std::string& path() const { return path_; }

private:
    std::string path_;
};

// Appends one record per target and method ("streaming heads, fitted lambda or stateless",
// "streaming heads, lambda 0.99", ...; the fitted one marked to have its profile written by
// run_search), and notes (the fitted lambdas, which heads chose which, their error against 0.99's).
// With input.streaming_measured, the lambda searches are read from there.
void fit_streaming_heads(const FitInput& input, SearchOutcome& outcome);

// A search's shard of the streaming fit (deploy kvsim): the lambda searches of one layer's KV heads
// on the fitting sequences, each head as it is in the whole fit (every head's search is its own).
std::vector<StreamingHeadFit> fit_streaming_layer(const FitInput& input, int layer);

// The streaming fit's first check, for a shard about to fit layers: InputError for a target that
// no set of streaming heads reaches (one pass over the held-out sequences).
void refuse_unreachable_streaming_targets(const FitInput& input);

// deploy duo: DuoAttention gates from a ranking (the order heads stream in, best first) and how
// many of them stream: the streaming heads' gates spread over (0, 0.5), the others' over (0.5, 1),
// each rank its own value, so that DuoAttention's quantile threshold at sparsity m / N, and its
// patch's 0.5, pick exactly the first m, and any other sparsity the next best prefix.
std::vector<double> duo_gates(const std::vector<std::size_t>& order, std::size_t streaming);

// The sparsity to pass DuoAttention for `streaming` of `heads` heads to stream: their share, which
// its threshold (np.quantile, linear) turns back into exactly that many heads.
double duo_sparsity(std::size_t streaming, std::size_t heads);

}  // namespace kvsim
