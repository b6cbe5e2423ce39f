// PyramidKV: Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
// Information Funneling". SnapKV's selection with a per-layer share of the budget: lower layers,
// whose attention is spread wide, keep more; upper layers, whose attention has funnelled, keep less.
#include "policies/pyramidkv.h"
#include "policies/snapkv.h"

namespace kvsim {

// floor(2 B (r (L-1) - k (r-1)) / ((r+1)(L-1))): an arithmetic series from layer 0 to L-1 whose
// mean is B and whose first term is r times its last.
int pyramid_budget(int budget, int layer, int num_layers, int ratio) {
    if (num_layers <= 1) return budget;
    // In 128 bits: a ratio up to 1e9 times a trace's layer count times the budget passes 2^63.
    // The quotient is at most 2 * budget * r / (r + 1), which fits an int.
    const __int128 L1 = num_layers - 1;
    const __int128 numerator = 2 * __int128{budget} * (ratio * L1 - __int128{layer} * (ratio - 1));
    return static_cast<int>(numerator / ((__int128{ratio} + 1) * L1));
}

namespace {

class PyramidKV : public SnapKV {
public:
    // The harness hands a stream at most `capacity` positions whatever its layer's share (it asks
    // for eviction past the budget), so the share, which may exceed the sequence, sizes nothing.
    PyramidKV(int capacity, int layer_share, int recent_window, int obs_window, int pool_kernel)
        : SnapKV(capacity, recent_window, obs_window, pool_kernel), layer_share_(layer_share) {}

protected:
    int eviction_target(int budget) const override { return std::min(budget, layer_share_); }

private:
    int layer_share_;
};

}  // namespace

PolicyDescriptor pyramidkv_descriptor() {
    PolicyDescriptor d{"pyramidkv", "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
            {{"pyramid_ratio", 4, true, 1, "budget of the first layer over that of the last"},
             {"recent_window", 32, true, 0, "most recent tokens never evicted"},
             {"obs_window", 16, true, 1, "steps of attention summed into the score"},
             {"pool_kernel", 7, true, 1, "width of the max-pooling over neighbouring cached tokens", true}},
            [](const ParamValues& p, const PolicyContext& ctx) -> std::unique_ptr<Policy> {
                const int recent_window = param_int(p, "recent_window");
                const int share = pyramid_budget(ctx.budget, ctx.layer, ctx.num_layers, param_int(p, "pyramid_ratio"));
                // A layer never keeps less than its recent window plus one evictable token.
                const int layer_share = std::max(share, recent_window + 1);
                return std::make_unique<PyramidKV>(ctx.capacity, layer_share, recent_window,
                                                   param_int(p, "obs_window"), param_int(p, "pool_kernel"));
            },
            check_recent_window_fits, false, snapkv_memory};
    d.scored = true;
    return d;
}

}  // namespace kvsim
