// Hand-made byte-level BPE vocabularies ("gpt2" GGUF tokenizers) for the tokenizer and capture tests.
// The byte table is written out here again, independently of the tokenizer's, so that a mistake in
// one shows up against the other.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/gguf_writer.h"

namespace kvsim::model::testing {

// GPT-2's spelling of one byte: printable Latin-1 as itself, the rest from U+0100 in byte order.
inline std::string gpt2_byte_spelling(int byte) {
    int code = byte;
    if (!((byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE && byte <= 0xFF))) {
        code = 0x100;
        for (int earlier = 0; earlier < byte; ++earlier) {
            if (!((earlier >= 0x21 && earlier <= 0x7E) || (earlier >= 0xA1 && earlier <= 0xAC) ||
                  (earlier >= 0xAE && earlier <= 0xFF)))
                ++code;
        }
    }
    std::string utf8;
    if (code < 0x80) {
        utf8 += static_cast<char>(code);
    } else {
        utf8 += static_cast<char>(0xC0 | (code >> 6));
        utf8 += static_cast<char>(0x80 | (code & 0x3F));
    }
    return utf8;
}

struct BpeVocabulary {
    // "left right" in rank order, written in byte spellings ("Ġ" is a space); each adds the token
    // left+right unless it is already there.
    std::vector<std::string> merges;
    // Tokens with no merge behind them (type 1, normal).
    std::vector<std::string> extra_tokens;
    // Special tokens: text and type (3 control, 4 user-defined). "<|endoftext|>" (control, BOS and
    // EOS, as in GPT-2) always comes first.
    std::vector<std::pair<std::string, int32_t>> specials;
    std::string pre = "gpt-2";
    std::optional<bool> add_bos_token;

    // Ids: bytes 0..255 in byte order, then merge results, extra tokens, "<|endoftext|>", specials.
    std::vector<std::string> tokens() const {
        std::vector<std::string> all;
        for (int byte = 0; byte < 256; ++byte) all.push_back(gpt2_byte_spelling(byte));
        const auto add = [&](const std::string& token) {
            for (const auto& existing : all)
                if (existing == token) return;
            all.push_back(token);
        };
        for (const auto& merge : merges) {
            const size_t space = merge.find(' ', 1);
            add(merge.substr(0, space) + merge.substr(space + 1));
        }
        for (const auto& token : extra_tokens) add(token);
        all.push_back("<|endoftext|>");
        for (const auto& [text, type] : specials) all.push_back(text);
        return all;
    }
    int id_of(const std::string& token) const {
        const std::vector<std::string> all = tokens();
        for (size_t i = 0; i < all.size(); ++i)
            if (all[i] == token) return static_cast<int>(i);
        return -1;
    }

    // Replaces any tokenizer keys in writer with this vocabulary's.
    void write_to(GgufWriter& writer) const {
        for (const char* key : {"tokenizer.ggml.scores", "tokenizer.ggml.unknown_token_id",
                                "tokenizer.ggml.add_bos_token", "tokenizer.ggml.merges", "tokenizer.ggml.pre"})
            writer.remove(key);
        const std::vector<std::string> all = tokens();
        std::vector<int32_t> types(all.size(), 1);
        const auto end_of_text = static_cast<uint32_t>(all.size() - specials.size() - 1);
        types[end_of_text] = 3;
        for (size_t i = 0; i < specials.size(); ++i) types[end_of_text + 1 + i] = specials[i].second;
        writer.set_string("tokenizer.ggml.model", "gpt2");
        writer.set_string("tokenizer.ggml.pre", pre);
        writer.set_string_array("tokenizer.ggml.tokens", all);
        writer.set_int32_array("tokenizer.ggml.token_type", types);
        writer.set_string_array("tokenizer.ggml.merges", merges);
        writer.set_uint32("tokenizer.ggml.bos_token_id", end_of_text);
        writer.set_uint32("tokenizer.ggml.eos_token_id", end_of_text);
        if (add_bos_token) writer.set("tokenizer.ggml.add_bos_token", GgufValue{*add_bos_token});
    }
    void write(const std::string& path) const {
        GgufWriter writer;
        write_to(writer);
        writer.write(path);
    }
};

}  // namespace kvsim::model::testing
