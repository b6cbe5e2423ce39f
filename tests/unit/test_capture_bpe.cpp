// `kvsim capture` on a GGUF whose tokenizer is byte-level BPE ("gpt2"): a random-weight Llama
// written by kvsim's GGUF writer, its SentencePiece vocabulary swapped for a hand-made byte-level one.
#include <doctest/doctest.h>

#include <fstream>

#include "helpers.h"
#include "src/capture.h"
#include "model/gguf_writer.h"
#include "model/tokenizer.h"
#include "tests/model/bpe_vocabulary.h"
#include "tests/model/test_util.h"

using namespace kvsim;

TEST_CASE("capture: a random-weight llama GGUF with a gpt2 tokenizer captures end to end, tokens as the tokenizer gives them") {
    const std::string text_path = test::temp_dir() + "/bpe_capture_text.txt";
    const std::string text = "Don't stop: 12345 steps.\n\nThe end.|na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x91\x8D";
    std::ofstream(text_path, std::ios::binary) << text;
    for (const std::string pre : {"llama-bpe", "qwen2", "gpt-2", "smollm"}) {
        CAPTURE(pre);
        model::testing::BpeVocabulary vocabulary;
        vocabulary.pre = pre;
        vocabulary.merges = {"Ġ t", "h e", "Ġt he", "e n", "Ġ s", "o n", "1 2"};
        vocabulary.specials = {{"<|eot_id|>", 3}};
        // One embedding row per token, as in the files llama.cpp's converter writes (llama.cpp
        // refuses an embedding whose rows differ from the token list).
        model::LlamaConfig config = model::testing::tiny_config();
        config.vocab_size = static_cast<int>(vocabulary.tokens().size());
        model::GgufWriter writer = model::random_llama_writer(config, 17);
        vocabulary.write_to(writer);
        const std::string model_path = test::temp_dir() + "/bpe_capture_" + pre + ".gguf";
        writer.write(model_path);

        CaptureOptions options;
        options.input = {model_path, text_path, "|", 0, 0};
        options.output_path = test::temp_dir() + "/bpe_capture_" + pre + ".h5";
        const CaptureSummary summary = capture_trace(options);
        CHECK(summary.sequences == 2);

        const model::Tokenizer tokenizer = model::Tokenizer::load(model_path);
        CHECK(tokenizer.add_bos_token() == (pre == "llama-bpe"));
        TraceReader trace(options.output_path);
        REQUIRE(trace.sequences().size() == 2);
        const std::string parts[] = {text.substr(0, text.find('|')), text.substr(text.find('|') + 1)};
        for (int s = 0; s < 2; ++s) {
            const std::vector<int> expected = tokenizer.encode(parts[s], /*add_bos=*/true);
            const std::vector<int32_t> stored = trace.read_tokens(s);
            CHECK(std::vector<int>(stored.begin(), stored.end()) == expected);
            CHECK(tokenizer.decode(expected) == parts[s]);
            CHECK(trace.sequences()[s].length == static_cast<int64_t>(expected.size()));
        }
    }
}
