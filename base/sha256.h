// SHA-256 (FIPS 180-4), for the provenance a trace records: the model and text it came from.
#pragma once
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
    void compress(const uint8_t* block);
    uint32_t state_[8];
    uint8_t buffer_[64];
    std::size_t buffered_ = 0;
    uint64_t total_bytes_ = 0;
};

std::string sha256_hex(std::string_view data);
// Hashes a file in chunks; throws InputError naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace kvsim
