// The contract between the replay harness and a KV-cache policy, and the registry that names
// every policy with its published default parameters.
#pragma once
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cache_math/tier_format.h"

namespace kvsim {

// A policy holds an ascending list of positions (it starts holding position 0, as the harness's
// cache does). At step `pos` it sees the attention on the positions it holds, then admits `pos`;
// when the cache is over budget it chooses victims.
class StreamingHeadState;  // cache_math/streaming_heads.h
struct KvProjection;        // cache_math/lowrank.h

// The prompt of one layer as a prefill-time compressor (kvpress's presses) reads it, once, at the
// prompt's end: every query head's queries and every KV head's keys and values, after RoPE, as
// the model computed them; position-major, as a trace stores them (cache_math/qkv_layer.h).
struct PromptView {
    int length = 0;  // prompt positions 0..length-1
    int layer = 0, num_layers = 1;
    int kv_head = 0;  // the KV head being compressed
    int num_query_heads = 1, num_kv_heads = 1, head_dim = 0;
    const float* queries = nullptr;  // [position][query head][head_dim]
    const float* keys = nullptr;     // [position][KV head][head_dim]
    const float* values = nullptr;   // [position][KV head][head_dim]

    int group() const { return num_query_heads / num_kv_heads; }
    const float* query(int64_t pos, int head) const {
        return queries + (pos * num_query_heads + head) * static_cast<int64_t>(head_dim);
    }
    const float* key(int64_t pos, int kv) const { return keys + (pos * num_kv_heads + kv) * static_cast<int64_t>(head_dim); }
    const float* value(int64_t pos, int kv) const {
        return values + (pos * num_kv_heads + kv) * static_cast<int64_t>(head_dim);
    }
};

// What a scored policy holds, slot by slot: for selection across the KV heads of a layer.
struct HeldScores {
    std::vector<int32_t> position;  // ascending
    std::vector<double> score;      // lower is evicted first; NaN lowest of all
    std::vector<uint8_t> protect;   // 1: never evicted (counts against the head's budget)
};

class Policy {
public:
    virtual ~Policy() = default;

    // attn[j] is the (not renormalised) weight of step `pos` on the j-th held position. Existing
    // slots are updated first (the first min(attn.size(), held) of them), then `pos` is admitted.
    virtual void on_decode_step(int32_t pos, std::span<const float> attn) = 0;

    // Brings the cache down to at most `budget` positions; appends victims in ascending order.
    virtual void evict(int budget, std::vector<int32_t>& victims) = 0;

    // Bookkeeping bytes this policy keeps per cached position (its position index included).
    virtual std::size_t bytes_per_slot() const = 0;

    // --- Precision: only policies that quantise override these. ---

    // After step t's eviction: the tier of each held position's key and value (indexed by
    // position; entries of positions not held are ignored). The caller keeps both arrays between
    // calls: a held position's entries are what this policy last gave it, fp16 (0) where it was
    // admitted since. So a policy may write only the entries it changes (thousands of positions
    // are held, and a step sinks a few). The default keeps everything at fp16.
    virtual void assign_tiers(int32_t t, std::span<const int32_t> held, std::span<uint8_t> key_tier,
                              std::span<uint8_t> value_tier) {
        (void)t, (void)held, (void)key_tier, (void)value_tier;
    }
    // The quantisation the tiers refer to; nullptr for a policy that keeps everything at fp16.
    virtual const TierFormat* tier_format() const { return nullptr; }
    // How many held positions sit at each tier (fp16, INT8, INT4) as assign_tiers last reported
    // them, where each position's key and value share its tier and the policy counts them as they
    // change: the memory metric then costs a few products a step, not a pass over the held
    // positions. False where the policy does not count them.
    virtual bool held_per_tier(std::array<int64_t, 3>& count) const { (void)count; return false; }
    // Whether on_decode_step reads the attention it is given: false for a policy that keeps by
    // position alone, which is then given an empty span (the harness skips building it).
    virtual bool reads_attention() const { return true; }
    // Whether evict() runs every step, not only over budget: a policy that sizes itself.
    virtual bool sizes_itself() const { return false; }
    // A streaming head's decayed linear state, which stands for the tokens it let go; nullptr for
    // every other policy. The harness feeds it each token's key and value and reads its output.
    virtual StreamingHeadState* linear_state() const { return nullptr; }
    // How the cache holds each token in fewer numbers (a low-rank latent, a KV-head group's shared
    // K and V), composed with eviction and tiers; nullptr for a cache of whole head vectors.
    virtual const KvProjection* projection() const { return nullptr; }

    // --- Prefill-time compression (kvpress's presses, policies/prompt_press.h). ---

    // A policy that compresses the prompt once, at its end, from the whole prompt, and never
    // evicts again: decoding appends. The harness then calls score_prompt after the prompt's last
    // token is admitted, just before the one eviction.
    virtual bool reads_prompt() const { return false; }
    virtual void score_prompt(const PromptView& prompt) { (void)prompt; }

    // --- Cross-head selection (Ada-KV, policies/adakv.h): scored eviction policies override these. ---

    // How far evict(budget) brings the cache down: the budget, or a policy's own share of it
    // (PyramidKV's layer share).
    virtual int eviction_target(int budget) const { return budget; }
    // Each held position (ascending), its score in the policy's own eviction order and whether it
    // is protected (a recent window, a token not yet observed): false for a policy without scores.
    virtual bool held_scores(HeldScores& out) { (void)out; return false; }
    // Brings the cache down to exactly `keep` positions (fewer only where protection allows no
    // more), by the policy's own order, whatever its eviction_target would be.
    virtual void evict_to(int keep, std::vector<int32_t>& victims) { evict(keep, victims); }
};

// Per-slot values in slot order where closing one slot moves whichever side of it is shorter: the
// slots before it one place on (the array then starts one place later) or those after it one
// place back. Where victims fall anywhere (SnapKV's), that halves what an eviction moves.
template <class T>
class SlotArray {
public:
    using value_type = T;
    // Room for `capacity` slots and as many moves of the start before the values go back to the
    // front.
    void reserve(std::size_t capacity) {
        if (storage_.size() < 2 * capacity) storage_.resize(2 * capacity);
    }
    void push_back(T value) {
        if (begin_ + size_ == storage_.size()) make_room();
        storage_[begin_ + size_++] = value;
    }
    std::size_t size() const { return size_; }
    T* data() { return storage_.data() + begin_; }
    const T* data() const { return storage_.data() + begin_; }
    T& operator[](std::size_t i) { return data()[i]; }
    const T& operator[](std::size_t i) const { return data()[i]; }
    const T* begin() const { return data(); }
    const T* end() const { return data() + size_; }
    operator std::span<const T>() const { return {data(), size_}; }

    // Removes the entries at `slots` (ascending indices), keeping the order of the rest: a single
    // slot (a step's usual eviction) by moving the shorter side, several by one block move per gap.
    void erase(std::span<const std::size_t> slots) {
        if (slots.empty()) return;
        T* at = data();
        if (slots.size() == 1 && slots[0] < size_ / 2) {
            std::copy_backward(at, at + slots[0], at + slots[0] + 1);
            ++begin_;
            --size_;
            return;
        }
        std::size_t out = slots[0];
        for (std::size_t v = 0; v < slots.size(); ++v) {
            const std::size_t from = slots[v] + 1;
            const std::size_t to = v + 1 < slots.size() ? slots[v + 1] : size_;
            std::copy(at + from, at + to, at + out);
            out += to - from;
        }
        size_ = out;
    }

private:
    // At the storage's end: back to the front where that frees at least half of it (so such moves
    // are at most one per size() erasures), else more room.
    void make_room() {
        if (begin_ > 0 && 2 * size_ <= storage_.size()) {
            std::copy(data(), data() + size_, storage_.data());
            begin_ = 0;
        } else {
            storage_.resize(std::max<std::size_t>(16, 2 * storage_.size()));
        }
    }
    std::vector<T> storage_;
    std::size_t begin_ = 0, size_ = 0;
};

// Parameter values after defaults are filled in; every policy parameter is a number.
using ParamValues = std::map<std::string, double>;

struct ParamSpec {
    std::string name;
    double default_value;
    bool integer;
    double min_value;
    std::string help;
    bool odd = false;   // pooling kernels must be odd to have a centre
    bool file = false;  // a path (relative to the config file), not a number
    // A file that replaces these parameters (lowrank's ranks: key_rank and value_rank): giving both
    // would leave one unused, so a config that does is refused.
    std::vector<std::string> replaces = {};
};

// What a policy may know about where it runs, besides its own parameters.
struct PolicyContext {
    int budget = 0;      // the harness budget, in tokens
    int capacity = 1;    // the most positions the harness hands it at once (budget + 1, more with a prefill)
    int layer = 0;       // this stream's layer in the trace
    int num_layers = 1;  // layers in the trace
    int kv_head = 0;     // this stream's KV head
    int num_kv_heads = 1;
    int head_dim = 0;    // 0 where the trace has no values
    const std::map<std::string, std::string>* files = nullptr;  // file parameters (paths), by name
};

// Memory an instance allocates that a parameter (or the trace's head size) sizes, beyond its
// per-slot bookkeeping: SnapKV's observation window, a streaming head's exact tokens and state.
// Checked against the memory limit before the instance is built, naming the parameter's key.
struct ParamMemory {
    uint64_t bytes = 0;
    std::string param;   // the parameter that sizes it; empty when the trace's shape does
    std::string detail;  // what the bytes are, e.g. "16 steps x 257 cached tokens"
};

struct PolicyDescriptor {
    std::string name;
    std::string paper;  // one line: who published it, where
    std::vector<ParamSpec> params;
    std::function<std::unique_ptr<Policy>(const ParamValues&, const PolicyContext&)> make;
    // Parameters that must fit inside the budget (a recent window narrower than it, say):
    // returns an empty string when fine, else what is wrong.
    std::function<std::string(const ParamValues&, int budget)> check_budget;
    // A policy that never evicts (full, int8, int4): budgets do not apply, one row fills them all.
    bool keeps_everything = false;
    // Null when the budget alone sizes the policy's memory.
    std::function<ParamMemory(const ParamValues&, const PolicyContext&)> param_memory = nullptr;
    // A scored eviction policy (policies/scored_eviction.h): it reports held_scores, so Ada-KV can
    // select across the KV heads of a layer by its scores.
    bool scored = false;
    // A policy whose cache holds its tokens' keys and values other than at fp16 (quantised tiers,
    // a streaming head's linear state): output error shows what it loses, retained mass cannot.
    // Last, so the descriptors' positional initialisers above keep their meaning.
    bool changes_values = false;
    // Checks of parameters against the trace's shape (a rank above the head size): returns the
    // parameter at fault and what is wrong, or an empty problem when fine.
    std::function<std::pair<std::string, std::string>(const ParamValues&, const PolicyContext&)> check_context =
        nullptr;
    // A projection policy (lowrank, group_heads): how its cache holds each token, so that it can
    // wrap an eviction policy too ({evict: h2o, project: {lowrank: {...}}}).
    std::function<std::shared_ptr<const KvProjection>(const ParamValues&, const PolicyContext&)> projection = nullptr;
    // A prefill-time compressor (kvpress's presses): it reads the prompt (Policy::reads_prompt),
    // needs a prompt to compress, and holds every token decoded after it.
    bool prompt_press = false;
};

// The quantisation composed with an eviction policy: {evict: h2o, quantize: {bits: 4, older_than: 128}}.
struct QuantizeRule {
    int bits = 8;           // 8 or 4
    int older_than = 0;     // tokens younger than this many steps stay fp16 (a recent fp16 window)
    int key_group = 128;    // KIVI keys: tokens per per-channel scale (a token's key stays fp16 until its group is complete)
    int value_group = 128;  // channels per per-token value scale
};

// Parses a quantize map (bits, older_than, key_group, value_group); group sizes default to 128
// for 8 bits and 64 for 4 bits. Throws InputError prefixed by `where`.
QuantizeRule resolve_quantize(const std::map<std::string, double>& given, const std::string& where);
std::string quantize_label(const QuantizeRule& rule);  // "int4(older_than=128)"

// Wraps an eviction policy so that what it keeps is held at the rule's precision.
std::unique_ptr<Policy> make_quantized(std::unique_ptr<Policy> inner, const QuantizeRule& rule);

// Keeps every position (the full cache; the base of whole-cache quantisers and projections).
std::unique_ptr<Policy> make_keep_all();
// Wraps a policy so that each token it keeps is held through a projection (policies/lowrank.cpp).
std::unique_ptr<Policy> make_projected(std::unique_ptr<Policy> inner, std::shared_ptr<const KvProjection> projection);

const std::vector<PolicyDescriptor>& policy_registry();
const PolicyDescriptor* find_policy(std::string_view name);
std::string known_policy_names();  // "sliding_window, streaming_llm, ..." for error messages

// Fills in defaults and checks names, integrality, ranges; throws InputError prefixed by `where`.
ParamValues resolve_params(const PolicyDescriptor& policy, const std::map<std::string, double>& given,
                           const std::string& where);

// File parameters must be declared as such, and none given beside the parameters it replaces
// (`given`: the numbers the config sets); throws InputError prefixed by `where`.
void check_file_params(const PolicyDescriptor& policy, const std::map<std::string, std::string>& files,
                       const std::string& where, const std::map<std::string, double>& given = {});

// A recent window must leave room to evict: shared by the windowed policies.
std::string check_recent_window_fits(const ParamValues& params, int budget);

inline int param_int(const ParamValues& params, const std::string& name) {
    return static_cast<int>(params.at(name));
}

}  // namespace kvsim
