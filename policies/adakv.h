// Ada-KV's adaptive budget allocation across the KV heads of a layer (policies/adakv.cpp).
#pragma once
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "policies/policy.h"

namespace kvsim {

// {evict: h2o, adakv: {floor: 0.2}}: the eviction policy's scores, selected across the layer's heads.
struct AdaKvRule {
    double floor = 0.2;  // each head keeps at least this fraction of its uniform share
    bool operator==(const AdaKvRule&) const = default;
};

// Ada-KV's name, paper and parameters, for `kvsim policies` and for checking an adakv map.
const PolicyDescriptor& adakv_descriptor();

// Parses an adakv map (floor in [0, 1]); throws InputError prefixed by `where`.
AdaKvRule resolve_adakv(const std::map<std::string, double>& given, const std::string& where);
std::string adakv_label(const AdaKvRule& rule);  // "adakv", "adakv(floor=0.5)"

// One layer's step of Ada-KV: given its heads' policies (every one has admitted this step's
// token) and each head's uniform share of the budget, how many positions each head keeps.
// The shares' sum is the layer's total; the keeps sum to it wherever the heads hold more.
class AdaKvAllocator {
public:
    explicit AdaKvAllocator(const AdaKvRule& rule) : rule_(rule) {}
    void allocate(std::span<Policy* const> heads, std::span<const int> shares, std::vector<int>& keep);

private:
    // A candidate as one unsigned number that is larger the later it is evicted: the score's
    // order (NaN lowest, -0 and +0 equal) above its position, above its head.
    using Candidate = unsigned __int128;
    AdaKvRule rule_;
    std::vector<HeldScores> held_;
    std::vector<Candidate> evictable_, pool_;
};

}  // namespace kvsim
