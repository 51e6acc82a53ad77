"""Compiles every Triton kernel of torch_rkv ahead of time, for GPUs this machine does not have, and fails
on what only a compile shows: an error, shared memory above the target's limit, a register spill, or an
approximate or fused instruction in a kernel whose results must match the CPU kernels bit for bit.

    python scripts/triton_compile_check.py [--archs 80 90 100 120] [--full-arch 90] [--jobs 2]

Each kernel module's compile_specs(False) (one representative configuration per kernel) is compiled for
every arch of --archs, and compile_specs(True) (every head_dim, bit width and variant its launchers launch)
for --full-arch. `triton.compile` builds the cubin with the wheel's own ptxas; the same ptxas run with -v on
the kernel's PTX, with the options Triton passes it, prints its registers and spill stores. Triton's cache
(~/.triton/cache) keeps the compiled kernels, so a second run takes seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

os.environ["TRITON_INTERPRET"] = "0"  # compiled, not interpreted: set before any @triton.jit runs

# The most shared memory one block may use (bytes, with the opt-in carve-out), from NVIDIA's CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability". Triton does not check it.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

# PTX instructions a bit-exact kernel (launched with enable_fp_fusion=False) must not contain: a fused
# multiply-add rounds once where the CPU rounds twice; the approximate forms are not correctly rounded.
INEXACT = re.compile(r"\b(fma\.rn\.f32|div\.approx|div\.full|sqrt\.approx|rcp\.approx)")


def specs():
    """{module name: (representative specs, full specs)}."""
    import importlib

    from torch_rkv.gpu import registry

    out = {}
    for name in registry.MODULES + registry.HELPER_MODULES:
        mod = importlib.import_module(f"torch_rkv.gpu.{name}")
        if hasattr(mod, "compile_specs"):
            out[name] = (mod.compile_specs(False), mod.compile_specs(True))
    return out


def compile_one(task):
    """Compile spec number i of module `name` for `arch`; (arch, label, problems, facts, seconds)."""
    name, full, i, arch = task
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    from triton.compiler import ASTSource

    spec = specs()[name][1 if full else 0][i]
    start = time.time()
    problems = []
    try:
        k = triton.compile(ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs),
                           target=GPUTarget("cuda", arch, 32), options=spec.options)
    except Exception as e:  # noqa: BLE001  (any compile failure is the finding)
        return arch, spec.label, [f"compile error: {str(e).strip().splitlines()[-1][:300]}"], "", time.time() - start
    shared = k.metadata.shared
    if shared > SHARED_LIMIT[arch]:
        problems.append(f"shared memory {shared} B above the sm_{arch} limit of {SHARED_LIMIT[arch]} B")
    exact = spec.options.get("enable_fp_fusion") is False
    ptx = k.asm["ptx"]
    if exact:
        found = sorted(set(INEXACT.findall(ptx)))
        if found:
            problems.append(f"bit-exact kernel has inexact instructions: {', '.join(found)}")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", *(["--fmad=false"] if exact else []),
               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    if not regs:
        problems.append(f"ptxas -v printed no register count: {log.strip()[-300:]}")
    if any(spills):
        problems.append(f"{max(spills)} bytes of register spill stores")
    facts = f"shared {shared} B, {regs.group(1) if regs else '?'} registers, {max(spills or [0])} B spilled"
    return arch, spec.label, problems, facts, time.time() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", type=int, nargs="+", default=[80, 90, 100, 120])
    ap.add_argument("--full-arch", type=int, default=90)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    for a in args.archs + [args.full_arch]:
        if a not in SHARED_LIMIT:
            ap.error(f"no shared memory limit known for sm_{a}: add it to SHARED_LIMIT")
    tasks = []
    for name, (rep, full) in specs().items():
        rep_labels = {s.label for s in rep}
        tasks += [(name, False, i, a) for a in args.archs for i in range(len(rep))]
        tasks += [(name, True, i, args.full_arch) for i, s in enumerate(full)
                  if not (s.label in rep_labels and args.full_arch in args.archs)]
    start = time.time()
    failed = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for arch, label, problems, facts, secs in pool.map(compile_one, tasks):
            mark = "FAIL" if problems else "ok"
            print(f"{mark:4} sm_{arch:<3} {label}: {facts} ({secs:.1f} s)" + "".join(f"\n     {p}" for p in problems),
                  flush=True)
            failed += bool(problems)
    print(f"triton compile check: {len(tasks)} kernel configurations, {failed} failed, {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
