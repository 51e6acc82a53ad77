#!/usr/bin/env bash
# The test suite under other CPU code paths than this machine's defaults, so a test that holds only on
# one instruction set fails here rather than on the next machine (docs/reliability.md):
#
#   RKV_CPU_CAPABILITY=default     torch_rkv's portable kernels instead of the AVX2 ones
#   ATEN_CPU_CAPABILITY=default    ATen's unvectorized kernels;  =avx2: its AVX2 kernels (on AVX-512 CPUs)
#   MKL_ENABLE_INSTRUCTIONS=AVX2 + ONEDNN_MAX_CPU_ISA=AVX2   the BLAS and oneDNN paths of an AVX2-only CPU
#
# A CI-sized subset each (the full suite runs once, with the defaults, in `make test`).
#   scripts/cpu_paths.sh            every variant
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
cd "$root"
kernels=(tests/test_attention.py tests/test_cache.py tests/test_paged.py tests/test_adversarial.py tests/test_quant.py tests/test_opcheck.py
         tests/test_build.py)
models=(tests/test_transformers.py tests/test_report.py -k "not reproduces_the_4_bit_reference_rows and not calibrated_levels_rows")

run() {  # run NAME VAR=VALUE... -- pytest arguments
  local name=$1; shift
  local vars=()
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  local start=$(date +%s) inductor
  # each variant compiles into its own inductor cache: torch's FX graph cache key leaves out
  # ATEN_CPU_CAPABILITY, so a graph compiled for AVX-512 would be reloaded and its C++ rebuilt without
  # the vector ISA it was generated for (a compile error, not a test result)
  inductor=$(mktemp -d)
  env "${vars[@]}" TORCHINDUCTOR_CACHE_DIR="$inductor" "$py" -m pytest -q -p no:cacheprovider -n "${TEST_JOBS:-2}" "$@"
  rm -rf "$inductor"
  echo "cpu paths: $name passed in $(( $(date +%s) - start )) s"
}

run "torch_rkv portable kernels" RKV_CPU_CAPABILITY=default -- "${kernels[@]}" -m "not slow and not triton"
run "ATen default" ATEN_CPU_CAPABILITY=default -- "${kernels[@]:0:2}" "${models[@]}" -m "not slow and not triton"
# the AVX2 variants differ from the defaults only where the CPU has more: on an AVX2-only CPU they are
# the configuration `make test` just ran, and rerunning it would test nothing new
aten=$("$py" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
if [[ $aten == AVX512* ]]; then
  run "ATen avx2" ATEN_CPU_CAPABILITY=avx2 -- "${kernels[@]:0:2}" "${models[@]}" -m "not slow and not triton"
  run "MKL + oneDNN at AVX2, real model" MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 -- "${models[@]}"
else
  echo "cpu paths: ATen avx2 and MKL + oneDNN at AVX2 not rerun: this CPU's own paths are those (ATen $aten)"
fi
