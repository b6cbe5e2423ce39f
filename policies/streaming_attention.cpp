// Streaming heads: DuoAttention (Xiao et al. 2024) keeps a full cache for retrieval heads and only
// sinks and a recent window for streaming heads; here a streaming head may also fold every token it
// lets go into a decayed linear-attention state (cache_math/streaming_heads.h) instead of dropping
// it, or keep no state at all (`stateless`), as DuoAttention's own streaming heads do.
#include <cmath>
#include <memory>

#include "policies/recency.h"
#include "cache_math/streaming_heads.h"
#include "base/errors.h"

namespace kvsim {
namespace {

class StreamingAttention : public Policy {
public:
    StreamingAttention(bool streaming, bool stateless, const StreamingHeadParams& params, int head_dim, int capacity)
        : streaming_(streaming), sinks_(params.sinks), recent_(params.recent),
          window_(static_cast<std::size_t>(std::max(capacity, 1))) {
        // A stateless head is attended like any cache, over the sinks and window it holds.
        if (streaming && !stateless && head_dim > 0) state_ = std::make_unique<StreamingHeadState>(head_dim, params);
        if (sinks_ > 0)
            sinks_held_ = 1;
        else
            window_.push(0);
    }

    void on_decode_step(int32_t pos, std::span<const float>) override {
        if (pos < sinks_)
            ++sinks_held_;
        else
            window_.push(pos);
    }
    bool reads_attention() const override { return false; }

    // A streaming head keeps its sinks and the `recent` newest tokens (the current one among them
    // as the model reads it); a retrieval head keeps everything.
    void evict(int, std::vector<int32_t>& victims) override {
        if (!streaming_) return;
        while (window_.size() > static_cast<std::size_t>(std::max(recent_ - 1, 0))) victims.push_back(window_.pop_oldest());
    }
    bool sizes_itself() const override { return streaming_; }
    std::size_t bytes_per_slot() const override { return sizeof(int32_t); }
    StreamingHeadState* linear_state() const override { return state_.get(); }

private:
    bool streaming_;
    int sinks_, recent_;
    std::size_t sinks_held_ = 0;
    PositionRing window_;
    std::unique_ptr<StreamingHeadState> state_;
};

}  // namespace

PolicyDescriptor streaming_attention_descriptor() {
    PolicyDescriptor d{
        "streaming_attention",
        "Xiao et al. 2024, DuoAttention (retrieval and streaming heads); streaming heads keep a decayed linear state",
        {{"sinks", 4, true, 0, "first tokens a streaming head keeps exactly"},
         {"recent", 64, true, 0, "most recent tokens a streaming head keeps exactly (0: the state holds every token)"},
         {"lambda", 0.99, false, 0, "per-step decay of the linear state"},
         {"gate_threshold", 0.5, false, 0, "pattern file: a gate above it keeps a retrieval head"},
         {"stateless", 0, true, 0, "1: streaming heads keep no linear state, only sinks and the recent window "
                                   "(DuoAttention's streaming heads); a profile may set it per head"},
         {"pattern", 0, false, 0, "DuoAttention full_attention_heads.tsv: one row per layer, a gate per KV head "
                                  "(default: every head streams)", false, true},
         {"profile", 0, false, 0, "YAML: streaming (0/1 per layer and KV head) and lambda (one, or per head)",
          false, true}},
        [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
            StreamingHeadParams params;
            params.sinks = param_int(p, "sinks");
            params.recent = param_int(p, "recent");
            params.lambda = p.at("lambda");
            bool streaming = true;
            bool stateless = p.at("stateless") != 0;
            if (ctx.files && ctx.files->count("profile") && ctx.files->count("pattern"))
                throw InputError(ctx.files->at("profile") + ": give streaming_attention a profile or a pattern, not both");
            if (ctx.files && ctx.files->count("profile")) {
                const StreamingPlan plan =
                    load_streaming_profile(ctx.files->at("profile"), ctx.num_layers, ctx.num_kv_heads, params.lambda);
                streaming = plan.is_streaming(ctx.layer, ctx.kv_head);
                params.lambda = plan.lambda_of(ctx.layer, ctx.kv_head);
                stateless = stateless || plan.is_stateless(ctx.layer, ctx.kv_head);
            } else if (ctx.files && ctx.files->count("pattern")) {
                // A few hundred bytes, read per (layer, KV head) when a run starts.
                const StreamingPlan plan = load_duo_attention_pattern(ctx.files->at("pattern"), ctx.num_layers,
                                                                      ctx.num_kv_heads, params.lambda,
                                                                      p.at("gate_threshold"));
                streaming = plan.is_streaming(ctx.layer, ctx.kv_head);
                params.lambda = plan.lambda_of(ctx.layer, ctx.kv_head);
            }
            return std::make_unique<StreamingAttention>(streaming, stateless, params, ctx.head_dim, ctx.capacity);
        },
        [](const ParamValues& p, int) -> std::string {
            if (p.at("lambda") > 1) return "lambda = " + std::to_string(p.at("lambda")) + " must be in [0, 1]";
            if (p.at("stateless") > 1) return "stateless = " + std::to_string(p.at("stateless")) + " must be 0 or 1";
            return {};
        }};
    d.keeps_everything = true;
    d.changes_values = true;
    // A streaming head holds its sinks and recent tokens' keys and values exactly (floats) and a
    // d x d state (doubles); without values (an attention trace) it holds positions only.
    d.param_memory = [](const ParamValues& p, const PolicyContext& ctx) -> ParamMemory {
        if (ctx.head_dim <= 0) return {};
        const uint64_t dim = static_cast<uint64_t>(ctx.head_dim);  // < 2^31: the products fit 64 bits
        const uint64_t sinks = static_cast<uint64_t>(p.at("sinks")), recent = static_cast<uint64_t>(p.at("recent"));
        const uint64_t exact = (sinks + recent) * (2 * dim * sizeof(float) + sizeof(int64_t));
        const uint64_t state = (dim + 1) * dim * sizeof(double);
        if (state > exact)
            return {exact + state, "", "a " + std::to_string(dim) + " x " + std::to_string(dim) + " linear state"};
        return {exact + state, recent >= sinks ? "recent" : "sinks",
                std::to_string(sinks) + " sinks + " + std::to_string(recent) + " recent tokens of head size " +
                    std::to_string(dim)};
    };
    return d;
}

}  // namespace kvsim
