#include "base/size_limits.h"

#include <unistd.h>

#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <utility>

namespace kvsim {
namespace {

// Physical memory, or the cgroup's limit when one is set and smaller (containers, Slurm jobs).
uint64_t available_memory() {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page_size = ::sysconf(_SC_PAGE_SIZE);
    uint64_t bytes = pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size)
                                                : uint64_t{8} << 30;
    for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
        std::ifstream in(path);
        uint64_t limit = 0;
        if (in >> limit && limit > 0 && limit < bytes) bytes = limit;
    }
    return bytes;
}

std::atomic<uint64_t>& limit_storage() {
    static std::atomic<uint64_t> limit{available_memory() / 4 * 3};
    return limit;
}

}  // namespace

uint64_t memory_limit_bytes() { return limit_storage().load(std::memory_order_relaxed); }
void set_memory_limit_bytes(uint64_t bytes) { limit_storage().store(bytes, std::memory_order_relaxed); }

std::string format_bytes(uint64_t bytes) {
    char text[64];
    if (bytes >= (uint64_t{1} << 30))
        std::snprintf(text, sizeof text, "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
    else if (bytes >= (uint64_t{1} << 20))
        std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
    else
        std::snprintf(text, sizeof text, "%llu bytes", static_cast<unsigned long long>(bytes));
    return text;
}

void check_memory(uint64_t bytes, const std::string& what) {
    const uint64_t limit = memory_limit_bytes();
    if (bytes > limit)
        throw InputError(what + " needs " + format_bytes(bytes) + ", over the memory limit of " + format_bytes(limit) +
                         " (--max-memory)");
}

uint64_t parse_byte_size(const std::string& text, const std::string& where) {
    double value = 0;
    const char* begin = text.data();
    const char* end = text.data() + text.size();
    const auto [rest, ec] = std::from_chars(begin, end, value);
    std::string unit(rest, end);
    double scale = 0;
    if (unit.empty() || unit == "B") scale = 1;
    else if (unit == "K" || unit == "KiB") scale = 1024.0;
    else if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024;
    else if (unit == "G" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
    else if (unit == "T" || unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
    const double bytes = value * scale;
    if (ec != std::errc() || rest == begin || scale == 0 || !std::isfinite(bytes) || bytes < 1 || bytes > 1.8e19)
        throw InputError(where + ": '" + text + "' is not a size (e.g. 512M, 8G, 1.5GiB or a byte count)");
    return static_cast<uint64_t>(bytes);
}

uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& what) {
    uint64_t out = 0;
    if (__builtin_mul_overflow(a, b, &out)) throw InputError(what + ": size overflows 64 bits");
    return out;
}

uint64_t checked_add(uint64_t a, uint64_t b, const std::string& what) {
    uint64_t out = 0;
    if (__builtin_add_overflow(a, b, &out)) throw InputError(what + ": size overflows 64 bits");
    return out;
}

}  // namespace kvsim
