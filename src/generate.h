// kvsim generate: the example engine. The native forward pass (model) with kvsim's runtime
// (runtime/kvsim_runtime.h) holding the whole KV cache under a fitted profile: the model never
// stores a key or value itself, and every attention output comes from the runtime.
#pragma once
#include <string>

#include "src/model_text.h"

namespace kvsim {

struct GenerateOptions {
    std::string model_path;
    std::string profile_path;
    std::string prompt;
    int new_tokens = 64;       // greedy continuation of the prompt, stopped early by EOS
    std::string backend = "cpu";
    ModelInput perplexity;      // with a text: its perplexity with the runtime in the loop
};

struct GenerateResult {
    std::string text;               // the continuation
    int prompt_tokens = 0, generated_tokens = 0;
    double bytes_per_token = 0;     // per (layer, KV head) and token of context, at the last step
    double compression_ratio = 0;   // a full fp16 cache's bytes over the runtime's
    double ppl = 0;                 // with a text: over every predicted token of its sequences
    int64_t ppl_tokens = 0;
};

GenerateResult run_generate(const GenerateOptions& options);

}  // namespace kvsim
