#include "src/atomic_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "src/errors.h"

namespace kvsim {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
    const std::filesystem::path p(path_);
    temp_path_ = (p.parent_path() / ("." + p.filename().string() + ".tmp-" + std::to_string(::getpid()))).string();
}

AtomicFile::~AtomicFile() {
    if (!committed_) std::remove(temp_path_.c_str());
}

void AtomicFile::commit() {
    if (std::rename(temp_path_.c_str(), path_.c_str()) != 0)
        throw InputError(path_ + ": cannot write (" + std::strerror(errno) + ")");
    committed_ = true;
}

void AtomicFile::write(const std::string& contents) {
    std::ofstream out(temp_path_, std::ios::binary);
    out << contents;
    out.close();
    if (!out) throw InputError(path_ + ": cannot write (" + std::strerror(errno) + ")");
}

void write_file_atomically(const std::string& path, const std::string& contents) {
    AtomicFile file(path);
    file.write(contents);
    file.commit();
}

}  // namespace kvsim
