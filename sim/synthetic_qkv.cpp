#include "sim/synthetic_qkv.h"

#include <tbb/parallel_for.h>
#include <tbb/parallel_pipeline.h>

#include <algorithm>
#include <memory>
#include <cmath>
#include <vector>

#include "sim/qkv_attention.h"
#include "sim/rng.h"
#include "cache_math/rope.h"
#include "base/errors.h"

namespace kvsim {
namespace {

std::vector<float> unit_vector(NormalStream& normal, int d) {
    std::vector<float> u(d);
    double norm = 0;
    for (float& x : u) {
        x = normal.next();
        norm += double(x) * x;
    }
    for (float& x : u) x = static_cast<float>(x / std::sqrt(norm));
    return u;
}

// RoPE as Llama applies it (adjacent pairs), by pos * theta^(-2i/d): the frequencies the trace
// records (TraceMetadata::rope), tabulated per position.
Rope synthetic_rope(int d, float theta) {
    Rope rope;
    for (int i = 0; i < d / 2; ++i) rope.frequencies.push_back(std::pow(static_cast<double>(theta), -2.0 * i / d));
    return rope;
}

struct RopeTable {
    RopeTable(int64_t tokens, int d, float theta) : d(d), cos(tokens * (d / 2)), sin(tokens * (d / 2)) {
        const Rope rope = synthetic_rope(d, theta);
        for (int64_t pos = 0; pos < tokens; ++pos) rope_cos_sin(rope.frequencies, pos, &cos[pos * (d / 2)], &sin[pos * (d / 2)]);
    }
    void apply(float* x, int64_t pos) const {
        rotate_head(x, d, RopePairing::adjacent, &cos[pos * (d / 2)], &sin[pos * (d / 2)]);
    }
    int d;
    std::vector<float> cos, sin;
};

class SyntheticQkvSource : public QkvSource {
public:
    SyntheticQkvSource(const SyntheticQkvSpec& spec, int64_t max_steps) : spec_(spec) {
        shape_.num_layers = spec.num_layers;
        shape_.num_query_heads = spec.num_query_heads;
        shape_.num_kv_heads = spec.num_kv_heads;
        shape_.sequence_names = {spec.name};
        shape_.sequence_lengths = {spec.tokens};
        shape_.last_steps = {last_replayed_step(spec.tokens, max_steps)};
        qkv_ = {spec.num_query_heads, spec.num_kv_heads, spec.head_dim};
    }
    ~SyntheticQkvSource() override { drop_prefetch(); }  // before the spec a load may still use goes
    std::string description() const override { return "synthetic-qkv/" + spec_.name + " (generated in-process)"; }

protected:
    void load_layer(int, int layer, QkvLayer& data) override {
        data = QkvLayer{};  // release the previous layer before generating the next
        data = generate_synthetic_qkv_layer(spec_, layer);
    }

private:
    SyntheticQkvSpec spec_;
};

}  // namespace

SyntheticQkvSpec synthetic_qkv_trace(const std::string& name, const std::string& where) {
    // name, layers, query heads, KV heads, head size, tokens, seed, sinks, heavy hitters, RoPE theta
    static const SyntheticQkvSpec shapes[] = {
        {"llama-1b-4096", 16, 32, 8, 128, 4096, 1, 4, 32, 500000.0f},  // Llama-3.2-1B's shape
        {"llama-1b-1024", 16, 32, 8, 128, 1024, 1, 4, 32, 500000.0f},  // the same at 1,024 tokens
        {"small-1024", 4, 8, 2, 64, 1024, 1, 4, 16, 10000.0f},         // value-level benchmarks
        {"tiny-256", 3, 4, 2, 16, 256, 1, 4, 8, 10000.0f},             // tests
    };
    for (const SyntheticQkvSpec& spec : shapes)
        if (spec.name == name) return spec;
    throw InputError(where + ": unknown synthetic qkv trace '" + name + "' (known: llama-1b-4096, llama-1b-1024, small-1024, tiny-256)");
}

QkvLayer generate_synthetic_qkv_layer(const SyntheticQkvSpec& spec, int layer) {
    const int d = spec.head_dim, hq = spec.num_query_heads, hkv = spec.num_kv_heads, group = hq / hkv;
    const int64_t T = spec.tokens;
    NormalStream normal(spec.seed * 2654435761u + static_cast<uint32_t>(layer) * 40503u + 1u);
    QkvLayer out;
    out.tokens = T;
    out.q.resize(T * hq * d);
    out.k.resize(T * hkv * d);
    out.v.resize(T * hkv * d);
    // Deeper layers attend more sharply (as PyramidKV observes): structure grows with depth.
    const float depth = spec.num_layers > 1 ? static_cast<float>(layer) / (spec.num_layers - 1) : 0.5f;
    const float sharp = 0.7f + 0.6f * depth;
    const RopeTable rope(T, d, spec.rope_theta);
    // One stream of draws runs through the KV heads in order. Each head's few directions and
    // amplitudes are drawn here in that order; its tokens' draws, a known count, are skipped and
    // replayed below by a copy of the stream, so the heads fill in parallel with the same values.
    struct HeadDraws {
        std::vector<float> sink_dir, heavy_dir, local_dir;
        float sink_amp = 0, heavy_amp = 0, local_amp = 0;
        std::vector<uint8_t> heavy;
        NormalStream tokens{0};  // the stream where this head's tokens begin
    };
    std::vector<HeadDraws> heads(hkv);
    const uint64_t normals_per_head = static_cast<uint64_t>(T) * (2 + group) * d;
    for (HeadDraws& head : heads) {
        head.sink_dir = unit_vector(normal, d);
        head.heavy_dir = unit_vector(normal, d);
        head.local_dir = unit_vector(normal, d);
        // Amplitudes vary by head: some heads are local, some retrieve heavy hitters.
        head.sink_amp = sharp * (5.0f + 2.0f * static_cast<float>(normal.uniform()));
        head.heavy_amp = sharp * (3.0f + 3.0f * static_cast<float>(normal.uniform()));
        head.local_amp = sharp * (4.0f + 3.0f * static_cast<float>(normal.uniform()));
        head.heavy.assign(T, 0);
        for (int i = 0; i < spec.heavy_hitters && T > spec.sinks; ++i)
            head.heavy[spec.sinks + normal.next_int(static_cast<uint32_t>(T - spec.sinks))] = 1;
        head.tokens = normal;
        normal.skip(normals_per_head);
    }
    tbb::parallel_for(0, hkv, [&](int g) {
        HeadDraws& head = heads[g];
        NormalStream& draws = head.tokens;
        for (int64_t t = 0; t < T; ++t) {
            float* k = out.k.data() + (t * hkv + g) * d;
            float* v = out.v.data() + (t * hkv + g) * d;
            const float sink = t < spec.sinks ? head.sink_amp : 0.0f, hit = head.heavy[t] ? head.heavy_amp : 0.0f;
            for (int i = 0; i < d; ++i) {
                k[i] = draws.next() + sink * head.sink_dir[i] + hit * head.heavy_dir[i] + head.local_amp * head.local_dir[i];
                v[i] = draws.next();
            }
            rope.apply(k, t);
            for (int h = g * group; h < (g + 1) * group; ++h) {
                float* q = out.q.data() + (t * hq + h) * d;
                for (int i = 0; i < d; ++i)
                    q[i] = draws.next() + head.sink_amp * head.sink_dir[i] + head.heavy_amp * head.heavy_dir[i] +
                           head.local_amp * head.local_dir[i];
                rope.apply(q, t);
            }
        }
    });
    return out;
}

std::unique_ptr<AttentionSource> make_synthetic_qkv_source(const SyntheticQkvSpec& spec, int64_t max_steps) {
    return std::make_unique<SyntheticQkvSource>(spec, max_steps);
}

void write_synthetic_qkv_trace(const SyntheticQkvSpec& spec, const std::string& path, TensorDtype dtype,
                               int sequences) {
    TraceMetadata m;
    m.kind = TraceKind::qkv;
    m.model_name = "synthetic Llama-shaped Q/K/V (sinks + RoPE recency + heavy hitters)";
    m.num_layers = spec.num_layers;
    m.num_query_heads = spec.num_query_heads;
    m.num_kv_heads = spec.num_kv_heads;
    m.head_dim = spec.head_dim;
    m.source_kind = "synthetic";
    m.source_generator = "synthetic-qkv/" + spec.name;
    m.source_seed = spec.seed;
    if (spec.head_dim % 2 == 0) m.rope = synthetic_rope(spec.head_dim, spec.rope_theta);
    TraceWriter writer(path, m);
    for (int s = 0; s < sequences; ++s) {
        SyntheticQkvSpec one = spec;
        one.seed = spec.seed + static_cast<uint32_t>(s);
        const int sequence = writer.add_sequence(sequences == 1 ? spec.name : spec.name + "-" + std::to_string(s), spec.tokens);
        // Layers are generated in parallel (each has its own seed) and written in order; at most
        // two are in flight, so memory stays at a few layers whatever the depth.
        int next_layer = 0;
        tbb::parallel_pipeline(
            2, tbb::make_filter<void, int>(tbb::filter_mode::serial_in_order,
                                           [&](tbb::flow_control& fc) {
                                               if (next_layer == spec.num_layers) fc.stop();
                                               return next_layer++;
                                           }) &
                   tbb::make_filter<int, std::pair<int, std::shared_ptr<QkvLayer>>>(
                       tbb::filter_mode::parallel,
                       [&](int layer) {
                           return std::pair{layer, std::make_shared<QkvLayer>(generate_synthetic_qkv_layer(one, layer))};
                       }) &
                   tbb::make_filter<std::pair<int, std::shared_ptr<QkvLayer>>, void>(
                       tbb::filter_mode::serial_in_order,
                       [&](const std::pair<int, std::shared_ptr<QkvLayer>>& layer) {
                           writer.write_qkv(sequence, layer.first, *layer.second, dtype);
                       }));
    }
    writer.commit();
}

}  // namespace kvsim
