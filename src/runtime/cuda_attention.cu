#include "src/runtime/cuda_attention.h"

#include <cuda_runtime.h>

#include <cmath>

#include "sim/cache_math.h"

namespace kvsim::runtime::cuda {
namespace {

// One tier of one side (keys or values) on the device, in tier_store.h's layout.
struct DeviceTier {
    const uint16_t* half = nullptr;
    const uint8_t* levels = nullptr;
    const uint16_t* scales = nullptr;
    int row_bytes = 0, groups = 0, group_channels = 1;
};

// Channel c of the row at `slot` of a tier, as attention reads it: the CPU's TierStore::read.
__device__ float element(const DeviceTier& t, int tier, int slot, int c, int d) {
    if (tier == 0) return half_bits_to_float(t.half[static_cast<size_t>(slot) * d + c]);
    const float scale = half_bits_to_float(t.scales[static_cast<size_t>(slot) * t.groups + c / t.group_channels]);
    const uint8_t* row = t.levels + static_cast<size_t>(slot) * t.row_bytes;
    const int level = tier == 1 ? static_cast<int8_t>(row[c]) : int4_level(row, c);
    return dequantize_level(static_cast<float>(level), scale);
}

struct Tiers {
    DeviceTier k[3], v[3];
};

// One block (a warp) per query head of the group: lanes split the channels, a shuffle reduces
// each row's dot product, every lane keeps the same online softmax (sim/cache_math.h).
__global__ void decode_attention_kernel(Tiers tiers, const int* slots, const uint8_t* key_tier,
                                        const uint8_t* value_tier, int rows, int d, const float* q, float scale,
                                        float* out, float* scores) {
    const int h = blockIdx.x, lane = threadIdx.x;
    constexpr int kMaxPerLane = 8;  // head size up to 256
    float acc[kMaxPerLane] = {};
    OnlineSoftmax softmax;
    for (int r = 0; r < rows; ++r) {
        float partial = 0.0f;
        for (int c = lane, i = 0; c < d; c += 32, ++i)
            partial += q[h * d + c] * element(tiers.k[key_tier[r]], key_tier[r], slots[r], c, d);
        for (int offset = 16; offset > 0; offset /= 2) partial += __shfl_xor_sync(0xffffffffu, partial, offset);
        const float s = partial * scale;
        if (lane == 0) scores[static_cast<size_t>(h) * rows + r] = s;
        float w = 0.0f;
        const float rescale = softmax.add(s, w);
        for (int c = lane, i = 0; c < d; c += 32, ++i)
            acc[i] = acc[i] * rescale + w * element(tiers.v[value_tier[r]], value_tier[r], slots[r], c, d);
    }
    for (int c = lane, i = 0; c < d; c += 32, ++i) out[h * d + c] = acc[i] / softmax.sum;
}

// Device buffers freed on every path out.
struct Buffers {
    std::vector<void*> held;
    ~Buffers() {
        for (void* p : held) cudaFree(p);
    }
    template <class T>
    cudaError_t copy_in(const T* host, std::size_t count, T** device) {
        *device = nullptr;
        if (count == 0) return cudaSuccess;
        cudaError_t e = cudaMalloc(reinterpret_cast<void**>(device), count * sizeof(T));
        if (e != cudaSuccess) return e;
        held.push_back(*device);
        return cudaMemcpy(*device, host, count * sizeof(T), cudaMemcpyHostToDevice);
    }
};

}  // namespace

bool device_available(std::string& why) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        why = std::string("no CUDA device: ") + cudaGetErrorString(e);
        return false;
    }
    if (count == 0) {
        why = "no CUDA device on this machine";
        return false;
    }
    return true;
}

bool decode_attention(const TierStore (&keys)[3], const TierStore (&values)[3], const std::vector<int>& slots,
                      const std::vector<uint8_t>& key_tier, const std::vector<uint8_t>& value_tier, int head_dim,
                      int group, const float* q, float* out, float* scores, std::string& error) {
    if (!device_available(error)) return false;
    if (head_dim > 256) {
        error = "head size " + std::to_string(head_dim) + " is over the kernel's 256";
        return false;
    }
    Buffers buffers;
    Tiers tiers;
    cudaError_t e = cudaSuccess;
    auto upload = [&](const TierStore& store, DeviceTier& t) {
        const std::size_t rows = store.rows();
        t.row_bytes = store.row_bytes();
        t.groups = store.groups();
        t.group_channels = store.group_channels();
        if (e == cudaSuccess && store.tier() == 0)
            e = buffers.copy_in(store.half(), rows * head_dim, const_cast<uint16_t**>(&t.half));
        if (e == cudaSuccess && store.tier() != 0) e = buffers.copy_in(store.levels(), rows * t.row_bytes, const_cast<uint8_t**>(&t.levels));
        if (e == cudaSuccess && store.tier() != 0) e = buffers.copy_in(store.scales(), rows * t.groups, const_cast<uint16_t**>(&t.scales));
    };
    for (int tier = 0; tier < 3; ++tier) {
        upload(keys[tier], tiers.k[tier]);
        upload(values[tier], tiers.v[tier]);
    }
    const int rows = static_cast<int>(slots.size());
    int* d_slots = nullptr;
    uint8_t *d_key_tier = nullptr, *d_value_tier = nullptr;
    float *d_q = nullptr, *d_out = nullptr, *d_scores = nullptr;
    if (e == cudaSuccess) e = buffers.copy_in(slots.data(), slots.size(), &d_slots);
    if (e == cudaSuccess) e = buffers.copy_in(key_tier.data(), key_tier.size(), &d_key_tier);
    if (e == cudaSuccess) e = buffers.copy_in(value_tier.data(), value_tier.size(), &d_value_tier);
    if (e == cudaSuccess) e = buffers.copy_in(q, static_cast<std::size_t>(group) * head_dim, &d_q);
    if (e == cudaSuccess) e = buffers.copy_in(out, static_cast<std::size_t>(group) * head_dim, &d_out);
    if (e == cudaSuccess) e = buffers.copy_in(scores, static_cast<std::size_t>(group) * rows, &d_scores);
    if (e == cudaSuccess) {
        decode_attention_kernel<<<group, 32>>>(tiers, d_slots, d_key_tier, d_value_tier, rows, head_dim, d_q,
                                               1.0f / std::sqrt(static_cast<float>(head_dim)), d_out, d_scores);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e == cudaSuccess)
        e = cudaMemcpy(out, d_out, static_cast<std::size_t>(group) * head_dim * sizeof(float), cudaMemcpyDeviceToHost);
    if (e == cudaSuccess && rows > 0)
        e = cudaMemcpy(scores, d_scores, static_cast<std::size_t>(group) * rows * sizeof(float), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        error = std::string("CUDA: ") + cudaGetErrorString(e);
        return false;
    }
    return true;
}

}  // namespace kvsim::runtime::cuda
