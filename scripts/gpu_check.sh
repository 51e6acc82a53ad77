#!/usr/bin/env bash
# Everything that needs a GPU, as one script for a lent GPU machine (torch preinstalled there, no package
# registry): build the extension for this GPU, run the CUDA tests, run them under compute-sanitizer
# (memcheck, racecheck), and the GPU benchmarks. Prints a summary; writes logs and JSON under $OUT
# (default out/gpu). About 8 minutes on an H200.
#   bash scripts/gpu_check.sh [peak GB/s of the device, default 4800 (H200)]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu}
mkdir -p "$out"
peak=${1:-4800}
source scripts/gpu_env.sh
export MAX_JOBS=${MAX_JOBS:-16}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python -c "import torch; print('torch', torch.__version__)" | tee -a "$out/device.txt"
time python setup.py -q build_ext --inplace > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
export PYTHONPATH=$PWD
cuda_tests="tests/test_quant.py tests/test_pack.py tests/test_rope.py tests/test_hadamard.py tests/test_attention.py tests/test_cache.py tests/test_paged.py tests/test_opcheck.py"
# pytest-xdist where there is one: a crashing case then costs its worker, not the rest of the run
xdist=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
python -m pytest -q -p no:cacheprovider $xdist $cuda_tests -k cuda 2>&1 | tee "$out/tests_cuda.log" | tail -5
status_tests=${PIPESTATUS[0]}
cs=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
for tool in memcheck racecheck; do
  HYPOTHESIS_PROFILE=ci "$cs" --tool "$tool" --error-exitcode 9 --target-processes all \
    python -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_cache.py tests/test_paged.py tests/test_quant.py -k cuda \
    > "$out/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitizer_$tool.log") clean summaries)" \
    | tee -a "$out/summary.txt"
done
python bench/bench_decode.py --json --device cuda --peak-gbps "$peak" --contexts 4096 16384 65536 --bits 4 2 > "$out/bench_decode.jsonl" 2> "$out/bench_decode.err"
python bench/bench_quant.py --json --device cuda --bits 4 2 > "$out/bench_quant.jsonl" 2> "$out/bench_quant.err"
echo "cuda tests exit $status_tests" | tee -a "$out/summary.txt"
tail -n 50 "$out"/bench_decode.jsonl
