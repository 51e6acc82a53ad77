"""pack / unpack: codes <-> bytes at exact density (docs/format.md).

2-bit: 4 codes per byte; 3-bit: 8 codes in 3 bytes; 4-bit: 2 per byte; 8-bit: 1 per byte. A row of D
codes is one little-endian bitstream. Semantics: :func:`torch_rkv.reference.pack`.
"""

from __future__ import annotations

import torch

from . import _validate


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (*, D) uint8, each < 2^bits -> (*, D*bits/8) uint8. D*bits must be a multiple of 8."""
    return torch.ops.rkv.pack.default(codes, bits)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed (*, B) uint8 -> codes (*, B*8/bits) uint8."""
    return torch.ops.rkv.unpack.default(packed, bits)


@torch.library.register_fake("rkv::pack")
def _pack_fake(codes, bits):
    _validate.pack(codes, bits)
    return codes.new_empty((*codes.shape[:-1], codes.shape[-1] * bits // 8))


@torch.library.register_fake("rkv::unpack")
def _unpack_fake(packed, bits):
    _validate.unpack(packed, bits)
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 8 // bits))
