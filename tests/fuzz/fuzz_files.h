// What the harnesses of file readers share: the input written to a scratch file of this process,
// and the rule that bad input may only ever be an InputError (anything else escaping, a crash or a
// sanitizer report is a bug the fuzzer reports).
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "base/errors.h"

namespace kvsim::fuzz {

// /tmp/kvsim-fuzz-NAME-PID (NAME may end in an extension or be a folder's name).
inline std::string scratch_path(const std::string& name) {
    return "/tmp/kvsim-fuzz-" + name.substr(0, name.find('.')) + "-" + std::to_string(::getpid()) +
           (name.find('.') == std::string::npos ? "" : name.substr(name.find('.')));
}

// Writes the input to PATH; false when it cannot (the harness then skips the input).
inline bool write_input(const std::string& path, const uint8_t* data, size_t size) {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) return false;
    std::fwrite(data, 1, size, f);
    std::fclose(f);
    return true;
}

template <class F>
void expect_only_input_errors(F&& f) {
    try {
        f();
    } catch (const InputError&) {
    }
}

}  // namespace kvsim::fuzz
