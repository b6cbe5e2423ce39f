#include "base/input_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "base/errors.h"

namespace kvsim {

void require_regular_file(const std::string& path) {
    if (path.empty()) throw InputError("an empty file name was given");
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0) {
        if (errno == ENOENT || errno == ENOTDIR) throw InputError(path + ": no such file");
        throw InputError(path + ": cannot open (" + std::strerror(errno) + ")");
    }
    if (S_ISDIR(info.st_mode)) throw InputError(path + ": is a directory, not a file");
    if (!S_ISREG(info.st_mode)) {
        const char* kind = S_ISFIFO(info.st_mode) ? "a FIFO" : S_ISSOCK(info.st_mode) ? "a socket" : "a device";
        throw InputError(path + ": is " + std::string(kind) + ", not a regular file");
    }
    if (::access(path.c_str(), R_OK) != 0)
        throw InputError(path + ": cannot read (" + std::strerror(errno) + ")");
}

std::string read_input_file(const std::string& path) {
    require_regular_file(path);
    std::ifstream in(path, std::ios::binary);
    if (!in) throw InputError(path + ": cannot read");
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

}  // namespace kvsim
