// Files the user names as input (configs, profiles, traces, models, texts) must be regular
// files: a directory would fail deep inside a parser, and a FIFO or device would block forever.
#pragma once
#include <string>

namespace kvsim {

// Throws InputError naming the path when it is missing, a directory, a FIFO, socket or device,
// unreadable, or its name is too long for the system (with the system's reason).
void require_regular_file(const std::string& path);

// The whole file, after require_regular_file: InputError naming the path when it cannot be read.
std::string read_input_file(const std::string& path);

}  // namespace kvsim
