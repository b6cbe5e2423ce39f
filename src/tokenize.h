// `kvsim tokenize`: a text's token ids and pieces under a GGUF's own tokenizer, printed as
// llama.cpp's tokenize tool prints them, to check how a prompt or a text is split.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "model/text_normalization.h"
#include "model/tokenizer.h"

namespace kvsim {

struct TokenizeOptions {
    std::string model_path;
    std::string text_path;  // a file, read as capture reads one (surrounding whitespace stripped)
    std::optional<std::string> prompt;  // or this text exactly as given; neither: standard input, as a file
    bool ids_only = false;  // "[1, 2, 3]" instead of one "id -> 'piece'" line per token
    bool add_bos = true;    // BOS when the GGUF adds one (tokenizer.ggml.add_bos_token)
    model::TextNormalization normalize = model::TextNormalization::none;
};

// llama-tokenize's output: per token "%6d -> '<piece>'" (Tokenizer::shown_piece, its bytes as
// they are), or with ids_only one line "[1, 2, 3]".
std::string format_tokens(const model::Tokenizer& tokenizer, const std::vector<int>& tokens, bool ids_only);

// The token ids of the options' text; InputError naming the file or flag on bad input.
std::vector<int> tokenize_input(const model::Tokenizer& tokenizer, const TokenizeOptions& options);

}  // namespace kvsim
