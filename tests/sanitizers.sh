#!/usr/bin/env bash
# The whole test suite built with AddressSanitizer and UndefinedBehaviorSanitizer in build-asan/,
# halting at the first report. Run by .ci/run; by hand: tests/sanitizers.sh
# clang, not gcc: the same two sanitizers, and a build under half the CPU time (gcc 12 spends most
# of an instrumented build in UBSan's checks: 7,196 CPU-seconds for build-asan against clang 14's
# 2,603; 58 s against 15 s for sim/replay.cpp alone).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f build-asan/build.ninja ] && ! grep -q 'command = clang++' build-asan/build.ninja; then
    rm -rf build-asan  # configured with another compiler, which meson cannot change in place
fi
if [ ! -f build-asan/build.ninja ]; then
    # CUDA off: nvcc is not built for the sanitizers, and no GPU would run its code here anyway.
    CC=clang CXX=clang++ meson setup build-asan --buildtype=debugoptimized -Db_sanitize=address,undefined \
        -Db_lundef=false -Dcuda=disabled >/dev/null
fi
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
ninja -C build-asan "${targets[@]}" >/dev/null
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
meson test -C build-asan --no-rebuild --print-errorlogs --timeout-multiplier 4
