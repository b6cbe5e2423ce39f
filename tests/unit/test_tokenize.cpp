// `kvsim tokenize` against llama.cpp's llama-tokenize, whose output below was recorded by hand
// (llama.cpp c392e50, `llama-tokenize -m M -p TEXT --log-disable [--ids] --no-parse-special
// --no-escape`), and Unicode NFC normalisation before tokenising (`--normalize nfc`).
#include <doctest/doctest.h>

#include <fstream>

#include "base/errors.h"
#include "helpers.h"
#include "model/gguf_writer.h"
#include "model/text_normalization.h"
#include "model/tokenizer.h"
#include "src/model_text.h"
#include "src/tokenize.h"
#include "tests/model/bpe_vocabulary.h"
#include "tests/model/test_util.h"

using namespace kvsim;

namespace {

// A random-weight Llama written by kvsim's writer with a byte-level BPE vocabulary and Qwen2's
// pre-tokenizer; "é" (bytes C3 A9, spelt "Ã©") is one token. The golden outputs below are
// llama-tokenize's on this very file: the ids follow from the merges' order.
std::string write_qwen2_model() {
    model::testing::BpeVocabulary vocabulary;
    vocabulary.pre = "qwen2";
    vocabulary.merges = {"Ġ t", "h e", "Ġt he", "Ã ©", "Ġ c", "a f", "Ġc af", "Ġcaf Ã©", "e n", "Ġ s", "o n", "1 2", "Ċ Ċ"};
    vocabulary.specials = {{"<|im_start|>", 3}};
    vocabulary.add_bos_token = false;  // as Qwen2's GGUFs say
    model::GgufWriter writer = model::random_llama_writer(model::testing::tiny_config(), 17);
    vocabulary.write_to(writer);
    const std::string path = test::temp_dir() + "/tokenize_qwen2.gguf";
    writer.write(path);
    return path;
}

std::string tokenize_prompt(const model::Tokenizer& tokenizer, const std::string& prompt, bool ids_only,
                            model::TextNormalization normalize = model::TextNormalization::none, bool add_bos = true) {
    TokenizeOptions options;
    options.prompt = prompt;
    options.ids_only = ids_only;
    options.normalize = normalize;
    options.add_bos = add_bos;
    return format_tokens(tokenizer, tokenize_input(tokenizer, options), ids_only);
}

}  // namespace

TEST_CASE("tokenize: stories260K's SentencePiece vocabulary prints as llama-tokenize prints it") {
    if (!model::testing::have_stories260k()) {
        MESSAGE("skipped: ../shared/models/stories260K is absent");
        return;
    }
    const model::Tokenizer tokenizer = model::Tokenizer::load(model::testing::stories260k_gguf().string());
    // BOS shown as its text, a piece's '▁' as a space, characters outside the vocabulary as their
    // bytes' tokens (each byte printed as it is), "é" a piece of its own.
    const std::string prompt = "Lily's cat, Tom, saw 3 big dogs: \"Woof!\" \xE6\x97\xA5\xE6\x9C\xAC \xC3\xA9";
    const std::string golden =
        "     1 -> '<s>'\n   317 -> ' Lily'\n   439 -> '''\n   419 -> 's'\n   280 -> ' c'\n   294 -> 'at'\n"
        "   432 -> ','\n   274 -> ' T'\n   287 -> 'om'\n   432 -> ','\n   394 -> ' saw'\n   410 -> ' '\n"
        "   472 -> '3'\n   370 -> ' big'\n   400 -> ' do'\n   428 -> 'g'\n   419 -> 's'\n   467 -> ':'\n"
        "   313 -> ' \"'\n   448 -> 'W'\n   347 -> 'oo'\n   431 -> 'f'\n   443 -> '!'\n   436 -> '\"'\n"
        "   410 -> ' '\n   233 -> '\xe6'\n   154 -> '\x97'\n   168 -> '\xa5'\n   233 -> '\xe6'\n   159 -> '\x9c'\n"
        "   175 -> '\xac'\n   410 -> ' '\n   485 -> '\xc3\xa9'\n";
    CHECK(tokenize_prompt(tokenizer, prompt, false) == golden);
    CHECK(tokenize_prompt(tokenizer, prompt, true) ==
          "[1, 317, 439, 419, 280, 294, 432, 274, 287, 432, 394, 410, 472, 370, 400, 428, 419, 467, 313, 448, 347, 431, "
          "443, 436, 410, 233, 154, 168, 233, 159, 175, 410, 485]\n");
    // llama-tokenize --ids --no-bos.
    CHECK(tokenize_prompt(tokenizer, "Once upon a time", true, model::TextNormalization::none, false) ==
          "[403, 407, 261, 378]\n");
}

TEST_CASE("tokenize: a Qwen2 byte-level BPE GGUF written by kvsim prints as llama-tokenize prints it") {
    const model::Tokenizer tokenizer = model::Tokenizer::load(write_qwen2_model());
    REQUIRE(!tokenizer.add_bos_token());
    // A decomposed é (e + U+0301, bytes CC 81), a blank line, digits one by one, a control token's
    // text that plain text does not match, spaces before a word.
    const std::string prompt = "The cafe\xCC\x81 sat.\n\n  then 123 <|im_start|> ok";
    const std::string golden =
        "    84 -> 'T'\n   257 -> 'he'\n   262 -> ' caf'\n   101 -> 'e'\n   204 -> '\xcc'\n   129 -> '\x81'\n"
        "   265 -> ' s'\n    97 -> 'a'\n   116 -> 't'\n    46 -> '.'\n   268 -> '\n\n'\n    32 -> ' '\n"
        "   258 -> ' the'\n   110 -> 'n'\n    32 -> ' '\n    49 -> '1'\n    50 -> '2'\n    51 -> '3'\n    32 -> ' '\n"
        "    60 -> '<'\n   124 -> '|'\n   105 -> 'i'\n   109 -> 'm'\n    95 -> '_'\n   115 -> 's'\n   116 -> 't'\n"
        "    97 -> 'a'\n   114 -> 'r'\n   116 -> 't'\n   124 -> '|'\n    62 -> '>'\n    32 -> ' '\n   111 -> 'o'\n"
        "   107 -> 'k'\n";
    CHECK(tokenize_prompt(tokenizer, prompt, false) == golden);
    CHECK(tokenize_prompt(tokenizer, prompt, true) ==
          "[84, 257, 262, 101, 204, 129, 265, 97, 116, 46, 268, 32, 258, 110, 32, 49, 50, 51, 32, 60, 124, 105, 109, 95, "
          "115, 116, 97, 114, 116, 124, 62, 32, 111, 107]\n");
    // llama-tokenize's "The café is 12 steps: the end" (é precomposed, C3 A9).
    CHECK(tokenize_prompt(tokenizer, "The caf\xC3\xA9 is 12 steps: the end", true) ==
          "[84, 257, 263, 32, 105, 115, 32, 49, 50, 265, 116, 101, 112, 115, 58, 258, 32, 264, 100]\n");
    // A control token is shown as its text, as llama-tokenize shows one it parsed.
    CHECK(format_tokens(tokenizer, {tokenizer.bos_id()}, false) == "   269 -> '<|endoftext|>'\n");
}

TEST_CASE("tokenize: --text reads a file as capture does, and --prompt with --text is refused naming both") {
    const model::Tokenizer tokenizer = model::Tokenizer::load(write_qwen2_model());
    const std::string path = test::temp_dir() + "/tokenize_text.txt";
    std::ofstream(path, std::ios::binary) << "\n  The end\n\n";
    TokenizeOptions options;
    options.text_path = path;
    CHECK(tokenize_input(tokenizer, options) == tokenizer.encode("The end", true));
    options.prompt = "x";
    CHECK_THROWS_WITH_AS(tokenize_input(tokenizer, options), doctest::Contains("--prompt and --text"), InputError);
    options.prompt.reset();
    options.text_path = test::temp_dir() + "/no_such_text.txt";
    CHECK_THROWS_WITH_AS(tokenize_input(tokenizer, options), doctest::Contains("no_such_text.txt"), InputError);
}

TEST_CASE("NFC: decomposed text composes, NFC text and bytes that are not UTF-8 stay as they are") {
    CHECK(model::normalize_nfc("cafe\xCC\x81", "t") == "caf\xC3\xA9");                    // e + U+0301 -> é
    CHECK(model::normalize_nfc("A\xCC\x8A\xCC\x81", "t") == "\xC7\xBA");                  // A + ring + acute -> U+01FA
    CHECK(model::normalize_nfc("\xEF\xAC\x81 caf\xC3\xA9", "t") == "\xEF\xAC\x81 caf\xC3\xA9");  // NFC, not NFKC: ﬁ stays
    CHECK(model::normalize_nfc("e\xCC\x81\xFF\xC3 x\xE0\x80\x80", "t") == "\xC3\xA9\xFF\xC3 x\xE0\x80\x80");
    CHECK(model::normalize_nfc("", "t").empty());
    CHECK(model::text_normalization_named("nfc") == model::TextNormalization::nfc);
    CHECK(model::text_normalization_named("none") == model::TextNormalization::none);
    CHECK(!model::text_normalization_named("NFKC"));
}

TEST_CASE("NFC: a decomposed é on a Qwen2 model is one token with --normalize nfc, as Hugging Face gives it") {
    const model::Tokenizer tokenizer = model::Tokenizer::load(write_qwen2_model());
    const std::string decomposed = "cafe\xCC\x81";
    // none: the bytes as they are (llama.cpp): e, then U+0301's two bytes.
    CHECK(tokenize_prompt(tokenizer, decomposed, true) == "[99, 261, 101, 204, 129]\n");
    // nfc: the tokens llama-tokenize gives the precomposed "café".
    CHECK(tokenize_prompt(tokenizer, decomposed, true, model::TextNormalization::nfc) == "[99, 261, 259]\n");
    CHECK(encode_text(tokenizer, decomposed, model::TextNormalization::nfc, true, "t") ==
          tokenizer.encode("caf\xC3\xA9", true));
}
