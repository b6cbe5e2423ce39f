// Streaming heads for a search: per (layer, KV head), the lambda in [0, 1] that minimises that
// head's output error when it streams (its sinks and recent window kept exactly, every other
// token folded into the decayed linear state of cache_math/streaming_heads.h), found by golden-section
// search on the fitting sequences; then, per target, the heads that stream, smallest fitted error
// first, until the cache meets the target's bytes. Every head is searched at once: each step is
// one lockstep replay in which every head runs at its own probe lambda.
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
    StreamingPlanFile(const std::string& folder, const std::string& name, int num_layers, int num_kv_heads,
                      const std::vector<uint8_t>& streaming, const std::vector<double>& lambda);
    ~StreamingPlanFile();
    StreamingPlanFile(const StreamingPlanFile&) = delete;
    StreamingPlanFile& operator=(const StreamingPlanFile&) = delete;
    const std::string& path() const { return path_; }

private:
    std::string path_;
};

// Appends one record per target and method ("streaming heads, fitted lambdas", "streaming heads,
// lambda 0.99", ...; the fitted one marked to have its profile written by run_search), and notes
// (the fitted lambdas, their error against 0.99's).
void fit_streaming_heads(const FitInput& input, SearchOutcome& outcome);

}  // namespace kvsim
