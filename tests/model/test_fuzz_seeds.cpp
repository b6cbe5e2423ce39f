// The fuzz_gguf seeds (tests/fuzz/corpus/gguf) are what tests/fuzz/fuzz_seeds.h makes with today's
// GGUF writer, and each is a file the model side accepts: a mutation of a valid model reaches the
// loader and the forward pass, not only the header checks. KVSIM_WRITE_FUZZ_SEEDS=1 rewrites them.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "tests/fuzz/fuzz_seeds.h"
#include "tests/model/test_util.h"

using namespace kvsim::model;
using namespace kvsim::model::testing;

namespace {

std::string file_bytes(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("fuzz seeds: the gguf corpus is what fuzz_seeds.h writes, and every seed loads") {
    const std::filesystem::path corpus = std::filesystem::path(KVSIM_SOURCE_DIR) / "tests" / "fuzz" / "corpus" / "gguf";
    const bool rewrite = std::getenv("KVSIM_WRITE_FUZZ_SEEDS") != nullptr;
    ScratchDir scratch;
    for (const auto& seed : kvsim::fuzz::gguf_seeds()) {
        const auto& name = seed.first;  // not a structured binding: clang 14 cannot capture one
        const auto& writer = seed.second;
        CAPTURE(name);
        const std::string path = scratch.file(name);
        writer.write(path);
        CHECK(std::filesystem::file_size(path) < 16 * 1024);
        if (rewrite) std::filesystem::copy_file(path, corpus / name, std::filesystem::copy_options::overwrite_existing);
        CHECK(file_bytes(corpus / name) == file_bytes(path));

        const GgufFile file = GgufFile::open(path);
        const Tokenizer tokenizer = Tokenizer::from_gguf(file);
        CHECK(tokenizer.decode(tokenizer.encode("the cat\xC3\xA9 \xF0\x9F\x99\x82", false)).size() > 0);
        if (name.rfind("llama", 0) != 0) continue;
        LlamaModel model = LlamaModel::load(file, 4);
        const std::vector<int> tokens = {1, 5, 9, 20};
        CHECK(std::isfinite(model.sequence_nll(tokens)));
    }
}
