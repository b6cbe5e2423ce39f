// The hand-run benchmarks' command lines, read as strictly as kvsim reads its own: a bad number or
// flag is one line naming the program and the argument, exit 2, before any work (std::atoi took
// "abc" as 0 and ran on).
#pragma once
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>

namespace kvsim::bench {

[[noreturn]] inline void bad_argument(const char* program, int index, const char* what, const char* text,
                                      const std::string& wanted) {
    std::fprintf(stderr, "%s: argument %d (%s) is '%s'; it must be %s\n", program, index, what, text, wanted.c_str());
    std::exit(2);
}

// Argument `index` (1-based) as a whole number in [low, high]; `fallback` where it is not given.
template <class T>
T integer_argument(int argc, char** argv, int index, T fallback, T low, T high, const char* what) {
    if (argc <= index) return fallback;
    const char* text = argv[index];
    const char* end = text + std::strlen(text);
    T value{};
    const auto [at, error] = std::from_chars(text, end, value);
    if (error != std::errc() || at != end || value < low || value > high)
        bad_argument(argv[0], index, what, text,
                     "a whole number from " + std::to_string(low) + " to " + std::to_string(high));
    return value;
}

// Argument `index` as a number in (low, high]; `fallback` where it is not given.
inline double real_argument(int argc, char** argv, int index, double fallback, double low, double high,
                            const char* what) {
    if (argc <= index) return fallback;
    const char* text = argv[index];
    const char* end = text + std::strlen(text);
    double value = 0;
    const auto [at, error] = std::from_chars(text, end, value);
    if (error != std::errc() || at != end || !(value > low && value <= high)) {
        char wanted[96];
        std::snprintf(wanted, sizeof wanted, "a number above %g and at most %g", low, high);
        bad_argument(argv[0], index, what, text, wanted);
    }
    return value;
}

}  // namespace kvsim::bench
