#include "base/json_file.h"

#include <fstream>
#include <sstream>

#include "base/errors.h"
#include "base/input_file.h"

namespace kvsim {

nlohmann::json load_json_file(const std::string& path) {
    require_regular_file(path);
    std::ifstream in(path, std::ios::binary);
    if (!in) throw InputError(path + ": cannot read");
    std::stringstream text;
    text << in.rdbuf();
    try {
        return nlohmann::json::parse(text.str());
    } catch (const nlohmann::json::parse_error& e) {
        throw InputError(path + ": not valid JSON (byte " + std::to_string(e.byte) + ")");
    } catch (const nlohmann::json::exception&) {  // a number past double's range (out_of_range 406)
        throw InputError(path + ": not valid JSON (a number past double's range)");
    }
}

}  // namespace kvsim
