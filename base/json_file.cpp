#include "base/json_file.h"

#include "base/errors.h"
#include "base/input_file.h"

namespace kvsim {

nlohmann::json load_json_file(const std::string& path) {
    const std::string text = read_input_file(path);
    try {
        return nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
        throw InputError(path + ": not valid JSON (byte " + std::to_string(e.byte) + ")");
    } catch (const nlohmann::json::exception&) {  // a number past double's range (out_of_range 406)
        throw InputError(path + ": not valid JSON (a number past double's range)");
    }
}

}  // namespace kvsim
