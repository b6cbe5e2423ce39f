// The SentencePiece BPE tokenizer: merge order on a hand-made vocabulary, byte fallback, round
// trips, and agreement with the real stories260K vocabulary.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <random>

#include "base/errors.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/tokenizer.h"
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

TEST_CASE("tokenizer: a tokenizer other than SentencePiece 'llama' and byte-level 'gpt2' is refused, naming the key") {
    ScratchDir scratch;
    GgufWriter writer;
    writer.set_string("tokenizer.ggml.model", "bert");
    writer.set_string_array("tokenizer.ggml.tokens", {"a"});
    const std::string path = scratch.file("bert_tokenizer.gguf");
    writer.write(path);
    CHECK_THROWS_WITH_AS(Tokenizer::load(path),
                         (path + ": metadata key 'tokenizer.ggml.model': tokenizer 'bert' is not supported (only "
                                 "'llama', SentencePiece BPE, and 'gpt2', byte-level BPE)").c_str(),
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

TEST_CASE("tokenizer: scores and token types out of range are refused, naming the key and the entry") {
    ScratchDir scratch;
    const std::string path = write_vocabulary(scratch, "good.gguf", {{"ab", -1.0f}, {"abc", -2.0f}});
    const GgufFile good = GgufFile::open(path);
    const auto error_with = [&](const std::string& key, GgufValue value) {
        GgufWriter writer;
        for (const auto& [name, existing] : good.metadata()) writer.set(name, name == key ? value : existing);
        const std::string broken = scratch.file("broken.gguf");
        writer.write(broken);
        try {
            Tokenizer::load(broken);
        } catch (const kvsim::InputError& error) {
            const std::string message = error.what();
            CHECK(message.find(broken + ": metadata key '" + key + "': ") == 0);
            return message.substr(broken.size() + 2);
        }
        FAIL("no InputError for " << key);
        return std::string();
    };
    const auto replaced = [&](const std::string& key, size_t index, GgufValue item) {
        GgufArray array = good.at(key).as_array();
        array.items[index] = item;
        return GgufValue{array};
    };
    const auto all_of_type = [&](GgufValueType type, GgufValue item) {
        return GgufValue{GgufArray{type, std::vector<GgufValue>(good.at("tokenizer.ggml.tokens").as_array().items.size(), item)}};
    };
    const float nan = std::numeric_limits<float>::quiet_NaN();
    // A NaN score breaks the merge queue's ordering; a score beyond float's range does not convert.
    CHECK(error_with("tokenizer.ggml.scores", replaced("tokenizer.ggml.scores", 260, GgufValue{nan})) ==
          "metadata key 'tokenizer.ggml.scores': entry 260 is nan, expected a finite float32");
    CHECK(error_with("tokenizer.ggml.scores", all_of_type(GgufValueType::FLOAT64, GgufValue{1e300})) ==
          "metadata key 'tokenizer.ggml.scores': entry 0 is 1e+300, expected a finite float32");
    // A type outside 0..6 (or not a whole number) would be cast to a TokenType that does not exist.
    CHECK(error_with("tokenizer.ggml.token_type", replaced("tokenizer.ggml.token_type", 5, GgufValue{int32_t{99}})) ==
          "metadata key 'tokenizer.ggml.token_type': entry 5 is 99, expected a token type from 0 to 6");
    CHECK(error_with("tokenizer.ggml.token_type", replaced("tokenizer.ggml.token_type", 0, GgufValue{int32_t{-1}})) ==
          "metadata key 'tokenizer.ggml.token_type': entry 0 is -1, expected a token type from 0 to 6");
    CHECK(error_with("tokenizer.ggml.token_type", all_of_type(GgufValueType::FLOAT64, GgufValue{1e20})) ==
          "metadata key 'tokenizer.ggml.token_type': entry 0 is 1e+20, expected a token type from 0 to 6");
    CHECK(error_with("tokenizer.ggml.token_type", all_of_type(GgufValueType::FLOAT32, GgufValue{2.5f})) ==
          "metadata key 'tokenizer.ggml.token_type': entry 0 is 2.5, expected a token type from 0 to 6");
    CHECK(error_with("tokenizer.ggml.tokens", GgufValue{GgufArray{GgufValueType::STRING, {}}}) ==
          "metadata key 'tokenizer.ggml.tokens': empty vocabulary");
}

TEST_CASE("tokenizer: any bytes encode to ids in the vocabulary and decode back exactly") {
    ScratchDir scratch;
    const Tokenizer tokenizer = Tokenizer::load(write_vocabulary(scratch, "v.gguf", {{"ab", -1.0f}, {"\xC3\xA9", -1.0f}}));
    std::mt19937 random(5);
    std::vector<std::string> texts = {"\xFF", "\xC3", "ab\xE2\x96", "\x80\x80\x80", "\xF0\x9F\x99", std::string(3, '\0'),
                                      "\xC0\xAF\xED\xA0\x80\xF4\x90\x80\x80"};
    for (int i = 0; i < 200; ++i) {
        std::string text(random() % 64, '\0');
        for (char& byte : text) byte = static_cast<char>(random() % 256);
        if (text.find(kSpace) == std::string::npos) texts.push_back(text);  // a literal '▁' decodes as a space
    }
    for (const std::string& text : texts) {
        CAPTURE(text);
        const std::vector<int> ids = tokenizer.encode(text, true);
        CHECK(std::all_of(ids.begin(), ids.end(), [&](int id) { return id >= 0 && id < tokenizer.vocab_size(); }));
        CHECK(tokenizer.decode(ids) == text);
    }
}

TEST_CASE("tokenizer: a text whose tokenization needs more than the memory limit is refused") {
    ScratchDir scratch;
    const Tokenizer tokenizer = Tokenizer::load(write_vocabulary(scratch, "v.gguf", {{"ab", -1.0f}}));
    const std::string text(100000, 'a');
    CHECK(tokenizer.encode(text, false).size() == 100003);  // '▁' as three byte tokens, then every 'a'
    const MemoryLimit limit(1 << 20);
    CHECK_THROWS_WITH_AS(tokenizer.encode(text, false),
                         "tokenizing 100000 bytes of text needs 10.7 MiB, over the memory limit of 1.0 MiB (--max-memory)",
                         kvsim::InputError);
}
