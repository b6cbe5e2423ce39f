#include "base/yaml_file.h"

#include <set>

#include "base/errors.h"
#include "base/input_file.h"

namespace kvsim {
namespace {

// yaml-cpp accepts a key given twice (and silently keeps one) and keys that are lists or maps;
// a config means one thing only, so both are input errors, reported at the key's line.
void check_keys(const std::string& path, const YAML::Node& node, int depth) {
    auto fail = [&](const YAML::Node& at, const std::string& what) {
        throw InputError(path + ":" + std::to_string(at.Mark().line + 1) + ": " + what);
    };
    if (depth > 64) fail(node, "nested more than 64 levels deep");
    if (node.IsSequence()) {
        for (const YAML::Node& item : node) check_keys(path, item, depth + 1);
    } else if (node.IsMap()) {
        std::set<std::string> seen;
        for (const auto& item : node) {
            if (!item.first.IsScalar()) fail(item.first, "a key must be a plain name, not a list or a map");
            if (!seen.insert(item.first.Scalar()).second) fail(item.first, "duplicate key '" + item.first.Scalar() + "'");
            check_keys(path, item.second, depth + 1);
        }
    }
}

}  // namespace

YAML::Node load_yaml_file(const std::string& path) { return load_yaml_text(read_input_file(path), path); }

YAML::Node load_yaml_text(const std::string& text, const std::string& path) {
    try {
        YAML::Node root = YAML::Load(text);
        check_keys(path, root, 0);
        return root;
    } catch (const InputError&) {
        throw;
    } catch (const YAML::BadFile&) {
        throw InputError(path + ": cannot read");
    } catch (const YAML::ParserException& e) {
        throw InputError(path + ":" + std::to_string(e.mark.line + 1) + ": YAML syntax error: " + e.msg);
    } catch (const YAML::Exception& e) {
        throw InputError(path + ": cannot read as YAML: " + e.msg);
    }
}

}  // namespace kvsim
