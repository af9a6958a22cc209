#!/usr/bin/env bash
# Fuzzes kvcache with libFuzzer for a bounded time.
#
#   [KVFUZZ_TARGET=state|api] tests/fuzz/run_fuzz.sh [seconds=60] [extra libFuzzer flags...]
#
# KVFUZZ_TARGET=state (default): the state loader (kvcache_fuzz_state, seeds in
# tests/fuzz/corpus, regressions in tests/fuzz/regressions). KVFUZZ_TARGET=api: random
# operation sequences with injected allocation failures against the reference model
# (kvcache_fuzz_api, seeds and regressions in tests/fuzz/api_corpus).
# Configures a clang build in build-fuzz/ (its own directory, OpenMP off), builds the
# target with -fsanitize=fuzzer,address,undefined and runs it on a copy of the seeds
# (they stay untouched). KVFUZZ_JOBS=N runs N parallel workers.
# KVFUZZ_SAN=asan (default: address + undefined, build-fuzz/), ubsan (undefined only,
# build-fuzz-ubsan/) or plain (no sanitizer, build-fuzz-plain/): the last two for long
# throughput runs (the API fuzzer's own checks, leak check included, run in every build).
# The API target runs with -entropic=0: libFuzzer's entropic schedule spent about 3/4 of
# the time updating its feature frequencies on these long programs (~50 exec/s instead of
# ~500 in the plain build); pass -entropic=1 after the seconds to get it back.
# KVFUZZ_BUILD=all configures and builds both targets (2 jobs) and exits; KVFUZZ_BUILD=no
# skips the configure and build (a prebuilt build dir: CI builds once, then runs the two
# targets side by side).
# A finding is written to build-fuzz/artifacts/ and the script fails: add the file to
# tests/fuzz/regressions/ (state) or tests/fuzz/api_corpus/ (api), so that
# test_fuzz_replay / test_fuzz_api_replay run it in every build, and fix the bug.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-60}"
shift || true
san="${KVFUZZ_SAN:-asan}"
case "$san" in
  asan) build=build-fuzz; sanitizers="address,undefined" ;;
  ubsan) build=build-fuzz-ubsan; sanitizers="undefined" ;;
  plain) build=build-fuzz-plain; sanitizers="" ;;
  *) echo "run_fuzz.sh: KVFUZZ_SAN must be asan, ubsan or plain, not '$san'" >&2; exit 1 ;;
esac
cxx="${KVFUZZ_CXX:-$(command -v clang++ || command -v clang++-14 || true)}"
if [ -z "$cxx" ]; then
  echo "run_fuzz.sh: clang++ not found (Debian: apt-get install clang libclang-rt-14-dev)" >&2
  exit 1
fi
build_mode="${KVFUZZ_BUILD:-yes}"
case "$build_mode" in
  yes|all|no) ;;
  *) echo "run_fuzz.sh: KVFUZZ_BUILD must be yes, all or no, not '$build_mode'" >&2; exit 1 ;;
esac
if [ "$build_mode" != no ]; then
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" \
  -DKVCACHE_USE_OPENMP=OFF -DKVCACHE_BUILD_BENCH=OFF -DKVCACHE_BUILD_EXAMPLES=OFF -DKVCACHE_INSTALL=OFF \
  -DKVCACHE_FUZZ_SANITIZERS="$sanitizers" >/dev/null
fi
if [ "$build_mode" = all ]; then
  cmake --build "$build" -j2 --target kvcache_fuzz_state kvcache_fuzz_api
  exit 0
fi
target="${KVFUZZ_TARGET:-state}"
case "$target" in
  state) exe=kvcache_fuzz_state; seeds=tests/fuzz/corpus; extra_dirs=(tests/fuzz/regressions); what="the state loader"; max_len=8192; schedule=() ;;
  api) exe=kvcache_fuzz_api; seeds=tests/fuzz/api_corpus; extra_dirs=(); what="the API (operation sequences, injected allocation failures)"; max_len=1024; schedule=(-entropic=0) ;;
  *) echo "run_fuzz.sh: KVFUZZ_TARGET must be state or api, not '$target'" >&2; exit 1 ;;
esac
# libFuzzer truncates the inputs it loads to -max_len: raise it to the largest seed or
# regression input, so that every one of them runs whole before the fuzzing starts (CI's
# sanitizer build relies on this instead of sanitized test_fuzz_replay builds).
for f in "$seeds"/* "${extra_dirs[@]/%//*}"; do
  if [ -f "$f" ]; then
    size=$(wc -c < "$f")
    if [ "$size" -gt "$max_len" ]; then max_len=$size; fi
  fi
done
if [ "$build_mode" = yes ]; then cmake --build "$build" --target "$exe"; fi
corpus="$build/corpus-$target"
mkdir -p "$corpus" "$build/artifacts"
cp -n "$seeds"/* "$corpus/" 2>/dev/null || true
jobs="${KVFUZZ_JOBS:-1}"
parallel=()
if [ "$jobs" -gt 1 ]; then parallel=("-fork=$jobs" "-ignore_crashes=0"); fi
echo "run_fuzz.sh: fuzzing $what for ${seconds}s (${jobs} worker(s), sanitizers: ${sanitizers:-none})"
"$build/tests/fuzz/$exe" "$corpus" "${extra_dirs[@]}" \
  -max_total_time="$seconds" -artifact_prefix="$build/artifacts/$target-" -print_final_stats=1 \
  -max_len="$max_len" "${schedule[@]}" "${parallel[@]}" "$@"
