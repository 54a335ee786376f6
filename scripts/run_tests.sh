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
if ! python3 -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("pytest", "hypothesis", "transformers", "transformer_lens", "onnxruntime", "onnxscript", "torchvision")))'; then
  bash scripts/install.sh --only-test-deps || exit 2
fi
cmake --build "$BUILD" -- -j"${MAX_JOBS:-2}" || exit 1
ctest --test-dir "$BUILD" --output-on-failure -j2
cpp=$?
python3 -m pytest tests/python -q -p no:cacheprovider
py=$?
echo "ctest exit $cpp, pytest exit $py"
[ $cpp = 0 ] && [ $py = 0 ]
