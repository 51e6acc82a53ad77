"""quantize / dequantize: group-wise round-to-nearest quantization with bit-packed codes.

A group is a tile of ``block_tokens`` tokens x ``group_size`` channels sharing one scale (and zero):

* per-token:   ``block_tokens=1, group_size=dim``   (one scale per token)
* grouped:     ``block_tokens=1, group_size=g``     (dim / g scales per token)
* per-channel: ``block_tokens=T, group_size=1``     (one scale per channel per block of T tokens)

Semantics: :func:`torch_rkv.reference.quantize`. Byte layout: docs/format.md.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _validate


class Quantized(NamedTuple):
    """A quantized tensor: packed codes (*, N, D*bits/8) uint8 and per-group metadata
    (*, N/block_tokens, D/group_size); ``zero`` is None for symmetric quantization."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    bits: int
    levels: Optional[torch.Tensor] = None  # non-uniform code values (2^bits,) float32; None: uniform

    @property
    def dim(self) -> int:
        return self.packed.shape[-1] * 8 // self.bits

    @property
    def group_size(self) -> int:
        return self.dim // self.scale.shape[-1]

    @property
    def block_tokens(self) -> int:
        return self.packed.shape[-2] // max(self.scale.shape[-2], 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def nbytes(self) -> int:
        """Bytes of codes plus metadata."""
        meta = self.scale.numel() * self.scale.element_size()
        if self.zero is not None:
            meta += self.zero.numel() * self.zero.element_size()
        return self.packed.numel() + meta


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: Optional[int] = None,
    block_tokens: int = 1,
    symmetric: bool = False,
    meta_dtype: torch.dtype = torch.float16,
    clip: bool = False,
    sink_rows: int = 0,
    levels: Optional[torch.Tensor] = None,
) -> Quantized:
    """Quantize ``x`` of shape (*, N, D) (float32/float16/bfloat16) to ``bits`` in {2, 3, 4, 8}.

    group_size (default D) must divide D and block_tokens must divide N; D * bits must be a multiple
    of 8. Returns packed (*, N, D*bits/8) uint8, scale and zero (*, N/block_tokens, D/group_size) in
    ``meta_dtype``. Computes in fp32; metadata is rounded outward so |x - x_hat| <= scale/2 for every
    finite x within the metadata dtype's range. NaN is stored as 0, +-Inf saturate.

    clip=True (asymmetric only) picks each group's range among 11 shrinkages of [min, max] (0 to 25% of
    the span cut off each side) by least squared error: values beyond the chosen range saturate, the
    rest get a finer grid. It pays at 2 bits (docs/measurements.md, "Clipped key ranges").

    sink_rows: tokens [0, sink_rows) are attention sinks that a cache keeps in full precision: they are
    encoded but do not set the range of a group they share with other tokens.

    levels (asymmetric, 2-4 bits): non-uniform code values, float32 (2^bits,), strictly ascending within
    [0, 2^bits - 1] (torch_rkv.codebook calibrates them; the uniform grid is 0, 1, ..., 2^bits - 1). The
    group's range and scale are unchanged; each value takes the nearest level (ties toward the lower)
    and decodes to levels[code] * scale + zero.
    """
    gs = x.shape[-1] if group_size is None else group_size
    packed, scale, zero = torch.ops.rkv.quantize.default(x, bits, gs, block_tokens, symmetric, meta_dtype, clip,
                                                         sink_rows, levels)
    return Quantized(packed, scale, None if symmetric else zero, bits, levels)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes * scale + zero (or (codes - 2^(bits-1)) * scale if symmetric; levels[codes] * scale + zero
    with non-uniform levels), shape (*, N, D)."""
    return torch.ops.rkv.dequantize.default(q.packed, q.scale, q.zero, q.bits, dtype, q.levels)


@torch.library.register_fake("rkv::quantize")
def _quantize_fake(x, bits, group_size, block_tokens, symmetric, meta_dtype, clip=False, sink_rows=0, levels=None):
    _validate.quantize(x, bits, group_size, block_tokens, meta_dtype, symmetric, clip, sink_rows)
    _validate.levels("quantize", "levels", x, levels, bits, symmetric)
    *lead, n, d = x.shape
    packed = x.new_empty((*lead, n, d * bits // 8), dtype=torch.uint8)
    meta = (*lead, n // block_tokens, d // group_size)
    scale = x.new_empty(meta, dtype=meta_dtype)
    zero = x.new_empty((0,) if symmetric else meta, dtype=meta_dtype)
    return packed, scale, zero


@torch.library.register_fake("rkv::dequantize")
def _dequantize_fake(packed, scale, zero, bits, out_dtype, levels=None):
    d = _validate.dequantize(packed, scale, zero, bits, out_dtype)
    _validate.levels("dequantize", "levels", packed, levels, bits, zero is None)
    return packed.new_empty((*packed.shape[:-1], d), dtype=out_dtype)
