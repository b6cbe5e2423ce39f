#include "sim/lowrank_fit.h"

#include <cmath>

#include "base/errors.h"
#include "sim/qkv_attention.h"

namespace kvsim {

Rope pre_rope_of_trace(const TraceMetadata& metadata, const std::string& path, double rope_theta) {
    if (metadata.head_dim % 2 != 0)
        throw InputError(path + ": RoPE rotates pairs of dimensions, but the head size is " + std::to_string(metadata.head_dim));
    if (!metadata.rope.known()) {
        if (!(rope_theta > 0))
            throw InputError(path + ": keys before RoPE need the model's RoPE, which this trace does not record "
                                    "(captured before kvsim recorded it): give the model's RoPE base (rope_theta, "
                                    "e.g. 10000), or capture again");
        return Rope{RopePairing::adjacent, rope_base_frequencies(rope_theta, static_cast<int>(metadata.head_dim))};
    }
    if (rope_theta > 0) {
        // A base given for a trace that records its RoPE must describe that RoPE: unscaled,
        // adjacent pairs, the same base (to rounding).
        const std::vector<double> given = rope_base_frequencies(rope_theta, static_cast<int>(metadata.head_dim));
        bool same = metadata.rope.pairing == RopePairing::adjacent;
        for (std::size_t i = 0; same && i < given.size(); ++i)
            same = std::abs(given[i] - metadata.rope.frequencies[i]) <= 1e-9 * given[i];
        if (!same)
            throw InputError(path + ": the trace records the model's RoPE (" + to_string(metadata.rope.pairing) +
                             " pairs, its own frequencies), and a RoPE base of " + std::to_string(rope_theta) +
                             " does not describe it: leave rope_theta out");
    }
    return metadata.rope;
}

KvBases fit_kv_bases(const std::string& trace_path, const std::vector<int>& sequences, const KeyFrame& keys) {
    const TraceReader reader(trace_path);
    const std::vector<int> chosen = selected_sequences(reader, sequences);
    auto source = open_trace_source(trace_path, 0, chosen);
    auto* qkv = dynamic_cast<QkvSource*>(source.get());
    if (!qkv) throw InputError(trace_path + ": bases are fitted on keys and values, but this trace records attention only");
    const QkvShape& shape = qkv->qkv_shape();
    const Rope rope = keys.pre_rope ? pre_rope_of_trace(reader.metadata(), trace_path, keys.rope_theta) : Rope{};
    KvBasesFitter fitter(source->shape().num_layers, shape.num_kv_heads, shape.head_dim, rope, keys.joint);
    const bool recorded_before_rope = rope.known() && reader.metadata().pre_rope_keys;
    std::vector<float> keys_before_rope;
    for (std::size_t s = 0; s < chosen.size(); ++s)
        for (int layer = 0; layer < source->shape().num_layers; ++layer) {
            if (recorded_before_rope) reader.read_pre_rope_keys(chosen[s], layer, keys_before_rope);
            fitter.add(layer, qkv->layer_data(static_cast<int>(s), layer), recorded_before_rope ? &keys_before_rope : nullptr);
        }
    return fitter.finish(chosen);
}

}  // namespace kvsim
