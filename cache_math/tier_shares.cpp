#include "cache_math/tier_shares.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>

#include "base/errors.h"
#include "base/input_file.h"
#include "base/yaml_file.h"

namespace kvsim {
namespace {

const char* const kZones[3] = {"fp16", "int8", "int4"};

std::vector<double>& zone(TierShares& s, int z) { return z == 0 ? s.fp16 : z == 1 ? s.int8 : s.int4; }
const std::vector<double>& zone(const TierShares& s, int z) { return z == 0 ? s.fp16 : z == 1 ? s.int8 : s.int4; }

std::string number_text(double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%.6g", v);
    return text;
}

}  // namespace

void check_tier_shares(const TierShares& s, const std::string& where) {
    const std::size_t heads = static_cast<std::size_t>(s.num_layers) * s.num_kv_heads;
    for (int z = 0; z < 3; ++z)
        if (zone(s, z).size() != heads)
            throw InputError(where + "." + kZones[z] + ": " + std::to_string(zone(s, z).size()) + " shares, but " +
                             std::to_string(s.num_layers) + " layers x " + std::to_string(s.num_kv_heads) +
                             " KV heads need " + std::to_string(heads));
    for (int l = 0; l < s.num_layers; ++l)
        for (int kv = 0; kv < s.num_kv_heads; ++kv) {
            const std::size_t i = s.index(l, kv);
            const std::string cell = "[" + std::to_string(l) + "][" + std::to_string(kv) + "]";
            double sum = 0;
            for (int z = 0; z < 3; ++z) {
                const double v = zone(s, z)[i];
                if (!(v >= 0 && v <= 1))
                    throw InputError(where + "." + kZones[z] + cell + ": " + number_text(v) + " is outside [0, 1]");
                sum += v;
            }
            if (sum > 1 + 1e-9)
                throw InputError(where + cell + ": the shares fp16 + int8 + int4 sum to " + number_text(sum) + " > 1");
        }
}

namespace {

TierShares parse_tier_shares(const std::string& text, const std::string& path, int num_layers, int num_kv_heads) {
    const YAML::Node file = load_yaml_text(text, path);
    auto fail = [&](const std::string& what) { throw InputError(path + ": " + what); };
    if (!file.IsMap() || !file["tiers"])
        fail("missing key 'tiers' (per-(layer, KV head) shares under fp16, int8 and int4)");
    const YAML::Node tiers = file["tiers"];
    if (!tiers.IsMap()) fail("tiers: expected a map with keys fp16, int8 and int4");
    TierShares s;
    s.num_layers = num_layers;
    s.num_kv_heads = num_kv_heads;
    for (int z = 0; z < 3; ++z) {
        const std::string key = std::string("tiers.") + kZones[z];
        const YAML::Node rows = tiers[kZones[z]];
        if (!rows) fail("missing key '" + key + "'");
        if (!rows.IsSequence() || static_cast<int>(rows.size()) != num_layers)
            fail(key + ": " + std::to_string(rows.IsSequence() ? rows.size() : 0) + " rows, but the trace has " +
                 std::to_string(num_layers) + " layers");
        for (int l = 0; l < num_layers; ++l) {
            const YAML::Node row = rows[l];
            const std::string row_key = key + "[" + std::to_string(l) + "]";
            if (!row.IsSequence() || static_cast<int>(row.size()) != num_kv_heads)
                fail(row_key + ": " + std::to_string(row.IsSequence() ? row.size() : 0) +
                     " entries, but the trace has " + std::to_string(num_kv_heads) + " KV heads");
            for (int kv = 0; kv < num_kv_heads; ++kv) {
                double v = 0;
                if (!row[kv].IsScalar() || !YAML::convert<double>::decode(row[kv], v) || std::isnan(v))
                    fail(row_key + "[" + std::to_string(kv) + "]: expected a number");
                zone(s, z).push_back(v);
            }
        }
    }
    check_tier_shares(s, path + ": tiers");
    return s;
}

}  // namespace

TierShares load_tier_shares(const std::string& path, int num_layers, int num_kv_heads) {
    return parsed_once<TierShares>(path, std::to_string(num_layers) + "x" + std::to_string(num_kv_heads),
                                   [&](const std::string& text) { return parse_tier_shares(text, path, num_layers, num_kv_heads); });
}

std::string tier_shares_json(const TierShares& s) {
    nlohmann::ordered_json j;
    for (int z = 0; z < 3; ++z) {
        nlohmann::ordered_json rows = nlohmann::ordered_json::array();
        for (int l = 0; l < s.num_layers; ++l) {
            const auto first = zone(s, z).begin() + static_cast<std::ptrdiff_t>(s.index(l, 0));
            rows.push_back(std::vector<double>(first, first + s.num_kv_heads));
        }
        j[kZones[z]] = rows;
    }
    return j.dump();
}

}  // namespace kvsim
