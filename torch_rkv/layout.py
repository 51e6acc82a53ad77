"""Buffer shapes and exact byte counts of a quantized KV cache: the one source of truth that the cache
allocates from and the memory planner counts with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheme import Scheme


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def packed_tokens(scheme: Scheme, capacity: int) -> int:
    """Quantized token rows per sequence and head for `capacity` tokens: whole blocks."""
    return round_up(max(0, capacity - scheme.sinks - scheme.recent), scheme.block)


def max_tokens(scheme: Scheme, capacity: int) -> int:
    """Tokens a cache sized for `capacity` really holds (sinks + whole quantized blocks + recent)."""
    return scheme.sinks + packed_tokens(scheme, capacity) + scheme.recent


@dataclass(frozen=True)
class CacheLayout:
    """One layer's buffers for `batch` sequences of up to `capacity` tokens (the layout may hold a few
    more: quantized capacity is rounded up to whole blocks; `max_tokens` is exact)."""

    scheme: Scheme
    batch: int
    kv_heads: int
    head_dim: int
    capacity: int
    dtype: torch.dtype = torch.float16  # full-precision sinks and window

    def __post_init__(self):
        self.scheme.check_head_dim(self.head_dim)
        if self.capacity < 0 or self.batch < 1 or self.kv_heads < 1:
            raise ValueError(f"CacheLayout: bad sizes batch={self.batch} kv_heads={self.kv_heads} "
                             f"capacity={self.capacity}")

    @property
    def packed_capacity(self) -> int:
        """Quantized token rows per sequence and head (a multiple of the scheme's block)."""
        return packed_tokens(self.scheme, self.capacity)

    @property
    def window(self) -> int:
        """Size of the full-precision ring: recent + block - 1 tokens at most wait there."""
        return self.scheme.recent + self.scheme.block - 1

    @property
    def max_tokens(self) -> int:
        return max_tokens(self.scheme, self.capacity)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every buffer; k_zero / v_zero absent when symmetric."""
        s, b, h, d, c = self.scheme, self.batch, self.kv_heads, self.head_dim, self.packed_capacity
        out = {}
        for side in ("k", "v"):
            bits = getattr(s, f"{side}_bits")
            group = getattr(s, f"{side}_group_size") or d
            tokens = getattr(s, f"{side}_block_tokens")
            out[f"{side}_packed"] = ((b, h, c, d * bits // 8), torch.uint8)
            meta = (b, h, c // tokens, d // group)
            out[f"{side}_scale"] = (meta, s.meta_dtype)
            if not getattr(s, f"{side}_symmetric"):
                out[f"{side}_zero"] = (meta, s.meta_dtype)
            out[f"{side}_window"] = ((b, h, self.window, d), self.dtype)
            out[f"{side}_sink"] = ((b, h, s.sinks, d), self.dtype)
        return out

    def allocate(self, device=None) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in self.shapes().items()}

    def nbytes(self) -> int:
        """Exact bytes of all buffers of this layer."""
        total = 0
        for shape, dt in self.shapes().values():
            n = 1
            for x in shape:
                n *= x
            total += n * torch.empty((), dtype=dt).element_size()
        return total
