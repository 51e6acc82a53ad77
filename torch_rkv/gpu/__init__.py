"""The GPU implementation of every rkv op: Triton kernels, one module per op family.

Each module holds its kernels (`@triton.jit`) and a launcher per op with the op's schema, which
`registry.register` attaches to the op's CUDA dispatch key (`torch.library.register_kernel`). With
TORCH_RKV_TRITON_ON_CPU=1 the launchers are attached to the CPU key too and run under Triton's interpreter
on CPU tensors: the GPU code path, end to end, on a machine without a GPU (docs/ops.md, "GPU kernels").

Triton reads TRITON_INTERPRET when a `@triton.jit` decorator runs, so it is decided before any kernel
module is imported: importing this package sets TRITON_INTERPRET=1 when the switch is on. The tests and
scripts/triton_on_cpu.py set it themselves on a machine without a GPU; elsewhere it is left as the
process has it (a vLLM process on CPU imports torch_rkv beside its own Triton code).
"""

from __future__ import annotations

import os


ON_CPU_ENV = "TORCH_RKV_TRITON_ON_CPU"


def switch_on() -> bool:
    """Whether TORCH_RKV_TRITON_ON_CPU sends CPU tensors through the Triton kernels (interpreted)."""
    v = os.environ.get(ON_CPU_ENV, "0")
    if v not in ("0", "1"):
        raise ValueError(f"{ON_CPU_ENV} must be 0 or 1 (got {v!r})")
    return v == "1"


if switch_on():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """Whether the kernels run under Triton's interpreter (CPU tensors) rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
