// SHA-256 for the provenance a trace records (the model and text it came from), by nettle.
#pragma once
#include <nettle/sha2.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace kvsim {

class Sha256 {
public:
    Sha256();
    void update(const void* data, std::size_t size);
    std::string hex_digest();  // finishes the hash; the object is spent

private:
    sha256_ctx context_;
};

std::string sha256_hex(std::string_view data);
// Hashes a file in chunks; throws InputError naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace kvsim
