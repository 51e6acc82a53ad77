"""hadamard: orthonormal fast Walsh-Hadamard transform along the last dim.

A power-of-two D is transformed whole; any other even D (<= 8192) block-diagonally in blocks of its
largest power-of-two divisor (96 -> 3 blocks of 32), which keeps the transform orthonormal. With signs s
the transform is H diag(s) / sqrt(n), inverse diag(s) H / sqrt(n). Semantics:
:func:`torch_rkv.reference.hadamard`.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _validate


def hadamard(x: torch.Tensor, signs: Optional[torch.Tensor] = None, inverse: bool = False) -> torch.Tensor:
    """Transform x (*, D); signs (D,) of +-1 or None. Without signs the transform is its own inverse."""
    return torch.ops.rkv.hadamard.default(x, signs, inverse)


def hadamard_signs(dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """A fixed random +-1 vector (float32, shape (dim,)) from ``seed``: the same on every machine."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (dim,), generator=gen)
    return (bits * 2 - 1).to(torch.float32).to(device)


@torch.library.register_fake("rkv::hadamard")
def _hadamard_fake(x, signs, inverse):
    _validate.hadamard(x, signs)
    return torch.empty_like(x, memory_format=torch.contiguous_format)
