// A progress bar on stderr, only when stderr is a terminal and the work has run for a second:
// the fraction done, the time since the bar was made, and the time left at the rate so far.
#pragma once
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace kvsim {

class ProgressBar {
public:
    explicit ProgressBar(bool enabled) : enabled_(enabled && ::isatty(STDERR_FILENO)) {}
    ~ProgressBar() { finish(); }

    // fraction: of the work, in [0, 1], measured in units whose rate stays roughly even (a
    // capture counts multiply-adds, not tokens), so that the time left is elapsed * (1 - f) / f.
    void update(double fraction) {
        if (!enabled_) return;
        const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
        if (elapsed < 1.0) return;
        const int width = 40, filled = static_cast<int>(fraction * width + 0.5);
        std::string left;
        if (fraction > 0.0 && fraction < 1.0) left = ", " + duration(elapsed * (1.0 - fraction) / fraction) + " left";
        const int shown = std::fprintf(stderr, "\r  [%.*s%*s] %3.0f%%  %s%s", filled,
                                       "########################################", width - filled, "", fraction * 100.0,
                                       duration(elapsed).c_str(), left.c_str());
        // A shorter line than the last (the time left shrinks) leaves no old characters behind.
        if (shown > 0 && shown < shown_width_) std::fprintf(stderr, "%*s", shown_width_ - shown, "");
        std::fflush(stderr);
        if (shown > shown_width_) shown_width_ = shown;
    }
    void finish() {
        if (shown_width_ > 0) std::fprintf(stderr, "\r%*s\r", shown_width_, "");
        shown_width_ = 0;
    }

    // "12.3 s" under a minute, then "4 min 05 s", then "2 h 07 min".
    static std::string duration(double seconds) {
        char text[32];
        if (seconds < 59.95) {  // what %.1f shows as 60.0 is a minute
            std::snprintf(text, sizeof text, "%.1f s", seconds);
        } else if (seconds < 3600.0) {
            const long s = static_cast<long>(seconds + 0.5);
            std::snprintf(text, sizeof text, "%ld min %02ld s", s / 60, s % 60);
        } else {
            const long m = static_cast<long>(seconds / 60.0 + 0.5);
            std::snprintf(text, sizeof text, "%ld h %02ld min", m / 60, m % 60);
        }
        return text;
    }

private:
    using Clock = std::chrono::steady_clock;
    bool enabled_;
    int shown_width_ = 0;  // characters of the widest line shown; 0 while none is
    Clock::time_point start_ = Clock::now();
};

}  // namespace kvsim
