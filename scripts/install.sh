#!/usr/bin/env bash
# Installs what torch_ext needs on a Debian/Ubuntu machine, then builds it (editable install, build tree build/).
#
#   bash scripts/install.sh              system packages if missing, torch if missing, Python deps, the build
#   bash scripts/install.sh --test-deps  also the test dependencies (requirements-test.txt); on by default when CI=true
#   bash scripts/install.sh --only-test-deps   only the test dependencies (scripts/run_tests.sh calls this)
#   bash scripts/install.sh --dry-run    print each step and command without running anything
#
# An installed torch >= 2.9 is kept as it is (this script never up- or downgrades it). CI pins its exact torch
# through pip's own constraint mechanism: .ci/run exports PIP_CONSTRAINT=.ci/constraints.txt.
# Environment: PYTHON (default python3), MAX_JOBS (parallel compile jobs, default 2); pip's own variables apply,
# e.g. PIP_INDEX_URL=https://download.pytorch.org/whl/cpu for a CPU-only torch when none is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DRY_RUN=0
TEST_DEPS=0
ONLY_TEST_DEPS=0
[ "${CI:-}" = true ] && TEST_DEPS=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --test-deps) TEST_DEPS=1 ;;
    --only-test-deps) TEST_DEPS=1; ONLY_TEST_DEPS=1 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
  esac
done

START=$SECONDS
N_STEPS=4
step() { echo; echo "==> [$1/$N_STEPS] $2 ($((SECONDS - START)) s elapsed)"; }
run() {
  echo "+ $*"
  if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

if [ "$ONLY_TEST_DEPS" = 1 ]; then
  keep_torch=$(mktemp)
  trap 'rm -f "$keep_torch"' EXIT
  "$PYTHON" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' >"$keep_torch" 2>/dev/null || true
  echo "==> test dependencies (requirements-test.txt), holding $(cat "$keep_torch")"
  run "$PYTHON" -m pip install --progress-bar on -c "$keep_torch" -r requirements-test.txt
  exit 0
fi

# 1. system packages: a compiler, CMake, Ninja, ccache, GoogleTest
step 1 "system packages (apt)"
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v ccache >/dev/null || need+=(ccache)
[ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || [ -f /usr/lib/cmake/GTest/GTestConfig.cmake ] \
  || need+=(libgtest-dev)
if [ ${#need[@]} -eq 0 ]; then
  echo "all present: cmake, ninja, g++, ccache, libgtest-dev"
else
  if [ "$(id -u)" = 0 ]; then SUDO=(); else SUDO=(sudo); fi
  echo "missing: ${need[*]}"
  run "${SUDO[@]}" apt-get update
  run "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}"
fi

# 2. torch: keep a supported one, install one only when there is none
step 2 "torch (>= 2.9)"
# pip's own record of the version (torch.__version__ may carry a local tag such as +cu128 that pip does not know).
torch_version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ -z "$torch_version" ]; then
  echo "no torch found for $PYTHON: installing torch>=2.9${PIP_CONSTRAINT:+ (constrained by $PIP_CONSTRAINT)}"
  run "$PYTHON" -m pip install --progress-bar on "torch>=2.9"
elif "$PYTHON" -c 'import sys; v = tuple(int(x) for x in sys.argv[1].split("+")[0].split(".")[:2]); sys.exit(v < (2, 9))' "$torch_version"; then
  echo "torch $torch_version found: kept (torch_ext supports torch >= 2.9)"
else
  echo "install.sh: torch $torch_version is installed, torch_ext needs torch >= 2.9." >&2
  echo "Upgrade it yourself (for example: $PYTHON -m pip install 'torch>=2.9'), then run this script again." >&2
  exit 2
fi

# 3. Python dependencies (never torch: the constraint below pins the torch found or just installed)
step 3 "Python dependencies (requirements.txt$([ "$TEST_DEPS" = 1 ] && echo ', requirements-test.txt'))"
reqs=(-r requirements.txt)
[ "$TEST_DEPS" = 1 ] && reqs+=(-r requirements-test.txt)
keep_torch=$(mktemp)
trap 'rm -f "$keep_torch"' EXIT
dist_version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ -n "$dist_version" ]; then
  echo "torch==$dist_version" >"$keep_torch"
  echo "holding torch at $dist_version"
fi
run "$PYTHON" -m pip install --progress-bar on -c "$keep_torch" "${reqs[@]}"

# 4. the extension: CMake configure + build (compiler lines are shown), editable install
step 4 "build torch_ext (CMake + Ninja, MAX_JOBS=${MAX_JOBS:-2}; the first build compiles the C++ core)"
# An earlier editable install whose source folder was deleted leaves a dangling torch-ext.egg-link
# that pip cannot uninstall ("No such file or directory" in samefile): drop it, saying so.
stale_link_fix='
import os, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    link = os.path.join(d, "torch-ext.egg-link")
    if not os.path.isfile(link):
        continue
    target = open(link).readline().strip()
    if os.path.isdir(target):
        continue
    dry = "--dry-run" in sys.argv
    verb = "would remove" if dry else "removing"
    print(f"{verb} a stale editable install of torch_ext: {link} -> {target} "
          "(that folder no longer exists)")
    if dry:
        continue
    os.remove(link)
    pth = os.path.join(d, "easy-install.pth")
    if os.path.isfile(pth):
        lines = open(pth).read().splitlines()
        open(pth, "w").write("".join(l + "\n" for l in lines if l.strip() != target))
'
"$PYTHON" -c "$stale_link_fix" $([ "${DRY_RUN:-0}" = 1 ] && echo --dry-run)
run env MAX_JOBS="${MAX_JOBS:-2}" "$PYTHON" -m pip install -v --no-build-isolation --no-deps -c "$keep_torch" -e .

echo
echo "==> done in $((SECONDS - START)) s. Try: torch-ext demo   (tests: bash scripts/run_tests.sh)"
