// The SentencePiece BPE tokenizer: merge order on a hand-made vocabulary, byte fallback, round
// trips, and agreement with the real stories260K vocabulary.
#include <doctest/doctest.h>

#include <cstdio>

#include "base/errors.h"
#include "src/model/gguf.h"
#include "src/model/gguf_writer.h"
#include "src/model/tokenizer.h"
#include "tests/model/test_util.h"

using namespace kvsim::model;
using namespace kvsim::model::testing;

namespace {

const std::string kSpace = "\xE2\x96\x81";  // '▁'

// <unk> <s> </s>, the 256 byte tokens (ids 3..258), then `pieces` with their scores.
std::string write_vocabulary(const ScratchDir& scratch, const std::string& name,
                             const std::vector<std::pair<std::string, float>>& pieces, bool add_space_prefix = true) {
    std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
    std::vector<float> scores = {0, 0, 0};
    std::vector<int32_t> types = {2, 3, 3};
    for (int byte = 0; byte < 256; ++byte) {
        char piece[8];
        std::snprintf(piece, sizeof piece, "<0x%02X>", byte);
        tokens.push_back(piece);
        scores.push_back(0);
        types.push_back(6);
    }
    for (const auto& [piece, score] : pieces) {
        tokens.push_back(piece);
        scores.push_back(score);
        types.push_back(1);
    }
    GgufWriter writer;
    writer.set_string("tokenizer.ggml.model", "llama");
    writer.set_string_array("tokenizer.ggml.tokens", tokens);
    writer.set_float32_array("tokenizer.ggml.scores", scores);
    writer.set_int32_array("tokenizer.ggml.token_type", types);
    writer.set_uint32("tokenizer.ggml.bos_token_id", 1);
    writer.set_uint32("tokenizer.ggml.eos_token_id", 2);
    if (!add_space_prefix) writer.set("tokenizer.ggml.add_space_prefix", GgufValue{false});
    const std::string path = scratch.file(name);
    writer.write(path);
    return path;
}

std::vector<std::string> pieces_of(const Tokenizer& tokenizer, const std::vector<int>& ids) {
    std::vector<std::string> pieces;
    for (const int id : ids) pieces.push_back(tokenizer.piece(id));
    return pieces;
}

const std::vector<std::string> kRoundTripTexts = {
    "",
    "Once upon a time, there was a little girl named Lily.",
    "  two leading spaces, trailing space ",
    "tabs\tand\nnew lines\n\n and \"quotes\" (brackets) {braces} 1234567890 !@#$%^&*",
    "caf\xC3\xA9 na\xC3\xAFve \xE2\x80\x9Cquoted\xE2\x80\x9D \xE2\x80\x94 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x99\x82",
    "\xC3\x97\xC3\x97\xC3\x97 repeated multi-byte characters \xC3\x97",
};

}  // namespace

TEST_CASE("tokenizer: merges the highest-scoring pair first, leftmost on ties") {
    ScratchDir scratch;
    SUBCASE("score decides") {
        const Tokenizer tokenizer = Tokenizer::load(
            write_vocabulary(scratch, "v1.gguf", {{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -2}, {"bc", -1}}, false));
        CHECK(pieces_of(tokenizer, tokenizer.encode("abc", false)) == std::vector<std::string>{"a", "bc"});
    }
    SUBCASE("tie: leftmost pair") {
        const Tokenizer tokenizer = Tokenizer::load(
            write_vocabulary(scratch, "v2.gguf", {{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -1}, {"bc", -1}}, false));
        CHECK(pieces_of(tokenizer, tokenizer.encode("abc", false)) == std::vector<std::string>{"ab", "c"});
    }
    SUBCASE("merges chain into longer pieces; spaces are '▁' with a dummy prefix") {
        const Tokenizer tokenizer = Tokenizer::load(write_vocabulary(
            scratch, "v3.gguf",
            {{kSpace, -10}, {"a", -10}, {"b", -10}, {"c", -10}, {"ab", -3}, {"abc", -4}, {kSpace + "abc", -5}}));
        CHECK(pieces_of(tokenizer, tokenizer.encode("abc abc", false)) ==
              std::vector<std::string>{kSpace + "abc", kSpace + "abc"});
        CHECK(pieces_of(tokenizer, tokenizer.encode("abc", true)) == std::vector<std::string>{"<s>", kSpace + "abc"});
        CHECK(tokenizer.decode(tokenizer.encode("abc abc", true)) == "abc abc");
    }
    SUBCASE("byte fallback for characters outside the vocabulary") {
        const Tokenizer tokenizer = Tokenizer::load(write_vocabulary(scratch, "v4.gguf", {{"a", -1}}, false));
        // 'é' is C3 A9: byte tokens are 3 + byte.
        CHECK(tokenizer.encode("a\xC3\xA9", false) == std::vector<int>{259, 3 + 0xC3, 3 + 0xA9});
        CHECK(tokenizer.decode(3 + 0xC3) == "\xC3");
        CHECK(tokenizer.decode(std::vector<int>{259, 3 + 0xC3, 3 + 0xA9}) == "a\xC3\xA9");
    }
}

TEST_CASE("tokenizer: a tokenizer other than SentencePiece 'llama' is refused, naming the key") {
    ScratchDir scratch;
    GgufWriter writer;
    writer.set_string("tokenizer.ggml.model", "gpt2");
    writer.set_string_array("tokenizer.ggml.tokens", {"a"});
    const std::string path = scratch.file("gpt2_tokenizer.gguf");
    writer.write(path);
    CHECK_THROWS_WITH_AS(Tokenizer::load(path),
                         (path + ": metadata key 'tokenizer.ggml.model': tokenizer 'gpt2' is not supported (only "
                                 "'llama', SentencePiece BPE)").c_str(),
                         kvsim::InputError);
}

TEST_CASE("tokenizer: the synthetic model's vocabulary round-trips text") {
    ScratchDir scratch;
    LlamaConfig config = tiny_config();
    config.vocab_size = 1200;
    write_random_llama(scratch.file("tiny.gguf"), config, 1);
    const Tokenizer tokenizer = Tokenizer::load(scratch.file("tiny.gguf"));
    CHECK(tokenizer.vocab_size() == 1200);
    for (const std::string& text : kRoundTripTexts) {
        CAPTURE(text);
        CHECK(tokenizer.decode(tokenizer.encode(text, true)) == text);
    }
    CHECK(pieces_of(tokenizer, tokenizer.encode("hello", false)) ==
          std::vector<std::string>{kSpace + "h", "el", "lo"});
}

TEST_CASE("stories260K tokenizer: round trips, special ids, and the golden text's own tokens") {
    if (!have_stories260k()) return;
    const Tokenizer tokenizer = Tokenizer::load(stories260k_gguf().string());
    CHECK(tokenizer.vocab_size() == 512);
    CHECK(tokenizer.bos_id() == 1);
    CHECK(tokenizer.eos_id() == 2);
    CHECK(tokenizer.decode(1) == "");
    CHECK(tokenizer.decode(3 + '\n') == "\n");

    for (const std::string& text : kRoundTripTexts) {
        CAPTURE(text);
        const std::vector<int> tokens = tokenizer.encode(text, true);
        CHECK(tokens.front() == 1);
        CHECK(tokenizer.decode(tokens) == text);
    }

    // "Once upon a time" uses the vocabulary's whole-word pieces.
    CHECK(pieces_of(tokenizer, tokenizer.encode("Once upon a time", false)) ==
          std::vector<std::string>{kSpace + "Once", kSpace + "upon", kSpace + "a", kSpace + "time"});
    // Characters outside the 512-piece vocabulary fall back to bytes.
    const std::vector<int> emoji = tokenizer.encode("\xF0\x9F\x99\x82", false);
    CHECK(emoji.size() >= 4);
    CHECK(std::vector<int>(emoji.end() - 4, emoji.end()) == std::vector<int>{3 + 0xF0, 3 + 0x9F, 3 + 0x99, 3 + 0x82});
}
