// Output files appear whole or not at all: write to a temporary name beside the target, rename
// when complete. A failed or interrupted run leaves no half-written file under the real name.
#pragma once
#include <string>

namespace kvsim {

class AtomicFile {
public:
    explicit AtomicFile(std::string path);
    ~AtomicFile();  // removes the temporary file unless commit() succeeded
    AtomicFile(const AtomicFile&) = delete;
    AtomicFile& operator=(const AtomicFile&) = delete;

    const std::string& temp_path() const { return temp_path_; }
    const std::string& path() const { return path_; }
    void write(const std::string& contents);  // writes the whole temporary file
    void commit();  // renames the temporary file to the real name

private:
    std::string path_;
    std::string temp_path_;
    bool committed_ = false;
};

// Writes `contents` to `path` atomically; throws InputError naming the path on failure.
void write_file_atomically(const std::string& path, const std::string& contents);

}  // namespace kvsim
