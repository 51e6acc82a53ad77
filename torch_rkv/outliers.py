"""Dense-and-sparse outliers (KVQuant, arXiv 2401.18079), as the report simulates them.

A cache block of T tokens x D channels (per kv head) keeps its k = outlier_count(...) most outlying
values in full precision in a fixed-size side buffer (a 16-bit index within the block and an fp16
value each: 32 bits an outlier, no dynamic allocation), and the dense part is quantized without them.
"Outlying" is measured against the value's own quantization group, the one that would have to stretch
its range to hold it: |x - mean| / std over the group's elements (per-channel keys: a channel's tokens
in the block; per-token values: a token's channels). Simulation only for now: the cache kernels do not
read a sparse buffer yet, and the caches refuse a scheme with outliers (Scheme.check_served).
"""

from __future__ import annotations

import torch

BITS_PER_OUTLIER = 32  # a 16-bit position within the block and an fp16 value


def outlier_count(fraction: float, block_tokens: int, dim: int) -> int:
    """Outliers each block keeps: the fraction of its values, rounded to nearest, at least one."""
    return max(1, round(fraction * block_tokens * dim)) if fraction > 0 else 0


def outlier_bits(fraction: float, block_tokens: int, dim: int) -> float:
    """Bits per element the side buffer costs."""
    return outlier_count(fraction, block_tokens, dim) * BITS_PER_OUTLIER / (block_tokens * dim)


def split(x: torch.Tensor, fraction: float, block_tokens: int, group_size: int, group_tokens: int,
          skip_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, n, D), n a multiple of block_tokens -> (dense, outlier mask). The dense part has each
    outlier replaced by its group's mean (so it sets no range); the mask marks the k most outlying values
    of every block of block_tokens tokens, groups of group_tokens x group_size. Rows [0, skip_rows) are
    never chosen (the cache keeps its sinks in full precision anyway)."""
    b, h, n, d = x.shape
    if n % block_tokens or block_tokens % group_tokens or d % group_size:
        raise ValueError(f"outliers.split: {n} tokens, blocks of {block_tokens}, groups of {group_tokens} x "
                         f"{group_size} do not tile")
    g = x.float().reshape(b, h, n // group_tokens, group_tokens, d // group_size, group_size)
    mean = g.mean(dim=(3, 5), keepdim=True)
    std = g.std(dim=(3, 5), keepdim=True, correction=0).clamp_min(1e-12)
    score = ((g - mean).abs() / std).reshape(b, h, n, d)
    score[:, :, :skip_rows] = -1.0
    k = outlier_count(fraction, block_tokens, d)
    blocks = score.reshape(b, h, n // block_tokens, block_tokens * d)
    top = blocks.topk(k, dim=-1).indices
    mask = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, True).reshape(b, h, n, d)
    if skip_rows:
        mask[:, :, :skip_rows] = False
    dense = torch.where(mask, mean.expand_as(g).reshape(b, h, n, d), x.float())
    return dense, mask


def merge(back: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The dense part dequantized, with the outliers read back from the side buffer (fp16)."""
    return torch.where(mask, x.to(torch.float16).float(), back)
