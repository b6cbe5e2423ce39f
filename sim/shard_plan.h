// How a sweep's work divides among independent processes (shards of a Slurm job array, or the
// steps of one resumable run). A work unit is one configuration cell (a row of the combinations,
// in table order) replayed over one layer of the trace, every sequence and KV head included.
//
// The enumeration is fixed and documented: units are numbered layer by layer, cells in table
// order within a layer (unit = layer * cells + cell). Shard i of N takes the contiguous range
// [floor(i * U / N), floor((i + 1) * U / N)) of the U units. Every unit of a layer replays the same
// decode steps over the same KV heads, so equal counts are equal shares of the policy work, and a
// contiguous range touches as few layers as possible: the work each layer shares among its cells
// (reading or recomputing attention, heavy hitters) is repeated only by shards whose ranges meet
// inside a layer.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace kvsim {

struct WorkUnit {
    std::size_t cell = 0;
    int layer = 0;
};

// Every unit of a sweep of `cells` cells over `layers` layers, in the enumeration's order.
std::vector<WorkUnit> enumerate_work(std::size_t cells, int layers);

struct ShardSpec {
    int index = 0;
    int count = 1;
    std::string text() const { return std::to_string(index) + "/" + std::to_string(count); }
};

// "i/N" with 0 <= i < N: InputError naming `flag` otherwise.
ShardSpec parse_shard(const std::string& text, const std::string& flag);

// The units [first, second) shard `shard` takes of `units`.
std::pair<std::size_t, std::size_t> shard_range(std::size_t units, const ShardSpec& shard);

}  // namespace kvsim
