// Fuzzes the tokenizers: bytes as text (random bytes, invalid UTF-8, '▁' and spaces in any number)
// through encode and decode, with small vocabularies that kvsim's own GGUF writer makes at
// start-up: SentencePiece ones (tests/fuzz/fuzz_seeds.h) and a byte-level BPE one per
// pre-tokenizer (tests/model/bpe_vocabulary.h). Beyond "only InputError escapes" it checks what
// encode promises: every id is in the vocabulary (with control tokens parsed too, for BPE), BOS
// comes first when asked for, and with all 256 byte tokens present, decoding what encode made
// after BOS gives the text back (for SentencePiece unless the text spells '▁' itself, which
// decodes as a space).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "base/errors.h"
#include "base/size_limits.h"
#include "model/gguf_writer.h"
#include "model/tokenizer.h"
#include "tests/fuzz/fuzz_seeds.h"
#include "tests/model/bpe_vocabulary.h"

namespace {

using namespace kvsim;

[[noreturn]] void bug(const std::string& what) {
    std::fprintf(stderr, "fuzz_tokenizer: %s\n", what.c_str());
    std::abort();
}

struct Vocabulary {
    model::Tokenizer tokenizer;
    bool every_byte = false;  // all 256 byte tokens: encode loses nothing
};

std::vector<Vocabulary> make_vocabularies() {
    struct Spec {
        int size;
        bool with_types, space_prefix;
        int byte_tokens;
    };
    std::vector<Vocabulary> vocabularies;
    const std::string path = "/tmp/kvsim-fuzz-tokenizer-" + std::to_string(::getpid()) + ".gguf";
    for (const Spec spec : {Spec{300, true, true, 256}, Spec{290, false, false, 256}, Spec{40, true, true, 16}}) {
        model::GgufWriter writer;
        fuzz::add_vocabulary(writer, spec.size, spec.with_types, spec.space_prefix, spec.byte_tokens);
        writer.write(path);
        vocabularies.push_back({model::Tokenizer::load(path), spec.byte_tokens == 256});
    }
    // Byte-level BPE, one vocabulary per pre-tokenizer: every byte has a token, so any text
    // round-trips exactly; merges of spaces, digits, letters and a multi-byte letter.
    for (const char* pre : {"gpt-2", "llama-bpe", "qwen2", "smollm"}) {
        model::testing::BpeVocabulary bpe;
        bpe.pre = pre;
        bpe.merges = {"Ġ t", "h e", "Ġt he", "i n", "Ġ a", "in g", "Ċ Ċ", "Ġ Ġ", "1 2", "12 3", "Ã ¯"};
        bpe.specials = {{"<|user|>", 4}, {"<|im_start|>", 3}};
        bpe.add_bos_token = true;
        bpe.write(path);
        vocabularies.push_back({model::Tokenizer::load(path), true});
    }
    std::remove(path.c_str());
    return vocabularies;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const std::vector<Vocabulary> vocabularies = [] {
        set_memory_limit_bytes(uint64_t{256} << 20);
        return make_vocabularies();
    }();
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    for (const Vocabulary& vocabulary : vocabularies) {
        const model::Tokenizer& tokenizer = vocabulary.tokenizer;
        try {
            const bool bpe = tokenizer.model() != model::Tokenizer::Model::SentencePiece;
            if (bpe)  // control tokens spelled in the text: ids in range, whatever the text
                for (const int id : tokenizer.encode(text, true, true))
                    if (id < 0 || id >= tokenizer.vocab_size()) bug("encode (parse_special) produced an id outside the vocabulary");
            for (const bool bos : {true, false}) {
                const std::vector<int> ids = tokenizer.encode(text, bos);
                if (bos && (ids.empty() || ids.front() != tokenizer.bos_id())) bug("encode: no BOS first");
                for (const int id : ids) {
                    if (id < 0 || id >= tokenizer.vocab_size()) bug("encode produced an id outside the vocabulary");
                    (void)tokenizer.decode(id);
                }
                // Without token types BOS is a normal piece that decodes as "<s>": leave it out.
                const std::string decoded = tokenizer.decode(std::vector<int>(ids.begin() + (bos ? 1 : 0), ids.end()));
                // A user-defined token ("<|user|>") decodes as written, so BPE round-trips always.
                if (vocabulary.every_byte && (bpe || text.find("\xE2\x96\x81") == std::string_view::npos) &&
                    decoded != text)
                    bug("decode(encode(text)) != text");
            }
        } catch (const InputError&) {
        }
    }
    return 0;
}
