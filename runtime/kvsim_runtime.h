/* kvsim runtime: a KV cache that runs a kvsim profile (profile.json) at serving time, per
 * (layer, KV head): token slots in tiers (FP16, INT8, INT4 with fp16 scales beside the data) under
 * the profile's eviction policy and budgets, or a streaming head's decayed linear state with its
 * exact sinks and recent window. What the simulator simulated, on real storage.
 *
 * Use: plan once (kvsim_rt_create sizes every buffer from the profile and the model's shape; no
 * allocation happens on the decode path), then per token and layer one kvsim_rt_decode call:
 * it appends the token's K and V, computes the step's attention for every query head, reading
 * every tier's rows where they are stored (FP16, INT8 or INT4, widened in vector registers),
 * updates the policy's scores from that attention, and evicts and re-zones to the profile's
 * budgets.
 *
 * Errors: every call returns a kvsim_status; kvsim_rt_last_error gives one line saying what went
 * wrong. The library never aborts, and a failed call leaves the cache as it was. Not thread-safe:
 * one handle per sequence, or calls serialised by the caller. C ABI, so any language can bind it.
 */
#ifndef KVSIM_RUNTIME_H
#define KVSIM_RUNTIME_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvsim_status {
    KVSIM_OK = 0,
    KVSIM_ERROR_INPUT = 1,      /* a bad argument or profile: another shape, a bad file, a null pointer */
    KVSIM_ERROR_CAPACITY = 2,   /* past the planned context, or a position out of order */
    KVSIM_ERROR_NONFINITE = 3,  /* NaN or infinity in Q, K or V */
    KVSIM_ERROR_BACKEND = 4,    /* the backend failed (no CUDA device, a failed CUDA call) */
    KVSIM_ERROR_INTERNAL = 5    /* a policy broke its contract: a bug, reported rather than aborted on */
} kvsim_status;

typedef struct kvsim_model_shape {
    int32_t num_layers;
    int32_t num_query_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t max_context; /* the most positions a sequence may reach: sizes every buffer */
    int32_t max_prefill; /* the most tokens one kvsim_rt_prefill call appends; 0: no prefill */
} kvsim_model_shape;

typedef struct kvsim_rt kvsim_rt;

/* Plans a cache for `profile_path` on `backend`: "cpu" (attention read straight from the stored
 * tiers, the query group at once), "cpu-oracle" (the simulator's two-pass attention, bit for bit), or "cuda"
 * (the cache's rows in device memory, attended there by split-K kernels; the policies, the
 * requantisation of tokens that sink and streaming heads run on the host, which keeps the master
 * copy and sends the device only the slots that changed each step; KVSIM_ERROR_BACKEND where
 * built without CUDA or no device is present). On failure *out is NULL and
 * kvsim_rt_create_error() says why (a profile of another shape names both shapes). */
kvsim_status kvsim_rt_create(const char* profile_path, const kvsim_model_shape* shape, const char* backend,
                             kvsim_rt** out);
const char* kvsim_rt_create_error(void); /* the last kvsim_rt_create failure of this thread */
void kvsim_rt_destroy(kvsim_rt* rt);
const char* kvsim_rt_last_error(const kvsim_rt* rt);

/* A failed CUDA call returns KVSIM_ERROR_BACKEND and leaves the step undone (a prefill keeps the
 * tokens before the one that failed, and says so); the device is sent the whole cache again
 * before the next call. */

/* Starts a new sequence: every layer's cache emptied, nothing reallocated. */
kvsim_status kvsim_rt_reset(kvsim_rt* rt);

/* One decode step of one layer at position `pos` (0, 1, 2, ... per layer): q holds the step's
 * queries (num_query_heads x head_dim, after RoPE), k and v the token's key and value
 * (num_kv_heads x head_dim each, after RoPE); out receives the attention output of every query
 * head (num_query_heads x head_dim) over the cache plus this token. */
kvsim_status kvsim_rt_decode(kvsim_rt* rt, int32_t layer, int32_t pos, const float* q, const float* k,
                             const float* v, float* out);

/* A prompt of `count` tokens of one layer at positions first_pos.. (count <= max_prefill): q, k, v
 * and out hold `count` rows of what kvsim_rt_decode takes, token after token. Each token attends
 * causally to the cache and the prompt before it and the policy observes it, but nothing is
 * evicted until the last: the cache is compressed once, as the simulator's prefill_tokens does. */
kvsim_status kvsim_rt_prefill(kvsim_rt* rt, int32_t layer, int32_t first_pos, int32_t count, const float* q,
                              const float* k, const float* v, float* out);

/* What the cache holds, for tests and reports. Bytes: summed over the KV heads of `layer` (-1: of
 * every layer), what each held while attending at its last step (K and V at their tier widths
 * with their scales, the current token at FP16, policy bookkeeping, linear states, counted as
 * kvsim's bytes_per_token metric counts them), and what a full fp16 cache would hold there. */
kvsim_status kvsim_rt_bytes(const kvsim_rt* rt, int32_t layer, double* held_bytes, double* full_fp16_bytes);

/* The positions a (layer, KV head) holds after its last step, ascending, with each one's key
 * tier (0 fp16, 1 int8, 2 int4); a streaming head reports its exact tokens at fp16. At most
 * `capacity` are written; *count receives how many it holds. */
kvsim_status kvsim_rt_held(const kvsim_rt* rt, int32_t layer, int32_t kv_head, int32_t* positions, uint8_t* tiers,
                           int32_t capacity, int32_t* count);

#ifdef __cplusplus
}
#endif

#endif
