#include "src/tokenize.h"

#include <cstdio>
#include <iostream>

#include "base/errors.h"
#include "base/size_limits.h"
#include "src/model_text.h"
#include "src/text.h"

namespace kvsim {
namespace {

// Standard input to its end, held to the memory limit as it grows (it may be a pipe of any length).
std::string read_standard_input() {
    std::string all;
    char block[1 << 16];
    while (true) {
        const std::size_t got = std::fread(block, 1, sizeof block, stdin);
        if (got > 0) {
            check_memory(checked_mul(static_cast<uint64_t>(all.size()) + got, 2, "standard input"),
                         "standard input: " + format_bytes(all.size() + got) + " of text");
            all.append(block, got);
        }
        if (got < sizeof block) break;
    }
    if (std::ferror(stdin)) throw InputError("standard input: cannot read");
    return all;
}

}  // namespace

std::string format_tokens(const model::Tokenizer& tokenizer, const std::vector<int>& tokens, bool ids_only) {
    std::string out;
    if (ids_only) {
        out = "[";
        for (std::size_t i = 0; i < tokens.size(); ++i) out += (i ? ", " : "") + std::to_string(tokens[i]);
        return out + "]\n";
    }
    for (const int token : tokens) {
        char id[32];
        std::snprintf(id, sizeof id, "%6d -> '", token);
        out += id + tokenizer.shown_piece(token) + "'\n";
    }
    return out;
}

std::vector<int> tokenize_input(const model::Tokenizer& tokenizer, const TokenizeOptions& options) {
    if (options.prompt && !options.text_path.empty())
        throw InputError("--prompt and --text: give one (or neither, for standard input)");
    if (options.prompt) return encode_text(tokenizer, *options.prompt, options.normalize, options.add_bos, "--prompt");
    const bool from_file = !options.text_path.empty();
    const TextSequences text = from_file ? read_text_sequences(options.text_path, "")
                                         : split_text(read_standard_input(), "", "standard input");
    return encode_text(tokenizer, text.texts.front(), options.normalize, options.add_bos,
                       from_file ? options.text_path : "standard input");
}

}  // namespace kvsim
