// One layer's queries, keys and values for a whole sequence, as plain arrays: what a trace's
// reader returns, a capture records and the tiers, quantiser and low-rank projection transform.
// Kept here, below the trace store, so the cache's arithmetic needs no file format.
#pragma once
#include <cstdint>
#include <vector>

namespace kvsim {

struct QkvLayer {
    int64_t tokens = 0;
    std::vector<float> q;  // [tokens][num_query_heads][head_dim]
    std::vector<float> k;  // [tokens][num_kv_heads][head_dim]
    std::vector<float> v;  // [tokens][num_kv_heads][head_dim]
    // [tokens][num_kv_heads][head_dim]: the keys before RoPE, where the trace records them and they
    // were asked for (TraceReader::read_pre_rope_keys); empty otherwise.
    std::vector<float> k_pre_rope;
};

}  // namespace kvsim
