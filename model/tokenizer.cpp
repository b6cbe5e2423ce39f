#include "model/tokenizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <queue>

#include "base/errors.h"
#include "base/size_limits.h"
#include "model/gguf.h"

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

void append_utf8(std::string& out, uint32_t code) {
    if (code < 0x80) {
        out += static_cast<char>(code);
    } else if (code < 0x800) {
        out += static_cast<char>(0xC0 | (code >> 6));
        out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
        out += static_cast<char>(0xE0 | (code >> 12));
        out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (code & 0x3F));
    }
}

// GPT-2's byte-to-unicode table: printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for
// themselves, the other 68 (controls, space, DEL, NBSP, soft hyphen) for U+0100 onwards in byte
// order, so every byte is a visible character and vocabularies can be stored as text.
struct ByteTable {
    std::array<uint32_t, 256> code_of_byte{};
    std::array<int, 0x144> byte_of_code{};  // -1 where no byte maps to the code point
    ByteTable() {
        byte_of_code.fill(-1);
        uint32_t next_code = 0x100;
        for (uint32_t byte = 0; byte < 256; ++byte) {
            const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
            code_of_byte[byte] = printable ? byte : next_code++;
            byte_of_code[code_of_byte[byte]] = static_cast<int>(byte);
        }
    }
};
const ByteTable& byte_table() {
    static const ByteTable table;
    return table;
}

std::string byte_as_piece(unsigned char byte) {
    std::string piece;
    append_utf8(piece, byte_table().code_of_byte[byte]);
    return piece;
}

// A byte-level piece back to its bytes; a character outside the table (not produced by the
// table, so not from a real vocabulary) is kept as its UTF-8.
void append_piece_bytes(std::string& out, const std::string& piece) {
    for (size_t i = 0; i < piece.size();) {
        const auto lead = static_cast<unsigned char>(piece[i]);
        const size_t length = std::min(utf8_length(lead), piece.size() - i);
        uint32_t code = length == 1 ? lead : lead & (0xFF >> (length + 1));
        for (size_t k = 1; k < length; ++k) code = (code << 6) | (static_cast<unsigned char>(piece[i + k]) & 0x3F);
        if (code < byte_table().byte_of_code.size() && byte_table().byte_of_code[code] >= 0) {
            out += static_cast<char>(byte_table().byte_of_code[code]);
        } else {
            out.append(piece, i, length);
        }
        i += length;
    }
}

uint64_t pair_key(int left, int right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& gguf_path) { return from_gguf(GgufFile::open(gguf_path)); }

Tokenizer Tokenizer::from_gguf(const GgufFile& file) {
    const std::string model = file.get_string("tokenizer.ggml.model");
    Tokenizer tokenizer;
    if (model == "llama") {
        tokenizer.model_ = Model::SentencePiece;
    } else if (model == "gpt2") {
        tokenizer.model_ = Model::ByteLevelBpe;
    } else {
        throw InputError(file.path() + ": metadata key 'tokenizer.ggml.model': tokenizer '" + model +
                         "' is not supported (only 'llama', SentencePiece BPE, and 'gpt2', byte-level BPE)");
    }
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
    } else if (tokenizer.model_ == Model::SentencePiece) {
        for (size_t i = 0; i < n; ++i) {
            if (parse_byte_piece(tokenizer.pieces_[i]) >= 0) tokenizer.types_[i] = TokenType::BYTE;
        }
    }

    const auto token_id = [&](const std::string& key, int fallback) {
        const int64_t id = file.get_int(key, fallback);
        if (id == -1 && fallback == -1) return -1;  // absent, and the model has no default
        if (id < 0 || id >= static_cast<int64_t>(n))
            throw InputError(file.path() + ": metadata key '" + key + "': token id " + std::to_string(id) +
                             " is outside the vocabulary");
        return static_cast<int>(id);
    };
    // Byte-level vocabularies have no SentencePiece defaults: an absent id is no such token.
    const bool spm = tokenizer.model_ == Model::SentencePiece;
    tokenizer.bos_id_ = token_id("tokenizer.ggml.bos_token_id", spm ? 1 : -1);
    tokenizer.eos_id_ = token_id("tokenizer.ggml.eos_token_id", spm ? 2 : -1);
    tokenizer.unknown_id_ = token_id("tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
    const auto get_bool = [&](const std::string& key, bool fallback) {
        const GgufValue* value = file.find(key);
        if (!value) return fallback;
        if (value->type() != GgufValueType::BOOL)
            throw InputError(file.path() + ": metadata key '" + key + "': expected a bool");
        return std::get<bool>(value->data);
    };
    tokenizer.add_space_prefix_ = get_bool("tokenizer.ggml.add_space_prefix", spm);

    if (spm) {
        tokenizer.add_bos_token_ = get_bool("tokenizer.ggml.add_bos_token", true);
        tokenizer.load_sentencepiece();
    } else {
        tokenizer.load_byte_level_bpe(file);
        // llama.cpp's defaults when the key is absent: Llama 3 adds BOS, the others do not.
        tokenizer.add_bos_token_ = get_bool("tokenizer.ggml.add_bos_token", tokenizer.pre_tokenizer_ == PreTokenizer::Llama3);
    }
    if (tokenizer.add_bos_token_ && tokenizer.bos_id_ < 0)
        throw InputError(file.path() + ": metadata key 'tokenizer.ggml.bos_token_id': absent, but the model adds BOS");
    return tokenizer;
}

void Tokenizer::load_sentencepiece() {
    byte_token_ids_.fill(unknown_id_);
    for (size_t i = 0; i < pieces_.size(); ++i) {
        const auto id = static_cast<int>(i);
        switch (types_[i]) {
            case TokenType::NORMAL:
            case TokenType::USER_DEFINED:
                text_piece_ids_.emplace(pieces_[i], id);  // first occurrence wins
                break;
            case TokenType::BYTE:
                if (const int byte = parse_byte_piece(pieces_[i]); byte >= 0) byte_token_ids_[byte] = id;
                break;
            default: break;  // control, unknown and unused pieces are never produced from text
        }
    }
}

void Tokenizer::load_byte_level_bpe(const GgufFile& file) {
    const std::string pre = file.get_string("tokenizer.ggml.pre");
    const std::optional<PreTokenizer> kind = pre_tokenizer_named(pre);
    if (!kind)
        throw InputError(file.path() + ": metadata key 'tokenizer.ggml.pre': pre-tokenizer '" + pre +
                         "' is not supported (only 'gpt-2', 'llama-bpe', 'qwen2' and 'smollm')");
    pre_tokenizer_ = *kind;
    ignore_merges_ = pre_tokenizer_ == PreTokenizer::Llama3;

    std::unordered_map<std::string, int> any_piece_ids;  // merges may name a token of any type
    for (size_t i = 0; i < pieces_.size(); ++i) {
        any_piece_ids.emplace(pieces_[i], static_cast<int>(i));  // first occurrence wins
        const TokenType token_type = types_[i];
        if (token_type == TokenType::NORMAL || token_type == TokenType::USER_DEFINED)
            text_piece_ids_.emplace(pieces_[i], static_cast<int>(i));
        if ((token_type == TokenType::CONTROL || token_type == TokenType::USER_DEFINED) && !pieces_[i].empty())
            special_ids_.push_back(static_cast<int>(i));
    }
    // Longest first, so that a marker containing a shorter one is matched whole.
    std::stable_sort(special_ids_.begin(), special_ids_.end(),
                     [&](int a, int b) { return pieces_[a].size() > pieces_[b].size(); });

    // Every byte must have a token: words start as one token per byte.
    for (int byte = 0; byte < 256; ++byte) {
        const auto found = any_piece_ids.find(byte_as_piece(static_cast<unsigned char>(byte)));
        if (found == any_piece_ids.end()) {
            char hex[8];
            std::snprintf(hex, sizeof hex, "0x%02X", byte);
            throw InputError(file.path() + ": metadata key 'tokenizer.ggml.tokens': no token for byte " + hex +
                             " ('" + byte_as_piece(static_cast<unsigned char>(byte)) +
                             "'), which byte-level BPE needs");
        }
        byte_token_ids_[static_cast<size_t>(byte)] = found->second;
    }

    const std::vector<std::string> merges = file.get_string_array("tokenizer.ggml.merges");
    checked_narrow<int>(merges.size(), file.path() + ": metadata key 'tokenizer.ggml.merges': merge count");
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
        const std::string& merge = merges[rank];
        const auto bad_merge = [&](const std::string& why) {
            return InputError(file.path() + ": metadata key 'tokenizer.ggml.merges': entry " + std::to_string(rank) +
                              " '" + merge + "' " + why);
        };
        // "left right"; neither side contains a space (spaces are spelt 'Ġ'), but a side may be a
        // lone character such as ' ' in hand-made vocabularies, hence the search from 1.
        const size_t space = merge.find(' ', 1);
        if (space == std::string::npos) throw bad_merge("is not two tokens separated by a space");
        const std::string left = merge.substr(0, space), right = merge.substr(space + 1);
        const auto left_id = any_piece_ids.find(left), right_id = any_piece_ids.find(right);
        const auto merged_id = any_piece_ids.find(left + right);
        if (left_id == any_piece_ids.end()) throw bad_merge("names '" + left + "', which is not in the vocabulary");
        if (right_id == any_piece_ids.end()) throw bad_merge("names '" + right + "', which is not in the vocabulary");
        if (merged_id == any_piece_ids.end())
            throw bad_merge("makes '" + left + right + "', which is not in the vocabulary");
        // A repeated merge keeps its first (best) rank, as a rank lookup by pair would.
        merges_.emplace(pair_key(left_id->second, right_id->second),
                        Merge{static_cast<int>(rank), merged_id->second});
    }
}

uint64_t Tokenizer::encode_bytes_needed(uint64_t text_bytes) {
    // Per byte of text at most, for whichever model needs more. SentencePiece: 3 bytes of
    // normalised text ('▁' for a space) plus the prefixed copy, one symbol, a queued pair or two,
    // and a token id (80). Byte-level BPE: a decoded character, a word, a symbol, three queued
    // pairs, the word spelt in the byte table's characters and a token id (112).
    constexpr uint64_t kPerByte = std::max<uint64_t>(4 + 24 + 2 * 24 + 4, 16 + 16 + 12 + 3 * 20 + 4 + 4);
    return checked_mul(checked_add(text_bytes, 2, "text to tokenize"), kPerByte, "text to tokenize");
}

std::vector<int> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
    std::vector<int> tokens;
    if (add_bos && add_bos_token_) tokens.push_back(bos_id_);
    if (text.empty()) return tokens;
    // Symbols are linked by int indices, one per character (at most one per byte, plus the prefix).
    if (text.size() >= static_cast<size_t>(std::numeric_limits<int>::max()))
        throw InputError("text of " + std::to_string(text.size()) + " bytes is too long to tokenize as one sequence");
    check_memory(encode_bytes_needed(text.size()), "tokenizing " + std::to_string(text.size()) + " bytes of text");
    if (model_ == Model::ByteLevelBpe) {
        encode_byte_level_bpe(text, parse_special, tokens);
    } else {
        encode_sentencepiece(text, tokens);
    }
    return tokens;
}

void Tokenizer::encode_sentencepiece(std::string_view text, std::vector<int>& tokens) const {
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
}

void Tokenizer::encode_byte_level_bpe(std::string_view text, bool parse_special, std::vector<int>& tokens) const {
    // Cut out special tokens first (longest first, each over the fragments the longer ones left),
    // as llama.cpp does: user-defined always, control only when parse_special.
    struct Fragment {
        std::string_view text;
        int special;  // the token id, or -1 for text still to tokenize
    };
    std::vector<Fragment> fragments = {{text, -1}};
    for (const int id : special_ids_) {
        if (!parse_special && type(id) == TokenType::CONTROL) continue;
        const std::string& marker = pieces_[static_cast<size_t>(id)];
        std::vector<Fragment> split;
        for (const Fragment& fragment : fragments) {
            if (fragment.special >= 0) {
                split.push_back(fragment);
                continue;
            }
            size_t start = 0;
            for (size_t found; (found = fragment.text.find(marker, start)) != std::string_view::npos;
                 start = found + marker.size()) {
                if (found > start) split.push_back({fragment.text.substr(start, found - start), -1});
                split.push_back({{}, id});
            }
            if (start < fragment.text.size()) split.push_back({fragment.text.substr(start), -1});
        }
        fragments = std::move(split);
    }
    for (const Fragment& fragment : fragments) {
        if (fragment.special >= 0) {
            tokens.push_back(fragment.special);
            continue;
        }
        for (const std::string_view word : pre_tokenize(fragment.text, pre_tokenizer_)) encode_bpe_word(word, tokens);
    }
}

void Tokenizer::encode_bpe_word(std::string_view word, std::vector<int>& tokens) const {
    if (ignore_merges_) {
        std::string spelt;
        for (const char byte : word) spelt += byte_as_piece(static_cast<unsigned char>(byte));
        if (const auto found = text_piece_ids_.find(spelt); found != text_piece_ids_.end()) {
            tokens.push_back(found->second);
            return;
        }
    }
    // One symbol per byte, doubly linked so that a merge is O(1); id -1 marks one merged away.
    struct Symbol {
        int prev, next, id;
    };
    std::vector<Symbol> symbols(word.size());
    for (size_t i = 0; i < word.size(); ++i) {
        const int index = static_cast<int>(i);
        symbols[i] = {index - 1, i + 1 < word.size() ? index + 1 : -1,
                      byte_token_ids_[static_cast<unsigned char>(word[i])]};
    }
    // Candidate merges, best first: lowest rank, then leftmost. The ids the pair had when queued
    // tell a stale entry (either side merged since) from a live one.
    struct Pair {
        int rank, left, right, left_id, right_id;
    };
    const auto worse = [](const Pair& a, const Pair& b) {
        return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    };
    std::priority_queue<Pair, std::vector<Pair>, decltype(worse)> queue(worse);
    const auto queue_pair = [&](int left, int right) {
        if (left < 0 || right < 0) return;
        const auto found = merges_.find(pair_key(symbols[left].id, symbols[right].id));
        if (found != merges_.end()) queue.push({found->second.rank, left, right, symbols[left].id, symbols[right].id});
    };
    for (int i = 1; i < static_cast<int>(symbols.size()); ++i) queue_pair(i - 1, i);

    while (!queue.empty()) {
        const Pair best = queue.top();
        queue.pop();
        Symbol& left = symbols[best.left];
        Symbol& right = symbols[best.right];
        if (left.id != best.left_id || right.id != best.right_id || left.next != best.right) continue;
        left.id = merges_.at(pair_key(best.left_id, best.right_id)).merged;
        right.id = -1;
        left.next = right.next;
        if (left.next >= 0) symbols[left.next].prev = best.left;
        queue_pair(left.prev, best.left);
        queue_pair(best.left, left.next);
    }
    for (int i = 0; i >= 0; i = symbols[i].next) tokens.push_back(symbols[i].id);
}

std::string Tokenizer::decode(int token) const {
    if (model_ == Model::ByteLevelBpe) {
        // As llama.cpp: normal pieces through the byte table, user-defined ones as written, the
        // rest (control, unknown, unused) nothing.
        std::string bytes;
        switch (type(token)) {
            case TokenType::NORMAL:
            case TokenType::BYTE: append_piece_bytes(bytes, piece(token)); break;
            case TokenType::USER_DEFINED: bytes = piece(token); break;
            default: break;
        }
        return bytes;
    }
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

std::string Tokenizer::shown_piece(int token) const {
    switch (type(token)) {
        case TokenType::CONTROL:
        case TokenType::UNKNOWN:
        case TokenType::USER_DEFINED: return piece(token);
        case TokenType::NORMAL: return decode(token);
        case TokenType::BYTE: return model_ == Model::SentencePiece ? decode(token) : std::string();
        default: return std::string();
    }
}

std::string Tokenizer::decode(const std::vector<int>& tokens) const {
    if (model_ == Model::ByteLevelBpe) {
        std::string text;
        for (const int token : tokens) text += decode(token);
        return text;
    }
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
