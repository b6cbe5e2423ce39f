// The CUDA backend's device side: every (layer, KV head)'s tiered rows in one device pool
// (device_pool.h: cudaMalloc'd once at plan time, in the host TierStores' row format with a row
// per slot, and a code per slot saying what it holds), and the kernels that attend over them.
// Their arithmetic is the shared __host__ __device__ code of cache_math/numerics.h and TierView
// (fp16 bits, dequantisation, the online softmax and its split-K merge), so what the CPU tests
// check is what the kernels run.
//
// The host keeps the master copy and the policies (the same HeadCache as the CPU backend): each
// step it stages only the slots that changed (the new token, tokens that sank to a coarser tier,
// evicted slots), and the device attends over what it holds. This header needs no CUDA headers:
// a build without nvcc gets cuda_absent.cpp, whose entry points say why there is no device.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/device_pool.h"

namespace kvsim::runtime::cuda {

// Whether this build has CUDA and a device can be used; when not, `why` says why in one line.
bool device_available(std::string& why);

// Where a cache on a device is kept and attended. The CUDA one is below (create); the tests
// drive the runtime through a host one as well, so the device path's bookkeeping is checked on
// machines without a GPU.
class DeviceCache {
public:
    // Plans the pool for `heads` (layer-major, num_kv_heads a layer). Null with `error` set when
    // there is no device or a CUDA call fails.
    static std::unique_ptr<DeviceCache> create(const std::vector<HeadLayout>& heads, int num_kv_heads,
                                               int group, int head_dim, std::string& error);
    virtual ~DeviceCache() = default;

    // Stages head `head`'s slot: its key and value rows read from the host views (at the tiers
    // its code names; nothing for an empty slot) and its code. Sent before the next attend.
    virtual bool stage(int head, int slot, uint8_t code, const TierView (&keys)[3], const TierView (&values)[3],
                       std::string& error) = 0;
    // One layer's step: q for every query head (num_query_heads x head_dim); every held slot of the
    // layer's device heads attended. Writes out (num_query_heads x head_dim; rows of heads the
    // device does not attend are left alone) and, per KV head, the group's mean softmax weight on
    // each slot (num_kv_heads rows of max_capacity() floats, by slot).
    virtual bool attend(int layer, const float* q, float* out, float* slot_weights, std::string& error) = 0;
    // The widest head of any layer.
    virtual int max_capacity() const = 0;
    // Bytes the device pool reserves (rows, scales, slot tables).
    virtual std::size_t reserved_bytes() const = 0;
};

}  // namespace kvsim::runtime::cuda
