// Prints the words kvsim's byte-level BPE pre-tokenizers cut texts into, for
// tests/model/pre_tokenizer_regex_test.py to compare with the patterns run by a real regex engine.
// stdin: one "<pre-tokenizer name> <text as hex>" per line ("-" for empty text);
// stdout: one line per input, the words as hex joined by ','.
#include <cstdio>
#include <iostream>
#include <string>

#include "model/bpe_pre_tokenizer.h"

int main() {
    std::string name, hex;
    while (std::cin >> name >> hex) {
        std::string text;
        if (hex != "-")
            for (size_t i = 0; i + 1 < hex.size(); i += 2) text += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
        const auto kind = kvsim::model::pre_tokenizer_named(name);
        if (!kind) {
            std::cerr << "unknown pre-tokenizer " << name << "\n";
            return 2;
        }
        std::string line;
        for (const std::string_view word : kvsim::model::pre_tokenize(text, *kind)) {
            if (!line.empty()) line += ',';
            for (const unsigned char byte : word) {
                char digits[3];
                std::snprintf(digits, sizeof digits, "%02x", byte);
                line += digits;
            }
        }
        std::cout << line << '\n';
    }
}
