// Fuzzes the model side: bytes as a GGUF file through GgufFile::open, every tensor read,
// Tokenizer::from_gguf (and encoding the input itself as text), LlamaConfig::from_gguf,
// LlamaModel::load and, since a file the fuzzer can make is only a few KB, a short forward pass.
// Bad input may only ever be an InputError; anything else escaping (std::out_of_range, bad_alloc,
// a crash, a sanitizer report) is a bug the fuzzer reports.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "base/errors.h"
#include "base/size_limits.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"

namespace {

using namespace kvsim;

const std::string& scratch_file() {
    static const std::string path = "/tmp/kvsim-fuzz-gguf-" + std::to_string(::getpid()) + ".gguf";
    return path;
}

[[noreturn]] void bug(const std::string& what) {
    std::fprintf(stderr, "fuzz_gguf: %s\n", what.c_str());
    std::abort();
}

template <class F>
void expect_only_input_errors(F&& f) {
    try {
        f();
    } catch (const InputError&) {
    }
}

// Q/K/V that reach a hook must be finite (the model checks them first), and the hook sees every
// documented element.
struct CheckingHooks : model::ForwardHooks {
    const model::LlamaConfig* config = nullptr;
    void after_qkv(int, int, float* q, float* k, float* v) override {
        for (int i = 0; i < config->q_dim(); ++i)
            if (!std::isfinite(q[i])) bug("after_qkv saw a non-finite query");
        for (int i = 0; i < config->kv_dim(); ++i)
            if (!std::isfinite(k[i]) || !std::isfinite(v[i])) bug("after_qkv saw a non-finite key or value");
    }
    std::vector<uint8_t> mask;
    const uint8_t* attention_mask(int, int kv_head, int pos) override {
        mask.assign(static_cast<size_t>(pos) + 1, 1);
        if (pos > 1 && kv_head == 0) mask[1] = 0;
        return mask.data();
    }
};

void run_model(const model::GgufFile& file, std::string_view text) {
    const model::LlamaConfig config = model::LlamaConfig::from_gguf(file);
    // Weights of a supported type lie in the file; a tensor of an unsupported type has no size
    // there, so its shape may claim 2^40 weights: load() must refuse that, not allocate it.
    model::LlamaModel llama = model::LlamaModel::load(file, 6);
    if (llama.max_positions() > 6 || llama.max_positions() < 1) bug("max_positions outside [1, 6]");
    std::vector<int> tokens;
    for (const char byte : text.substr(0, 5)) tokens.push_back(static_cast<unsigned char>(byte) % config.vocab_size);
    tokens.resize(std::min<size_t>(std::max<size_t>(tokens.size(), 2), llama.max_positions()), 0);

    const float* logits = llama.forward_batch(tokens, 0);
    for (size_t i = 0; i < tokens.size() * static_cast<size_t>(config.vocab_size); ++i)
        if (!std::isfinite(logits[i])) bug("forward_batch returned a non-finite logit");
    CheckingHooks hooks;
    hooks.config = &config;
    llama.reset();
    for (size_t pos = 0; pos < tokens.size(); ++pos) llama.forward(tokens[pos], static_cast<int>(pos), &hooks);
    (void)llama.sequence_nll(tokens, nullptr, 2);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    // Far below libFuzzer's -rss_limit_mb: an input that would need more is refused by
    // check_memory() as an InputError, which is what this harness checks.
    static const bool limited = [] {
        set_memory_limit_bytes(uint64_t{256} << 20);
        return true;
    }();
    (void)limited;
    {
        FILE* f = std::fopen(scratch_file().c_str(), "wb");
        if (!f) return 0;
        std::fwrite(data, 1, size, f);
        std::fclose(f);
    }
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    expect_only_input_errors([&] {
        const model::GgufFile file = model::GgufFile::open(scratch_file());
        for (const auto& info : file.tensors()) {
            expect_only_input_errors([&] {
                const std::vector<float> values = file.read_tensor(info.name);
                if (values.size() != info.element_count()) bug("read_tensor: wrong element count");
            });
        }
        expect_only_input_errors([&] {
            const model::Tokenizer tokenizer = model::Tokenizer::from_gguf(file);
            for (const bool bos : {true, false}) {
                const std::vector<int> ids = tokenizer.encode(text, bos);
                for (const int id : ids)
                    if (id < 0 || id >= tokenizer.vocab_size()) bug("encode produced an id outside the vocabulary");
                (void)tokenizer.decode(ids);
            }
        });
        run_model(file, text);
    });
    std::remove(scratch_file().c_str());
    return 0;
}
