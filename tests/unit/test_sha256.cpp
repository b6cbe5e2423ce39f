#include <doctest/doctest.h>

#include <filesystem>

#include "base/sha256.h"

using namespace kvsim;

TEST_CASE("SHA-256 matches the FIPS 180-4 examples") {
    CHECK(sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    CHECK(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
          "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    Sha256 chunked;  // the same bytes fed in uneven pieces
    const std::string million(1000000, 'a');
    for (std::size_t i = 0; i < million.size(); i += 997) chunked.update(million.data() + i, std::min<std::size_t>(997, million.size() - i));
    CHECK(chunked.hex_digest() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("SHA-256 of the shared model file matches its README") {
    const std::string path = KVSIM_SHARED_DIR "/models/stories260K/stories260K.gguf";
    if (!std::filesystem::exists(path)) {
        MESSAGE("skipped: " << path << " not present");
        return;
    }
    CHECK(sha256_file(path) == "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d");
}
