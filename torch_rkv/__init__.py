"""torch_rkv: RoPE-aware low-bit KV-cache quantization as torch.library custom ops.

Importing the package loads the compiled kernels (torch.ops.rkv.*), then the Python side of each op
(fake kernels for torch.compile, wrappers with docstrings), then the public API.
"""

import torch

from . import _C  # noqa: F401  (loads the kernels: TORCH_LIBRARY(rkv) + CPU/CUDA impls)
from . import ops  # noqa: F401  (fake kernels)
from .gpu import registry as _gpu_registry

_gpu_registry.register()  # the Triton kernels: every op's CUDA implementation (where triton is installed)
from .ops.attention import decode_attention
from .ops.hadamard import hadamard, hadamard_signs
from .ops.pack import pack, unpack
from .ops.quant import Quantized, dequantize, quantize
from .ops.rope import rope, rope_tables
from . import scheme  # noqa: E402, F401  (presets: torch_rkv.scheme.recommended(3), ...)
from .cache import QuantizedKVCache
from .scheme import Scheme

__version__ = "0.1.0"


def cpu_capability() -> str:
    """The CPU kernels in use: "avx2" (x86-64 with AVX2, FMA and F16C) or "default" (portable C++),
    chosen once from the CPU's features; RKV_CPU_CAPABILITY=default|avx2 forces one (csrc/cpu/capability.h)."""
    return _C.cpu_capability()


cpu_capability()  # a bad RKV_CPU_CAPABILITY fails here, at import, naming the variable


def has_kernel(op: str, device_type: str) -> bool:
    """Whether rkv::<op> has a kernel compiled for device_type ("cpu" or "cuda")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"rkv::{op}", device_type.upper())


__all__ = [
    "QuantizedKVCache",
    "Quantized",
    "Scheme",
    "decode_attention",
    "dequantize",
    "hadamard",
    "hadamard_signs",
    "cpu_capability",
    "has_kernel",
    "pack",
    "quantize",
    "rope",
    "rope_tables",
    "unpack",
]
