// The CUDA side of the runtime: a decode-attention kernel over one KV head's rows in the tier
// layout of tier_store.h, its arithmetic the shared __host__ __device__ functions of
// sim/cache_math.h (fp16 bits, dequantisation, the online softmax), so what the CPU tests check
// is what the kernel runs. Built when meson finds nvcc (-Dcuda=auto); the backend that keeps a
// whole cache on the device is not wired into kvsim_rt_create yet, so the kernel's entry here is
// a host function that copies one head's rows to the device, runs, and copies back.
#pragma once
#include <string>
#include <vector>

#include "src/runtime/tier_store.h"

namespace kvsim::runtime::cuda {

// Whether this build has CUDA and a device can be used; when not, `why` says why in one line.
bool device_available(std::string& why);

// The attention of `group` query heads (q: group x head_dim) over rows at slots[r] whose keys and
// values sit at key_tier[r] / value_tier[r] of `keys` / `values` (the three tiers of one head):
// out (group x head_dim) and the scores q.k / sqrt(d) (group x rows). Device memory from
// cudaMalloc, freed before it returns. Returns false with `error` set on any failed CUDA call.
bool decode_attention(const TierStore (&keys)[3], const TierStore (&values)[3], const std::vector<int>& slots,
                      const std::vector<uint8_t>& key_tier, const std::vector<uint8_t>& value_tier, int head_dim,
                      int group, const float* q, float* out, float* scores, std::string& error);

}  // namespace kvsim::runtime::cuda
