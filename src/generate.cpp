#include "src/generate.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "base/errors.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "runtime/kvsim_runtime.h"

namespace kvsim {
namespace {

// The runtime as the model's attention: K, V and Q go to kvsim_rt_decode as each position's are
// computed; the outputs come back when the model asks for them (after the chunk's positions).
class RuntimeAttention : public model::ForwardHooks {
public:
    RuntimeAttention(kvsim_rt* rt, const model::LlamaConfig& c)
        : rt_(rt), config_(c), pending_(c.n_layers), prompt_(c.n_layers) {}

    // A prompt goes in as one prefill: its rows are gathered as the model computes them and handed
    // to the runtime when the model first asks for the chunk's attention.
    void set_prefill(bool on) { prefill_ = on; }

    void after_qkv(int layer, int pos, float* q, float* k, float* v) override {
        if (prefill_) {
            Prompt& p = prompt_[layer];
            if (p.q.empty()) p.first = pos;
            p.q.insert(p.q.end(), q, q + config_.q_dim());
            p.k.insert(p.k.end(), k, k + config_.kv_dim());
            p.v.insert(p.v.end(), v, v + config_.kv_dim());
            return;
        }
        std::vector<float>& out = pending_[layer][pos];
        out.resize(config_.q_dim());
        if (kvsim_rt_decode(rt_, layer, pos, q, k, v, out.data()) != KVSIM_OK)
            throw InputError(std::string("kvsim runtime: ") + kvsim_rt_last_error(rt_));
    }
    bool attention_output(int layer, int kv_head, int pos, const float*, float* out) override {
        if (Prompt& p = prompt_[layer]; !p.q.empty()) {
            const int count = static_cast<int>(p.q.size() / config_.q_dim());
            std::vector<float> outputs(p.q.size());
            if (kvsim_rt_prefill(rt_, layer, p.first, count, p.q.data(), p.k.data(), p.v.data(), outputs.data()) != KVSIM_OK)
                throw InputError(std::string("kvsim runtime: ") + kvsim_rt_last_error(rt_));
            for (int i = 0; i < count; ++i)
                pending_[layer][p.first + i].assign(outputs.begin() + static_cast<std::ptrdiff_t>(i) * config_.q_dim(),
                                                    outputs.begin() + static_cast<std::ptrdiff_t>(i + 1) * config_.q_dim());
            p = Prompt{};
        }
        auto it = pending_[layer].find(pos);
        const int width = config_.n_heads / config_.n_kv_heads * config_.head_dim;
        std::copy_n(it->second.data() + static_cast<std::size_t>(kv_head) * width, width, out);
        if (kv_head == config_.n_kv_heads - 1) pending_[layer].erase(it);
        return true;
    }
    bool holds_the_cache() const override { return true; }
    void reset() {
        for (auto& p : pending_) p.clear();
        for (auto& p : prompt_) p = Prompt{};
        if (kvsim_rt_reset(rt_) != KVSIM_OK) throw InputError(std::string("kvsim runtime: ") + kvsim_rt_last_error(rt_));
    }

private:
    kvsim_rt* rt_;
    const model::LlamaConfig& config_;
    std::vector<std::map<int, std::vector<float>>> pending_;  // per layer: outputs by position
    struct Prompt {
        int first = 0;
        std::vector<float> q, k, v;
    };
    std::vector<Prompt> prompt_;  // per layer: the prompt's rows not yet handed over
    bool prefill_ = false;
};

struct RuntimeHandle {
    kvsim_rt* rt = nullptr;
    ~RuntimeHandle() { kvsim_rt_destroy(rt); }
};

}  // namespace

GenerateResult run_generate(const GenerateOptions& options) {
    const model::Tokenizer tokenizer = model::Tokenizer::load(options.model_path);
    if (options.new_tokens < 0) throw InputError("-n: must be at least 0");
    const std::vector<int> prompt =
        encode_text(tokenizer, options.prompt, options.perplexity.normalize, /*add_bos=*/true, "--prompt");

    // The model, and the positions the runtime plans for: the prompt and its continuation, and the
    // longest sequence of the text (read as kvsim eval reads it, so the perplexities compare).
    ModelInput text_input = options.perplexity;
    text_input.model_path = options.model_path;
    std::unique_ptr<LoadedInput> text;
    std::unique_ptr<model::LlamaModel> own;
    const int generation = static_cast<int>(prompt.size()) + options.new_tokens;
    if (!text_input.text_path.empty()) text = std::make_unique<LoadedInput>(load_model_input(text_input));
    if (!text || text->model.max_positions() < generation)
        own = std::make_unique<model::LlamaModel>(model::LlamaModel::load(options.model_path, generation));
    model::LlamaModel& llama = own ? *own : text->model;
    const model::LlamaConfig& c = llama.config();
    // The model's trained context: its GGUF's, or less where --context says the header overstates it.
    check_context_flag(options.model_path, text_input.context, c);
    const int context = text_input.context > 0 ? std::min(text_input.context, c.context_length) : c.context_length;
    if (generation > context)
        throw InputError("--prompt: " + std::to_string(prompt.size()) + " tokens and -n " +
                         std::to_string(options.new_tokens) + " pass the model's context of " + std::to_string(context) +
                         " positions");
    int positions = generation;
    if (text)
        for (const auto& sequence : text->text.sequences) positions = std::max(positions, static_cast<int>(sequence.size()));

    const kvsim_model_shape shape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, positions,
                                  static_cast<int32_t>(prompt.size())};
    RuntimeHandle handle;
    if (kvsim_rt_create(options.profile_path.c_str(), &shape, options.backend.c_str(), &handle.rt) != KVSIM_OK)
        throw InputError(kvsim_rt_create_error());
    RuntimeAttention hooks(handle.rt, c);

    GenerateResult result;
    // Perplexity first (each sequence from an empty cache), then the prompt's continuation.
    if (text) {
        double nll = 0;
        for (const std::vector<int>& tokens : text->text.sequences) {
            hooks.reset();
            nll += llama.sequence_nll(tokens, &hooks, 1);
            result.ppl_tokens += static_cast<int64_t>(tokens.size()) - 1;
        }
        result.ppl = std::exp(nll / static_cast<double>(result.ppl_tokens));
    }

    hooks.reset();
    llama.reset();
    result.prompt_tokens = static_cast<int>(prompt.size());
    // The prompt in one prefill (compressed once at its end), then token by token.
    hooks.set_prefill(true);
    const float* logits = llama.forward_batch(prompt, 0, &hooks) +
                          static_cast<std::size_t>(result.prompt_tokens - 1) * c.vocab_size;
    hooks.set_prefill(false);
    std::vector<int> generated;
    for (int pos = result.prompt_tokens; pos < result.prompt_tokens + options.new_tokens; ++pos) {
        const int next = static_cast<int>(std::max_element(logits, logits + c.vocab_size) - logits);  // greedy
        if (next == tokenizer.eos_id()) break;
        generated.push_back(next);
        if (pos + 1 == result.prompt_tokens + options.new_tokens) break;
        logits = llama.forward(next, pos, &hooks);
    }
    result.generated_tokens = static_cast<int>(generated.size());
    result.text = tokenizer.decode(generated);

    double held = 0, full = 0;
    kvsim_rt_bytes(handle.rt, -1, &held, &full);
    const double heads = static_cast<double>(c.n_layers) * c.n_kv_heads;
    const double last_positions = full / (4.0 * c.head_dim * heads);  // context at the last step
    result.bytes_per_token = last_positions > 0 ? held / (heads * last_positions) : 0;
    result.compression_ratio = held > 0 ? full / held : 0;
    return result;
}

}  // namespace kvsim
