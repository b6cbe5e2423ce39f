// JSON input files (profiles, bases, fitted ranks, partial results and checkpoints, the results,
// search and profile files `kvsim report` plots), read with the checks every kvsim input file gets:
// a regular file only, nesting no deeper than kMaxJsonDepth, and a parse error is an InputError
// naming the file.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace kvsim {

// The deepest nesting of lists and objects a kvsim JSON file may have. Every format kvsim reads
// nests at most 5 deep (a partial's frame: file, frame, cells, a cell, its params); nlohmann's
// parser is iterative, but converting, copying or comparing a document recurses once per level, so
// about 100,000 levels overflow the stack. The bound is checked on the text, before any parse.
inline constexpr int kMaxJsonDepth = 64;

// InputError naming `path` and the byte where `text` first nests deeper than kMaxJsonDepth.
void check_json_depth(std::string_view text, const std::string& path);

// The parsed document; what it must contain is the caller's to check.
nlohmann::json load_json_file(const std::string& path);
// The same, keeping the file's key order.
nlohmann::ordered_json load_ordered_json_file(const std::string& path);

}  // namespace kvsim
