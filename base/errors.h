// Error types shared by every part of kvsim.
#pragma once
#include <stdexcept>
#include <string>

namespace kvsim {

// Bad input from the user: a config, trace, model file or CLI flag. The message names the
// file and the key or dataset; main() prints it on one line and exits with status 2.
struct InputError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A policy broke the harness contract (evicted a position it does not hold, left the cache
// over budget). The message names the policy and the step. Exit status 1: a bug, not input.
struct PolicyError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

}  // namespace kvsim
