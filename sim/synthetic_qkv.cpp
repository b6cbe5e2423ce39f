#include "sim/synthetic_qkv.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "sim/qkv_attention.h"
#include "sim/rng.h"
#include "base/errors.h"

namespace kvsim {
namespace {

class Normal {
public:
    explicit Normal(uint32_t seed) : rng_(seed) {}
    float next() {  // Box-Muller; the second value is kept for the next call
        if (has_spare_) {
            has_spare_ = false;
            return spare_;
        }
        double u = rng_.next_float(), v = rng_.next_float();
        if (u < 1e-300) u = 1e-300;
        const double r = std::sqrt(-2.0 * std::log(u)), a = 6.283185307179586 * v;
        spare_ = static_cast<float>(r * std::sin(a));
        has_spare_ = true;
        return static_cast<float>(r * std::cos(a));
    }
    uint32_t next_int(uint32_t n) { return rng_.next_int(n); }
    double uniform() { return rng_.next_float(); }

private:
    Xoshiro128 rng_;
    bool has_spare_ = false;
    float spare_ = 0;
};

std::vector<float> unit_vector(Normal& normal, int d) {
    std::vector<float> u(d);
    double norm = 0;
    for (float& x : u) {
        x = normal.next();
        norm += double(x) * x;
    }
    for (float& x : u) x = static_cast<float>(x / std::sqrt(norm));
    return u;
}

// RoPE as Llama applies it: adjacent pairs (2i, 2i+1) rotated by pos / theta^(2i/d).
struct Rope {
    Rope(int64_t tokens, int d, float theta) : half(d / 2), cos_sin(tokens * d) {
        for (int64_t pos = 0; pos < tokens; ++pos)
            for (int i = 0; i < half; ++i) {
                const double angle = pos * std::pow(static_cast<double>(theta), -2.0 * i / d);
                cos_sin[(pos * half + i) * 2] = static_cast<float>(std::cos(angle));
                cos_sin[(pos * half + i) * 2 + 1] = static_cast<float>(std::sin(angle));
            }
    }
    void apply(float* x, int64_t pos) const {
        const float* cs = cos_sin.data() + pos * half * 2;
        for (int i = 0; i < half; ++i) {
            const float a = x[2 * i], b = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
            x[2 * i] = a * c - b * s;
            x[2 * i + 1] = a * s + b * c;
        }
    }
    int half;
    std::vector<float> cos_sin;
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
        {"small-1024", 4, 8, 2, 64, 1024, 1, 4, 16, 10000.0f},         // value-level benchmarks
        {"tiny-256", 3, 4, 2, 16, 256, 1, 4, 8, 10000.0f},             // tests
    };
    for (const SyntheticQkvSpec& spec : shapes)
        if (spec.name == name) return spec;
    throw InputError(where + ": unknown synthetic qkv trace '" + name + "' (known: llama-1b-4096, small-1024, tiny-256)");
}

QkvLayer generate_synthetic_qkv_layer(const SyntheticQkvSpec& spec, int layer) {
    const int d = spec.head_dim, hq = spec.num_query_heads, hkv = spec.num_kv_heads, group = hq / hkv;
    const int64_t T = spec.tokens;
    Normal normal(spec.seed * 2654435761u + static_cast<uint32_t>(layer) * 40503u + 1u);
    QkvLayer out;
    out.tokens = T;
    out.q.resize(T * hq * d);
    out.k.resize(T * hkv * d);
    out.v.resize(T * hkv * d);
    // Deeper layers attend more sharply (as PyramidKV observes): structure grows with depth.
    const float depth = spec.num_layers > 1 ? static_cast<float>(layer) / (spec.num_layers - 1) : 0.5f;
    const float sharp = 0.7f + 0.6f * depth;
    const Rope rope(T, d, spec.rope_theta);
    for (int g = 0; g < hkv; ++g) {
        const std::vector<float> sink_dir = unit_vector(normal, d), heavy_dir = unit_vector(normal, d),
                                 local_dir = unit_vector(normal, d);
        // Amplitudes vary by head: some heads are local, some retrieve heavy hitters.
        const float sink_amp = sharp * (5.0f + 2.0f * static_cast<float>(normal.uniform()));
        const float heavy_amp = sharp * (3.0f + 3.0f * static_cast<float>(normal.uniform()));
        const float local_amp = sharp * (4.0f + 3.0f * static_cast<float>(normal.uniform()));
        std::vector<uint8_t> heavy(T, 0);
        for (int i = 0; i < spec.heavy_hitters && T > spec.sinks; ++i)
            heavy[spec.sinks + normal.next_int(static_cast<uint32_t>(T - spec.sinks))] = 1;
        for (int64_t t = 0; t < T; ++t) {
            float* k = out.k.data() + (t * hkv + g) * d;
            float* v = out.v.data() + (t * hkv + g) * d;
            const float sink = t < spec.sinks ? sink_amp : 0.0f, hit = heavy[t] ? heavy_amp : 0.0f;
            for (int i = 0; i < d; ++i) {
                k[i] = normal.next() + sink * sink_dir[i] + hit * heavy_dir[i] + local_amp * local_dir[i];
                v[i] = normal.next();
            }
            rope.apply(k, t);
            for (int h = g * group; h < (g + 1) * group; ++h) {
                float* q = out.q.data() + (t * hq + h) * d;
                for (int i = 0; i < d; ++i)
                    q[i] = normal.next() + sink_amp * sink_dir[i] + heavy_amp * heavy_dir[i] + local_amp * local_dir[i];
                rope.apply(q, t);
            }
        }
    }
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
    TraceWriter writer(path, m);
    for (int s = 0; s < sequences; ++s) {
        SyntheticQkvSpec one = spec;
        one.seed = spec.seed + static_cast<uint32_t>(s);
        const int sequence = writer.add_sequence(sequences == 1 ? spec.name : spec.name + "-" + std::to_string(s), spec.tokens);
        for (int layer = 0; layer < spec.num_layers; ++layer)
            writer.write_qkv(sequence, layer, generate_synthetic_qkv_layer(one, layer), dtype);
    }
    writer.commit();
}

}  // namespace kvsim
