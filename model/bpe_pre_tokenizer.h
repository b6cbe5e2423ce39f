// Pre-tokenizers of byte-level BPE vocabularies (GGUF key tokenizer.ggml.pre): they cut text into
// words before any merge, as the regular expressions in each model's tokenizer.json do (merges
// never cross a word boundary). Written as hand scanners that follow those patterns alternative by
// alternative, because no regex engine available here knows \p{L} and \p{N}; the Unicode
// categories come from ICU.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

namespace kvsim::model {

enum class PreTokenizer {
    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    Gpt2,
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
    // \s*[\r\n]+|\s+(?!\S)|\s+
    Llama3,
    // Llama3's pattern with single digits (\p{N} instead of \p{N}{1,3}).
    Qwen2,
    // Every digit split off on its own first, then Gpt2's pattern on the text between digits.
    SmolLM,
};

// The pre-tokenizer a GGUF's tokenizer.ggml.pre names (with llama.cpp's aliases for the same
// pattern), or nullopt for one kvsim does not implement.
std::optional<PreTokenizer> pre_tokenizer_named(std::string_view name);

// Consecutive non-empty words covering text exactly, in order. Bytes that are not valid UTF-8 count
// as characters that are neither letters, numbers nor spaces. Throws InputError for text of 2^31
// bytes or more.
std::vector<std::string_view> pre_tokenize(std::string_view text, PreTokenizer kind);

}  // namespace kvsim::model
