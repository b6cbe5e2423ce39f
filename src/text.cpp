#include "src/text.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/errors.h"
#include "base/sha256.h"

namespace kvsim {

TextSequences read_text_sequences(const std::string& path, const std::string& split_on) {
    if (!std::filesystem::exists(path)) throw InputError(path + ": no such file");
    std::ifstream in(path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    if (!in && !in.eof()) throw InputError(path + ": cannot read");
    const std::string all = buffer.str();

    TextSequences out;
    out.sha256 = sha256_hex(all);
    auto add = [&](const std::string& piece) {
        const auto first = piece.find_first_not_of(" \t\r\n");
        if (first == std::string::npos) return;
        const auto last = piece.find_last_not_of(" \t\r\n");
        out.texts.push_back(piece.substr(first, last - first + 1));
    };
    if (split_on.empty()) {
        add(all);
    } else {
        std::size_t start = 0;
        while (true) {
            const std::size_t at = all.find(split_on, start);
            add(all.substr(start, at == std::string::npos ? std::string::npos : at - start));
            if (at == std::string::npos) break;
            start = at + split_on.size();
        }
    }
    if (out.texts.empty()) throw InputError(path + ": empty text (nothing to read after splitting and stripping)");
    return out;
}

}  // namespace kvsim
