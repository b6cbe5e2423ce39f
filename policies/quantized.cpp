// Quantised caches: KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
// KV Cache") arranges keys per channel and values per token; here symmetric, after RoPE. Any
// eviction policy composes with a quantisation rule; `full`, `int8` and `int4` keep every token.
#include <cmath>

#include "policies/policy.h"
#include "cache_math/quantize.h"
#include "base/errors.h"

namespace kvsim {
namespace {

// Keeps every position: the full cache, and the base of the whole-cache quantisers.
class KeepAll : public Policy {
public:
    void on_decode_step(int32_t, std::span<const float>) override {}
    bool reads_attention() const override { return false; }
    void evict(int, std::vector<int32_t>&) override {}
    std::size_t bytes_per_slot() const override { return 0; }  // a full cache needs no bookkeeping
};

// Holds what `inner` keeps; a token older than `older_than` steps is stored at `bits`, and a
// key waits at fp16 until its whole token group has arrived (its per-channel scale needs them).
class Quantized : public Policy {
public:
    Quantized(std::unique_ptr<Policy> inner, const QuantizeRule& rule) : inner_(std::move(inner)), rule_(rule) {
        format_.key_group = rule.key_group;
        format_.value_group = rule.value_group;
    }
    void on_decode_step(int32_t pos, std::span<const float> attn) override { inner_->on_decode_step(pos, attn); }
    void evict(int budget, std::vector<int32_t>& victims) override { inner_->evict(budget, victims); }
    std::size_t bytes_per_slot() const override { return inner_->bytes_per_slot(); }
    bool reads_attention() const override { return inner_->reads_attention(); }
    bool sizes_itself() const override { return inner_->sizes_itself(); }
    const TierFormat* tier_format() const override { return &format_; }
    const KvProjection* projection() const override { return inner_->projection(); }
    int eviction_target(int budget) const override { return inner_->eviction_target(budget); }
    bool held_scores(HeldScores& out) override { return inner_->held_scores(out); }
    void evict_to(int keep, std::vector<int32_t>& victims) override { inner_->evict_to(keep, victims); }

    void assign_tiers(int32_t t, std::span<const int32_t> held, std::span<uint8_t> key_tier,
                      std::span<uint8_t> value_tier) override {
        const uint8_t low = static_cast<uint8_t>(rule_.bits == 8 ? Tier::int8 : Tier::int4);
        for (int32_t p : held) {
            const bool young = t - p < rule_.older_than;
            value_tier[p] = young ? 0 : low;
            key_tier[p] = (young || key_group_pending(p, t, rule_.key_group)) ? 0 : low;
        }
    }

private:
    std::unique_ptr<Policy> inner_;
    QuantizeRule rule_;
    TierFormat format_;
};

std::string format_int(double v) { return std::to_string(static_cast<long long>(v)); }

}  // namespace

QuantizeRule resolve_quantize(const std::map<std::string, double>& given, const std::string& where) {
    QuantizeRule rule;
    for (const auto& [name, value] : given) {
        const std::string key = where + "." + name;
        if (name != "bits" && name != "older_than" && name != "key_group" && name != "value_group")
            throw InputError(where + ": unknown key '" + name + "' (known: bits, older_than, key_group, value_group)");
        if (value != std::floor(value) || !std::isfinite(value))
            throw InputError(key + ": must be an integer");
    }
    auto get = [&](const char* name, double fallback) {
        const auto it = given.find(name);
        return it == given.end() ? fallback : it->second;
    };
    const double bits = get("bits", 8);
    if (bits != 4 && bits != 8) throw InputError(where + ".bits: must be 4 or 8, got " + format_int(bits));
    rule.bits = static_cast<int>(bits);
    const double default_group = rule.bits == 8 ? 128 : 64;
    const double older = get("older_than", 0), key_group = get("key_group", default_group),
                 value_group = get("value_group", default_group);
    if (older < 0) throw InputError(where + ".older_than: must be >= 0, got " + format_int(older));
    if (key_group < 1) throw InputError(where + ".key_group: must be >= 1, got " + format_int(key_group));
    if (value_group < 1) throw InputError(where + ".value_group: must be >= 1, got " + format_int(value_group));
    if (older > 1e9 || key_group > 1e9 || value_group > 1e9) throw InputError(where + ": value too large");
    rule.older_than = static_cast<int>(older);
    rule.key_group = static_cast<int>(key_group);
    rule.value_group = static_cast<int>(value_group);
    return rule;
}

std::string quantize_label(const QuantizeRule& rule) {
    std::string label = rule.bits == 8 ? "int8" : "int4";
    std::string args;
    const int default_group = rule.bits == 8 ? 128 : 64;
    if (rule.older_than) args += "older_than=" + std::to_string(rule.older_than);
    if (rule.key_group != default_group) args += (args.empty() ? "" : ",") + std::string("key_group=") + std::to_string(rule.key_group);
    if (rule.value_group != default_group)
        args += (args.empty() ? "" : ",") + std::string("value_group=") + std::to_string(rule.value_group);
    return args.empty() ? label : label + "(" + args + ")";
}

std::unique_ptr<Policy> make_keep_all() { return std::make_unique<KeepAll>(); }

std::unique_ptr<Policy> make_quantized(std::unique_ptr<Policy> inner, const QuantizeRule& rule) {
    return std::make_unique<Quantized>(std::move(inner), rule);
}

namespace {
PolicyDescriptor whole_cache_quantizer(const std::string& name, int bits) {
    const double group = bits == 8 ? 128 : 64;
    PolicyDescriptor d{name, "KIVI arrangement (Liu et al. 2024), symmetric, after RoPE, every token kept",
                       {{"key_group", group, true, 1, "tokens sharing a per-channel key scale"},
                        {"value_group", group, true, 1, "channels sharing a per-token value scale"},
                        {"fp16_recent", 0, true, 0, "most recent tokens kept at fp16"}},
                       [bits](const ParamValues& p, const PolicyContext&) -> std::unique_ptr<Policy> {
                           QuantizeRule rule;
                           rule.bits = bits;
                           rule.key_group = param_int(p, "key_group");
                           rule.value_group = param_int(p, "value_group");
                           rule.older_than = param_int(p, "fp16_recent");
                           return make_quantized(std::make_unique<KeepAll>(), rule);
                       },
                       nullptr};
    d.keeps_everything = true;
    d.changes_values = true;
    return d;
}
}  // namespace

PolicyDescriptor full_descriptor() {
    PolicyDescriptor d{"full", "the full cache: every token at fp16 (the baseline)", {},
                       [](const ParamValues&, const PolicyContext&) -> std::unique_ptr<Policy> {
                           return std::make_unique<KeepAll>();
                       },
                       nullptr};
    d.keeps_everything = true;
    return d;
}
PolicyDescriptor int8_descriptor() { return whole_cache_quantizer("int8", 8); }
PolicyDescriptor int4_descriptor() { return whole_cache_quantizer("int4", 4); }

}  // namespace kvsim
