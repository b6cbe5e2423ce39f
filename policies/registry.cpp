// Every policy kvsim knows, by the name configs use.
#include <cmath>
#include <sstream>

#include "policies/policy.h"
#include "base/errors.h"

namespace kvsim {

PolicyDescriptor sliding_window_descriptor();
PolicyDescriptor streaming_llm_descriptor();
PolicyDescriptor h2o_descriptor();
PolicyDescriptor scissorhands_descriptor();
PolicyDescriptor tova_descriptor();
PolicyDescriptor snapkv_descriptor();
PolicyDescriptor pyramidkv_descriptor();
PolicyDescriptor full_descriptor();
PolicyDescriptor int8_descriptor();
PolicyDescriptor int4_descriptor();
PolicyDescriptor streaming_attention_descriptor();
PolicyDescriptor stratigraphic_descriptor();
PolicyDescriptor lowrank_descriptor();
PolicyDescriptor group_heads_descriptor();
PolicyDescriptor snapkv_press_descriptor();
PolicyDescriptor tova_press_descriptor();
PolicyDescriptor observed_attention_press_descriptor();
PolicyDescriptor knorm_press_descriptor();
PolicyDescriptor streaming_llm_press_descriptor();
PolicyDescriptor keydiff_press_descriptor();
PolicyDescriptor cur_press_descriptor();
PolicyDescriptor lagkv_press_descriptor();
PolicyDescriptor noncausal_press_descriptor();
PolicyDescriptor mixed_descriptor();

const std::vector<PolicyDescriptor>& policy_registry() {
    static const std::vector<PolicyDescriptor> registry = {
        sliding_window_descriptor(), streaming_llm_descriptor(), h2o_descriptor(),   scissorhands_descriptor(),
        tova_descriptor(),           snapkv_descriptor(),        pyramidkv_descriptor(),       full_descriptor(),
        int8_descriptor(),           int4_descriptor(),          streaming_attention_descriptor(),
        stratigraphic_descriptor(),  lowrank_descriptor(),       group_heads_descriptor(),
        // kvpress's presses: prefill-time compression of a prompt (prompt_press.h).
        snapkv_press_descriptor(),   tova_press_descriptor(),    observed_attention_press_descriptor(),
        knorm_press_descriptor(),    streaming_llm_press_descriptor(), keydiff_press_descriptor(),
        cur_press_descriptor(),      lagkv_press_descriptor(),   noncausal_press_descriptor(),
        // kvsim's per-head mix of the above (policies/mixed.h).
        mixed_descriptor(),
    };
    return registry;
}

const PolicyDescriptor* find_policy(std::string_view name) {
    for (const auto& policy : policy_registry())
        if (policy.name == name) return &policy;
    return nullptr;
}

std::string known_policy_names() {
    std::string names;
    for (const auto& policy : policy_registry()) names += (names.empty() ? "" : ", ") + policy.name;
    return names;
}

static std::string format_number(double v) {
    std::ostringstream out;
    out << v;
    return out.str();
}

ParamValues resolve_params(const PolicyDescriptor& policy, const std::map<std::string, double>& given,
                           const std::string& where) {
    ParamValues values;
    for (const auto& spec : policy.params)
        if (!spec.file) values[spec.name] = spec.default_value;  // file parameters travel as paths
    for (const auto& [name, value] : given) {
        const ParamSpec* spec = nullptr;
        for (const auto& s : policy.params)
            if (s.name == name && s.file) throw InputError(where + "." + name + ": expected a file path, got a number");
        for (const auto& s : policy.params)
            if (s.name == name) spec = &s;
        if (!spec) {
            std::string known;
            for (const auto& s : policy.params) known += (known.empty() ? "" : ", ") + s.name;
            throw InputError(where + ": unknown parameter '" + name + "' for policy " + policy.name +
                             (known.empty() ? " (it takes none)" : " (known: " + known + ")"));
        }
        const std::string key = where + "." + name;
        if (!std::isfinite(value)) throw InputError(key + ": must be a finite number");
        if (spec->integer && value != std::floor(value))
            throw InputError(key + ": must be an integer, got " + format_number(value));
        if (value < spec->min_value)
            throw InputError(key + ": must be >= " + format_number(spec->min_value) + ", got " + format_number(value));
        if (spec->integer && value > 1e9) throw InputError(key + ": " + format_number(value) + " is too large");
        if (spec->odd && static_cast<int64_t>(value) % 2 == 0)
            throw InputError(key + ": must be odd, got " + format_number(value));
        values[name] = value;
    }
    return values;
}

void check_file_params(const PolicyDescriptor& policy, const std::map<std::string, std::string>& files,
                       const std::string& where, const std::map<std::string, double>& given) {
    for (const auto& [name, path] : files) {
        const ParamSpec* spec = nullptr;
        for (const auto& s : policy.params)
            if (s.name == name) spec = &s;
        if (!spec) throw InputError(where + ": unknown parameter '" + name + "' for policy " + policy.name);
        if (!spec->file) throw InputError(where + "." + name + ": expected a number, got '" + path + "'");
        for (const std::string& replaced : spec->replaces)
            if (given.count(replaced))
                throw InputError(where + "." + replaced + ": " + name + " (" + path + ") replaces " + replaced +
                                 ", which would go unused; give one or the other");
    }
}

std::string check_recent_window_fits(const ParamValues& params, int budget) {
    const int window = param_int(params, "recent_window");
    if (window >= budget)
        return "recent_window = " + std::to_string(window) + " must be less than the budget " + std::to_string(budget);
    return {};
}

}  // namespace kvsim
