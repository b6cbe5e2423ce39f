// The Llama forward pass: the real stories260K model against its golden greedy tokens and its
// known likelihood on TinyStories text, then synthetic random models for shapes, hooks, masks,
// batching and load errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

#include "base/errors.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "tests/model/test_util.h"

using namespace kvsim::model;
using namespace kvsim::model::testing;

namespace {

std::string read_text(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
}

// The ids between the first '[' and ']' of golden_greedy_from_BOS.txt.
std::vector<int> read_golden_tokens(const std::filesystem::path& path) {
    const std::string text = read_text(path);
    const auto open = text.find('['), close = text.find(']');
    REQUIRE(open != std::string::npos);
    REQUIRE(close != std::string::npos);
    std::vector<int> ids;
    std::string list = text.substr(open + 1, close - open - 1);
    std::replace(list.begin(), list.end(), ',', ' ');
    std::istringstream numbers(list);
    for (int id; numbers >> id;) ids.push_back(id);
    return ids;
}

std::string trim(const std::string& text) {
    const auto first = text.find_first_not_of(" \t\r\n");
    if (first == std::string::npos) return "";
    return text.substr(first, text.find_last_not_of(" \t\r\n") - first + 1);
}

int argmax(const float* values, int count) { return static_cast<int>(std::max_element(values, values + count) - values); }

std::vector<float> copy_logits(const float* logits, const LlamaModel& model) {
    return {logits, logits + model.config().vocab_size};
}

float max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    float worst = 0.0f;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
    return worst;
}

// Records every hook call; optionally returns a fixed mask for every (layer, head, pos).
struct RecordingHooks : ForwardHooks {
    struct QkvCall {
        int layer, pos;
    };
    std::vector<QkvCall> qkv_calls;
    std::vector<std::tuple<int, int, int>> mask_calls;  // layer, kv_head, pos
    std::vector<uint8_t> mask;                          // returned when use_mask
    bool use_mask = false;
    const LlamaConfig* config = nullptr;
    bool shapes_ok = true;

    void after_qkv(int layer, int pos, float* q, float* k, float* v) override {
        qkv_calls.push_back({layer, pos});
        // Touch the full documented extents: q [n_heads*head_dim], k and v [n_kv_heads*head_dim].
        for (int i = 0; i < config->q_dim(); ++i) shapes_ok &= std::isfinite(q[i]);
        for (int i = 0; i < config->kv_dim(); ++i) shapes_ok &= std::isfinite(k[i]) && std::isfinite(v[i]);
    }
    const uint8_t* attention_mask(int layer, int kv_head, int pos) override {
        mask_calls.emplace_back(layer, kv_head, pos);
        if (!use_mask) return nullptr;
        mask.resize(static_cast<size_t>(pos) + 1, 1);
        return mask.data();
    }
};

// Keeps only the listed positions (for every layer and KV head).
struct KeepOnlyHooks : ForwardHooks {
    std::vector<int> kept_positions;
    std::vector<uint8_t> mask;
    const uint8_t* attention_mask(int, int, int pos) override {
        mask.assign(static_cast<size_t>(pos) + 1, 0);
        for (const int kept : kept_positions)
            if (kept <= pos) mask[kept] = 1;
        return mask.data();
    }
};

}  // namespace

TEST_CASE("stories260K: config and greedy decoding from BOS reproduce the golden tokens") {
    if (!have_stories260k()) return;
    LlamaModel model = LlamaModel::load(stories260k_gguf().string());
    const LlamaConfig& c = model.config();
    CHECK(c.dim == 64);
    CHECK(c.hidden_dim == 172);
    CHECK(c.n_layers == 5);
    CHECK(c.n_heads == 8);
    CHECK(c.n_kv_heads == 4);
    CHECK(c.head_dim == 8);
    CHECK(c.vocab_size == 512);
    CHECK(c.norm_eps == doctest::Approx(1e-5));
    CHECK(c.rope_theta == doctest::Approx(10000.0));

    const std::vector<int> golden = read_golden_tokens(stories260k_dir() / "golden_greedy_from_BOS.txt");
    REQUIRE(golden.size() == 120);
    const Tokenizer tokenizer = Tokenizer::load(stories260k_gguf().string());

    std::vector<int> generated;
    int token = tokenizer.bos_id();
    for (int pos = 0; pos < static_cast<int>(golden.size()); ++pos) {
        token = argmax(model.forward(token, pos), c.vocab_size);
        generated.push_back(token);
    }
    MESSAGE("greedy from BOS: " << tokenizer.decode(generated));
    int first_mismatch = -1;
    for (size_t i = 0; i < golden.size() && first_mismatch < 0; ++i)
        if (generated[i] != golden[i]) first_mismatch = static_cast<int>(i);
    INFO("first mismatch at index " << first_mismatch);
    CHECK(generated == golden);
    // The model's own choices are the tokenizer's canonical segmentation of that text.
    CHECK(tokenizer.encode(tokenizer.decode(golden), false) == golden);
}

TEST_CASE("stories260K: mean NLL per token on TinyStories text is about 1.3 nats") {
    if (!have_stories260k()) return;
    const auto text_path = shared_dir() / "text" / "tinystories_sample.txt";
    if (!std::filesystem::exists(text_path)) {
        MESSAGE("SKIPPED: " << text_path.string() << " is absent");
        return;
    }
    LlamaModel model = LlamaModel::load(stories260k_gguf().string());
    const Tokenizer tokenizer = Tokenizer::load(stories260k_gguf().string());

    const std::string text = read_text(text_path);
    const std::string separator = "<|endoftext|>";
    double total_nll = 0.0, total_nll_token_by_token = 0.0;
    int64_t predicted = 0;
    int stories = 0;
    for (size_t start = 0; start <= text.size();) {
        const size_t end = std::min(text.find(separator, start), text.size());
        const std::string story = trim(text.substr(start, end - start));
        start = end + separator.size();
        if (story.empty()) continue;
        const std::vector<int> tokens = tokenizer.encode(story, /*add_bos=*/true);
        REQUIRE(static_cast<int>(tokens.size()) <= 512);  // the model's trained context
        total_nll += model.sequence_nll(tokens);
        total_nll_token_by_token += model.sequence_nll(tokens, nullptr, /*chunk_size=*/1);
        predicted += static_cast<int64_t>(tokens.size()) - 1;
        ++stories;
    }
    CHECK(stories == 5);
    const double mean_nll = total_nll / static_cast<double>(predicted);
    MESSAGE("stories260K mean NLL on tinystories_sample.txt: " << mean_nll << " nats/token over " << predicted
                                                               << " predicted tokens, " << stories << " stories");
    CHECK(mean_nll >= 1.15);
    CHECK(mean_nll <= 1.45);
    // Chunked (matrix-matrix) and token-by-token evaluation agree.
    CHECK(total_nll_token_by_token == doctest::Approx(total_nll).epsilon(1e-5));
}

TEST_CASE("synthetic model: forward gives finite logits for every stored weight type") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    for (const TensorType type : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0}) {
        CAPTURE(tensor_type_name(static_cast<uint32_t>(type)));
        const std::string path = scratch.file("tiny.gguf");
        write_random_llama(path, config, 7, type, /*tied_output=*/type == TensorType::F16);
        LlamaModel model = LlamaModel::load(path);
        CHECK(model.config().vocab_size == config.vocab_size);
        CHECK(model.tied_output() == (type == TensorType::F16));
        for (int pos = 0; pos < 10; ++pos) {
            const float* logits = model.forward(3 + pos * 11, pos);
            CHECK(std::all_of(logits, logits + config.vocab_size, [](float x) { return std::isfinite(x); }));
            // Random weights still give logits that vary across the vocabulary.
            const auto [low, high] = std::minmax_element(logits, logits + config.vocab_size);
            CHECK(*high - *low > 1e-3f);
        }
    }
}

TEST_CASE("synthetic model: quantised weights give logits close to the fp32 model's") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    write_random_llama(scratch.file("f32.gguf"), config, 11, TensorType::F32);
    write_random_llama(scratch.file("q8.gguf"), config, 11, TensorType::Q8_0);
    LlamaModel exact = LlamaModel::load(scratch.file("f32.gguf"));
    LlamaModel quantised = LlamaModel::load(scratch.file("q8.gguf"));
    const std::vector<float> a = copy_logits(exact.forward(5, 0), exact);
    const std::vector<float> b = copy_logits(quantised.forward(5, 0), quantised);
    const float spread = *std::max_element(a.begin(), a.end()) - *std::min_element(a.begin(), a.end());
    CHECK(max_abs_difference(a, b) < 0.05f * spread);
    CHECK(max_abs_difference(a, b) > 0.0f);  // they are not the same weights
}

TEST_CASE("synthetic model: forward_batch equals token-by-token forward") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    write_random_llama(scratch.file("tiny.gguf"), config, 3);
    LlamaModel model = LlamaModel::load(scratch.file("tiny.gguf"));
    const std::vector<int> tokens = {1, 40, 77, 290, 5, 5, 123, 64, 250, 9, 31, 200};

    std::vector<std::vector<float>> sequential;
    for (int pos = 0; pos < static_cast<int>(tokens.size()); ++pos)
        sequential.push_back(copy_logits(model.forward(tokens[pos], pos), model));

    // In two chunks of different sizes: the second continues from the cache the first left.
    model.reset();
    const int split = 5;
    std::vector<std::vector<float>> batched;
    const float* first = model.forward_batch(std::span(tokens).subspan(0, split), 0);
    for (int i = 0; i < split; ++i) batched.emplace_back(first + i * config.vocab_size, first + (i + 1) * config.vocab_size);
    const float* second = model.forward_batch(std::span(tokens).subspan(split), split);
    for (int i = 0; i < static_cast<int>(tokens.size()) - split; ++i)
        batched.emplace_back(second + i * config.vocab_size, second + (i + 1) * config.vocab_size);

    for (size_t pos = 0; pos < tokens.size(); ++pos) {
        CAPTURE(pos);
        CHECK(max_abs_difference(sequential[pos], batched[pos]) < 1e-4f);
    }
    CHECK(model.sequence_nll(tokens, nullptr, 4) == doctest::Approx(model.sequence_nll(tokens, nullptr, 1)).epsilon(1e-6));
}

TEST_CASE("synthetic model: hooks see every layer and position with the documented shapes") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    write_random_llama(scratch.file("tiny.gguf"), config, 5);
    LlamaModel model = LlamaModel::load(scratch.file("tiny.gguf"));

    RecordingHooks hooks;
    hooks.config = &model.config();
    const int steps = 4;
    for (int pos = 0; pos < steps; ++pos) model.forward(10 + pos, pos, &hooks);
    CHECK(hooks.shapes_ok);
    REQUIRE(hooks.qkv_calls.size() == static_cast<size_t>(steps * config.n_layers));
    REQUIRE(hooks.mask_calls.size() == static_cast<size_t>(steps * config.n_layers * config.n_kv_heads));
    // Token by token: position-major, then layer; masks per KV head after that layer's after_qkv.
    size_t call = 0;
    for (int pos = 0; pos < steps; ++pos) {
        for (int layer = 0; layer < config.n_layers; ++layer) {
            CHECK(hooks.qkv_calls[pos * config.n_layers + layer].pos == pos);
            CHECK(hooks.qkv_calls[pos * config.n_layers + layer].layer == layer);
            for (int head = 0; head < config.n_kv_heads; ++head)
                CHECK(hooks.mask_calls[call++] == std::make_tuple(layer, head, pos));
        }
    }
}

TEST_CASE("synthetic model: a mask of all ones equals no mask; masking positions changes the logits") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    write_random_llama(scratch.file("tiny.gguf"), config, 9);
    LlamaModel model = LlamaModel::load(scratch.file("tiny.gguf"));
    const std::vector<int> tokens = {1, 17, 99, 230, 41, 8};
    const int last = static_cast<int>(tokens.size()) - 1;

    const auto run = [&](ForwardHooks* hooks) {
        model.reset();
        const float* logits = nullptr;
        for (int pos = 0; pos <= last; ++pos) logits = model.forward(tokens[pos], pos, hooks);
        return copy_logits(logits, model);
    };
    const std::vector<float> plain = run(nullptr);

    RecordingHooks all_ones;
    all_ones.config = &model.config();
    all_ones.use_mask = true;
    CHECK(run(&all_ones) == plain);  // bit for bit

    KeepOnlyHooks drop_some;
    drop_some.kept_positions = {0, 3, 4, 5};  // positions 1 and 2 evicted
    CHECK(max_abs_difference(run(&drop_some), plain) > 1e-4f);

    // Renormalisation: keeping only the current position makes attention return exactly its own
    // value row, which carries no position (RoPE touches q and k only), so the logits equal those
    // of the same token run alone at position 0.
    KeepOnlyHooks only_self;
    std::vector<float> self_only;
    model.reset();
    for (int pos = 0; pos <= last; ++pos) {
        only_self.kept_positions = {pos};
        const float* logits = model.forward(tokens[pos], pos, &only_self);
        if (pos == last) self_only = copy_logits(logits, model);
    }
    model.reset();
    const std::vector<float> alone = copy_logits(model.forward(tokens[last], 0), model);
    CHECK(max_abs_difference(self_only, alone) < 1e-5f);
}

TEST_CASE("synthetic model: forward_batch with hooks matches token-by-token and calls them layer by layer") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    write_random_llama(scratch.file("tiny.gguf"), config, 21);
    LlamaModel model = LlamaModel::load(scratch.file("tiny.gguf"));
    const std::vector<int> tokens = {1, 50, 60, 70, 80, 90, 100};
    const int n = static_cast<int>(tokens.size());

    // A mask that depends on the layer and head too: evict position 1 in layer 1, KV head 0.
    struct EvictOne : ForwardHooks {
        std::vector<uint8_t> mask;
        std::vector<std::string> calls;
        void after_qkv(int layer, int pos, float*, float*, float*) override {
            calls.push_back("qkv " + std::to_string(layer) + " " + std::to_string(pos));
        }
        const uint8_t* attention_mask(int layer, int kv_head, int pos) override {
            calls.push_back("mask " + std::to_string(layer) + " " + std::to_string(kv_head) + " " + std::to_string(pos));
            if (layer != 1 || kv_head != 0 || pos < 1) return nullptr;
            mask.assign(static_cast<size_t>(pos) + 1, 1);
            mask[1] = 0;
            return mask.data();
        }
    };
    EvictOne sequential_hooks, batch_hooks;
    std::vector<float> sequential_last;
    for (int pos = 0; pos < n; ++pos) sequential_last = copy_logits(model.forward(tokens[pos], pos, &sequential_hooks), model);
    model.reset();
    const float* batch = model.forward_batch(tokens, 0, &batch_hooks);
    const std::vector<float> batch_last(batch + (n - 1) * config.vocab_size, batch + n * config.vocab_size);
    CHECK(max_abs_difference(sequential_last, batch_last) < 1e-4f);

    std::vector<std::string> expected;
    for (int layer = 0; layer < config.n_layers; ++layer) {
        for (int pos = 0; pos < n; ++pos) {
            expected.push_back("qkv " + std::to_string(layer) + " " + std::to_string(pos));
            for (int head = 0; head < config.n_kv_heads; ++head)
                expected.push_back("mask " + std::to_string(layer) + " " + std::to_string(head) + " " + std::to_string(pos));
        }
    }
    CHECK(batch_hooks.calls == expected);
    CHECK(sequential_hooks.calls.size() == expected.size());
}

TEST_CASE("synthetic model: the cache stores what after_qkv leaves in k and v") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    write_random_llama(scratch.file("tiny.gguf"), config, 13);
    LlamaModel model = LlamaModel::load(scratch.file("tiny.gguf"));

    struct ZeroSecondHead : ForwardHooks {
        int head_dim = 0;
        void after_qkv(int, int, float*, float* k, float* v) override {
            std::fill(k + head_dim, k + 2 * head_dim, 0.0f);  // KV head 1 of the key
            std::fill(v, v + head_dim, 0.5f);                  // KV head 0 of the value
        }
    } hooks;
    hooks.head_dim = config.head_dim;
    const std::vector<float> plain = copy_logits(model.forward(42, 0), model);
    const std::vector<float> hooked = copy_logits(model.forward(42, 0, &hooks), model);
    CHECK(max_abs_difference(plain, hooked) > 1e-4f);
    for (int layer = 0; layer < config.n_layers; ++layer) {
        const float* key = model.cached_key(layer, 1, 0);
        const float* value = model.cached_value(layer, 0, 0);
        CHECK(std::all_of(key, key + config.head_dim, [](float x) { return x == 0.0f; }));
        CHECK(std::all_of(value, value + config.head_dim, [](float x) { return x == 0.5f; }));
    }
}

TEST_CASE("synthetic model: misuse of forward throws") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    write_random_llama(scratch.file("tiny.gguf"), config, 1);
    LlamaModel model = LlamaModel::load(scratch.file("tiny.gguf"), /*max_context=*/16);
    CHECK(model.max_positions() == 16);
    CHECK_THROWS_AS(model.forward(config.vocab_size, 0), std::out_of_range);
    CHECK_THROWS_AS(model.forward(-1, 0), std::out_of_range);
    CHECK_THROWS_AS(model.forward(1, 1), std::out_of_range);  // position 0 is not cached yet
    for (int pos = 0; pos < 16; ++pos) model.forward(1, pos);
    CHECK_THROWS_AS(model.forward(1, 16), std::out_of_range);  // past the cache
    CHECK_NOTHROW(model.forward(2, 3));                         // rewinding is allowed
    CHECK_THROWS_AS(model.cached_key(0, 0, 4), std::out_of_range);  // dropped by the rewind
}

TEST_CASE("loading a non-Llama or incomplete model throws InputError naming the file and key or tensor") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    const auto load_error = [&](GgufWriter writer, const std::string& name) {
        const std::string path = scratch.file(name);
        writer.write(path);
        try {
            LlamaModel::load(path);
        } catch (const kvsim::InputError& error) {
            const std::string message = error.what();
            CHECK(message.find(path) == 0);
            CHECK(message.find('\n') == std::string::npos);
            return message;
        }
        FAIL("no InputError for " << name);
        return std::string();
    };

    SUBCASE("architecture other than llama") {
        GgufWriter writer = random_llama_writer(config, 1);
        writer.set_string("general.architecture", "gpt2");
        const std::string message = load_error(writer, "gpt2.gguf");
        CHECK(message.find("general.architecture") != std::string::npos);
        CHECK(message.find("gpt2") != std::string::npos);
    }
    SUBCASE("missing tensor") {
        GgufWriter writer = random_llama_writer(config, 1);
        REQUIRE(writer.remove_tensor("blk.1.ffn_down.weight"));
        const std::string message = load_error(writer, "missing_tensor.gguf");
        CHECK(message.find("'blk.1.ffn_down.weight'") != std::string::npos);
    }
    SUBCASE("missing metadata key") {
        GgufWriter writer = random_llama_writer(config, 1);
        REQUIRE(writer.remove("llama.block_count"));
        const std::string message = load_error(writer, "missing_key.gguf");
        CHECK(message.find("'llama.block_count'") != std::string::npos);
    }
    SUBCASE("unsupported tensor type") {
        GgufWriter writer = random_llama_writer(config, 1);
        REQUIRE(writer.remove_tensor("blk.0.attn_q.weight"));
        // IQ2_XXS (ggml type 16): 256-weight blocks of 66 bytes; the contents do not matter.
        const size_t blocks = static_cast<size_t>(config.q_dim()) * config.dim / 256;
        writer.add_raw_tensor("blk.0.attn_q.weight", {static_cast<uint64_t>(config.dim), static_cast<uint64_t>(config.q_dim())},
                              16, std::vector<uint8_t>(blocks * 66, 0));
        const std::string message = load_error(writer, "iq2.gguf");
        CHECK(message.find("'blk.0.attn_q.weight'") != std::string::npos);
        CHECK(message.find("IQ2_XXS (16)") != std::string::npos);
    }
    SUBCASE("tensor of the wrong shape") {
        GgufWriter writer = random_llama_writer(config, 1);
        REQUIRE(writer.remove_tensor("blk.0.attn_k.weight"));
        const std::vector<float> zeros(static_cast<size_t>(config.dim) * config.dim, 0.0f);
        writer.add_tensor("blk.0.attn_k.weight", {static_cast<uint64_t>(config.dim), static_cast<uint64_t>(config.dim)}, zeros);
        const std::string message = load_error(writer, "shape.gguf");
        CHECK(message.find("'blk.0.attn_k.weight'") != std::string::npos);
    }
}

namespace {

// The InputError message loading `writer`'s file gives, naming that file on one line.
std::string load_error(const ScratchDir& scratch, const GgufWriter& writer, int max_context = 0) {
    const std::string path = scratch.file("broken.gguf");
    writer.write(path);
    try {
        LlamaModel::load(path, max_context);
    } catch (const kvsim::InputError& error) {
        const std::string message = error.what();
        CHECK(message.find(path + ": ") == 0);
        CHECK(message.find('\n') == std::string::npos);
        return message.substr(path.size() + 2);
    }
    FAIL("no InputError");
    return "";
}

// Multiplies every weight of a tensor by `factor` (the writer holds F32 bytes for it).
void scale_tensor(GgufWriter& writer, const LlamaConfig& config, const std::string& name, int rows, int cols, float factor,
                  uint64_t seed = 1) {
    // Rebuild from the same seeded writer's values: read them back from a written copy.
    ScratchDir scratch;
    random_llama_writer(config, seed).write(scratch.file("m.gguf"));
    std::vector<float> values = GgufFile::open(scratch.file("m.gguf")).read_tensor(name);
    for (float& value : values) value *= factor;
    REQUIRE(writer.remove_tensor(name));
    const std::vector<uint64_t> shape = cols == 0 ? std::vector<uint64_t>{static_cast<uint64_t>(rows)}
                                                  : std::vector<uint64_t>{static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
    writer.add_tensor(name, shape, values);
}

}  // namespace

TEST_CASE("LlamaConfig::from_gguf range-checks every integer before narrowing it") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    const struct {
        const char* key;
        GgufValue value;
        const char* expected;
    } cases[] = {
        // 4 heads x (2^30 + 8) overflows an int: q_dim() would wrap negative.
        {"llama.attention.key_length", GgufValue{uint32_t{(1u << 30) + 8}}, "head size 1073741832 x head_count 4 overflows an int"},
        {"llama.attention.key_length", GgufValue{uint64_t{1} << 63}, "uint64 value 9223372036854775808 is too large"},
        {"llama.block_count", GgufValue{uint64_t{1} << 31}, "value 2147483648 is out of range [1, 2147483647]"},
        {"llama.block_count", GgufValue{int32_t{-1}}, "value -1 is out of range [1, 2147483647]"},
        // In range, but far more blocks than the file has tensors for: refused before anything is
        // sized by it (a list of 9 x 2^31 tensor names took minutes and gigabytes).
        {"llama.block_count", GgufValue{uint32_t{2147483647}}, "2147483647 blocks need 19327352823 tensors, the file has 21"},
        {"llama.attention.head_count_kv", GgufValue{uint32_t{8}}, "head_count 4 is not a multiple of head_count_kv 8"},
        {"llama.attention.head_count_kv", GgufValue{uint32_t{0}}, "value 0 is out of range [1, 2147483647]"},
        {"llama.context_length", GgufValue{int64_t{0}}, "value 0 is out of range [1, 2147483647]"},
        {"llama.rope.freq_base", GgufValue{1e300}, "is not a positive finite float32"},
        {"llama.attention.layer_norm_rms_epsilon", GgufValue{1e-300}, "is not a positive finite float32"},
        {"llama.vocab_size", GgufValue{uint32_t{299}}, "299 differs from the 300 rows of tensor 'token_embd.weight'"},
    };
    for (const auto& c : cases) {
        CAPTURE(c.key);
        GgufWriter writer = random_llama_writer(config, 1);
        writer.set(c.key, c.value);
        if (std::string(c.key) == "llama.attention.key_length") writer.remove("llama.rope.dimension_count");
        const std::string message = load_error(scratch, writer);
        CHECK(message.find(std::string("metadata key '") + c.key + "': ") == 0);
        CHECK(message.find(c.expected) != std::string::npos);
    }
}

TEST_CASE("LlamaConfig::from_gguf checks every weight's shape against the metadata, reading no data") {
    ScratchDir scratch;
    LlamaConfig config = tiny_config();
    GgufWriter writer = random_llama_writer(config, 1);
    writer.set_uint32("llama.feed_forward_length", 95);
    const std::string path = scratch.file("ffn.gguf");
    writer.write(path);
    CHECK_THROWS_WITH_AS(LlamaConfig::from_gguf(GgufFile::open(path)),
                         (path + ": tensor 'blk.0.ffn_gate.weight': shape [64, 96], expected [64, 95] from the llama.* metadata").c_str(),
                         kvsim::InputError);
    writer = random_llama_writer(config, 1);
    REQUIRE(writer.remove_tensor("blk.1.attn_output.weight"));
    writer.write(path);
    CHECK_THROWS_WITH_AS(LlamaConfig::from_gguf(GgufFile::open(path)), (path + ": missing tensor 'blk.1.attn_output.weight'").c_str(),
                         kvsim::InputError);
}

TEST_CASE("LlamaModel::load checks its memory plan before allocating: a header context of 2^31-1 positions") {
    ScratchDir scratch;
    LlamaConfig config = tiny_config();
    config.context_length = std::numeric_limits<int>::max();
    const std::string path = scratch.file("long.gguf");
    write_random_llama(path, config, 1);
    const MemoryLimit limit(uint64_t{256} << 20);
    // A cache for the whole context: 2 layers x 2 KV heads x 2^31 positions x 16 floats, twice.
    CHECK_THROWS_WITH_AS(LlamaModel::load(path),
                         (path + ": metadata key 'llama.context_length': weights and a KV cache of 2147483647 positions "
                                 "needs 1152.0 GiB, over the memory limit of 256.0 MiB (--max-memory)").c_str(),
                         kvsim::InputError);
    // What is needed instead: the positions the caller will use.
    LlamaModel model = LlamaModel::load(path, 40);
    CHECK(model.max_positions() == 40);
    CHECK(model.memory_bytes() < (uint64_t{1} << 20));
    CHECK(std::isfinite(model.sequence_nll({1, 2, 3, 4, 5, 6})));
    // A chunk whose activations would not fit is refused the same way.
    const MemoryLimit tight(model.memory_bytes() + 1000);
    const std::vector<int> tokens(40, 3);
    try {
        model.forward_batch(tokens, 0);
        FAIL("no InputError");
    } catch (const kvsim::InputError& error) {
        CHECK(std::string(error.what()).find(path + ": activations for a chunk of 40 tokens needs") == 0);
    }
}

TEST_CASE("LlamaModel::load refuses weights that are not finite, naming the tensor and the element") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
        GgufWriter writer = random_llama_writer(config, 1);
        std::vector<float> values(static_cast<size_t>(config.kv_dim()) * config.dim, 0.25f);
        values[37] = bad;
        REQUIRE(writer.remove_tensor("blk.1.attn_v.weight"));
        writer.add_tensor("blk.1.attn_v.weight", {static_cast<uint64_t>(config.dim), static_cast<uint64_t>(config.kv_dim())},
                          values, TensorType::F16);  // F16 keeps NaN and infinity
        CHECK(load_error(scratch, writer) ==
              std::string("tensor 'blk.1.attn_v.weight': element 37 is ") + (std::isnan(bad) ? "NaN" : "infinite") +
                  " (weights must be finite)");
    }
}

TEST_CASE("forward pass: a non-finite query, key, value, score or logit stops it at that layer and position") {
    ScratchDir scratch;
    const LlamaConfig config = tiny_config();
    const std::string path = scratch.file("m.gguf");
    const auto error_of = [&](LlamaModel& model, const std::vector<int>& tokens, ForwardHooks* hooks) {
        try {
            model.forward_batch(tokens, 0, hooks);
        } catch (const NonFiniteError& error) {
            CHECK(error.model_path() == path);
            return std::string(error.what());
        }
        FAIL("no NonFiniteError");
        return std::string();
    };
    const std::vector<int> tokens = {1, 40, 41, 42, 43, 44};

    // The random model with two of its tensors scaled up (rows, cols as scale_tensor takes them).
    struct Scaled {
        const char* name;
        int rows, cols;
        float factor;
    };
    const auto load_scaled = [&](std::initializer_list<Scaled> scaled) {
        GgufWriter writer = random_llama_writer(config, 1);
        for (const Scaled& t : scaled) scale_tensor(writer, config, t.name, t.rows, t.cols, t.factor);
        writer.write(path);
        return LlamaModel::load(path);
    };
    SUBCASE("query·key overflows: attention scores, before hooks see a non-finite value") {
        LlamaModel model = load_scaled({{"blk.0.attn_q.weight", config.q_dim(), config.dim, 1e20f},
                                        {"blk.0.attn_k.weight", config.kv_dim(), config.dim, 1e20f}});
        RecordingHooks hooks;
        hooks.config = &model.config();
        CHECK(error_of(model, tokens, &hooks) == path + ": layer 0, position 0: non-finite attention scores (NaN or infinity)");
        CHECK(hooks.shapes_ok);  // q, k and v themselves were finite
    }
    SUBCASE("the residual stream overflows: the query, never shown to after_qkv") {
        LlamaModel model = load_scaled({{"blk.1.attn_norm.weight", config.dim, 0, 1e30f},
                                        {"blk.1.attn_q.weight", config.q_dim(), config.dim, 1e10f}});
        RecordingHooks hooks;
        hooks.config = &model.config();
        CHECK(error_of(model, tokens, &hooks) == path + ": layer 1, position 0: non-finite query (NaN or infinity)");
        CHECK(hooks.shapes_ok);
        CHECK(hooks.qkv_calls.size() == tokens.size());  // layer 0 for every token, nothing of layer 1
    }
    SUBCASE("the classifier overflows: logits") {
        LlamaModel model = load_scaled({{"output_norm.weight", config.dim, 0, 1e30f},
                                        {"output.weight", config.vocab_size, config.dim, 1e20f}});
        CHECK(error_of(model, tokens, nullptr) == path + ": position 0: non-finite logits (NaN or infinity)");
        CHECK_THROWS_AS(model.sequence_nll(tokens), NonFiniteError);
    }
    SUBCASE("a hook's own overflow at a later position names that position; the model stays usable") {
        write_random_llama(path, config, 1);
        LlamaModel model = LlamaModel::load(path);
        struct Poison : ForwardHooks {
            void after_qkv(int layer, int pos, float* q, float*, float*) override {
                if (layer == 1 && pos == 3) std::fill(q, q + 16, 3e38f);
            }
        } poison;
        const std::string message = error_of(model, tokens, &poison);
        CHECK(message == path + ": layer 1, position 3: non-finite attention scores (NaN or infinity)");
        const std::vector<float> clean = copy_logits(model.forward_batch(tokens, 0), model);
        CHECK(std::all_of(clean.begin(), clean.end(), [](float v) { return std::isfinite(v); }));
        const NonFiniteError error(path, "logits", -1, 9);
        CHECK(std::string(error.in_sequence("story.txt sequence 2").what()) ==
              path + ": story.txt sequence 2, position 9: non-finite logits (NaN or infinity)");
    }
}
