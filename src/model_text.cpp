#include "src/model_text.h"

#include <algorithm>
#include <cstdio>

#include "base/errors.h"

namespace kvsim {

TokenizedText tokenize_text(const model::Tokenizer& tokenizer, const std::string& text_path,
                            const std::string& split_on, int limit) {
    const TextSequences text = read_text_sequences(text_path, split_on);
    TokenizedText out;
    out.text_sha256 = text.sha256;
    for (std::size_t i = 0; i < text.texts.size(); ++i) {
        std::vector<int> tokens = tokenizer.encode(text.texts[i], /*add_bos=*/true);
        if (static_cast<int>(tokens.size()) > limit) {
            std::fprintf(stderr, "kvsim: warning: %s: sequence %zu has %zu tokens, more than the %d the model can use; "
                                 "stopping at %d\n",
                         text_path.c_str(), i, tokens.size(), limit, limit);
            tokens.resize(limit);
        }
        if (tokens.size() < 2) continue;  // BOS alone predicts nothing
        out.sequences.push_back(std::move(tokens));
    }
    if (out.sequences.empty()) throw InputError(text_path + ": empty text (no sequence has a token after BOS)");
    return out;
}

LoadedInput load_model_input(const ModelInput& input) {
    model::LlamaModel llama = model::LlamaModel::load(input.model_path, input.context);
    const model::Tokenizer tokenizer = model::Tokenizer::load(input.model_path);
    const int limit = usable_context(llama, input.context, input.max_tokens);
    TokenizedText text = tokenize_text(tokenizer, input.text_path, input.split_on, limit);
    return LoadedInput{std::move(llama), std::move(text), limit};
}

int usable_context(const model::LlamaModel& model, int context_override, int max_tokens) {
    int limit = model.max_positions();
    if (context_override > 0) limit = std::min(limit, context_override);
    if (max_tokens > 0) limit = std::min(limit, max_tokens);
    return limit;
}

}  // namespace kvsim
