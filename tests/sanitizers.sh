#!/usr/bin/env bash
# The whole test suite built with AddressSanitizer and UndefinedBehaviorSanitizer in build-asan/,
# halting at the first report. Run by .ci/run; by hand: tests/sanitizers.sh
#   tests/sanitizers.sh [--build-only | --no-build]
# clang, not gcc: the same two sanitizers, and a build under half the CPU time (gcc 12 spends most
# of an instrumented build in UBSan's checks: 7,196 CPU-seconds for build-asan against clang 14's
# 2,603; 58 s against 15 s for sim/replay.cpp alone).
# The same build carries libFuzzer's coverage instrumentation (-Dfuzz=true), so tests/fuzz/run.sh
# builds its fuzzers here too: CI compiles the project with clang once, not twice. In that build
# the fuzz harnesses are fuzzers, not `meson test` cases; run.sh replays their seeds and
# regressions as it starts.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
case "$mode" in all|--build-only|--no-build|--setup-only) ;; *) echo "usage: $0 [--build-only|--no-build]" >&2; exit 2;; esac

# UBSan without three of its checks: alignment, null and pointer-overflow each instrument every
# load through a pointer, which stops the replay's and the model's inner loops from vectorising.
# With them, kvsim's fixed-order dot product ran 100x slower than the release build (0.43 s against
# 13.7 s in a micro-benchmark of 2,000 passes over 4,096 keys), and the suite took 35 minutes; what
# they would report is still caught here: a null dereference is a SEGV that ASan reports with its
# stack, a pointer pushed out of its object is caught by ASan where it is read, and x86 reads
# unaligned values correctly (kvsim's file readers copy bytes into typed values, never cast them).
ubsan_off=-fno-sanitize=alignment,null,pointer-overflow
if [ -f build-asan/build.ninja ] && { ! grep -q 'command = clang++' build-asan/build.ninja ||
                                      ! grep -q 'fsanitize=fuzzer-no-link' build-asan/build.ninja ||
                                      ! grep -q -e "$ubsan_off" build-asan/build.ninja; }; then
    rm -rf build-asan  # configured with another compiler or other flags, which meson cannot change in place
fi
if [ ! -f build-asan/build.ninja ]; then
    # CUDA off: nvcc is not built for the sanitizers, and no GPU would run its code here anyway.
    CC=clang CXX=clang++ meson setup build-asan --buildtype=debugoptimized -Db_sanitize=address,undefined \
        -Dc_args="$ubsan_off" -Dcpp_args="$ubsan_off" -Db_lundef=false -Dcuda=disabled -Dfuzz=true >/dev/null
fi
[ "$mode" = --setup-only ] && exit 0

if [ "$mode" != --no-build ]; then
    # Only what the tests run: the benchmarks are built and run by hand, from the release build.
    mapfile -t targets < <(python3 - <<'PY'
import json, os, subprocess
build = os.path.abspath("build-asan")
def introspect(what):
    return json.loads(subprocess.check_output(["meson", "introspect", build, what]))
files = {t["id"]: t["filename"] for t in introspect("--targets")}
for test in introspect("--tests"):
    for dep in test["depends"]:
        for f in files[dep]:
            print(os.path.relpath(f, build))
PY
)
    # Quiet on success; on a failure, the compiler's or linker's own lines.
    ninja -C build-asan "${targets[@]}" > build-asan/ninja.log 2>&1 || { grep -E -A8 '^FAILED' build-asan/ninja.log | head -60; exit 1; }
fi
[ "$mode" = --build-only ] && exit 0

export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# The command-line tests read this to run their searches on shorter traces with fewer budgets: the
# same code paths, sized for a build that runs several times slower.
export KVSIM_SANITIZER_BUILD=1
meson test -C build-asan --no-rebuild --print-errorlogs --timeout-multiplier 4
