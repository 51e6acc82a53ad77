#!/usr/bin/env bash
# One device call for work on the CUDA decode kernel (a lent GPU machine, torch preinstalled): build
# variants of the extension side by side, check the error path, run the CUDA tests on the first variant,
# time each variant's decode kernel (bench_decode's gpu_ms, the kernels' own time) and profile each
# one's split kernel with ncu. Each word of $RKV_VARIANTS is a comma-separated list of nvcc -D flags for
# one variant ("-": the tree as it is). Writes at most six files under $OUT (the device returns eight).
#   RKV_VARIANTS="- KNOB=1" bash scripts/gpu_decode_probe.sh          # about 5 minutes on an H200
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=$(realpath -m "${OUT:-out/gpu}")
mkdir -p "$out"
t_start=$(date +%s)
stamp() { echo "== $1 (+$(( $(date +%s) - t_start )) s)"; }
read -r -a variants <<< "${RKV_VARIANTS:--}"
source scripts/gpu_env.sh
export MAX_JOBS=$(( 16 / ${#variants[@]} ))
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
echo "CC=${CC:-} CXX=${CXX:-}"; ${CXX:-c++} --version | head -1

stamp "build ${variants[*]}"
dirs=() pids=()
for i in "${!variants[@]}"; do
  d=/tmp/rkv_v$i; dirs+=("$d")
  rm -rf "$d" && mkdir -p "$d" && cp -r torch_rkv setup.py pyproject.toml bench tests "$d"/
  flags=""; [ "${variants[$i]}" != "-" ] && flags=$(echo "${variants[$i]}" | tr ',' '\n' | sed 's/^/-D/' | tr '\n' ' ')
  (cd "$d" && NVCC_APPEND_FLAGS="$flags" python3 setup.py -q build_ext --inplace > "$d/build.log" 2>&1) &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?
  echo "build $i (${variants[$i]}) rc=$rc"; [ $rc -ne 0 ] && grep -E "error" "${dirs[$i]}/build.log" | head -5
done

stamp "error path (variant 0)"
cd "${dirs[0]}"
export PYTHONPATH=$PWD
if ! python3 "$repo/scripts/error_path_check.py" cpu cuda; then
  timeout 120 cuda-gdb -q -batch -ex run -ex bt --args python3 -c "
import torch, torch_rkv
torch.ops.rkv.quantize(torch.zeros(4, 8), 5, 8, 1, False, torch.float16)" > "$out/error_path_bt.txt" 2>&1
  grep -E "^#[0-9]" "$out/error_path_bt.txt" | head -4 | cut -c1-200
  nm -C --defined-only torch_rkv/_C*.so | grep -c "std::basic_ostream" | sed 's/^/std::basic_ostream symbols defined in _C: /'
fi

stamp "cuda tests (variant 0)"
HYPOTHESIS_PROFILE=ci timeout "${RKV_TEST_S:-180}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_attention.py \
  tests/test_paged.py tests/test_cache.py tests/test_quant.py tests/test_opcheck.py tests/test_outliers.py -k cuda \
  > "$out/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|crashed" "$out/tests.log" | tail -12

stamp "bench"
for i in "${!variants[@]}"; do
  (cd "${dirs[$i]}" && PYTHONPATH=${dirs[$i]} timeout 120 python3 bench/bench_decode.py --json --device cuda --peak-gbps 4800 \
    --contexts ${RKV_CONTEXTS:-4096 16384 65536} --bits 4 --keys pre-rope-per-channel --min-run-time 0.1 2>/dev/null) \
    | sed "s/^{/{\"variant\": \"${variants[$i]}\", /" >> "$out/bench.jsonl"
  echo "bench $i (${variants[$i]}) rc=${PIPESTATUS[0]}"
done
python3 "$repo/scripts/gpu_bench_summary.py" "$out/bench.jsonl"

stamp "ncu"
cat > /tmp/rkv_one.py <<'EOF'
import sys
import torch
import torch_rkv
from torch_rkv.layout import CacheLayout
from torch_rkv.scheme import Scheme
sys.path.insert(0, "bench")
from bench_decode import fill_random
n, hq, hkv, d = 16384, 32, 8, 128
s = Scheme(k_bits=4, v_bits=4, k_group_size=1, k_block_tokens=128, pre_rope=True)
bufs = fill_random(CacheLayout(s, 1, hkv, d, n, torch.float32), n, "cuda")
cos, sin = torch_rkv.rope_tables(d, n, theta=1e4, device="cuda")
a = [bufs.get(k) for k in ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero", "k_window", "v_window", "k_sink", "v_sink")]
q = torch.randn(1, hq, d, device="cuda")
for _ in range(3):
    torch_rkv.decode_attention(q, *a, torch.full((1,), n, device="cuda"), 4, 4, s.block, s.recent, cos, sin)
torch.cuda.synchronize()
EOF
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for i in "${!variants[@]}"; do
  echo "---- variant $i (${variants[$i]})" >> "$out/ncu.txt"
  (cd "${dirs[$i]}" && PYTHONPATH=${dirs[$i]} timeout 90 "$ncu" --clock-control none -k regex:attention_split -s 2 -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section InstructionStats python3 /tmp/rkv_one.py) >> "$out/ncu.txt" 2>&1
  echo "ncu $i (${variants[$i]}) rc=$?"
done
grep -E "^---- variant|Duration|Registers Per|Achieved Occupancy|Issued Warp|Executed Instructions  " "$out/ncu.txt"
stamp done
} 2>&1 | tee "$out/probe.log"
