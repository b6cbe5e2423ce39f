// The C API of kvsim_runtime.h over the CPU backend: one HeadCache per (layer, KV head), planned
// from the profile once, stepped in parallel over KV heads (each head owns its state, so results
// do not depend on the number of threads).
#include "runtime/kvsim_runtime.h"

#include <tbb/parallel_for.h>

#include <cmath>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/errors.h"
#include "base/size_limits.h"
#include "policies/policy.h"
#include "search/profile.h"
#include "cache_math/softmax_exp.h"
#include "cache_math/tiers.h"
#include "runtime/cuda_attention.h"
#include "runtime/head_cache.h"
#include "runtime/runtime_internal.h"

struct kvsim_rt {
    kvsim_model_shape shape{};
    int group = 1;
    kvsim::ParamValues params;
    std::map<std::string, std::string> files;
    std::vector<std::unique_ptr<kvsim::runtime::HeadCache>> heads;  // [layer * num_kv_heads + kv]
    std::vector<int32_t> next_position;  // per layer
    std::string error;
    // The CUDA backend: the device's copy of every non-streaming head, and what a step uses.
    std::unique_ptr<kvsim::runtime::cuda::DeviceCache> device;
    bool device_stale = false;  // a device call failed: every slot is sent again before the next
    std::vector<int> admitted_slot;   // per KV head of the step's layer
    std::vector<float> slot_weights;  // num_kv_heads x device->max_capacity()
};

namespace {

thread_local std::string create_error;

// The CUDA backend cannot run here: KVSIM_ERROR_BACKEND.
struct BackendError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

using kvsim::runtime::HeadCache;
using kvsim::runtime::HeadPlan;
using kvsim::runtime::TierView;

kvsim_status fail(kvsim_rt* rt, kvsim_status status, const std::string& what) {
    rt->error = what;
    return status;
}

bool all_finite(const float* x, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i])) return false;
    return true;
}

std::unique_ptr<kvsim_rt> plan(const char* profile_path, const kvsim_model_shape& shape, const std::string& backend,
                               const kvsim::runtime::DeviceFactory& make_device) {
    using namespace kvsim;
    if (backend == "cuda" && make_device == nullptr) {
        std::string why;
        if (!runtime::cuda::device_available(why)) throw BackendError("backend 'cuda': " + why);
    }
    if (backend != "cpu" && backend != "cpu-oracle" && backend != "cuda")
        throw InputError("backend '" + backend + "': expected cpu, cpu-oracle (the two-pass attention that matches "
                         "the simulator bit for bit) or cuda");
    if (shape.num_layers < 1 || shape.num_query_heads < 1 || shape.num_kv_heads < 1 || shape.head_dim < 1 ||
        shape.max_context < 1 || shape.num_query_heads % shape.num_kv_heads != 0 || shape.max_prefill < 0 ||
        shape.max_prefill > shape.max_context)
        throw InputError("model shape: layers, query heads, KV heads, head size and max_context must be >= 1, "
                         "query heads a multiple of KV heads, and max_prefill in 0..max_context");
    auto rt = std::make_unique<kvsim_rt>();
    rt->shape = shape;
    rt->group = shape.num_query_heads / shape.num_kv_heads;
    const Profile p = load_profile(profile_path);  // read once: the plan below keeps what it needs
    check_profile_shape(p.model, profile_path,
                        ModelShape{"", shape.num_layers, shape.num_query_heads, shape.num_kv_heads, shape.head_dim},
                        "the engine's model");
    const PolicyDescriptor* policy = find_policy(p.policy);
    if (!policy) throw InputError(std::string(profile_path) + ": policy.name: unknown policy '" + p.policy + "'");
    rt->params = resolve_params(*policy, p.params, std::string(profile_path) + ": policy.params");
    // The policy reads its heads' plan itself.
    if (p.streaming || p.tiers || p.mixed) rt->files["profile"] = profile_path;

    const int L = shape.num_layers, K = shape.num_kv_heads;
    uint64_t reserved = 0;
    for (int layer = 0; layer < L; ++layer)
        for (int kv = 0; kv < K; ++kv) {
            HeadPlan h;
            h.layer = layer, h.kv_head = kv, h.num_layers = L, h.num_kv_heads = K;
            h.group = rt->group;
            h.head_dim = shape.head_dim;
            h.max_context = shape.max_context;
            h.oracle = backend == "cpu-oracle";
            h.prefill = shape.max_prefill;
            const std::size_t u = static_cast<std::size_t>(layer) * K + kv;
            h.budget = policy->keeps_everything ? shape.max_context
                       : !p.head_budgets.empty() ? std::min(p.head_budgets[u], shape.max_context)
                                                 : std::min(p.layer_budgets.at(layer), shape.max_context);
            // A stateless streaming head holds its sinks and window as slots, nothing more.
            if (p.streaming && p.streaming->heads.at(u) && !p.streaming->stateless.empty() && p.streaming->stateless[u])
                h.budget = std::min(p.streaming->sinks + std::max(p.streaming->recent, 1), shape.max_context);
            // A mixed cache's evicting head holds its own budget, a stateless streaming head its
            // sinks and window; the rest (tiers, a state, the full cache) every position.
            if (p.mixed && p.mixed->method[u] == HeadMethod::evict)
                h.budget = std::min(p.mixed->budgets[u], shape.max_context);
            if (p.mixed && p.mixed->method[u] == HeadMethod::streaming && p.mixed->stateless[u])
                h.budget = std::min(p.mixed->sinks + std::max(p.mixed->recent, 1), shape.max_context);
            // What one head reserves at most: every slot at every tier, each tier's two int32 maps
            // between slots and rows, and the serving path's per-slot scores of the query group,
            // row means and indices (each query head's scores rounded up to kSoftmaxRowAlignBytes,
            // and aligned).
            const uint64_t per_slot = 7ull * shape.head_dim + 6 * 2 * 4 + 4ull * rt->group + 3 * 4;
            reserved += checked_mul(static_cast<uint64_t>(std::max(h.budget, h.prefill)) + 1, per_slot, "runtime plan") +
                        uint64_t{kSoftmaxRowAlignBytes} * (rt->group + 1);
            check_memory(reserved, std::string(profile_path) + " on " + std::to_string(shape.max_context) +
                                       " positions (the runtime's planned cache)");
            const PolicyDescriptor* descriptor = policy;
            const kvsim_rt* owner = rt.get();
            const PolicyContext ctx{h.budget, std::min(std::max(h.budget, h.prefill), shape.max_context) + 1, layer, L,
                                    kv, K, shape.head_dim, &owner->files};
            rt->heads.push_back(std::make_unique<HeadCache>(
                h, [descriptor, owner, ctx]() { return descriptor->make(owner->params, ctx); }));
            // The profile cannot know the engine's head size: its tier format must fit it, as a
            // replay's and kvsim eval's must.
            if (const TierFormat* f = rt->heads.back()->tier_format())
                check_tier_format(*f, shape.head_dim, std::string(profile_path) + ": policy " + p.policy,
                                  "the engine's model");
        }
    rt->next_position.assign(L, 0);
    if (backend == "cuda") {
        std::vector<runtime::HeadLayout> layouts(rt->heads.size());
        for (std::size_t u = 0; u < rt->heads.size(); ++u) {
            const HeadCache& head = *rt->heads[u];
            if (head.per_channel_keys())
                throw BackendError("backend 'cuda': per-channel (KIVI) key groups (policy " + p.policy +
                                   ") are not on the device yet; use cpu");
            head.tier_views(layouts[u].keys, layouts[u].values);
            layouts[u].capacity = head.streaming() ? 0 : head.capacity();
        }
        std::string error;
        rt->device = make_device ? make_device(layouts, K, rt->group, shape.head_dim, error)
                                 : runtime::cuda::DeviceCache::create(layouts, K, rt->group, shape.head_dim, error);
        if (!rt->device) throw BackendError(error);
        for (auto& head : rt->heads) head->mirror_to_device(true);
        rt->admitted_slot.assign(K, -1);
        rt->slot_weights.assign(static_cast<std::size_t>(K) * rt->device->max_capacity(), 0.0f);
    }
    return rt;
}

// One token of one layer on the CUDA backend: the device heads admit it on the host, the slots
// that changed since the last step go to the device, the device attends, and the heads complete
// the step from the weights it returns (streaming heads run on the host, after the device has
// succeeded, so a failed device call leaves every head as it was).
bool device_step(kvsim_rt* rt, int32_t layer, int32_t t, const float* q, const float* k, const float* v, float* out,
                 bool defer_eviction) {
    const int K = rt->shape.num_kv_heads;
    const std::size_t d = static_cast<std::size_t>(rt->shape.head_dim);
    auto head = [&](int l, int kv) -> HeadCache& { return *rt->heads[static_cast<std::size_t>(l) * K + kv]; };
    for (int kv = 0; kv < K; ++kv)
        rt->admitted_slot[kv] = head(layer, kv).streaming() ? -1 : head(layer, kv).admit(t, k + kv * d, v + kv * d);
    std::string error;
    bool ok = true;
    auto send = [&](int l) {
        for (int kv = 0; kv < K; ++kv) {
            HeadCache& h = head(l, kv);
            const std::size_t u = static_cast<std::size_t>(l) * K + kv;
            TierView keys[3], values[3];
            h.tier_views(keys, values);
            h.take_dirty([&](int slot, uint8_t code) {
                ok = ok && rt->device->stage(static_cast<int>(u), slot, code, keys, values, error);
            });
        }
    };
    if (rt->device_stale) {
        for (auto& h : rt->heads) h->mark_all_dirty();
        for (int l = 0; l < rt->shape.num_layers; ++l) send(l);
    } else {
        send(layer);
    }
    ok = ok && rt->device->attend(layer, q, out, rt->slot_weights.data(), error);
    if (!ok) {
        for (int kv = 0; kv < K; ++kv)
            if (rt->admitted_slot[kv] >= 0) head(layer, kv).abandon(rt->admitted_slot[kv]);
        rt->device_stale = true;
        rt->error = error;
        return false;
    }
    rt->device_stale = false;
    const std::size_t row = static_cast<std::size_t>(rt->device->max_capacity());
    tbb::parallel_for(0, K, [&](int kv) {
        HeadCache& h = head(layer, kv);
        const std::size_t first_query = static_cast<std::size_t>(kv) * rt->group * d;
        if (h.streaming())
            h.decode(t, q + first_query, k + kv * d, v + kv * d, out + first_query, defer_eviction);
        else
            h.complete_from_slot_weights(t, rt->admitted_slot[kv], rt->slot_weights.data() + kv * row, defer_eviction);
    });
    return true;
}

// Checks everything before touching the cache, so a refused call leaves it as it was.
kvsim_status kvsim_rt_prefill_or_decode(kvsim_rt* rt, int32_t layer, int32_t pos, int32_t count, const float* q,
                                        const float* k, const float* v, float* out, bool prefill) {
    if (!rt) return KVSIM_ERROR_INPUT;
    const kvsim_model_shape& s = rt->shape;
    const char* call = prefill ? "kvsim_rt_prefill" : "kvsim_rt_decode";
    if (!q || !k || !v || !out) return fail(rt, KVSIM_ERROR_INPUT, std::string(call) + ": q, k, v and out must not be null");
    if (layer < 0 || layer >= s.num_layers)
        return fail(rt, KVSIM_ERROR_INPUT, "layer " + std::to_string(layer) + " is not in 0.." + std::to_string(s.num_layers - 1));
    if (prefill && (count < 1 || count > s.max_prefill))
        return fail(rt, KVSIM_ERROR_CAPACITY, std::string(call) + ": " + std::to_string(count) +
                                                  " tokens, but the plan allows 1.." + std::to_string(s.max_prefill) +
                                                  " a call (max_prefill)");
    if (pos != rt->next_position[layer])
        return fail(rt, KVSIM_ERROR_CAPACITY, "layer " + std::to_string(layer) + ": position " + std::to_string(pos) +
                                                  " out of order (the next is " + std::to_string(rt->next_position[layer]) + ")");
    if (static_cast<int64_t>(pos) + count > s.max_context)
        return fail(rt, KVSIM_ERROR_CAPACITY, "position " + std::to_string(pos + count - 1) +
                                                  " is past the planned context of " + std::to_string(s.max_context) +
                                                  " positions");
    const std::size_t d = static_cast<std::size_t>(s.head_dim), rows = static_cast<std::size_t>(count);
    const std::size_t q_row = s.num_query_heads * d, kv_row = s.num_kv_heads * d;
    if (!all_finite(q, rows * q_row) || !all_finite(k, rows * kv_row) || !all_finite(v, rows * kv_row))
        return fail(rt, KVSIM_ERROR_NONFINITE, "layer " + std::to_string(layer) + ", position " + std::to_string(pos) +
                                                   (count > 1 ? ".." + std::to_string(pos + count - 1) : "") +
                                                   ": NaN or infinity in q, k or v");
    try {
        if (rt->device) {
            for (int32_t i = 0; i < count; ++i)
                if (!device_step(rt, layer, pos + i, q + i * q_row, k + i * kv_row, v + i * kv_row, out + i * q_row,
                                 prefill && i + 1 < count)) {
                    // Tokens before i completed: the layer goes on from position pos + i.
                    rt->next_position[layer] += i;
                    if (i > 0)
                        rt->error += " (this prefill appended positions " + std::to_string(pos) + ".." +
                                     std::to_string(pos + i - 1) + "; the next is " + std::to_string(pos + i) + ")";
                    return KVSIM_ERROR_BACKEND;
                }
            rt->next_position[layer] += count;
            rt->error.clear();
            return KVSIM_OK;
        }
        tbb::parallel_for(0, s.num_kv_heads, [&](int kv) {
            HeadCache& head = *rt->heads[static_cast<std::size_t>(layer) * s.num_kv_heads + kv];
            const std::size_t first_query = static_cast<std::size_t>(kv) * rt->group * d;
            for (int32_t i = 0; i < count; ++i)
                head.decode(pos + i, q + i * q_row + first_query, k + i * kv_row + kv * d, v + i * kv_row + kv * d,
                            out + i * q_row + first_query, prefill && i + 1 < count);
        });
    } catch (const std::exception& e) {
        return fail(rt, KVSIM_ERROR_INTERNAL, e.what());
    }
    rt->next_position[layer] += count;
    rt->error.clear();
    return KVSIM_OK;
}

kvsim_status create(const char* profile_path, const kvsim_model_shape* shape, const char* backend,
                    const kvsim::runtime::DeviceFactory& make_device, kvsim_rt** out) {
    if (out) *out = nullptr;
    if (!profile_path || !shape || !out) {
        create_error = "kvsim_rt_create: profile_path, shape and out must not be null";
        return KVSIM_ERROR_INPUT;
    }
    try {
        *out = plan(profile_path, *shape, backend ? backend : "cpu", make_device).release();
        create_error.clear();
        return KVSIM_OK;
    } catch (const BackendError& e) {
        create_error = e.what();
        return KVSIM_ERROR_BACKEND;
    } catch (const kvsim::InputError& e) {
        create_error = e.what();
        return KVSIM_ERROR_INPUT;
    } catch (const std::invalid_argument& e) {
        create_error = std::string(profile_path) + ": " + e.what();
        return KVSIM_ERROR_INPUT;
    } catch (const std::exception& e) {
        create_error = e.what();
        return KVSIM_ERROR_INTERNAL;
    }
}

}  // namespace

kvsim_status kvsim::runtime::create_with_device(const char* profile_path, const kvsim_model_shape& shape,
                                                DeviceFactory make_device, kvsim_rt** out) {
    return create(profile_path, &shape, "cuda", make_device, out);
}

extern "C" {

kvsim_status kvsim_rt_create(const char* profile_path, const kvsim_model_shape* shape, const char* backend,
                             kvsim_rt** out) {
    return create(profile_path, shape, backend, nullptr, out);
}

const char* kvsim_rt_create_error(void) { return create_error.c_str(); }

void kvsim_rt_destroy(kvsim_rt* rt) { delete rt; }

const char* kvsim_rt_last_error(const kvsim_rt* rt) { return rt ? rt->error.c_str() : "no handle"; }

kvsim_status kvsim_rt_reset(kvsim_rt* rt) {
    if (!rt) return KVSIM_ERROR_INPUT;
    // Every head's new policy first: a failure (a plan file gone since create) changes nothing.
    std::vector<std::unique_ptr<kvsim::Policy>> fresh;
    try {
        for (const auto& h : rt->heads) fresh.push_back(h->fresh_policy());
    } catch (const kvsim::InputError& e) {
        return fail(rt, KVSIM_ERROR_INPUT, e.what());
    } catch (const std::exception& e) {
        return fail(rt, KVSIM_ERROR_INTERNAL, e.what());
    }
    for (std::size_t i = 0; i < rt->heads.size(); ++i) rt->heads[i]->reset(std::move(fresh[i]));
    std::fill(rt->next_position.begin(), rt->next_position.end(), 0);
    rt->error.clear();
    return KVSIM_OK;
}

kvsim_status kvsim_rt_decode(kvsim_rt* rt, int32_t layer, int32_t pos, const float* q, const float* k,
                             const float* v, float* out) {
    return kvsim_rt_prefill_or_decode(rt, layer, pos, 1, q, k, v, out, false);
}

kvsim_status kvsim_rt_prefill(kvsim_rt* rt, int32_t layer, int32_t first_pos, int32_t count, const float* q,
                              const float* k, const float* v, float* out) {
    return kvsim_rt_prefill_or_decode(rt, layer, first_pos, count, q, k, v, out, true);
}

kvsim_status kvsim_rt_bytes(const kvsim_rt* rt, int32_t only_layer, double* held_bytes, double* full_fp16_bytes) {
    if (!rt || !held_bytes || !full_fp16_bytes || only_layer < -1 || only_layer >= rt->shape.num_layers)
        return KVSIM_ERROR_INPUT;
    double held = 0, full = 0;
    for (int layer = 0; layer < rt->shape.num_layers; ++layer) {
        if (rt->next_position[layer] == 0 || (only_layer >= 0 && layer != only_layer)) continue;
        for (int kv = 0; kv < rt->shape.num_kv_heads; ++kv)
            held += rt->heads[static_cast<std::size_t>(layer) * rt->shape.num_kv_heads + kv]->attending_bytes();
        full += 4.0 * rt->shape.head_dim * rt->next_position[layer] * rt->shape.num_kv_heads;
    }
    *held_bytes = held;
    *full_fp16_bytes = full;
    return KVSIM_OK;
}

kvsim_status kvsim_rt_held(const kvsim_rt* rt, int32_t layer, int32_t kv_head, int32_t* positions, uint8_t* tiers,
                           int32_t capacity, int32_t* count) {
    if (!rt || !count || layer < 0 || layer >= rt->shape.num_layers || kv_head < 0 ||
        kv_head >= rt->shape.num_kv_heads || capacity < 0 || (capacity > 0 && (!positions || !tiers)))
        return KVSIM_ERROR_INPUT;
    const HeadCache& head = *rt->heads[static_cast<std::size_t>(layer) * rt->shape.num_kv_heads + kv_head];
    const std::vector<int32_t>& held = head.held();
    *count = static_cast<int32_t>(held.size());
    for (std::size_t i = 0; i < held.size() && static_cast<int32_t>(i) < capacity; ++i) {
        positions[i] = held[i];
        tiers[i] = head.key_tier_of(i);
    }
    return KVSIM_OK;
}

}  // extern "C"
