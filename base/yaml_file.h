// YAML input files, read with the checks every kvsim YAML file gets: a regular file only, no
// duplicate or non-scalar keys, nesting at most 64 deep. Errors are InputErrors naming the file
// and line.
#pragma once
#include <string>

#include <yaml-cpp/yaml.h>

namespace kvsim {

YAML::Node load_yaml_file(const std::string& path);
// The same for a file's bytes read already; errors name `path`.
YAML::Node load_yaml_text(const std::string& text, const std::string& path);

}  // namespace kvsim
