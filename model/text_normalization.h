// Unicode normalisation of text before it is tokenised. Hugging Face's tokenizer for Qwen2
// normalises its input to NFC (canonical composition: "e" + U+0301 COMBINING ACUTE becomes "é");
// llama.cpp, reading the same GGUF, does not, and neither do Llama 3's or GPT-2's tokenizers. So a
// decomposed text gives Qwen2 different tokens in the two; the choice is the user's.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kvsim::model {

enum class TextNormalization {
    none,  // the text's bytes as they are (llama.cpp)
    nfc,   // Unicode NFC (Hugging Face's Qwen2 tokenizer)
};

// "none" or "nfc"; nullopt for any other name.
std::optional<TextNormalization> text_normalization_named(std::string_view name);
const char* to_string(TextNormalization normalization);

// The text in NFC, computed by ICU; bytes that are not well-formed UTF-8 are kept as they are (a
// tokenizer spells them as byte tokens either way). Text already in NFC comes back unchanged.
// Throws InputError "<what>: ..." when the normalised copy would pass the memory limit.
std::string normalize_nfc(std::string_view text, const std::string& what);

}  // namespace kvsim::model
