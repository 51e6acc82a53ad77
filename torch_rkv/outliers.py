"""Dense-and-sparse outliers (KVQuant, arXiv 2401.18079): sizes, and the simulation's round trip.

A cache block of T tokens x D channels (per kv head) keeps up to k = outlier_count(...) values outside its
dense quantization, in a fixed-size side buffer of k 32-bit entries (a 16-bit position within the block
and the fp16 residual against the dense part's decoded value; no dynamic allocation). They are chosen
greedily to shrink the dense groups' ranges most (reference.select_outliers, the spec the cache kernels
follow bit for bit; include/rkv/outliers.h), and the dense part is quantized with them left out of its
ranges. The caches store them (layout.page_regions: k_outliers / v_outliers); the report simulates them
through the same reference functions.
"""

from __future__ import annotations

import torch

from . import reference as ref

BITS_PER_OUTLIER = 32  # a 16-bit position within the block and an fp16 residual


def outlier_count(fraction: float, block_tokens: int, dim: int) -> int:
    """Outliers each block keeps: the fraction of its values, rounded to nearest, at least one."""
    return max(1, round(fraction * block_tokens * dim)) if fraction > 0 else 0


def outlier_bits(fraction: float, block_tokens: int, dim: int) -> float:
    """Bits per element the side buffer costs."""
    return outlier_count(fraction, block_tokens, dim) * BITS_PER_OUTLIER / (block_tokens * dim)


def select(x: torch.Tensor, fraction: float, block_tokens: int, group_size: int, group_tokens: int,
           skip_rows: int = 0) -> torch.Tensor:
    """x (B, H, n, D), n a multiple of block_tokens -> the outlier mask: each block's values that
    reference.select_outliers takes (groups of group_tokens x group_size; rows [0, skip_rows) of each
    sequence are sinks, never taken), as the cache append chooses them."""
    b, h, n, d = x.shape
    if n % block_tokens or block_tokens % group_tokens or d % group_size:
        raise ValueError(f"outliers.select: {n} tokens, blocks of {block_tokens}, groups of {group_tokens} x "
                         f"{group_size} do not tile")
    k = outlier_count(fraction, block_tokens, d)
    blocks = x.float().cpu().reshape(b, h, n // block_tokens, block_tokens, d)
    mask = torch.zeros(blocks.shape, dtype=torch.bool)
    sinky = min(n // block_tokens, -(-skip_rows // block_tokens))  # the blocks that hold sink rows
    for j in range(sinky):  # each with its own sink rows, as the append sees them
        mask[:, :, j] = ref.select_outliers(blocks[:, :, j].reshape(-1, block_tokens, d), k, group_tokens, group_size,
                                            min(skip_rows - j * block_tokens, block_tokens)).reshape(b, h, block_tokens, d)
    if n // block_tokens > sinky:  # the rest, all at once
        rest = blocks[:, :, sinky:]
        mask[:, :, sinky:] = ref.select_outliers(rest.reshape(-1, block_tokens, d), k, group_tokens, group_size,
                                                 0).reshape(rest.shape)
    return mask.reshape(b, h, n, d).to(x.device)


def merge(back: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The dense part decoded (back) with each outlier's fp16 residual added, as the kernels read it."""
    return torch.where(mask, back + ref.outlier_residual(x, back).float(), back)
