// A progress bar on stderr, only when stderr is a terminal and the work has run for a second.
#pragma once
#include <unistd.h>

#include <chrono>
#include <cstdio>

namespace kvsim {

class ProgressBar {
public:
    explicit ProgressBar(bool enabled) : enabled_(enabled && ::isatty(STDERR_FILENO)) {}
    ~ProgressBar() { finish(); }

    void update(double fraction) {
        if (!enabled_) return;
        const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
        if (elapsed < 1.0) return;
        const int width = 40, filled = static_cast<int>(fraction * width + 0.5);
        std::fprintf(stderr, "\r  [%.*s%*s] %3.0f%%  %.1f s", filled, "########################################",
                     width - filled, "", fraction * 100.0, elapsed);
        std::fflush(stderr);
        shown_ = true;
    }
    void finish() {
        if (shown_) std::fprintf(stderr, "\r%*s\r", 70, "");
        shown_ = false;
    }

private:
    using Clock = std::chrono::steady_clock;
    bool enabled_;
    bool shown_ = false;
    Clock::time_point start_ = Clock::now();
};

}  // namespace kvsim
