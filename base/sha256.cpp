#include "base/sha256.h"

#include <cstdio>
#include <vector>

#include "base/errors.h"
#include "base/input_file.h"

namespace kvsim {

Sha256::Sha256() { sha256_init(&context_); }

void Sha256::update(const void* data, std::size_t size) {
    sha256_update(&context_, size, static_cast<const uint8_t*>(data));
}

std::string Sha256::hex_digest() {
    uint8_t digest[SHA256_DIGEST_SIZE];
    sha256_digest(&context_, sizeof digest, digest);
    char hex[2 * SHA256_DIGEST_SIZE + 1];
    for (int i = 0; i < SHA256_DIGEST_SIZE; ++i) std::snprintf(hex + 2 * i, 3, "%02x", digest[i]);
    return std::string(hex, 2 * SHA256_DIGEST_SIZE);
}

std::string sha256_hex(std::string_view data) {
    Sha256 hash;
    hash.update(data.data(), data.size());
    return hash.hex_digest();
}

std::string sha256_file(const std::string& path) {
    require_regular_file(path);
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) throw InputError(path + ": cannot read");
    Sha256 hash;
    std::vector<char> chunk(1 << 20);
    std::size_t n;
    while ((n = std::fread(chunk.data(), 1, chunk.size(), f)) > 0) hash.update(chunk.data(), n);
    const bool failed = std::ferror(f);
    std::fclose(f);
    if (failed) throw InputError(path + ": cannot read");
    return hash.hex_digest();
}

}  // namespace kvsim
