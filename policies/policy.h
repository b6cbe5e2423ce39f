// The contract between the replay harness and a KV-cache policy, and the registry that names
// every policy with its published default parameters.
#pragma once
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvsim {

// A policy holds an ascending list of positions (it starts holding position 0, as the harness's
// cache does). At step `pos` it sees the attention on the positions it holds, then admits `pos`;
// when the cache is over budget it chooses victims.
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
};

// Removes the entries at `slots` (ascending indices) from `column`, keeping the order of the
// rest: one block move per gap, since a step usually evicts a single slot.
template <class T>
void erase_slots(std::vector<T>& column, std::span<const std::size_t> slots) {
    if (slots.empty()) return;
    T* data = column.data();
    std::size_t out = slots[0];
    for (std::size_t v = 0; v < slots.size(); ++v) {
        const std::size_t from = slots[v] + 1;
        const std::size_t to = v + 1 < slots.size() ? slots[v + 1] : column.size();
        std::copy(data + from, data + to, data + out);
        out += to - from;
    }
    column.resize(out);
}

// Parameter values after defaults are filled in; every policy parameter is a number.
using ParamValues = std::map<std::string, double>;

struct ParamSpec {
    std::string name;
    double default_value;
    bool integer;
    double min_value;
    std::string help;
    bool odd = false;  // pooling kernels must be odd to have a centre
};

// What a policy may know about where it runs, besides its own parameters.
struct PolicyContext {
    int budget = 0;      // the harness budget, in tokens
    int capacity = 1;    // the most positions the harness hands it at once (budget + 1, more with a prefill)
    int layer = 0;       // this stream's layer in the trace
    int num_layers = 1;  // layers in the trace
};

struct PolicyDescriptor {
    std::string name;
    std::string paper;  // one line: who published it, where
    std::vector<ParamSpec> params;
    std::function<std::unique_ptr<Policy>(const ParamValues&, const PolicyContext&)> make;
    // Parameters that must fit inside the budget (a recent window narrower than it, say):
    // returns an empty string when fine, else what is wrong.
    std::function<std::string(const ParamValues&, int budget)> check_budget;
};

const std::vector<PolicyDescriptor>& policy_registry();
const PolicyDescriptor* find_policy(std::string_view name);
std::string known_policy_names();  // "sliding_window, streaming_llm, ..." for error messages

// Fills in defaults and checks names, integrality, ranges; throws InputError prefixed by `where`.
ParamValues resolve_params(const PolicyDescriptor& policy, const std::map<std::string, double>& given,
                           const std::string& where);

// A recent window must leave room to evict: shared by the windowed policies.
std::string check_recent_window_fits(const ParamValues& params, int budget);

inline int param_int(const ParamValues& params, const std::string& name) {
    return static_cast<int>(params.at(name));
}

}  // namespace kvsim
