// Small GGUF files made with kvsim's own writer: the seeds of fuzz_gguf (tests/fuzz/corpus/gguf,
// written by `KVSIM_WRITE_FUZZ_SEEDS=1 build/tests/model_tests -tc='fuzz seeds*'`) and the
// vocabulary fuzz_tokenizer builds in-process. A few KB each: the fuzzer mutates every byte.
#pragma once

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "model/gguf_writer.h"

namespace kvsim::fuzz {

// <unk> <s> </s>, every byte token, then pieces with falling scores (ties on purpose), a
// user-defined piece, a control piece and an unused one; the types written or left for the reader
// to infer.
inline void add_vocabulary(model::GgufWriter& writer, int vocab_size, bool with_types = true,
                           bool add_space_prefix = true, int byte_tokens = 256) {
    std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
    std::vector<int32_t> types = {2, 3, 3};
    for (int byte = 0; byte < byte_tokens; ++byte) {
        char name[16];
        std::snprintf(name, sizeof name, "<0x%02X>", static_cast<unsigned>(byte));
        pieces.push_back(name);
        types.push_back(6);
    }
    const std::vector<std::pair<std::string, int32_t>> extra = {
        {"\xE2\x96\x81", 1}, {"e", 1}, {"t", 1}, {"h", 1}, {"a", 1}, {"\xE2\x96\x81t", 1}, {"he", 1},
        {"\xE2\x96\x81the", 1}, {"th", 1}, {"\xC3\xA9", 1}, {"caf\xC3\xA9", 1}, {"\xE6\x97\xA5", 1},
        {"<tool>", 4}, {"<|im_end|>", 3}, {"<unused0>", 5}, {"at", 1}, {"\xE2\x96\x81\xE2\x96\x81", 1},
    };
    for (size_t i = 0; pieces.size() < static_cast<size_t>(vocab_size); ++i) {
        if (i < extra.size()) {
            pieces.push_back(extra[i].first);
            types.push_back(extra[i].second);
        } else {
            pieces.push_back(std::to_string(i).insert(0, 1, 'x'));
            types.push_back(1);
        }
    }
    std::vector<float> scores(pieces.size(), 0.0f);
    for (size_t i = 3 + byte_tokens; i < scores.size(); ++i) scores[i] = -static_cast<float>((i - 3 - byte_tokens) / 2);
    writer.set_string("tokenizer.ggml.model", "llama");
    writer.set_string_array("tokenizer.ggml.tokens", pieces);
    writer.set_float32_array("tokenizer.ggml.scores", scores);
    if (with_types)
        writer.set_int32_array("tokenizer.ggml.token_type", types);
    else
        writer.remove("tokenizer.ggml.token_type");  // random_llama_writer's vocabulary has them
    writer.set_uint32("tokenizer.ggml.unknown_token_id", 0);
    writer.set_uint32("tokenizer.ggml.bos_token_id", 1);
    writer.set_uint32("tokenizer.ggml.eos_token_id", 2);
    if (!add_space_prefix) writer.set("tokenizer.ggml.add_space_prefix", model::GgufValue{false});
}

// A Llama small enough that the fuzzer's mutations of it still run a forward pass in microseconds.
inline model::LlamaConfig tiny_llama_config(int dim = 8) {
    model::LlamaConfig config;
    config.dim = dim;
    config.hidden_dim = 2 * dim;
    config.n_layers = 1;
    config.n_heads = 2;
    config.n_kv_heads = 1;
    config.head_dim = dim / 2;
    config.vocab_size = 24;
    config.context_length = 16;
    return config;
}

// Name and writer of every gguf seed.
inline std::vector<std::pair<std::string, model::GgufWriter>> gguf_seeds() {
    using model::TensorType;
    std::vector<std::pair<std::string, model::GgufWriter>> seeds;
    const auto llama = [](TensorType type, bool tied, int dim = 8) {
        model::GgufWriter writer = model::random_llama_writer(tiny_llama_config(dim), 1, type, tied);
        add_vocabulary(writer, tiny_llama_config(dim).vocab_size, true, true, 4);
        return writer;
    };
    seeds.emplace_back("llama-f32.gguf", llama(TensorType::F32, false));
    seeds.emplace_back("llama-f16-tied.gguf", llama(TensorType::F16, true));
    seeds.emplace_back("llama-bf16-tied.gguf", llama(TensorType::BF16, true));
    seeds.emplace_back("llama-q8_0-tied.gguf", llama(TensorType::Q8_0, true, 32));
    {
        // key_length and value_length present (head size != dim / heads), GQA 4:1.
        model::LlamaConfig config = tiny_llama_config();
        config.n_heads = 4;
        config.head_dim = 4;
        model::GgufWriter writer = model::random_llama_writer(config, 2, TensorType::F16, true);
        add_vocabulary(writer, config.vocab_size, false, false, 4);
        seeds.emplace_back("llama-gqa-f16.gguf", std::move(writer));
    }
    {
        model::GgufWriter writer(2);  // GGUF v2, metadata of every type and nested arrays, no tensors
        using model::GgufArray;
        using model::GgufValue;
        using T = model::GgufValueType;
        writer.set_uint32("general.alignment", 64);
        writer.set("u8", GgufValue{uint8_t{7}});
        writer.set("i16", GgufValue{int16_t{-3}});
        writer.set("u64", GgufValue{uint64_t{1} << 40});
        writer.set("i64", GgufValue{int64_t{-5}});
        writer.set("f64", GgufValue{0.25});
        writer.set("b", GgufValue{true});
        writer.set("nested", GgufValue{GgufArray{T::ARRAY, {GgufValue{GgufArray{T::STRING, {GgufValue{std::string("x")}}}},
                                                           GgufValue{GgufArray{T::INT8, {GgufValue{int8_t{-1}}}}}}}});
        add_vocabulary(writer, 12, true, true, 2);
        seeds.emplace_back("metadata-v2.gguf", std::move(writer));
    }
    return seeds;
}

}  // namespace kvsim::fuzz
