// The tokenizer a GGUF carries, built from its own vocabulary. Two kinds (tokenizer.ggml.model):
//
// "llama", SentencePiece-style BPE: pieces with scores and byte-fallback tokens <0x00>..<0xFF>. Encoding works as
// SentencePiece and llama.cpp's SPM tokenizer do (and llama2.c's encode() in spirit): spaces become
// U+2581 '▁', a '▁' dummy prefix is added, the text is split into UTF-8 characters, and the
// adjacent pair whose concatenation is a vocabulary piece with the highest score is merged
// (leftmost first on ties) until no pair is a piece; characters left outside the vocabulary are
// emitted as their UTF-8 bytes' byte tokens.
//
// "gpt2", byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM): every byte is spelt as one printable
// character (GPT-2's byte-to-unicode table, so a space is 'Ġ'), the text is cut into words by the
// pre-tokenizer tokenizer.ggml.pre names (bpe_pre_tokenizer.h), and within each word the adjacent
// pair with the lowest rank in tokenizer.ggml.merges (its index there) is merged, leftmost first,
// until no pair has a merge. User-defined tokens in the text are always matched whole, control
// tokens (chat markers, BOS) only when parse_special asks, as llama.cpp does.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "model/bpe_pre_tokenizer.h"

namespace kvsim::model {

class GgufFile;

class Tokenizer {
  public:
    // SentencePiece token types (tokenizer.ggml.token_type).
    enum class TokenType : int32_t { NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6 };

    enum class Model { SentencePiece, ByteLevelBpe };

    // Throws InputError naming the file and key for a missing or malformed vocabulary (empty, over
    // 2^31 pieces, a score that is not a finite float32, a token type outside 0..6, a special
    // token id outside the vocabulary), an unsupported tokenizer model or pre-tokenizer, and for
    // byte-level BPE a merge naming a token not in the vocabulary or a byte with no token.
    static Tokenizer from_gguf(const GgufFile& file);
    static Tokenizer load(const std::string& gguf_path);

    // Token ids for text, preceded by BOS when add_bos and the model adds one
    // (tokenizer.ggml.add_bos_token; absent: yes for "llama" and Llama 3, no for other byte-level
    // BPE). parse_special matches control tokens written in the text (byte-level BPE only); plain
    // user text leaves it off. Any bytes are fine (invalid UTF-8 goes through byte fallback or byte
    // tokens); text whose tokenization would need more than the memory limit (encode_bytes_needed)
    // or has 2^31 bytes or more throws InputError.
    std::vector<int> encode(std::string_view text, bool add_bos, bool parse_special = false) const;
    // Bytes encode() may hold for a text of text_bytes bytes, for checking a plan up front.
    static uint64_t encode_bytes_needed(uint64_t text_bytes);
    // One token's bytes: '▁' becomes a space, a byte token its byte, a byte-level BPE piece its
    // bytes through the inverse byte table (user-defined pieces as written), control tokens (BOS,
    // EOS) "".
    std::string decode(int token) const;
    // A sequence's text as encode() produced it: tokens' bytes concatenated, control tokens skipped,
    // and SentencePiece's dummy-prefix space in front removed, so decode(encode(s, b)) == s.
    std::string decode(const std::vector<int>& tokens) const;
    // A token as llama.cpp's tokenize tool shows it (its token_to_piece with special tokens shown):
    // control, unknown and user-defined tokens as their text ("<s>"), normal and (SentencePiece)
    // byte tokens as decode() gives them, any other type as nothing.
    std::string shown_piece(int token) const;

    Model model() const { return model_; }
    bool add_bos_token() const { return add_bos_token_; }
    int vocab_size() const { return static_cast<int>(pieces_.size()); }
    int bos_id() const { return bos_id_; }
    int eos_id() const { return eos_id_; }
    const std::string& piece(int token) const { return pieces_.at(static_cast<size_t>(token)); }
    float score(int token) const { return scores_.at(static_cast<size_t>(token)); }
    TokenType type(int token) const { return types_.at(static_cast<size_t>(token)); }

  private:
    void load_sentencepiece();
    void load_byte_level_bpe(const GgufFile& file);
    void encode_sentencepiece(std::string_view text, std::vector<int>& tokens) const;
    void encode_byte_level_bpe(std::string_view text, bool parse_special, std::vector<int>& tokens) const;
    void encode_bpe_word(std::string_view word, std::vector<int>& tokens) const;

    Model model_ = Model::SentencePiece;
    std::vector<std::string> pieces_;
    std::vector<float> scores_;
    std::vector<TokenType> types_;
    std::unordered_map<std::string, int> text_piece_ids_;  // normal and user-defined pieces only
    // byte -> <0xHH> token (unknown id if absent); for byte-level BPE the token of its character.
    std::array<int, 256> byte_token_ids_{};
    int bos_id_ = 1, eos_id_ = 2, unknown_id_ = 0;  // -1: the vocabulary has none
    bool add_space_prefix_ = true;
    bool add_bos_token_ = true;

    // Byte-level BPE only.
    PreTokenizer pre_tokenizer_{};
    bool ignore_merges_ = false;  // Llama 3: a word that is a whole token is that token, merges or not
    struct Merge {
        int rank, merged;
    };
    std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> rank and result
    std::vector<int> special_ids_;                // control and user-defined tokens, longest first
};

}  // namespace kvsim::model
