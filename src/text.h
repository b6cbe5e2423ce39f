// Text a model reads: one file, optionally split into sequences on a separator.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace kvsim {

struct TextSequences {
    std::vector<std::string> texts;  // stripped of surrounding whitespace; empty pieces dropped
    std::string sha256;              // of the whole file
};

// Throws InputError naming the file when it is missing, unreadable or holds no text.
TextSequences read_text_sequences(const std::string& path, const std::string& split_on);
// The same for text already read (standard input): `name` stands for the file in the message.
TextSequences split_text(std::string_view all, const std::string& split_on, const std::string& name);

}  // namespace kvsim
