// Byte-level BPE ("gpt2" GGUF tokenizers): the pre-tokenizers' splits worked out by hand from their
// patterns, merge order on hand-made vocabularies, special tokens, BOS, byte-exact round trips and
// one-line refusals of vocabularies kvsim cannot use.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "base/errors.h"
#include "model/bpe_pre_tokenizer.h"
#include "model/gguf_writer.h"
#include "model/tokenizer.h"
#include "tests/model/bpe_vocabulary.h"
#include "tests/model/test_util.h"

using namespace kvsim::model;
using namespace kvsim::model::testing;

namespace {

using Words = std::vector<std::string>;

Words split(const std::string& text, PreTokenizer kind) {
    Words words;
    for (const std::string_view word : pre_tokenize(text, kind)) words.emplace_back(word);
    return words;
}

Tokenizer load(const ScratchDir& scratch, const BpeVocabulary& vocabulary, const std::string& name = "bpe.gguf") {
    const std::string path = scratch.file(name);
    vocabulary.write(path);
    return Tokenizer::load(path);
}

Words pieces_of(const Tokenizer& tokenizer, const std::vector<int>& ids) {
    Words pieces;
    for (const int id : ids) pieces.push_back(tokenizer.piece(id));
    return pieces;
}

// The InputError message load() throws for a vocabulary.
std::string refusal(const ScratchDir& scratch, const BpeVocabulary& vocabulary) {
    const std::string path = scratch.file("bad.gguf");
    vocabulary.write(path);
    try {
        Tokenizer::load(path);
    } catch (const kvsim::InputError& error) {
        return error.what();
    }
    return "(no error)";
}

// A few English merges, enough for multi-byte tokens in the round trips.
BpeVocabulary english_vocabulary(const std::string& pre) {
    BpeVocabulary vocabulary;
    vocabulary.pre = pre;
    vocabulary.merges = {"Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "e r", "Ġ s", "r e", "a n", "Ġ w", "in g",
                         "Ġ o", "e d", "o u", "Ġ b", "Ċ Ċ", "Ġ Ġ", "1 2", "Ã ¯"};
    return vocabulary;
}

const Words kPreTokenizerNames = {"gpt-2", "llama-bpe", "qwen2", "smollm"};

}  // namespace

TEST_CASE("pre-tokenizer names: the four kvsim implements and llama.cpp's aliases for them") {
    CHECK(pre_tokenizer_named("gpt-2") == PreTokenizer::Gpt2);
    CHECK(pre_tokenizer_named("llama-bpe") == PreTokenizer::Llama3);
    CHECK(pre_tokenizer_named("llama3") == PreTokenizer::Llama3);
    CHECK(pre_tokenizer_named("qwen2") == PreTokenizer::Qwen2);
    CHECK(pre_tokenizer_named("smollm") == PreTokenizer::SmolLM);
    CHECK_FALSE(pre_tokenizer_named("tekken").has_value());
    CHECK_FALSE(pre_tokenizer_named("").has_value());
}

TEST_CASE("gpt-2 pre-tokenizer: contractions are lower case only, a space joins the word after it") {
    const auto gpt2 = PreTokenizer::Gpt2;
    CHECK(split("Hello world", gpt2) == Words{"Hello", " world"});
    CHECK(split("don't", gpt2) == Words{"don", "'t"});
    CHECK(split("DON'T", gpt2) == Words{"DON", "'", "T"});  // 'T is not a contraction here
    CHECK(split("we're I'll you've", gpt2) == Words{"we", "'re", " I", "'ll", " you", "'ve"});
    CHECK(split(" 's", gpt2) == Words{" '", "s"});
    CHECK(split("12345", gpt2) == Words{"12345"});
    CHECK(split("abc 12345", gpt2) == Words{"abc", " 12345"});
    CHECK(split("x\xC2\xB2", gpt2) == Words{"x", "\xC2\xB2"});  // '²' is a number (No), not a letter
    // A run of spaces leaves its last one to the next word; at the end it stays whole.
    CHECK(split("a  b", gpt2) == Words{"a", " ", " b"});
    CHECK(split("a   ", gpt2) == Words{"a", "   "});
    CHECK(split("a\t b", gpt2) == Words{"a", "\t", " b"});
    CHECK(split("a\tb", gpt2) == Words{"a", "\t", "b"});
    // Only an ASCII space joins: a newline stays apart from the word after it.
    CHECK(split("a\n\nb", gpt2) == Words{"a", "\n", "\n", "b"});
    CHECK(split("na\xC3\xAFve caf\xC3\xA9", gpt2) == Words{"na\xC3\xAFve", " caf\xC3\xA9"});  // naïve café
    CHECK(split("\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E", gpt2) == Words{"\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E"});  // 日本語
    // Emoji and punctuation are neither letters, numbers nor spaces: one run.
    CHECK(split("hi \xF0\x9F\x91\x8D\xF0\x9F\x91\x8D!", gpt2) == Words{"hi", " \xF0\x9F\x91\x8D\xF0\x9F\x91\x8D!"});
    CHECK(split("'hello", gpt2) == Words{"'", "hello"});
    // Invalid UTF-8 bytes are "other" characters, so they still come back byte for byte.
    CHECK(split("a\xFF\xFE b", gpt2) == Words{"a", "\xFF\xFE", " b"});
    CHECK(split("", gpt2).empty());
}

TEST_CASE("llama-bpe pre-tokenizer: any-case contractions, digits in threes, one leading symbol joins a word") {
    const auto llama3 = PreTokenizer::Llama3;
    CHECK(split("don't", llama3) == Words{"don", "'t"});
    CHECK(split("DON'T I'M", llama3) == Words{"DON", "'T", " I", "'M"});
    CHECK(split("12345", llama3) == Words{"123", "45"});
    CHECK(split(" 12345", llama3) == Words{" ", "123", "45"});  // a space never joins a number
    CHECK(split("a  b", llama3) == Words{"a", " ", " b"});
    CHECK(split("a   ", llama3) == Words{"a", "   "});
    // Whitespace up to its last line break is one word; a tab or a quote joins the letters after it.
    CHECK(split("a\n\nb", llama3) == Words{"a", "\n\n", "b"});
    CHECK(split("a \n b", llama3) == Words{"a", " \n", " b"});
    CHECK(split("a\tb", llama3) == Words{"a", "\tb"});
    CHECK(split("'hello", llama3) == Words{"'hello"});
    // Punctuation takes the line breaks straight after it.
    CHECK(split("end.\n\nNext", llama3) == Words{"end", ".\n\n", "Next"});
    CHECK(split("$100", llama3) == Words{"$", "100"});
    CHECK(split("na\xC3\xAFve caf\xC3\xA9", llama3) == Words{"na\xC3\xAFve", " caf\xC3\xA9"});
    CHECK(split("\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E", llama3) == Words{"\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E"});
    CHECK(split("hi \xF0\x9F\x91\x8D\xF0\x9F\x91\x8D!", llama3) == Words{"hi", " \xF0\x9F\x91\x8D\xF0\x9F\x91\x8D!"});
    // An emoji is a symbol, so it joins a word after it.
    CHECK(split("\xF0\x9F\x91\x8Dok", llama3) == Words{"\xF0\x9F\x91\x8Dok"});
}

TEST_CASE("qwen2 pre-tokenizer: llama-bpe's pattern with every digit on its own") {
    const auto qwen2 = PreTokenizer::Qwen2;
    CHECK(split("12345", qwen2) == Words{"1", "2", "3", "4", "5"});
    CHECK(split(" 12345", qwen2) == Words{" ", "1", "2", "3", "4", "5"});
    CHECK(split("DON'T", qwen2) == Words{"DON", "'T"});
    CHECK(split("a\n\nb", qwen2) == Words{"a", "\n\n", "b"});
    CHECK(split("a  b", qwen2) == Words{"a", " ", " b"});
    CHECK(split("\xD9\xA3\xD9\xA4", qwen2) == Words{"\xD9\xA3", "\xD9\xA4"});  // Arabic-Indic digits ٣٤
}

TEST_CASE("smollm pre-tokenizer: digits split off first, then gpt-2's pattern between them") {
    const auto smollm = PreTokenizer::SmolLM;
    CHECK(split("12345", smollm) == Words{"1", "2", "3", "4", "5"});
    // The space before a number is cut off with the text before it, so it stands alone.
    CHECK(split("abc 12345", smollm) == Words{"abc", " ", "1", "2", "3", "4", "5"});
    CHECK(split("12 apples", smollm) == Words{"1", "2", " apples"});
    CHECK(split("v2.0", smollm) == Words{"v", "2", ".", "0"});
    CHECK(split("don't DON'T", smollm) == Words{"don", "'t", " DON", "'", "T"});
    CHECK(split("a  b", smollm) == Words{"a", " ", " b"});
    CHECK(split("a\n\nb", smollm) == Words{"a", "\n", "\n", "b"});
    CHECK(split("na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E", smollm) ==
          Words{"na\xC3\xAFve", " \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E"});
}

TEST_CASE("every pre-tokenizer covers random bytes exactly, in order, with no empty word") {
    std::mt19937 random(42);
    const std::string alphabet[] = {"a", "Z", " ", "  ", "\n", "\r\n", "\t", "'", "'s", "'LL", "1", "42", ".", "!",
                                    "\xC3\xAF", "\xE6\x97\xA5", "\xF0\x9F\x91\x8D", "\xFF", "\xC3", "\xE2\x80\x83"};
    for (const PreTokenizer kind : {PreTokenizer::Gpt2, PreTokenizer::Llama3, PreTokenizer::Qwen2, PreTokenizer::SmolLM}) {
        for (int trial = 0; trial < 200; ++trial) {
            std::string text;
            const int parts = static_cast<int>(random() % 30);
            for (int i = 0; i < parts; ++i) text += alphabet[random() % std::size(alphabet)];
            std::string joined;
            for (const std::string_view word : pre_tokenize(text, kind)) {
                REQUIRE_FALSE(word.empty());
                joined += word;
            }
            REQUIRE(joined == text);
        }
    }
}

TEST_CASE("byte-level BPE: with no merges every byte is its own token, spelt through GPT-2's table") {
    ScratchDir scratch;
    BpeVocabulary vocabulary;
    const Tokenizer tokenizer = load(scratch, vocabulary);
    CHECK(tokenizer.model() == Tokenizer::Model::ByteLevelBpe);
    CHECK(tokenizer.encode("a b", false) == std::vector<int>{'a', ' ', 'b'});
    CHECK(tokenizer.piece(' ') == "\xC4\xA0");   // 'Ġ', U+0120
    CHECK(tokenizer.piece('\n') == "\xC4\x8A");  // 'Ċ', U+010A
    CHECK(tokenizer.piece(0xAD) == "\xC5\x83");  // soft hyphen, the last remapped byte: U+0143
    std::string every_byte;
    for (int byte = 0; byte < 256; ++byte) every_byte += static_cast<char>(byte);
    CHECK(tokenizer.decode(tokenizer.encode(every_byte, false)) == every_byte);
    for (int byte = 0; byte < 256; ++byte) CHECK(tokenizer.decode(byte) == std::string(1, static_cast<char>(byte)));
}

TEST_CASE("byte-level BPE: the merge with the lowest rank goes first, so the order of merges decides") {
    ScratchDir scratch;
    BpeVocabulary ab_first;
    ab_first.merges = {"a b", "b c"};
    const Tokenizer a = load(scratch, ab_first, "ab.gguf");
    CHECK(pieces_of(a, a.encode("abc", false)) == Words{"ab", "c"});

    BpeVocabulary bc_first;
    bc_first.merges = {"b c", "a b"};
    const Tokenizer b = load(scratch, bc_first, "bc.gguf");
    CHECK(pieces_of(b, b.encode("abc", false)) == Words{"a", "bc"});

    // Merges build on merges; equal ranks go leftmost first.
    BpeVocabulary layered;
    layered.merges = {"a a", "aa b", "Ġ aab"};
    const Tokenizer c = load(scratch, layered, "layered.gguf");
    CHECK(pieces_of(c, c.encode("aaa", false)) == Words{"aa", "a"});
    CHECK(pieces_of(c, c.encode("x aab", false)) == Words{"x", "\xC4\xA0" "aab"});
    CHECK(pieces_of(c, c.encode("aaab", false)) == Words{"aa", "a", "b"});
    // A merge never crosses a word: "a" and " a" stay apart, and "Ġ a" is no merge here.
    CHECK(pieces_of(c, c.encode("a a", false)) == Words{"a", "\xC4\xA0", "a"});
}

TEST_CASE("byte-level BPE: llama-bpe takes a word that is a whole token as it is, as llama.cpp does") {
    ScratchDir scratch;
    BpeVocabulary vocabulary;
    vocabulary.merges = {"a b"};
    vocabulary.extra_tokens = {"abc"};  // reachable by no merge
    vocabulary.pre = "gpt-2";
    const Tokenizer gpt2 = load(scratch, vocabulary, "gpt2.gguf");
    CHECK(pieces_of(gpt2, gpt2.encode("abc", false)) == Words{"ab", "c"});
    vocabulary.pre = "llama-bpe";
    const Tokenizer llama3 = load(scratch, vocabulary, "llama3.gguf");
    CHECK(pieces_of(llama3, llama3.encode("abc", false)) == Words{"abc"});
    CHECK(pieces_of(llama3, llama3.encode("abcd", false)) == Words{"ab", "c", "d"});
}

TEST_CASE("byte-level BPE: control tokens only when parse_special, user-defined tokens always") {
    ScratchDir scratch;
    BpeVocabulary vocabulary;
    vocabulary.pre = "qwen2";
    vocabulary.specials = {{"<|im_start|>", 3}, {"<|im_end|>", 3}, {"<tool>", 4}};
    const Tokenizer tokenizer = load(scratch, vocabulary);
    const int im_start = vocabulary.id_of("<|im_start|>"), im_end = vocabulary.id_of("<|im_end|>");
    const int tool = vocabulary.id_of("<tool>");
    const std::string text = "<|im_start|>user\nhi<tool><|im_end|>";

    const std::vector<int> plain = tokenizer.encode(text, false);
    CHECK(std::count(plain.begin(), plain.end(), im_start) == 0);
    CHECK(std::count(plain.begin(), plain.end(), im_end) == 0);
    CHECK(std::count(plain.begin(), plain.end(), tool) == 1);
    CHECK(tokenizer.decode(plain) == text);

    const std::vector<int> parsed = tokenizer.encode(text, false, /*parse_special=*/true);
    CHECK(pieces_of(tokenizer, parsed) == Words{"<|im_start|>", "u", "s", "e", "r", "\xC4\x8A", "h", "i", "<tool>",
                                                "<|im_end|>"});
    // Control tokens decode to nothing; user-defined ones to their text.
    CHECK(tokenizer.decode(parsed) == "user\nhi<tool>");
}

TEST_CASE("byte-level BPE: BOS as tokenizer.ggml.add_bos_token says, else llama.cpp's default per pre-tokenizer") {
    ScratchDir scratch;
    BpeVocabulary vocabulary;
    const int bos = vocabulary.id_of("<|endoftext|>");
    for (const std::string& pre : kPreTokenizerNames) {
        vocabulary.pre = pre;
        vocabulary.add_bos_token.reset();
        const Tokenizer by_default = load(scratch, vocabulary, pre + "-default.gguf");
        const bool llama3 = pre == "llama-bpe";
        CHECK(by_default.add_bos_token() == llama3);
        CHECK(by_default.encode("x", true) == (llama3 ? std::vector<int>{bos, 'x'} : std::vector<int>{'x'}));
        CHECK(by_default.encode("x", false) == std::vector<int>{'x'});
        for (const bool add : {false, true}) {
            vocabulary.add_bos_token = add;
            const Tokenizer told = load(scratch, vocabulary, pre + (add ? "-bos.gguf" : "-nobos.gguf"));
            CHECK(told.encode("x", true) == (add ? std::vector<int>{bos, 'x'} : std::vector<int>{'x'}));
            CHECK(told.decode(told.encode("x", true)) == "x");
        }
    }
}

TEST_CASE("byte-level BPE: decode(encode(text)) is byte-exact for every pre-tokenizer") {
    ScratchDir scratch;
    std::vector<std::string> texts = {"", " ", "  leading and trailing  ", "don't DON'T 12345\n\n\ttabs\r\nCRLF",
                                      "na\xC3\xAFve caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x91\x8D",
                                      "bad \xFF\xC3 utf-8 \xED\xA0\x80 surrogate", "<|endoftext|> is plain text here"};
    const std::filesystem::path text_dir = shared_dir() / "text";
    if (std::filesystem::is_directory(text_dir)) {
        for (const auto& entry : std::filesystem::directory_iterator(text_dir)) {
            std::ifstream in(entry.path(), std::ios::binary);
            std::ostringstream contents;
            contents << in.rdbuf();
            texts.push_back(contents.str());
        }
    } else {
        MESSAGE("SKIPPED the shared text files: " << text_dir.string() << " is absent");
    }
    for (const std::string& pre : kPreTokenizerNames) {
        const Tokenizer tokenizer = load(scratch, english_vocabulary(pre), pre + ".gguf");
        for (const std::string& text : texts) {
            const std::vector<int> tokens = tokenizer.encode(text, true);
            CHECK(tokenizer.decode(tokens) == text);
            if (text.size() > 1000) CHECK(tokens.size() < text.size());  // the merges do shorten English
        }
    }
}

TEST_CASE("byte-level BPE: an unknown model or pre-tokenizer, a bad merge or a missing byte is one line naming it") {
    ScratchDir scratch;
    const auto one_line = [](const std::string& message) { return message.find('\n') == std::string::npos; };

    BpeVocabulary unknown_pre;
    unknown_pre.pre = "tekken";
    std::string message = refusal(scratch, unknown_pre);
    CHECK(message.find("'tokenizer.ggml.pre'") != std::string::npos);
    CHECK(message.find("'tekken'") != std::string::npos);
    CHECK(one_line(message));

    {
        GgufWriter writer;
        BpeVocabulary{}.write_to(writer);
        writer.set_string("tokenizer.ggml.model", "bert");
        writer.write(scratch.file("bert.gguf"));
        try {
            Tokenizer::load(scratch.file("bert.gguf"));
            FAIL("a 'bert' tokenizer was accepted");
        } catch (const kvsim::InputError& error) {
            message = error.what();
        }
        CHECK(message.find("'tokenizer.ggml.model'") != std::string::npos);
        CHECK(message.find("'bert'") != std::string::npos);
        CHECK(one_line(message));
    }
    {
        GgufWriter writer;
        BpeVocabulary{}.write_to(writer);
        writer.remove("tokenizer.ggml.pre");
        writer.write(scratch.file("no-pre.gguf"));
        CHECK_THROWS_WITH_AS(Tokenizer::load(scratch.file("no-pre.gguf")),
                             doctest::Contains("'tokenizer.ggml.pre'"), kvsim::InputError);
    }

    // The helper adds every merge's result to the vocabulary, so these are edited in afterwards.
    const auto with_merges = [&](const std::vector<std::string>& merges) {
        GgufWriter writer;
        BpeVocabulary{}.write_to(writer);
        writer.set_string_array("tokenizer.ggml.merges", merges);
        writer.write(scratch.file("merges.gguf"));
        try {
            Tokenizer::load(scratch.file("merges.gguf"));
        } catch (const kvsim::InputError& error) {
            return std::string(error.what());
        }
        return std::string("(no error)");
    };
    message = with_merges({"a b", "xyz q"});
    CHECK(message.find("'tokenizer.ggml.merges': entry 0 'a b' makes 'ab', which is not in the vocabulary") !=
          std::string::npos);
    BpeVocabulary has_ab;
    has_ab.merges = {"a b"};
    {
        GgufWriter writer;
        has_ab.write_to(writer);
        writer.set_string_array("tokenizer.ggml.merges", {"a b", "xyz q"});
        writer.write(scratch.file("unknown-left.gguf"));
        CHECK_THROWS_WITH_AS(Tokenizer::load(scratch.file("unknown-left.gguf")),
                             doctest::Contains("entry 1 'xyz q' names 'xyz', which is not in the vocabulary"),
                             kvsim::InputError);
    }
    message = with_merges({"ab"});
    CHECK(message.find("entry 0 'ab' is not two tokens separated by a space") != std::string::npos);
    CHECK(one_line(message));

    {
        GgufWriter writer;
        BpeVocabulary{}.write_to(writer);
        std::vector<std::string> tokens = BpeVocabulary{}.tokens();
        tokens[' '] = "space";  // byte 0x20 loses its token 'Ġ'
        writer.set_string_array("tokenizer.ggml.tokens", tokens);
        writer.write(scratch.file("no-space.gguf"));
        CHECK_THROWS_WITH_AS(Tokenizer::load(scratch.file("no-space.gguf")), doctest::Contains("no token for byte 0x20"),
                             kvsim::InputError);
    }
}
