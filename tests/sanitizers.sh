#!/usr/bin/env bash
# The whole test suite built with AddressSanitizer and UndefinedBehaviorSanitizer (gcc) in
# build-asan/, halting at the first report. Run by .ci/run; by hand: tests/sanitizers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f build-asan/build.ninja ]; then
    # CUDA off: nvcc is not built for the sanitizers, and no GPU would run its code here anyway.
    meson setup build-asan --buildtype=debugoptimized -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled >/dev/null
fi
ninja -C build-asan >/dev/null
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
meson test -C build-asan --print-errorlogs --timeout-multiplier 4
