#include "runtime/cuda_attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cache_math/numerics.h"

namespace kvsim::runtime::cuda {
namespace {

constexpr int kMaxPerLane = 8;  // channels a lane accumulates: head size up to 256

__global__ void scatter_kernel(uint8_t* pool, const uint8_t* staged, const PoolCopy* copies, int count) {
    for (int i = blockIdx.x; i < count; i += gridDim.x) {
        const PoolCopy c = copies[i];
        for (uint32_t b = threadIdx.x; b < c.length; b += blockDim.x) pool[c.pool_offset + b] = staged[c.staged_offset + b];
    }
}

// Split-K decode attention, one warp per (query head, chunk of slots): lanes split the channels, a
// shuffle sums each dot product, every lane runs the same online softmax. Writes each held slot's
// score and the chunk's (maximum, sum, accumulator).
__global__ void partial_kernel(const PooledHead* heads, int group, int d, float scale, const float* q, int max_chunks,
                               int max_capacity, float* scores, float* partial) {
    const int h = blockIdx.x, chunk = blockIdx.y, lane = threadIdx.x;
    const PooledHead& head = heads[h / group];
    const float* qh = q + static_cast<size_t>(h) * d;
    float acc[kMaxPerLane] = {};
    OnlineSoftmax softmax;
    const int end = min((chunk + 1) * kChunkSlots, head.capacity);
    for (int slot = chunk * kChunkSlots; slot < end; ++slot) {
        const uint8_t code = head.codes[slot];
        if (code == kEmptyCode) continue;
        const TierView& k = head.keys[code & 3];
        const TierView& v = head.values[code >> 2];
        float dot = 0.0f;
        for (int c = lane; c < d; c += 32) dot += qh[c] * k.element(slot, c);
        for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        const float s = dot * scale;
        if (lane == 0) scores[static_cast<size_t>(h) * max_capacity + slot] = s;
        float w = 0.0f;
        const float rescale = softmax.add(s, w);
        for (int c = lane, i = 0; c < d; c += 32, ++i) acc[i] = acc[i] * rescale + w * v.element(slot, c);
    }
    float* out = partial + (static_cast<size_t>(h) * max_chunks + chunk) * (d + 2);
    if (lane == 0) out[0] = softmax.maximum, out[1] = softmax.sum;
    for (int c = lane, i = 0; c < d; c += 32, ++i) out[2 + c] = acc[i];
}

// Merges a query head's chunks in order (OnlineSoftmax::merge) into its output, maximum and sum.
__global__ void combine_kernel(const PooledHead* heads, int group, int d, int max_chunks, const float* partial,
                               float* out, float* maxima, float* sums) {
    const int h = blockIdx.x, lane = threadIdx.x;
    const int chunks = (heads[h / group].capacity + kChunkSlots - 1) / kChunkSlots;
    float acc[kMaxPerLane] = {};
    OnlineSoftmax softmax;
    for (int chunk = 0; chunk < chunks; ++chunk) {
        const float* p = partial + (static_cast<size_t>(h) * max_chunks + chunk) * (d + 2);
        OnlineSoftmax part;
        part.maximum = p[0], part.sum = p[1];
        float mine = 0.0f, theirs = 0.0f;
        softmax.merge(part, mine, theirs);
        for (int c = lane, i = 0; c < d; c += 32, ++i) acc[i] = acc[i] * mine + p[2 + c] * theirs;
    }
    if (chunks == 0) return;
    const float inv_sum = 1.0f / softmax.sum;
    for (int c = lane, i = 0; c < d; c += 32, ++i) out[static_cast<size_t>(h) * d + c] = acc[i] * inv_sum;
    if (lane == 0) maxima[h] = softmax.maximum, sums[h] = softmax.sum;
}

// What the policy sees, per KV head and slot: the group's mean softmax weight (0 where empty).
__global__ void weights_kernel(const PooledHead* heads, int group, int max_capacity, const float* scores,
                               const float* maxima, const float* sums, float* slot_weights) {
    const int kv = blockIdx.y;
    const int slot = blockIdx.x * blockDim.x + threadIdx.x;
    if (slot >= max_capacity) return;
    const PooledHead& head = heads[kv];
    float mean = 0.0f;
    if (slot < head.capacity && head.codes[slot] != kEmptyCode) {
        for (int g = 0; g < group; ++g) {
            const int h = kv * group + g;
            mean += expf(scores[static_cast<size_t>(h) * max_capacity + slot] - maxima[h]) * (1.0f / sums[h]);
        }
        mean /= static_cast<float>(group);
    }
    slot_weights[static_cast<size_t>(kv) * max_capacity + slot] = mean;
}

class CudaDeviceCache final : public DeviceCache {
public:
    CudaDeviceCache(const std::vector<HeadLayout>& layouts) : pool_(layouts) {}
    ~CudaDeviceCache() override {
        for (void* p : allocations_) cudaFree(p);
    }

    bool plan(int num_kv_heads, int group, int head_dim, std::string& error) {
        kv_heads_ = num_kv_heads, group_ = group, d_ = head_dim;
        if (head_dim > 32 * kMaxPerLane) {
            error = "backend 'cuda': head size " + std::to_string(head_dim) + " is over the kernels' " +
                    std::to_string(32 * kMaxPerLane);
            return false;
        }
        max_chunks_ = std::max(1, (pool_.max_capacity() + kChunkSlots - 1) / kChunkSlots);
        const std::size_t queries = static_cast<std::size_t>(kv_heads_) * group_, capacity = pool_.max_capacity();
        if (!allocate(&pool_device_, pool_.bytes(), error) ||
            !check(cudaMemset(pool_device_, kEmptyCode, pool_.bytes()), "cudaMemset", error))
            return false;
        const std::vector<PooledHead> heads = pool_.heads_at(pool_device_);
        host_out_.resize(queries * d_);
        return allocate(&heads_, heads.size(), error) &&
               check(cudaMemcpy(heads_, heads.data(), heads.size() * sizeof(PooledHead), cudaMemcpyHostToDevice),
                     "cudaMemcpy", error) &&
               allocate(&staged_device_, DevicePool::kStagedBytes, error) &&
               allocate(&copies_device_, DevicePool::kMaxCopies, error) && allocate(&q_, queries * d_, error) &&
               allocate(&out_, queries * d_, error) && allocate(&partial_, queries * max_chunks_ * (d_ + 2), error) &&
               allocate(&scores_, queries * capacity, error) && allocate(&maxima_, queries, error) &&
               allocate(&sums_, queries, error) && allocate(&slot_weights_, kv_heads_ * capacity, error);
    }

    bool stage(int head, int slot, uint8_t code, const TierView (&keys)[3], const TierView (&values)[3],
               std::string& error) override {
        if (pool_.stage(head, slot, code, keys, values)) return true;
        return flush(error) && pool_.stage(head, slot, code, keys, values);
    }

    bool attend(int layer, const float* q, float* out, float* slot_weights, std::string& error) override {
        const std::size_t queries = static_cast<std::size_t>(kv_heads_) * group_;
        const int capacity = pool_.max_capacity();
        const PooledHead* heads = heads_ + static_cast<std::size_t>(layer) * kv_heads_;
        if (!flush(error) || !check(cudaMemcpy(q_, q, queries * d_ * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy", error))
            return false;
        partial_kernel<<<dim3(static_cast<unsigned>(queries), static_cast<unsigned>(max_chunks_)), 32>>>(
            heads, group_, d_, 1.0f / std::sqrt(static_cast<float>(d_)), q_, max_chunks_, capacity, scores_, partial_);
        combine_kernel<<<static_cast<unsigned>(queries), 32>>>(heads, group_, d_, max_chunks_, partial_, out_, maxima_, sums_);
        weights_kernel<<<dim3(static_cast<unsigned>((capacity + 127) / 128), static_cast<unsigned>(kv_heads_)), 128>>>(
            heads, group_, capacity, scores_, maxima_, sums_, slot_weights_);
        if (!check(cudaGetLastError(), "a kernel launch", error) ||
            !check(cudaMemcpy(host_out_.data(), out_, queries * d_ * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy", error) ||
            !check(cudaMemcpy(slot_weights, slot_weights_, static_cast<std::size_t>(kv_heads_) * capacity * sizeof(float),
                              cudaMemcpyDeviceToHost),
                   "cudaMemcpy", error))
            return false;
        for (int kv = 0; kv < kv_heads_; ++kv) {
            if (pool_.layout(layer * kv_heads_ + kv).capacity == 0) continue;
            const std::size_t first = static_cast<std::size_t>(kv) * group_ * d_;
            std::copy_n(host_out_.data() + first, static_cast<std::size_t>(group_) * d_, out + first);
        }
        return true;
    }

    int max_capacity() const override { return pool_.max_capacity(); }
    std::size_t reserved_bytes() const override { return pool_.bytes(); }

private:
    static bool check(cudaError_t e, const char* what, std::string& error) {
        if (e == cudaSuccess) return true;
        error = std::string("backend 'cuda': ") + what + " failed: " + cudaGetErrorString(e);
        return false;
    }
    template <class T>
    bool allocate(T** device, std::size_t count, std::string& error) {
        void* p = nullptr;
        if (!check(cudaMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T)), "cudaMalloc", error)) return false;
        allocations_.push_back(p);
        *device = static_cast<T*>(p);
        return true;
    }
    // Sends the staged slots into the pool; what was staged is dropped either way (after a
    // failure the runtime stages every slot again).
    bool flush(std::string& error) {
        const int count = static_cast<int>(pool_.copies().size());
        bool ok = true;
        if (count > 0) {
            ok = check(cudaMemcpy(staged_device_, pool_.staged().data(), pool_.staged_bytes(), cudaMemcpyHostToDevice),
                       "cudaMemcpy", error) &&
                 check(cudaMemcpy(copies_device_, pool_.copies().data(), count * sizeof(PoolCopy), cudaMemcpyHostToDevice),
                       "cudaMemcpy", error);
            if (ok) {
                scatter_kernel<<<std::min(count, 4096), 128>>>(pool_device_, staged_device_, copies_device_, count);
                ok = check(cudaGetLastError(), "a kernel launch", error);
            }
        }
        pool_.clear();
        return ok;
    }

    DevicePool pool_;
    int kv_heads_ = 0, group_ = 1, d_ = 0, max_chunks_ = 1;
    std::vector<void*> allocations_;
    uint8_t* pool_device_ = nullptr;
    PooledHead* heads_ = nullptr;
    uint8_t* staged_device_ = nullptr;
    PoolCopy* copies_device_ = nullptr;
    float *q_ = nullptr, *out_ = nullptr, *partial_ = nullptr, *scores_ = nullptr, *maxima_ = nullptr, *sums_ = nullptr,
          *slot_weights_ = nullptr;
    std::vector<float> host_out_;
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

std::unique_ptr<DeviceCache> DeviceCache::create(const std::vector<HeadLayout>& heads, int num_kv_heads,
                                                 int group, int head_dim, std::string& error) {
    std::string why;
    if (!device_available(why)) {
        error = "backend 'cuda': " + why;
        return nullptr;
    }
    auto cache = std::make_unique<CudaDeviceCache>(heads);
    if (!cache->plan(num_kv_heads, group, head_dim, error)) return nullptr;
    return cache;
}

}  // namespace kvsim::runtime::cuda
