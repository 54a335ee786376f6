#!/usr/bin/env bash
# Builds the C++ core and the GoogleTest suites with AddressSanitizer and UndefinedBehaviorSanitizer
# in a separate build tree (build-asan by default, ccache when available) and runs them with ctest.
# The suites include FuzzCorpus.ReplaysWithOnlyProjectErrors (tests/cpp/test_fuzz_corpus.cpp),
# which replays tests/python/fuzz_corpus (seeds and saved findings) through
# parse -> verify -> Executor -> reactive Engine, so the corpus replay runs sanitized too.
#
#   scripts/sanitize.sh                 # build-asan, all suites
#   BUILD_DIR=/tmp/asan JOBS=1 scripts/sanitize.sh
#   scripts/sanitize.sh -R 'Ir|FuzzCorpus'   # extra arguments go to ctest
#
# Only torch_ext's own code is instrumented (libtorch is the prebuilt wheel). Leak checking is
# off: libtorch keeps process-lifetime allocations (operator registry, thread pools) that
# LeakSanitizer would report at exit. Any ASan or UBSan report aborts the test that triggers it
# (halt_on_error, -fno-sanitize-recover), so "all tests passed" means clean.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-asan}"
JOBS="${JOBS:-2}"
SAN_FLAGS="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

TORCH_PREFIX="$(python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
LAUNCHER=()
if command -v ccache >/dev/null; then LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

# The Python extension stays off: its post-build step copies _C into the source tree, which must
# keep the regular build's extension.
cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DCMAKE_CXX_FLAGS="$SAN_FLAGS" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN_FLAGS" \
  -DCMAKE_SHARED_LINKER_FLAGS="$SAN_FLAGS" \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DTORCH_EXT_BUILD_PYTHON=OFF \
  -DTORCH_EXT_BUILD_TESTS=ON \
  "${LAUNCHER[@]}" >/dev/null

cmake --build "$BUILD_DIR" --target torch_ext_tests -- -j"$JOBS"

export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS" "$@"
echo "sanitize.sh: ASan+UBSan clean on every selected suite (build tree $BUILD_DIR)"
