// Fewer dimensions per token. `lowrank`: each (layer, KV head) keeps its keys and values as the
// coordinates on rank-r PCA bases fitted from the fitting sequences (Palu, Eigen Attention, LoRC),
// or one latent per token per layer up-projected per head (joint: DeepSeek's MLA, as TransMLA and
// MHA2MLA convert to it). `group_heads`: each group of g KV heads keeps one K and V, their mean
// (MHA to GQA/MQA, the GQA paper's uptraining start point), in contiguous groups or grouped by
// fitted head similarity. Both keep every token; any eviction policy and quantisation compose
// with them (the cache holds what eviction keeps, each token projected, its latent quantised).
#include <memory>

#include "policies/policy.h"
#include "cache_math/lowrank.h"
#include "base/errors.h"

namespace kvsim {
namespace {

// What `inner` keeps, each token held through the projection.
class Projected : public Policy {
public:
    Projected(std::unique_ptr<Policy> inner, std::shared_ptr<const KvProjection> projection)
        : inner_(std::move(inner)), projection_(std::move(projection)) {}
    void on_decode_step(int32_t pos, std::span<const float> attn) override { inner_->on_decode_step(pos, attn); }
    void evict(int budget, std::vector<int32_t>& victims) override { inner_->evict(budget, victims); }
    std::size_t bytes_per_slot() const override { return inner_->bytes_per_slot(); }
    void assign_tiers(int32_t t, std::span<const int32_t> held, std::span<uint8_t> key_tier,
                      std::span<uint8_t> value_tier) override {
        inner_->assign_tiers(t, held, key_tier, value_tier);
    }
    const TierFormat* tier_format() const override { return inner_->tier_format(); }
    bool reads_attention() const override { return inner_->reads_attention(); }
    bool sizes_itself() const override { return inner_->sizes_itself(); }
    StreamingHeadState* linear_state() const override { return inner_->linear_state(); }
    const KvProjection* projection() const override { return projection_.get(); }
    int eviction_target(int budget) const override { return inner_->eviction_target(budget); }
    bool held_scores(HeldScores& out) override { return inner_->held_scores(out); }
    void evict_to(int keep, std::vector<int32_t>& victims) override { inner_->evict_to(keep, victims); }

private:
    std::unique_ptr<Policy> inner_;
    std::shared_ptr<const KvProjection> projection_;
};

const std::string* file_of(const PolicyContext& ctx, const char* name) {
    if (!ctx.files) return nullptr;
    const auto it = ctx.files->find(name);
    return it == ctx.files->end() ? nullptr : &it->second;
}

std::pair<std::string, std::string> check_lowrank(const ParamValues& p, const PolicyContext& ctx) {
    if (p.at("joint") > 1) return {"joint", "joint must be 0 (a latent per KV head) or 1 (one per layer)"};
    if (!file_of(ctx, "bases"))
        return {"", "lowrank needs a bases file (bases: FILE, written by kvsim trace bases or kvsim search)"};
    if (ctx.head_dim <= 0) return {"", "lowrank needs a Q/K/V trace (this one records attention only)"};
    const bool joint = p.at("joint") == 1;
    const int most = joint ? ctx.num_kv_heads * ctx.head_dim : ctx.head_dim;
    for (const char* name : {"key_rank", "value_rank"}) {
        std::string problem = check_rank(param_int(p, name), most, name);
        if (!problem.empty() && joint) problem += " x " + std::to_string(ctx.num_kv_heads) + " KV heads, a joint latent";
        if (!problem.empty()) return {name, problem};
    }
    return {};
}

std::pair<std::string, std::string> check_group_heads(const ParamValues& p, const PolicyContext& ctx) {
    const int group = param_int(p, "group");
    if (ctx.num_kv_heads % group != 0)
        return {"group", "group = " + std::to_string(group) + " must divide the trace's " + std::to_string(ctx.num_kv_heads) +
                             " KV heads per layer"};
    if (p.at("fitted") > 1) return {"fitted", "fitted must be 0 (contiguous groups) or 1 (grouped by head similarity)"};
    if (p.at("fitted") == 1 && !file_of(ctx, "bases"))
        return {"fitted", "a fitted grouping reads head distances from a bases file (bases: FILE)"};
    if (ctx.head_dim <= 0) return {"", "group_heads needs a Q/K/V trace (this one records attention only)"};
    return {};
}

void refuse_context(const std::string& policy, const std::pair<std::string, std::string>& check) {
    if (!check.second.empty())
        throw InputError(policy + (check.first.empty() ? "" : "." + check.first) + ": " + check.second);
}

// Alone, a projection policy keeps every token.
auto keep_all_projected(
    std::function<std::shared_ptr<const KvProjection>(const ParamValues&, const PolicyContext&)> projection) {
    return [projection](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
        return make_projected(make_keep_all(), projection(p, ctx));
    };
}

}  // namespace

std::unique_ptr<Policy> make_projected(std::unique_ptr<Policy> inner, std::shared_ptr<const KvProjection> projection) {
    return std::make_unique<Projected>(std::move(inner), std::move(projection));
}

PolicyDescriptor lowrank_descriptor() {
    PolicyDescriptor d{
        "lowrank",
        "low-rank K/V on PCA bases (Palu, Eigen Attention, LoRC); joint: one latent per layer (DeepSeek MLA, TransMLA)",
        {{"key_rank", 4, true, 1, "numbers a token's key keeps per KV head (joint: per layer)"},
         {"value_rank", 4, true, 1, "numbers a token's value keeps per KV head (joint: per layer)"},
         {"joint", 0, true, 0, "1: one latent per token for the layer's KV heads together"},
         {"bases", 0, false, 0, "the bases (kvsim trace bases, or kvsim search with fit: [ranks])", false, true},
         {"ranks", 0, false, 0, "fitted ranks per (layer, KV head), or per layer for joint (ranks-*.json from kvsim "
                                "search); overrides key_rank and value_rank", false, true}},
        nullptr, nullptr};
    d.params.back().replaces = {"key_rank", "value_rank"};
    d.projection = [](const ParamValues& p, const PolicyContext& ctx) -> std::shared_ptr<const KvProjection> {
        refuse_context("lowrank", check_lowrank(p, ctx));  // a caller that skipped check_context
        auto projection = std::make_shared<KvProjection>();
        projection->bases = load_kv_bases(ctx.files->at("bases"), ctx.num_layers, ctx.num_kv_heads, ctx.head_dim);
        const bool joint = p.at("joint") == 1;
        if (joint && projection->bases->joint_key.empty())
            throw InputError(ctx.files->at("bases") + ": joint = 1 needs joint bases, and this file was fitted without "
                                                      "them (kvsim trace bases --no-joint)");
        projection->kind = joint ? KvProjection::Kind::joint_low_rank : KvProjection::Kind::low_rank;
        const std::size_t units = joint ? ctx.num_layers : static_cast<std::size_t>(ctx.num_layers) * ctx.num_kv_heads;
        if (const std::string* ranks = file_of(ctx, "ranks")) {
            const FittedRanks fitted = load_fitted_ranks(*ranks, ctx.num_layers, ctx.num_kv_heads, ctx.head_dim);
            if (fitted.joint != joint)
                throw InputError(*ranks + ": ranks fitted " + (fitted.joint ? "per layer (joint)" : "per KV head") +
                                 ", but the policy's joint is " + std::to_string(param_int(p, "joint")));
            projection->key_rank = fitted.key_rank;
            projection->value_rank = fitted.value_rank;
        } else {
            projection->key_rank.assign(units, param_int(p, "key_rank"));
            projection->value_rank.assign(units, param_int(p, "value_rank"));
        }
        return projection;
    };
    d.make = keep_all_projected(d.projection);
    d.keeps_everything = true;
    d.changes_values = true;
    d.check_context = check_lowrank;
    return d;
}

PolicyDescriptor group_heads_descriptor() {
    PolicyDescriptor d{
        "group_heads",
        "KV heads mean-pooled in groups (MHA to GQA/MQA; Ainslie et al. 2023), contiguous or by fitted similarity",
        {{"group", 2, true, 1, "KV heads sharing one K and V (the layer's KV head count: MQA)"},
         {"fitted", 0, true, 0, "1: group heads by similarity measured on the fitting sequences (needs bases)"},
         {"bases", 0, false, 0, "the bases file, whose head distances a fitted grouping reads", false, true}},
        nullptr, nullptr};
    d.projection = [](const ParamValues& p, const PolicyContext& ctx) -> std::shared_ptr<const KvProjection> {
        refuse_context("group_heads", check_group_heads(p, ctx));
        auto projection = std::make_shared<KvProjection>();
        projection->kind = KvProjection::Kind::grouping;
        projection->group_size = param_int(p, "group");
        projection->fitted_groups = p.at("fitted") == 1;
        if (projection->fitted_groups)
            projection->bases =
                load_kv_bases(ctx.files->at("bases"), ctx.num_layers, ctx.num_kv_heads, ctx.head_dim);
        return projection;
    };
    d.make = keep_all_projected(d.projection);
    d.keeps_everything = true;
    d.changes_values = true;
    d.check_context = check_group_heads;
    return d;
}

}  // namespace kvsim
