#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang, AddressSanitizer and UndefinedBehaviorSanitizer in the
# sanitizer build (build-asan/, set up by tests/sanitizers.sh with libFuzzer's coverage), and runs
# each for SECONDS (default 60). New inputs go to build-fuzz/corpus/NAME (the
# seeds in tests/fuzz/corpus/NAME stay as they are); a crash is saved under build-fuzz/crashes/ and
# ends the run with status 1: copy it into tests/fuzz/regressions/NAME/ and fix it.
#   tests/fuzz/run.sh [SECONDS] [NAME...]      e.g. tests/fuzz/run.sh 1800 gguf   (30 minutes)
# KVSIM_FUZZ_SEED fixes libFuzzer's random seed (CI sets it, so a CI run can be repeated).
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
shift || true

tests/sanitizers.sh --setup-only
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for f in tests/fuzz/fuzz_*.cpp; do n=$(basename "$f" .cpp); names+=("${n#fuzz_}"); done
fi
targets=()
for n in "${names[@]}"; do targets+=("tests/fuzz/fuzz_$n"); done
ninja -C build-asan "${targets[@]}" >/dev/null

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
mkdir -p build-fuzz/crashes
status=0
for n in "${names[@]}"; do
    mkdir -p "build-fuzz/corpus/$n"
    seeds="tests/fuzz/corpus/$n"
    extra=()
    [ -d "tests/fuzz/regressions/$n" ] && extra+=("tests/fuzz/regressions/$n")
    options=()
    [ -f "tests/fuzz/$n.dict" ] && options+=(-dict="tests/fuzz/$n.dict")
    [ -n "${KVSIM_FUZZ_SEED:-}" ] && options+=(-seed="$KVSIM_FUZZ_SEED")
    echo "fuzz: $n for ${seconds}s"
    if ! "build-asan/tests/fuzz/fuzz_$n" -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=20 \
            -print_final_stats=1 -artifact_prefix="build-fuzz/crashes/$n-" "${options[@]}" \
            "build-fuzz/corpus/$n" "$seeds" "${extra[@]}" > "build-fuzz/fuzz-$n.log" 2>&1; then
        echo "fuzz: $n FAILED; see build-fuzz/fuzz-$n.log and build-fuzz/crashes/"
        tail -40 "build-fuzz/fuzz-$n.log"
        status=1
    else
        grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "build-fuzz/fuzz-$n.log" | sed "s/^/fuzz: $n: /"
    fi
done
exit $status
