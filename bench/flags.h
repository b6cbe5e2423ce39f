// A benchmark's CLI11 flags parsed as kvsim parses its own: --help prints and exits 0; a bad flag
// or value is one line, exit 2 (CLI11's own exit codes are 100 and up).
#pragma once
#include <cstdio>
#include <optional>

#include <CLI/CLI.hpp>

namespace kvsim::bench {

// The exit status where the program should stop now; nothing where the flags are good.
inline std::optional<int> parse_flags(CLI::App& app, int argc, char** argv) {
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::ParseError& e) {
        std::fprintf(stderr, "%s: %s (see --help)\n", argv[0], e.what());
        return 2;
    }
    return std::nullopt;
}

}  // namespace kvsim::bench
