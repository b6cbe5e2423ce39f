// By hand, for recording goldens (tests/goldens/README.md): writes the first `prompt` positions of
// one (sequence, layer) of a Q/K/V trace as the .npy files kvpress's harness reads, head-major
// ([1][heads][prompt][head_dim], float32): queries.npy (after RoPE), keys.npy, values.npy.
//   dump_prompt_npy TRACE SEQUENCE LAYER PROMPT OUT_DIR
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "sim/trace_store.h"

namespace {

void write_npy(const std::string& path, const std::vector<float>& position_major, int64_t prompt, int64_t heads,
               int64_t dim) {
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, " + std::to_string(heads) + ", " +
                         std::to_string(prompt) + ", " + std::to_string(dim) + "), }";
    while ((10 + header.size() + 1) % 64 != 0) header += ' ';
    header += '\n';
    std::ofstream out(path, std::ios::binary);
    out.write("\x93NUMPY\x01\x00", 8);
    const uint16_t length = static_cast<uint16_t>(header.size());
    out.write(reinterpret_cast<const char*>(&length), 2);  // little-endian on every machine kvsim builds on
    out << header;
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < prompt; ++t)
            out.write(reinterpret_cast<const char*>(position_major.data() + (t * heads + h) * dim),
                      static_cast<std::streamsize>(dim * sizeof(float)));
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 6) {
        std::fprintf(stderr, "usage: %s TRACE SEQUENCE LAYER PROMPT OUT_DIR\n", argv[0]);
        return 2;
    }
    const kvsim::TraceReader reader(argv[1]);
    const int sequence = std::stoi(argv[2]), layer = std::stoi(argv[3]);
    const int64_t prompt = std::stoll(argv[4]);
    const std::string out = argv[5];
    const kvsim::TraceMetadata& m = reader.metadata();
    const kvsim::QkvLayer data = reader.read_qkv(sequence, layer);
    if (prompt < 1 || prompt > data.tokens) {
        std::fprintf(stderr, "prompt %lld is outside 1..%lld\n", static_cast<long long>(prompt),
                     static_cast<long long>(data.tokens));
        return 2;
    }
    write_npy(out + "/queries.npy", data.q, prompt, m.num_query_heads, m.head_dim);
    write_npy(out + "/keys.npy", data.k, prompt, m.num_kv_heads, m.head_dim);
    write_npy(out + "/values.npy", data.v, prompt, m.num_kv_heads, m.head_dim);
    return 0;
}
