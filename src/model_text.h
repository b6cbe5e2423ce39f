// Tokenised text for a model: each sequence BOS + tokens, cut at the model's context.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "model/llama.h"
#include "model/text_normalization.h"
#include "model/tokenizer.h"
#include "src/text.h"

namespace kvsim {

struct TokenizedText {
    std::vector<std::vector<int>> sequences;
    std::vector<std::size_t> text_index;  // per sequence: its index in the split text (empty ones are dropped)
    std::string text_sha256;

    // "<text file> sequence 3", for messages: the index counts the text's pieces, as warnings do.
    std::string sequence_name(const std::string& text_path, std::size_t sequence) const {
        return text_path + " sequence " + std::to_string(text_index[sequence]);
    }
    // "tinystories_sample-3": the name a trace captured from this text gives the sequence, so
    // eval's per-sequence records and a replay's name the same story alike.
    static std::string trace_sequence_name(const std::string& text_path, std::size_t sequence) {
        return std::filesystem::path(text_path).stem().string() + "-" + std::to_string(sequence);
    }
};

// Token ids for a text, normalised first as asked (model/text_normalization.h), preceded by BOS
// when add_bos and the model adds one. `what` names the text in errors.
std::vector<int> encode_text(const model::Tokenizer& tokenizer, std::string_view text,
                             model::TextNormalization normalization, bool add_bos, const std::string& what);

// Tokenises every sequence with BOS; a sequence longer than `limit` tokens is cut there with a
// warning on stderr naming the file and the sequence. Throws InputError for empty text.
TokenizedText tokenize_text(const model::Tokenizer& tokenizer, const std::string& text_path,
                            const std::string& split_on, int limit,
                            model::TextNormalization normalization = model::TextNormalization::none);

// --context above the model's trained context: InputError naming the file and the metadata key
// (eval, capture, search's confirmation and generate refuse it alike).
void check_context_flag(const std::string& model_path, int context, const model::LlamaConfig& config);

// The positions a model may use: its GGUF context, or less when the user says so.
int usable_context(int model_context, int context_override, int max_tokens);

// A GGUF model and the text it reads, as `kvsim capture` and `kvsim eval` take them.
struct ModelInput {
    std::string model_path;
    std::string text_path;
    std::string split_on;  // "" = the whole file is one sequence
    int max_tokens = 0;    // per sequence, BOS included; 0 = the model's context
    int context = 0;       // the model's trained context, when the GGUF header overstates it
    // Unicode normalisation before tokenising (--normalize): none, as llama.cpp; nfc, as Hugging
    // Face's Qwen2 tokenizer.
    model::TextNormalization normalize = model::TextNormalization::none;
};

struct LoadedInput {
    model::LlamaModel model;  // its KV cache holds the longest sequence, not the whole context
    TokenizedText text;
    int context_limit = 0;  // tokens per sequence the model may use
};

// Loads the model, its tokenizer and the tokenised text; throws InputError naming the file. The
// model's buffers are sized by the longest tokenised sequence (at most context_limit tokens) and
// checked against the memory limit before they are allocated.
LoadedInput load_model_input(const ModelInput& input);

}  // namespace kvsim
