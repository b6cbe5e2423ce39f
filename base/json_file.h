// JSON input files (profiles, bases, fitted ranks, partial results), read with the checks every
// kvsim input file gets: a regular file only, and a parse error is an InputError naming the file.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace kvsim {

// The parsed document; what it must contain is the caller's to check.
nlohmann::json load_json_file(const std::string& path);

}  // namespace kvsim
