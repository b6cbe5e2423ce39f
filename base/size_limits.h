// What input may make kvsim allocate, and size arithmetic that cannot wrap. Every size that comes
// from a file or a flag goes through here before it reaches an allocation or a narrower type.
#pragma once
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "base/errors.h"

namespace kvsim {

// The most memory one allocation plan may take. The default is three quarters of the machine's
// (or the cgroup's) memory; `--max-memory` changes it for a command.
uint64_t memory_limit_bytes();
void set_memory_limit_bytes(uint64_t bytes);

// Throws InputError "<what> needs 12.0 GiB, over the memory limit of 18.0 GiB (--max-memory)"
// when `bytes` exceeds the limit. `what` names the file and the key or dataset that implies it.
void check_memory(uint64_t bytes, const std::string& what);

// "512M", "8G", "1.5GiB", "100000" (bytes) for --max-memory; InputError naming `where` otherwise.
uint64_t parse_byte_size(const std::string& text, const std::string& where);

// "3.2 GiB", "12.0 MiB", "512 bytes".
std::string format_bytes(uint64_t bytes);

// a * b and a + b, or InputError "<what>: size overflows 64 bits" when they would wrap.
uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& what);
uint64_t checked_add(uint64_t a, uint64_t b, const std::string& what);

// `value` as To, or InputError "<what>: <value> is out of range [min, max]".
template <class To, class From>
To checked_narrow(From value, const std::string& what) {
    static_assert(std::is_integral_v<To> && std::is_integral_v<From>);
    if (!std::in_range<To>(value))
        throw InputError(what + ": " + std::to_string(value) + " is out of range [" +
                         std::to_string(std::numeric_limits<To>::min()) + ", " +
                         std::to_string(std::numeric_limits<To>::max()) + "]");
    return static_cast<To>(value);
}

}  // namespace kvsim
