#!/usr/bin/env bash
# The CPU kernels under AddressSanitizer + UndefinedBehaviorSanitizer.
#
#   scripts/sanitize.sh [pytest arguments]     default: the CPU test suite (real-model tests deselected)
#
# Builds the extension with RKV_SANITIZE=1 (CPU only, -O1, -fno-sanitize-recover) in a copy of the tree
# under build/sanitize, so the normal build is never replaced, and runs pytest there with the sanitizer
# runtimes preloaded (Python itself is not instrumented). Any report aborts the run: exit status != 0.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
work=$root/build/sanitize/src
rm -rf "$work" && mkdir -p "$work"
(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$work")
cd "$work"
RKV_SANITIZE=1 "$py" setup.py -q build_ext --inplace > build.log 2>&1 || { tail -30 build.log; exit 1; }
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:protect_shadow_gap=0:detect_odr_violation=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
if [ $# -eq 0 ]; then
  set -- tests -m "not slow and not triton" -k "not compile" --ignore-glob='tests/test_gpu_*.py'
fi
start=$(date +%s)
"$py" -m pytest -q -p no:cacheprovider -n "${TEST_JOBS:-2}" "$@"
echo "sanitize: no ASan/UBSan report, $(( $(date +%s) - start )) s"
