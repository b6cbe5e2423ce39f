#include "sim/shard_plan.h"

#include <charconv>

#include "base/errors.h"

namespace kvsim {

std::vector<WorkUnit> enumerate_work(std::size_t cells, int layers) {
    std::vector<WorkUnit> units;
    units.reserve(cells * static_cast<std::size_t>(layers));
    for (int layer = 0; layer < layers; ++layer)
        for (std::size_t cell = 0; cell < cells; ++cell) units.push_back({cell, layer});
    return units;
}

ShardSpec parse_shard(const std::string& text, const std::string& flag) {
    const std::size_t slash = text.find('/');
    auto number = [&](std::string_view digits, int& out) {
        const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), out);
        return !digits.empty() && error == std::errc() && end == digits.data() + digits.size();
    };
    ShardSpec shard;
    if (slash == std::string::npos || !number(std::string_view(text).substr(0, slash), shard.index) ||
        !number(std::string_view(text).substr(slash + 1), shard.count))
        throw InputError(flag + " " + text + ": expected INDEX/COUNT, e.g. 0/4");
    if (shard.count < 1 || shard.count > 1000000)
        throw InputError(flag + " " + text + ": the shard count must be 1 to 1000000");
    if (shard.index < 0 || shard.index >= shard.count)
        throw InputError(flag + " " + text + ": shard index out of range (0 to " + std::to_string(shard.count - 1) +
                         ")");
    return shard;
}

std::pair<std::size_t, std::size_t> shard_range(std::size_t units, const ShardSpec& shard) {
    const auto n = static_cast<std::size_t>(shard.count), i = static_cast<std::size_t>(shard.index);
    return {i * units / n, (i + 1) * units / n};
}

}  // namespace kvsim
