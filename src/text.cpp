#include "src/text.h"

#include <fstream>

#include "base/errors.h"
#include "base/input_file.h"
#include "base/sha256.h"
#include "base/size_limits.h"

namespace kvsim {

TextSequences read_text_sequences(const std::string& path, const std::string& split_on) {
    // A FIFO would block the read forever, a directory read as empty text; a name too long for
    // the system is an InputError too, not a filesystem exception.
    require_regular_file(path);
    std::ifstream in(path, std::ios::binary);
    if (!in) throw InputError(path + ": cannot open");
    in.seekg(0, std::ios::end);
    const std::streamoff size = in.tellg();
    if (size < 0) throw InputError(path + ": cannot determine the file's size");
    in.seekg(0);
    // The file's bytes, then its sequences (at most as many bytes again).
    check_memory(checked_mul(static_cast<uint64_t>(size), 2, path),
                 path + ": " + format_bytes(static_cast<uint64_t>(size)) + " of text");
    std::string all(static_cast<std::size_t>(size), '\0');
    in.read(all.data(), size);
    if (in.gcount() != size) throw InputError(path + ": cannot read (the file changed while being read?)");

    return split_text(all, split_on, path);
}

TextSequences split_text(std::string_view all, const std::string& split_on, const std::string& name) {
    TextSequences out;
    out.sha256 = sha256_hex(all);
    auto add = [&](std::string_view piece) {
        const auto first = piece.find_first_not_of(" \t\r\n");
        if (first == std::string_view::npos) return;
        const auto last = piece.find_last_not_of(" \t\r\n");
        out.texts.emplace_back(piece.substr(first, last - first + 1));
    };
    const std::string_view view = all;
    if (split_on.empty()) {
        add(view);
    } else {
        std::size_t start = 0;
        while (true) {
            const std::size_t at = view.find(split_on, start);
            add(view.substr(start, at == std::string_view::npos ? std::string_view::npos : at - start));
            if (at == std::string_view::npos) break;
            start = at + split_on.size();
        }
    }
    if (out.texts.empty()) throw InputError(name + ": empty text (nothing to read after splitting and stripping)");
    return out;
}

}  // namespace kvsim
