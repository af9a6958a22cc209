#!/usr/bin/env bash
# Fuzzes the kvcache state loader with libFuzzer for a bounded time.
#
#   tests/fuzz/run_fuzz.sh [seconds=60] [extra libFuzzer flags...]
#
# Configures a clang build in build-fuzz/ (its own directory, OpenMP off), builds
# kvcache_fuzz_state with -fsanitize=fuzzer,address,undefined and runs it on a copy of
# tests/fuzz/corpus (the seeds stay untouched). KVFUZZ_JOBS=N runs N parallel workers.
# A finding is written to build-fuzz/artifacts/ and the script fails: add the file to
# tests/fuzz/regressions/ (test_fuzz_replay then runs it in every build) and fix the bug.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-60}"
shift || true
build=build-fuzz
cxx="${KVFUZZ_CXX:-$(command -v clang++ || command -v clang++-14 || true)}"
if [ -z "$cxx" ]; then
  echo "run_fuzz.sh: clang++ not found (Debian: apt-get install clang libclang-rt-14-dev)" >&2
  exit 1
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" \
  -DKVCACHE_USE_OPENMP=OFF -DKVCACHE_BUILD_BENCH=OFF -DKVCACHE_BUILD_EXAMPLES=OFF -DKVCACHE_INSTALL=OFF >/dev/null
cmake --build "$build" --target kvcache_fuzz_state
mkdir -p "$build/corpus" "$build/artifacts"
cp -n tests/fuzz/corpus/* "$build/corpus/" 2>/dev/null || true
jobs="${KVFUZZ_JOBS:-1}"
parallel=()
if [ "$jobs" -gt 1 ]; then parallel=("-fork=$jobs" "-ignore_crashes=0"); fi
echo "run_fuzz.sh: fuzzing the state loader for ${seconds}s (${jobs} worker(s))"
"$build/tests/fuzz/kvcache_fuzz_state" "$build/corpus" tests/fuzz/regressions \
  -max_total_time="$seconds" -artifact_prefix="$build/artifacts/" -print_final_stats=1 \
  -max_len=8192 "${parallel[@]}" "$@"
