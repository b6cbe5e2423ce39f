// A mixed cache, one method per (layer, KV head), as `kvsim search` fits it (fit: mixed): no
// published system chooses per head among eviction, tiered precision, streaming and the full
// cache; each piece is a published policy (policies/mixed.h), built here for its own head:
//   for the stream's (layer, KV head), read the head's method from the plan;
//   evict:     the plan's eviction policy at the head's own budget;
//   tiers:     stratigraphic at the head's own FP16/INT8/INT4 shares;
//   streaming: streaming_attention's streaming head at the head's lambda (or without a state);
//   full:      every token at fp16.
#include "policies/mixed.h"

#include <cmath>

#include "base/errors.h"
#include "base/json_file.h"
#include "cache_math/tier_shares.h"

namespace kvsim {

std::string_view head_method_name(HeadMethod m) {
    switch (m) {
        case HeadMethod::evict: return "evict";
        case HeadMethod::tiers: return "tiers";
        case HeadMethod::streaming: return "streaming";
        case HeadMethod::full: return "full";
    }
    return "?";
}

std::size_t MixedPlan::count(HeadMethod m) const {
    std::size_t n = 0;
    for (HeadMethod h : method) n += h == m;
    return n;
}

namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr int kMostTokens = 100000000;  // the largest budget or window a plan may give (sim's kMaxBudgetTokens)

// An eviction policy held to its own head's budget. The harness holds a mixed head to the whole
// sequence (the policy keeps everything as far as it knows), so this asks to be sized every step
// and evicts, as the harness would, only once the head holds more than its budget.
class HeadBudget : public Policy {
public:
    HeadBudget(std::unique_ptr<Policy> inner, int budget) : inner_(std::move(inner)), budget_(budget) {}
    void on_decode_step(int32_t pos, std::span<const float> attn) override {
        inner_->on_decode_step(pos, attn);
        ++held_;
    }
    void evict(int, std::vector<int32_t>& victims) override {
        if (held_ <= budget_) return;
        const std::size_t before = victims.size();
        inner_->evict(budget_, victims);
        held_ -= static_cast<int64_t>(victims.size() - before);
    }
    std::size_t bytes_per_slot() const override { return inner_->bytes_per_slot(); }
    bool reads_attention() const override { return inner_->reads_attention(); }
    bool sizes_itself() const override { return true; }
    void assign_tiers(int32_t t, std::span<const int32_t> held, std::span<uint8_t> key_tier,
                      std::span<uint8_t> value_tier) override {
        inner_->assign_tiers(t, held, key_tier, value_tier);
    }
    const TierFormat* tier_format() const override { return inner_->tier_format(); }
    StreamingHeadState* linear_state() const override { return inner_->linear_state(); }
    const KvProjection* projection() const override { return inner_->projection(); }

private:
    std::unique_ptr<Policy> inner_;
    int64_t budget_;
    int64_t held_ = 1;  // a policy starts holding position 0
};

struct PlanReader {
    std::string where;
    // `key` below the plan ("evict.budgets[0][1]"); empty: the plan itself.
    [[noreturn]] void fail(const std::string& key, const std::string& what) const {
        throw InputError(where + (key.empty() ? "" : "." + key) + ": " + what);
    }
    const Json& at(const Json& j, const std::string& name, const std::string& parent) const {
        if (!j.is_object()) fail(parent, "expected an object");
        if (!j.contains(name)) fail(parent.empty() ? name : parent + "." + name, "missing");
        return j.at(name);
    }
    // A table of num_layers rows of num_kv_heads numbers in [lo, hi].
    std::vector<double> table(const Json& j, const std::string& key, int L, int K, double lo, double hi) const {
        std::vector<double> out;
        if (!j.is_array() || static_cast<int>(j.size()) != L)
            fail(key, "expected " + std::to_string(L) + " rows (one per layer)");
        for (int l = 0; l < L; ++l) {
            const Json& row = j[static_cast<std::size_t>(l)];
            const std::string row_key = key + "[" + std::to_string(l) + "]";
            if (!row.is_array() || static_cast<int>(row.size()) != K)
                fail(row_key, "expected " + std::to_string(K) + " entries (one per KV head)");
            for (int kv = 0; kv < K; ++kv) {
                const Json& v = row[static_cast<std::size_t>(kv)];
                const std::string k = row_key + "[" + std::to_string(kv) + "]";
                if (!v.is_number()) fail(k, "expected a number");
                const double x = v.get<double>();
                if (!std::isfinite(x) || x < lo || x > hi)
                    fail(k, v.dump() + " is outside [" + format_number(lo) + ", " + format_number(hi) + "]");
                out.push_back(x);
            }
        }
        return out;
    }
    ParamValues params(const Json& j, const std::string& key) const {
        if (!j.is_object()) fail(key, "expected an object of numbers");
        ParamValues out;
        for (const auto& [name, value] : j.items()) {
            if (!value.is_number() || !std::isfinite(value.get<double>())) fail(key + "." + name, "expected a number");
            out[name] = value.get<double>();
        }
        return out;
    }
    static std::string format_number(double x) {
        char text[32];
        std::snprintf(text, sizeof text, "%g", x);
        return text;
    }
};

OrderedJson rows(const std::vector<double>& v, int L, int K) {
    OrderedJson out = OrderedJson::array();
    for (int l = 0; l < L; ++l) {
        OrderedJson row = OrderedJson::array();
        for (int kv = 0; kv < K; ++kv) row.push_back(v[static_cast<std::size_t>(l) * K + kv]);
        out.push_back(row);
    }
    return out;
}

template <class T>
std::vector<double> as_doubles(const std::vector<T>& v) {
    return std::vector<double>(v.begin(), v.end());
}

// The stratigraphic parameters of one tier head: its own shares, with no depth slope.
ParamValues tier_head_params(const MixedPlan& plan, std::size_t u) {
    ParamValues p = plan.tier_params;
    p["surface"] = plan.fp16[u];
    p["slope"] = 0;  // fp16 share = surface * ((1 - 0) + 0 * depth): the head's own share, exactly
    p["int8_share"] = plan.int8[u];
    p["int4_share"] = plan.int4[u];
    return p;
}

}  // namespace

OrderedJson mixed_plan_json(const MixedPlan& plan) {
    const int L = plan.num_layers, K = plan.num_kv_heads;
    OrderedJson methods = OrderedJson::array();
    for (int l = 0; l < L; ++l) {
        OrderedJson row = OrderedJson::array();
        for (int kv = 0; kv < K; ++kv) row.push_back(std::string(head_method_name(plan.method[plan.index(l, kv)])));
        methods.push_back(row);
    }
    OrderedJson j;
    j["method"] = methods;
    auto numbers = [](const ParamValues& p) {
        OrderedJson o = OrderedJson::object();
        for (const auto& [name, value] : p) o[name] = value;
        return o;
    };
    if (plan.count(HeadMethod::evict))
        j["evict"] = {{"policy", plan.evict_policy}, {"params", numbers(plan.evict_params)},
                      {"budgets", rows(as_doubles(plan.budgets), L, K)}};
    if (plan.count(HeadMethod::tiers))
        j["tiers"] = {{"params", numbers(plan.tier_params)}, {"fp16", rows(plan.fp16, L, K)},
                      {"int8", rows(plan.int8, L, K)}, {"int4", rows(plan.int4, L, K)}};
    if (plan.count(HeadMethod::streaming))
        j["streaming"] = {{"sinks", plan.sinks}, {"recent", plan.recent}, {"lambda", rows(plan.lambda, L, K)},
                          {"stateless", rows(as_doubles(plan.stateless), L, K)}};
    return j;
}

MixedPlan parse_mixed_plan(const Json& mixed, int L, int K, const std::string& where) {
    const PlanReader r{where};
    MixedPlan plan;
    plan.num_layers = L;
    plan.num_kv_heads = K;
    const std::size_t units = static_cast<std::size_t>(L) * K;
    const Json& methods = r.at(mixed, "method", "");
    if (!methods.is_array() || static_cast<int>(methods.size()) != L)
        r.fail("method", "expected " + std::to_string(L) + " rows (one per layer)");
    for (int l = 0; l < L; ++l) {
        const Json& row = methods[static_cast<std::size_t>(l)];
        if (!row.is_array() || static_cast<int>(row.size()) != K)
            r.fail("method[" + std::to_string(l) + "]", "expected " + std::to_string(K) + " entries (one per KV head)");
        for (int kv = 0; kv < K; ++kv) {
            const Json& m = row[static_cast<std::size_t>(kv)];
            const std::string key = "method[" + std::to_string(l) + "][" + std::to_string(kv) + "]";
            int found = -1;
            for (int i = 0; i < kHeadMethods && m.is_string(); ++i)
                if (m.get<std::string>() == head_method_name(static_cast<HeadMethod>(i))) found = i;
            if (found < 0) r.fail(key, m.dump() + " is not a method (known: evict, tiers, streaming, full)");
            plan.method.push_back(static_cast<HeadMethod>(found));
        }
    }
    plan.budgets.assign(units, 0);
    plan.fp16.assign(units, 0), plan.int8.assign(units, 0), plan.int4.assign(units, 0);
    plan.lambda.assign(units, 0);
    plan.stateless.assign(units, 0);
    auto resolve = [&](const PolicyDescriptor& d, const ParamValues& given, const std::string& key) {
        return resolve_params(d, given, where + "." + key);
    };
    if (plan.count(HeadMethod::evict) || mixed.contains("evict")) {
        const Json& e = r.at(mixed, "evict", "");
        const Json& name = r.at(e, "policy", "evict");
        if (!name.is_string()) r.fail("evict.policy", "expected a policy's name");
        plan.evict_policy = name.get<std::string>();
        const PolicyDescriptor* d = find_policy(plan.evict_policy);
        if (!d) r.fail("evict.policy", "unknown policy '" + plan.evict_policy + "' (known: " + known_policy_names() + ")");
        if (d->keeps_everything || d->prompt_press || plan.evict_policy == "mixed")
            r.fail("evict.policy", plan.evict_policy + " does not evict while decoding: name an eviction policy");
        plan.evict_params = resolve(*d, r.params(r.at(e, "params", "evict"), "evict.params"), "evict.params");
        for (const ParamSpec& s : d->params)
            if (s.file && plan.evict_params.count(s.name)) r.fail("evict.params." + s.name, "is a file parameter");
        const std::vector<double> b = r.table(r.at(e, "budgets", "evict"), "evict.budgets", L, K, 0, kMostTokens);
        for (std::size_t u = 0; u < units; ++u) {
            const std::string key = "evict.budgets[" + std::to_string(u / K) + "][" + std::to_string(u % K) + "]";
            if (b[u] != std::floor(b[u])) r.fail(key, "expected an integer");
            plan.budgets[u] = static_cast<int>(b[u]);
            if (plan.method[u] != HeadMethod::evict) continue;
            if (plan.budgets[u] < 1) r.fail(key, "an evicting head needs a budget of at least 1");
            if (d->check_budget)
                if (const std::string problem = d->check_budget(plan.evict_params, plan.budgets[u]); !problem.empty())
                    r.fail(key, problem + " (evict.params)");
        }
    }
    if (plan.count(HeadMethod::tiers) || mixed.contains("tiers")) {
        const Json& t = r.at(mixed, "tiers", "");
        const PolicyDescriptor& d = *find_policy("stratigraphic");
        plan.tier_params = resolve(d, r.params(r.at(t, "params", "tiers"), "tiers.params"), "tiers.params");
        if (plan.tier_params.count("profile")) r.fail("tiers.params.profile", "is a file parameter");
        plan.fp16 = r.table(r.at(t, "fp16", "tiers"), "tiers.fp16", L, K, 0, 1);
        plan.int8 = r.table(r.at(t, "int8", "tiers"), "tiers.int8", L, K, 0, 1);
        plan.int4 = r.table(r.at(t, "int4", "tiers"), "tiers.int4", L, K, 0, 1);
        check_tier_shares(TierShares{L, K, plan.fp16, plan.int8, plan.int4}, where + ".tiers");
        if (d.check_budget)
            if (const std::string problem = d.check_budget(plan.tier_params, 1); !problem.empty())
                r.fail("tiers.params", problem);
    }
    if (plan.count(HeadMethod::streaming) || mixed.contains("streaming")) {
        const Json& s = r.at(mixed, "streaming", "");
        auto count = [&](const char* name) {
            const Json& v = r.at(s, name, "streaming");
            const std::string key = std::string("streaming.") + name;
            if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMostTokens)
                r.fail(key, v.dump() + " is not an integer in [0, " + std::to_string(kMostTokens) + "]");
            return static_cast<int>(v.get<int64_t>());
        };
        plan.sinks = count("sinks");
        plan.recent = count("recent");
        plan.lambda = r.table(r.at(s, "lambda", "streaming"), "streaming.lambda", L, K, 0, 1);
        const std::vector<double> g = r.table(r.at(s, "stateless", "streaming"), "streaming.stateless", L, K, 0, 1);
        for (std::size_t u = 0; u < units; ++u) {
            if (g[u] != 0 && g[u] != 1)
                r.fail("streaming.stateless[" + std::to_string(u / K) + "][" + std::to_string(u % K) + "]",
                       "expected 0 or 1");
            plan.stateless[u] = static_cast<uint8_t>(g[u]);
        }
    }
    return plan;
}

MixedPlan load_mixed_plan(const std::string& path, int num_layers, int num_kv_heads) {
    const Json root = load_json_file(path);
    if (!root.is_object() || !root.contains("mixed"))
        throw InputError(path + ": mixed: missing (the per-head methods of a mixed cache)");
    return parse_mixed_plan(root["mixed"], num_layers, num_kv_heads, path + ": mixed");
}

std::unique_ptr<Policy> make_mixed_head(const MixedPlan& plan, const PolicyContext& ctx) {
    if (ctx.layer >= plan.num_layers || ctx.kv_head >= plan.num_kv_heads)
        throw std::logic_error("make_mixed_head: a head outside the plan");
    const std::size_t u = plan.index(ctx.layer, ctx.kv_head);
    PolicyContext head = ctx;
    head.files = nullptr;
    switch (plan.method[u]) {
        case HeadMethod::evict: {
            head.budget = plan.budgets[u];
            return std::make_unique<HeadBudget>(find_policy(plan.evict_policy)->make(plan.evict_params, head),
                                                plan.budgets[u]);
        }
        case HeadMethod::tiers:
            return find_policy("stratigraphic")->make(tier_head_params(plan, u), head);
        case HeadMethod::streaming: {
            const PolicyDescriptor& d = *find_policy("streaming_attention");
            const ParamValues p = resolve_params(
                d, {{"sinks", plan.sinks}, {"recent", plan.recent}, {"lambda", plan.lambda[u]},
                    {"stateless", plan.stateless[u]}},
                "mixed.streaming");
            return d.make(p, head);
        }
        case HeadMethod::full: return make_keep_all();
    }
    throw std::logic_error("make_mixed_head: unknown method");
}

PolicyDescriptor mixed_descriptor() {
    PolicyDescriptor d{
        "mixed",
        "kvsim's per-head mix (fit: mixed): each (layer, KV head) evicts at its own budget, holds stratigraphic "
        "tiers, streams (DuoAttention's heads, with or without a linear state) or keeps its full cache",
        {{"profile", 0, false, 0, "a profile.json (or plan) with a 'mixed' key: each head's method and its level",
          false, true}},
        [](const ParamValues&, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
            if (!ctx.files || !ctx.files->count("profile"))  // check_context refuses this with the key first
                throw InputError("policy mixed: missing its profile (a profile.json with a 'mixed' key)");
            // A few kilobytes, read per (layer, KV head) when a run starts, as stratigraphic's shares are.
            const MixedPlan plan = load_mixed_plan(ctx.files->at("profile"), ctx.num_layers, ctx.num_kv_heads);
            return make_mixed_head(plan, ctx);
        },
        nullptr};
    d.check_context = [](const ParamValues&, const PolicyContext& ctx) -> std::pair<std::string, std::string> {
        if (!ctx.files || !ctx.files->count("profile"))
            return {"profile", "missing: policy mixed runs the per-head methods of a profile.json with a 'mixed' key"};
        return {};
    };
    d.keeps_everything = true;  // each head sizes itself: its own budget, shares or window
    d.changes_values = true;
    return d;
}

}  // namespace kvsim
