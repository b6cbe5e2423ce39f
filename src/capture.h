// `kvsim capture`: a GGUF model reads text teacher-forced; every layer's Q and K (after RoPE)
// and V are recorded into a qkv trace with the model's and text's provenance.
#pragma once
#include <string>

#include "sim/trace_store.h"
#include "src/model_text.h"

namespace kvsim {

struct CaptureOptions {
    ModelInput input;
    TensorDtype dtype = TensorDtype::float32;
    std::string output_path;
};

struct CaptureSummary {
    int sequences = 0;
    long tokens = 0;
};

CaptureSummary capture_trace(const CaptureOptions& options);

}  // namespace kvsim
