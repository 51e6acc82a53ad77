#!/usr/bin/env bash
# Everything that needs a GPU, as one script for a lent GPU machine (torch and triton preinstalled there, no
# package registry). It builds no GPU code: the Triton kernels compile when they first run (the C++
# extension, the op schemas and CPU kernels, is built here only if the tree has none for this torch).
# It checks that raised errors reach Python, runs the CUDA tests (opcheck on CUDA tensors among them),
# runs the decode, append and prefill kernels under compute-sanitizer (memcheck, racecheck), and the GPU
# benchmarks with the device's peak bandwidth. Each stage
# has a time limit (seconds, overridable), and all of them together RKV_BUDGET_S (default 570), so the
# whole fits one device call of 10 minutes with the most important results first. Writes eight files
# under $OUT (default out/gpu), the most a lent machine returns; summary.txt: stage results and times.
#   bash scripts/gpu_check.sh [peak GB/s of the device, default 4800 (H200)]
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${OUT:-out/gpu}")
mkdir -p "$out"
peak=${1:-4800}
source scripts/gpu_env.sh
export MAX_JOBS=${MAX_JOBS:-16}
t_start=$(date +%s)
say() { echo "$* (+$(( $(date +%s) - t_start )) s)" | tee -a "$out/summary.txt"; }
# a stage's limit: its own (seconds), or what is left of the whole run's RKV_BUDGET_S if that is less
lim() {
  local left=$(( t_start + ${RKV_BUDGET_S:-570} - $(date +%s) ))
  (( left < 1 )) && left=1
  echo $(( left < $1 ? left : $1 ))
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
  echo "CXX=${CXX:-c++}: $(${CXX:-c++} --version | head -1)"; } | tee "$out/summary.txt"

if ! python -c "import torch_rkv" > /dev/null 2>&1; then
  timeout -k 10 "$(lim 300)" python setup.py -q build_ext --inplace > "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; say "build failed"; exit 1; }
  say "built the C++ extension (CPU kernels)"
fi
python -c "import triton; print('triton', triton.__version__)" | tee -a "$out/summary.txt"
export PYTHONPATH=$PWD HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
python scripts/error_path_check.py cpu cuda | tee -a "$out/summary.txt"

# pytest-xdist where there is one: a crashing case then costs its worker, not the rest of the run
xdist=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
# the transformers modules are left out: they run no CUDA kernels, and a lent image's transformers may be
# one the integration refuses (import error by design)
timeout -k 10 "$(lim "${RKV_TESTS_S:-150}")" python -m pytest -q -p no:cacheprovider $xdist tests -k cuda \
  --ignore-glob='tests/test_families_*.py' --ignore=tests/test_report.py --ignore=tests/test_transformers.py \
  > "$out/tests_cuda.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$out/tests_cuda.log" | head -20 | tee -a "$out/summary.txt"
say "cuda tests: exit $rc, $(grep -E '(passed|failed)' "$out/tests_cuda.log" | tail -1)"

timeout -k 10 "$(lim "${RKV_BENCH_S:-100}")" python bench/bench_decode.py --json --device cuda --peak-gbps "$peak" \
  --contexts 4096 16384 65536 --bits 4 3 2 --keys pre-rope-per-channel --batch "${RKV_BENCH_BATCH:-1}" \
  --min-run-time 0.1 > "$out/bench_decode.jsonl" 2> "$out/bench.err"
say "bench_decode: exit $?, $(wc -l < "$out/bench_decode.jsonl") rows"
python scripts/gpu_bench_summary.py "$out/bench_decode.jsonl" | tee -a "$out/summary.txt"

cs=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
for tool_s in memcheck:${RKV_MEMCHECK_S:-130} racecheck:${RKV_RACECHECK_S:-70}; do
  tool=${tool_s%%:*}
  HYPOTHESIS_PROFILE=sanitizer timeout -k 10 "$(lim "${tool_s##*:}")" "$cs" --tool "$tool" --error-exitcode 9 \
    --target-processes all python -m pytest -q -p no:cacheprovider ${xdist:+-n 4} tests/test_quant.py \
    tests/test_attention.py tests/test_paged.py tests/test_cache.py -k cuda \
    2>&1 | head -c 4000000 > "$out/sanitizer_$tool.log"
  rc=${PIPESTATUS[0]}
  # a hazard is printed when it happens, so a run cut at its time limit still reports those it met
  hazards=$(grep -cE '^========= (Invalid|Error|Race|Warning)' "$out/sanitizer_$tool.log")
  clean=$(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitizer_$tool.log")
  say "compute-sanitizer $tool: exit $rc (124: stage time limit), $hazards hazards reported, $clean clean summaries"
done

timeout -k 10 "$(lim "${RKV_PAGED_S:-60}")" python bench/bench_paged.py --json --min-run-time 0.2 \
  > "$out/bench_paged.jsonl" 2>> "$out/bench.err"
say "bench_paged: exit $?"
timeout -k 10 "$(lim "${RKV_QUANT_S:-50}")" python bench/bench_quant.py --json --device cuda --bits 4 \
  --min-run-time 0.2 > "$out/bench_quant.jsonl" 2>> "$out/bench.err"
say "bench_quant: exit $?"
