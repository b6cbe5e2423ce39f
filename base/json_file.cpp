#include "base/json_file.h"

#include "base/errors.h"
#include "base/input_file.h"

namespace kvsim {
namespace {

template <class Json>
Json parse_json_file(const std::string& path) {
    const std::string text = read_input_file(path);
    check_json_depth(text, path);
    try {
        return Json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
        throw InputError(path + ": not valid JSON (byte " + std::to_string(e.byte) + ")");
    } catch (const nlohmann::json::exception&) {  // a number past double's range (out_of_range 406)
        throw InputError(path + ": not valid JSON (a number past double's range)");
    }
}

}  // namespace

void check_json_depth(std::string_view text, const std::string& path) {
    int depth = 0;
    bool in_string = false, escaped = false;
    for (std::size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (escaped)
                escaped = false;
            else if (c == '\\')
                escaped = true;
            else if (c == '"')
                in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            if (++depth > kMaxJsonDepth)
                throw InputError(path + ": lists and objects nested deeper than " + std::to_string(kMaxJsonDepth) +
                                 " levels (byte " + std::to_string(i + 1) + ")");
        } else if (c == ']' || c == '}') {
            --depth;  // unbalanced brackets are the parser's to report
        }
    }
}

nlohmann::json load_json_file(const std::string& path) { return parse_json_file<nlohmann::json>(path); }

nlohmann::ordered_json load_ordered_json_file(const std::string& path) {
    return parse_json_file<nlohmann::ordered_json>(path);
}

}  // namespace kvsim
