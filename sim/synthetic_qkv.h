// A synthetic Q/K/V trace shaped like a real model (Llama-3.2-1B by default: 16 layers, 32 query
// heads, 8 KV heads, head size 128), whose attention has the three structures eviction policies
// exploit: attention sinks (the first tokens), recency (RoPE on a shared component makes nearby
// keys score higher) and heavy hitters (a few tokens every query of a KV head attends to).
// Generated per layer from a seed, so a 16-layer, 4096-token trace never sits in memory whole.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "sim/attention_source.h"
#include "sim/trace_store.h"

namespace kvsim {

struct SyntheticQkvSpec {
    std::string name = "llama-1b-4096";
    int num_layers = 16;
    int num_query_heads = 32;
    int num_kv_heads = 8;
    int head_dim = 128;
    int64_t tokens = 4096;
    uint32_t seed = 1;
    int sinks = 4;
    int heavy_hitters = 32;  // per KV head
    float rope_theta = 500000.0f;
};

// Looks up a named shape ("llama-1b-4096", "small-1024", "tiny-256"); throws InputError naming `where`.
SyntheticQkvSpec synthetic_qkv_trace(const std::string& name, const std::string& where);

QkvLayer generate_synthetic_qkv_layer(const SyntheticQkvSpec& spec, int layer);

std::unique_ptr<AttentionSource> make_synthetic_qkv_source(const SyntheticQkvSpec& spec, int64_t max_steps);

// Writes the trace as a qkv-kind HDF5 file (float16 or float32), a layer at a time. With
// sequences > 1, sequence s is generated with seed spec.seed + s and named "<name>-<s>".
void write_synthetic_qkv_trace(const SyntheticQkvSpec& spec, const std::string& path, TensorDtype dtype,
                               int sequences = 1);

}  // namespace kvsim
