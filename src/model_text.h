// Tokenised text for a model: each sequence BOS + tokens, cut at the model's context.
#pragma once
#include <string>
#include <vector>

#include "src/model/llama.h"
#include "src/model/tokenizer.h"
#include "src/text.h"

namespace kvsim {

struct TokenizedText {
    std::vector<std::vector<int>> sequences;
    std::string text_sha256;
};

// Tokenises every sequence with BOS; a sequence longer than `limit` tokens is cut there with a
// warning on stderr naming the file and the sequence. Throws InputError for empty text.
TokenizedText tokenize_text(const model::Tokenizer& tokenizer, const std::string& text_path,
                            const std::string& split_on, int limit);

// The positions a model may use: its GGUF context, or less when the user says so.
int usable_context(const model::LlamaModel& model, int context_override, int max_tokens);

}  // namespace kvsim
