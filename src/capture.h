// `kvsim capture`: a GGUF model reads text teacher-forced; every layer's Q and K (after RoPE)
// and V are recorded into a qkv trace with the model's and text's provenance and its RoPE.
#pragma once
#include <string>
#include <vector>

#include "sim/trace_store.h"
#include "src/model_text.h"

namespace kvsim {

struct CaptureOptions {
    ModelInput input;
    TensorDtype dtype = TensorDtype::float32;
    std::string output_path;
    // Model layers to record, ascending (empty = all): the trace's layer i is the model's layers[i],
    // and the trace says so (TraceMetadata::source_layers).
    std::vector<int> layers;
    // Also record each layer's keys before RoPE (k_pre_rope), for low-rank keys fitted before RoPE.
    bool pre_rope_keys = false;
    // A progress bar with the time left on stderr, when it is a terminal (progress.h).
    bool show_progress = false;
};

struct CaptureSummary {
    int sequences = 0;
    long tokens = 0;
};

CaptureSummary capture_trace(const CaptureOptions& options);

}  // namespace kvsim
