// Writes one of the hostile traces of hostile_traces.h, for tests/cli_trace_input_test.py:
//   make_hostile_trace KIND PATH
#include <cstdio>
#include <exception>

#include "hostile_traces.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: make_hostile_trace KIND PATH\n");
        return 2;
    }
    try {
        kvsim::test::write_hostile_trace(argv[1], argv[2]);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "make_hostile_trace: %s\n", e.what());
        return 2;
    }
    return 0;
}
