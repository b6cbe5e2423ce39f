// `kvsim capture`: a GGUF model reads text teacher-forced; every layer's Q and K (after RoPE)
// and V are recorded into a qkv trace with the model's and text's provenance.
#pragma once
#include <string>

#include "sim/trace_store.h"

namespace kvsim {

struct CaptureOptions {
    std::string model_path;
    std::string text_path;
    std::string split_on;  // "" = the whole file is one sequence
    int max_tokens = 0;    // per sequence, BOS included; 0 = the model's context
    int context = 0;       // the model's trained context, when the GGUF header overstates it
    TensorDtype dtype = TensorDtype::float32;
    std::string output_path;
};

struct CaptureSummary {
    int sequences = 0;
    long tokens = 0;
};

CaptureSummary capture_trace(const CaptureOptions& options);

}  // namespace kvsim
