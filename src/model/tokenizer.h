// SentencePiece-style BPE tokenizer built from a GGUF's own vocabulary (tokenizer.ggml.model
// "llama"): pieces with scores and byte-fallback tokens <0x00>..<0xFF>. Encoding works as
// SentencePiece and llama.cpp's SPM tokenizer do (and llama2.c's encode() in spirit): spaces become
// U+2581 '▁', a '▁' dummy prefix is added, the text is split into UTF-8 characters, and the
// adjacent pair whose concatenation is a vocabulary piece with the highest score is merged
// (leftmost first on ties) until no pair is a piece; characters left outside the vocabulary are
// emitted as their UTF-8 bytes' byte tokens.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvsim::model {

class GgufFile;

class Tokenizer {
  public:
    // SentencePiece token types (tokenizer.ggml.token_type).
    enum class TokenType : int32_t { NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6 };

    // Throws InputError naming the file and key for a missing or malformed vocabulary (empty, over
    // 2^31 pieces, a score that is not a finite float32, a token type outside 0..6, a special
    // token id outside the vocabulary).
    static Tokenizer from_gguf(const GgufFile& file);
    static Tokenizer load(const std::string& gguf_path);

    // Token ids for text, preceded by BOS when add_bos. Any bytes are fine (invalid UTF-8 goes
    // through byte fallback); text whose tokenization would need more than the memory limit
    // (encode_bytes_needed) or has 2^31 bytes or more throws InputError.
    std::vector<int> encode(std::string_view text, bool add_bos) const;
    // Bytes encode() may hold for a text of text_bytes bytes, for checking a plan up front.
    static uint64_t encode_bytes_needed(uint64_t text_bytes);
    // One token's text: '▁' becomes a space, a byte token its byte, control tokens (BOS, EOS) "".
    std::string decode(int token) const;
    // A sequence's text as encode() produced it: pieces concatenated, '▁' as spaces, control tokens
    // skipped, and the dummy-prefix space in front removed, so decode(encode(s, b)) == s.
    std::string decode(const std::vector<int>& tokens) const;

    int vocab_size() const { return static_cast<int>(pieces_.size()); }
    int bos_id() const { return bos_id_; }
    int eos_id() const { return eos_id_; }
    const std::string& piece(int token) const { return pieces_.at(static_cast<size_t>(token)); }
    float score(int token) const { return scores_.at(static_cast<size_t>(token)); }
    TokenType type(int token) const { return types_.at(static_cast<size_t>(token)); }

  private:
    std::vector<std::string> pieces_;
    std::vector<float> scores_;
    std::vector<TokenType> types_;
    std::unordered_map<std::string, int> text_piece_ids_;  // normal and user-defined pieces only
    std::array<int, 256> byte_token_ids_{};                // byte -> <0xHH> token (unknown id if absent)
    int bos_id_ = 1, eos_id_ = 2, unknown_id_ = 0;
    bool add_space_prefix_ = true;
};

}  // namespace kvsim::model
