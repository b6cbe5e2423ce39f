#include "src/model/tokenizer.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <queue>

#include "base/errors.h"
#include "base/size_limits.h"
#include "src/model/gguf.h"

namespace kvsim::model {

namespace {

constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";  // U+2581 '▁', SentencePiece's space

// Length of the UTF-8 character starting with `lead`; a stray continuation or invalid byte counts
// as a character of its own (it will be emitted through byte fallback).
size_t utf8_length(unsigned char lead) {
    if (lead < 0x80) return 1;
    if ((lead & 0xE0) == 0xC0) return 2;
    if ((lead & 0xF0) == 0xE0) return 3;
    if ((lead & 0xF8) == 0xF0) return 4;
    return 1;
}

// "<0x41>" -> 0x41; -1 when the piece is not a byte token's.
int parse_byte_piece(const std::string& piece) {
    unsigned value = 0;
    char end = 0;
    if (piece.size() != 6 || std::sscanf(piece.c_str(), "<0x%2X%c", &value, &end) != 2 || end != '>') return -1;
    return static_cast<int>(value);
}

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
    std::string result;
    result.reserve(text.size());
    size_t start = 0;
    for (size_t found; (found = text.find(from, start)) != std::string_view::npos; start = found + from.size()) {
        result.append(text.substr(start, found - start));
        result.append(to);
    }
    result.append(text.substr(start));
    return result;
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& gguf_path) { return from_gguf(GgufFile::open(gguf_path)); }

Tokenizer Tokenizer::from_gguf(const GgufFile& file) {
    const std::string model = file.get_string("tokenizer.ggml.model");
    if (model != "llama") {
        throw InputError(file.path() + ": metadata key 'tokenizer.ggml.model': tokenizer '" + model +
                         "' is not supported (only 'llama', SentencePiece BPE)");
    }
    Tokenizer tokenizer;
    tokenizer.pieces_ = file.get_string_array("tokenizer.ggml.tokens");
    const size_t n = tokenizer.pieces_.size();
    if (n == 0) throw InputError(file.path() + ": metadata key 'tokenizer.ggml.tokens': empty vocabulary");
    // Token ids are ints (vocab_size(), encode's output).
    checked_narrow<int>(n, file.path() + ": metadata key 'tokenizer.ggml.tokens': vocabulary size");

    const auto bad_entry = [&](const std::string& key, size_t i, double value, const std::string& expected) {
        char text[32];
        std::snprintf(text, sizeof text, "%.9g", value);
        return InputError(file.path() + ": metadata key '" + key + "': entry " + std::to_string(i) + " is " + text +
                          ", expected " + expected);
    };
    tokenizer.scores_.assign(n, 0.0f);
    if (file.find("tokenizer.ggml.scores")) {
        const std::vector<double> scores = file.get_number_array("tokenizer.ggml.scores");
        if (scores.size() != n)
            throw InputError(file.path() + ": metadata key 'tokenizer.ggml.scores': " + std::to_string(scores.size()) +
                             " scores for " + std::to_string(n) + " tokens");
        // The merge queue orders by score: a NaN would break its ordering, and a double beyond
        // float's range does not convert.
        for (size_t i = 0; i < n; ++i) {
            if (!(std::fabs(scores[i]) <= std::numeric_limits<float>::max()))
                throw bad_entry("tokenizer.ggml.scores", i, scores[i], "a finite float32");
            tokenizer.scores_[i] = static_cast<float>(scores[i]);
        }
    }

    tokenizer.types_.assign(n, TokenType::NORMAL);
    if (file.find("tokenizer.ggml.token_type")) {
        const std::vector<double> types = file.get_number_array("tokenizer.ggml.token_type");
        if (types.size() != n)
            throw InputError(file.path() + ": metadata key 'tokenizer.ggml.token_type': " +
                             std::to_string(types.size()) + " types for " + std::to_string(n) + " tokens");
        // 0 is llama.cpp's "undefined": such a piece, like any but normal, user-defined and byte
        // pieces, is never produced from text.
        for (size_t i = 0; i < n; ++i) {
            if (!(types[i] >= 0 && types[i] <= static_cast<double>(TokenType::BYTE) && types[i] == std::floor(types[i])))
                throw bad_entry("tokenizer.ggml.token_type", i, types[i], "a token type from 0 to 6");
            tokenizer.types_[i] = static_cast<TokenType>(static_cast<int32_t>(types[i]));
        }
    } else {
        for (size_t i = 0; i < n; ++i) {
            if (parse_byte_piece(tokenizer.pieces_[i]) >= 0) tokenizer.types_[i] = TokenType::BYTE;
        }
    }

    const auto token_id = [&](const std::string& key, int fallback) {
        const int64_t id = file.get_int(key, fallback);
        if (id < 0 || id >= static_cast<int64_t>(n))
            throw InputError(file.path() + ": metadata key '" + key + "': token id " + std::to_string(id) +
                             " is outside the vocabulary");
        return static_cast<int>(id);
    };
    tokenizer.bos_id_ = token_id("tokenizer.ggml.bos_token_id", 1);
    tokenizer.eos_id_ = token_id("tokenizer.ggml.eos_token_id", 2);
    tokenizer.unknown_id_ = token_id("tokenizer.ggml.unknown_token_id", 0);
    if (const GgufValue* prefix = file.find("tokenizer.ggml.add_space_prefix")) {
        if (prefix->type() != GgufValueType::BOOL)
            throw InputError(file.path() + ": metadata key 'tokenizer.ggml.add_space_prefix': expected a bool");
        tokenizer.add_space_prefix_ = std::get<bool>(prefix->data);
    }

    tokenizer.byte_token_ids_.fill(tokenizer.unknown_id_);
    for (size_t i = 0; i < n; ++i) {
        const auto id = static_cast<int>(i);
        switch (tokenizer.types_[i]) {
            case TokenType::NORMAL:
            case TokenType::USER_DEFINED:
                tokenizer.text_piece_ids_.emplace(tokenizer.pieces_[i], id);  // first occurrence wins
                break;
            case TokenType::BYTE:
                if (const int byte = parse_byte_piece(tokenizer.pieces_[i]); byte >= 0) tokenizer.byte_token_ids_[byte] = id;
                break;
            default: break;  // control, unknown and unused pieces are never produced from text
        }
    }
    return tokenizer;
}

uint64_t Tokenizer::encode_bytes_needed(uint64_t text_bytes) {
    // Per byte of text at most: 3 bytes of normalised text ('▁' for a space) plus the prefixed copy,
    // one symbol, a queued pair or two, and a token id.
    constexpr uint64_t kPerByte = 4 + 24 + 2 * 24 + 4;
    return checked_mul(checked_add(text_bytes, 2, "text to tokenize"), kPerByte, "text to tokenize");
}

std::vector<int> Tokenizer::encode(std::string_view text, bool add_bos) const {
    std::vector<int> tokens;
    if (add_bos) tokens.push_back(bos_id_);
    if (text.empty()) return tokens;
    // Symbols are linked by int indices, one per character (at most one per byte, plus the prefix).
    if (text.size() >= static_cast<size_t>(std::numeric_limits<int>::max()))
        throw InputError("text of " + std::to_string(text.size()) + " bytes is too long to tokenize as one sequence");
    check_memory(encode_bytes_needed(text.size()), "tokenizing " + std::to_string(text.size()) + " bytes of text");

    // SentencePiece normalisation: a dummy-prefix space, then every space as '▁'.
    std::string prefixed;
    prefixed.reserve(text.size() + 1);
    if (add_space_prefix_) prefixed += ' ';
    prefixed += text;
    const std::string normalized = replace_all(prefixed, " ", kSpaceMarker);

    // One symbol per UTF-8 character, in a doubly linked list so merges are O(1).
    struct Symbol {
        int prev, next;
        size_t start, length;  // length 0: merged into its left neighbour
    };
    std::vector<Symbol> symbols;
    symbols.reserve(text.size() + 1);
    for (size_t start = 0; start < normalized.size();) {
        const size_t length = std::min(utf8_length(static_cast<unsigned char>(normalized[start])), normalized.size() - start);
        const int index = static_cast<int>(symbols.size());
        symbols.push_back({index - 1, index + 1, start, length});
        start += length;
    }
    symbols.back().next = -1;

    // Candidate merges, best first: highest score, then leftmost.
    struct Bigram {
        int left, right;
        float score;
        size_t length;  // merged length when queued; a mismatch later means the pair went stale
    };
    const auto worse = [](const Bigram& a, const Bigram& b) {
        return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    std::priority_queue<Bigram, std::vector<Bigram>, decltype(worse)> queue(worse);
    const auto queue_pair = [&](int left, int right) {
        if (left < 0 || right < 0) return;
        const size_t length = symbols[left].length + symbols[right].length;
        const auto found = text_piece_ids_.find(normalized.substr(symbols[left].start, length));
        if (found != text_piece_ids_.end()) queue.push({left, right, scores_[found->second], length});
    };
    for (int i = 1; i < static_cast<int>(symbols.size()); ++i) queue_pair(i - 1, i);

    while (!queue.empty()) {
        const Bigram best = queue.top();
        queue.pop();
        Symbol& left = symbols[best.left];
        Symbol& right = symbols[best.right];
        // Stale if either side was merged away or grew since the pair was queued.
        if (left.length == 0 || right.length == 0 || left.length + right.length != best.length) continue;
        left.length += right.length;
        right.length = 0;
        left.next = right.next;
        if (left.next >= 0) symbols[left.next].prev = best.left;
        queue_pair(left.prev, best.left);
        queue_pair(best.left, left.next);
    }

    for (int i = 0; i >= 0; i = symbols[i].next) {
        const std::string_view piece = std::string_view(normalized).substr(symbols[i].start, symbols[i].length);
        if (const auto found = text_piece_ids_.find(std::string(piece)); found != text_piece_ids_.end()) {
            tokens.push_back(found->second);
        } else {
            for (const char byte : piece) tokens.push_back(byte_token_ids_[static_cast<unsigned char>(byte)]);
        }
    }
    return tokens;
}

std::string Tokenizer::decode(int token) const {
    switch (type(token)) {
        case TokenType::CONTROL: return "";
        case TokenType::BYTE:
            if (const int byte = parse_byte_piece(pieces_[static_cast<size_t>(token)]); byte >= 0)
                return std::string(1, static_cast<char>(byte));
            break;
        default: break;
    }
    return replace_all(pieces_[static_cast<size_t>(token)], kSpaceMarker, " ");
}

std::string Tokenizer::decode(const std::vector<int>& tokens) const {
    // Bytes first, '▁' to spaces after: a '▁' spelt with byte tokens is a space too.
    std::string raw;
    for (const int token : tokens) {
        const TokenType token_type = type(token);
        if (token_type == TokenType::CONTROL) continue;
        if (token_type == TokenType::BYTE) {
            raw += decode(token);
        } else {
            raw += pieces_[static_cast<size_t>(token)];
        }
    }
    std::string text = replace_all(raw, kSpaceMarker, " ");
    if (add_space_prefix_ && !text.empty() && text.front() == ' ') text.erase(0, 1);
    return text;
}

}  // namespace kvsim::model
