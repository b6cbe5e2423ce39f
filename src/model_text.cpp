#include "src/model_text.h"

#include <algorithm>
#include <cstdio>

#include "base/errors.h"
#include "base/size_limits.h"
#include "model/gguf.h"

namespace kvsim {

std::vector<int> encode_text(const model::Tokenizer& tokenizer, std::string_view text,
                             model::TextNormalization normalization, bool add_bos, const std::string& what) {
    if (normalization == model::TextNormalization::none) return tokenizer.encode(text, add_bos);
    return tokenizer.encode(model::normalize_nfc(text, what), add_bos);
}

TokenizedText tokenize_text(const model::Tokenizer& tokenizer, const std::string& text_path,
                            const std::string& split_on, int limit, model::TextNormalization normalization) {
    const TextSequences text = read_text_sequences(text_path, split_on);
    TokenizedText out;
    out.text_sha256 = text.sha256;
    uint64_t held = 0;  // the text's sequences and the token ids kept so far
    for (const std::string& piece : text.texts) held += piece.size();
    for (std::size_t i = 0; i < text.texts.size(); ++i) {
        // Checked here too so that the message names the file and sequence; encode() checks it again.
        check_memory(held + model::Tokenizer::encode_bytes_needed(text.texts[i].size()),
                     text_path + ": sequence " + std::to_string(i) + " (" + format_bytes(text.texts[i].size()) +
                         ") to tokenize");
        std::vector<int> tokens = encode_text(tokenizer, text.texts[i], normalization, /*add_bos=*/true,
                                              text_path + ": sequence " + std::to_string(i));
        if (static_cast<int64_t>(tokens.size()) > limit) {
            std::fprintf(stderr, "kvsim: warning: %s: sequence %zu has %zu tokens, more than the %d the model can use; "
                                 "stopping at %d\n",
                         text_path.c_str(), i, tokens.size(), limit, limit);
            tokens.resize(limit);
        }
        if (tokens.size() < 2) continue;  // BOS alone predicts nothing
        held += tokens.size() * sizeof(int);
        out.sequences.push_back(std::move(tokens));
        out.text_index.push_back(i);
    }
    if (out.sequences.empty()) throw InputError(text_path + ": empty text (no sequence has a token after BOS)");
    return out;
}

LoadedInput load_model_input(const ModelInput& input) {
    // One parse of the file for the config, the tokenizer and the weights.
    const model::GgufFile file = model::GgufFile::open(input.model_path);
    const model::LlamaConfig config = model::LlamaConfig::from_gguf(file);
    const model::Tokenizer tokenizer = model::Tokenizer::from_gguf(file);
    // Token ids the tokenizer can produce must be rows of the embedding.
    if (tokenizer.vocab_size() > config.vocab_size)
        throw InputError(input.model_path + ": metadata key 'tokenizer.ggml.tokens': " +
                         std::to_string(tokenizer.vocab_size()) + " tokens, but tensor 'token_embd.weight' has " +
                         std::to_string(config.vocab_size) + " rows");
    check_context_flag(input.model_path, input.context, config);
    const int limit = usable_context(config.context_length, input.context, input.max_tokens);
    TokenizedText text = tokenize_text(tokenizer, input.text_path, input.split_on, limit, input.normalize);
    // The KV cache holds what the longest sequence needs, not the header's context (which may
    // claim 2^31 positions).
    std::size_t longest = 0;
    for (const auto& tokens : text.sequences) longest = std::max(longest, tokens.size());
    model::LlamaModel llama = model::LlamaModel::load(file, static_cast<int>(longest));
    return LoadedInput{std::move(llama), std::move(text), limit};
}

void check_context_flag(const std::string& model_path, int context, const model::LlamaConfig& config) {
    if (context > config.context_length)
        throw InputError(model_path + ": --context " + std::to_string(context) +
                         " is beyond the model's trained context of " + std::to_string(config.context_length) +
                         " positions (metadata key '" + config.architecture + ".context_length')");
}

int usable_context(int model_context, int context_override, int max_tokens) {
    int limit = model_context;
    if (context_override > 0) limit = std::min(limit, context_override);
    if (max_tokens > 0) limit = std::min(limit, max_tokens);
    return limit;
}

}  // namespace kvsim
