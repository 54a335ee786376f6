#!/usr/bin/env bash
# Runs every test: the GoogleTest suites (ctest, on the same build tree the extension uses) and pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${TORCH_EXT_BUILD_DIR:-build}
if [ ! -f "$BUILD/build.ninja" ]; then
  echo "no build tree at $BUILD: run scripts/install.sh first" >&2
  exit 2
fi
# Test-only dependencies (requirements-test.txt) are installed on first use, keeping the installed torch.
if ! python3 -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("pytest", "xdist", "hypothesis", "transformers", "transformer_lens", "onnxruntime", "onnxscript", "torchvision")))'; then
  bash scripts/install.sh --only-test-deps || exit 2
fi
cmake --build "$BUILD" -- -j"${MAX_JOBS:-2}" || exit 1
ctest --test-dir "$BUILD" --output-on-failure -j2
cpp=$?
# pytest-xdist runs the test files side by side, each file whole on one worker (--dist loadfile: its module
# fixtures and test order as in a serial run). Workers: TORCH_EXT_TEST_WORKERS, default min(cores, 4); 1 runs
# serially. Each worker keeps torch's default intra-op thread count, the one a serial run has (bit-exact results
# of MKL/oneDNN kernels depend on it).
workers=${TORCH_EXT_TEST_WORKERS:-$(cores=$(nproc 2>/dev/null || echo 1); echo $((cores < 4 ? cores : 4)))}
if ! [[ "$workers" =~ ^[0-9]+$ ]] || [ "$workers" -lt 1 ]; then
  echo "TORCH_EXT_TEST_WORKERS must be a whole number >= 1, got '$workers'" >&2
  exit 2
fi
xdist=()
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile)
python3 -m pytest tests/python -q -p no:cacheprovider --durations=30 "${xdist[@]}"
py=$?
echo "ctest exit $cpp, pytest exit $py"
[ $cpp = 0 ] && [ $py = 0 ]
