"""Non-uniform quantization levels: the Lloyd-Max codebook of a standard Gaussian, and the
TurboQuant-style round trip that uses it (the report's peer; vLLM's TurboQuant presets store keys and
values this way).

After a random Hadamard rotation each coordinate of a token's head vector x (D channels) is close to
N(0, |x|^2 / D), whatever the channel it came from. So one codebook serves every row: store |x| (the
per-row metadata, in the scheme's meta dtype) and, per channel, the index of the Lloyd-Max level nearest
to x_i sqrt(D) / |x|; read back the levels scaled so that the row's norm is |x| again (norm correction:
the levels' own rounding would shrink it). Simulation only for now: the cache kernels store uniform
codes, and the caches refuse a scheme with these levels (Scheme.check_served).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def _pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@lru_cache(maxsize=None)
def _levels(bits: int) -> tuple[float, ...]:
    # Lloyd's iteration on the density itself: boundaries halfway between levels, each level the mean of
    # N(0, 1) between its boundaries, E[X | a < X < b] = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a))
    n = 1 << bits
    levels = [-3 + 6 * (i + 0.5) / n for i in range(n)]
    for _ in range(500):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        levels = [(_pdf(a) - _pdf(b)) / (_cdf(b) - _cdf(a)) for a, b in zip(edges, edges[1:])]
    return tuple(levels)


def gaussian_levels(bits: int) -> torch.Tensor:
    """The 2^bits Lloyd-Max levels of N(0, 1), ascending, float32 (minimum mean squared error)."""
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"gaussian_levels: bits must be 1, 2, 3, 4 or 8 (got {bits})")
    return torch.tensor(_levels(bits), dtype=torch.float32)


def gaussian_round_trip(x: torch.Tensor, bits: int, meta_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """x (..., D), already rotated -> what the TurboQuant-style store and load give back, float32: each
    row's norm kept in meta_dtype, its direction coded with the Gaussian levels, the row rescaled to the
    kept norm."""
    x = x.float()
    d = x.shape[-1]
    levels = gaussian_levels(bits).to(x.device)
    norm = x.norm(dim=-1, keepdim=True).to(meta_dtype).float()
    unit = x * (math.sqrt(d) / x.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    edges = (levels[1:] + levels[:-1]) / 2
    back = levels[torch.bucketize(unit, edges)]
    return back * (norm / back.norm(dim=-1, keepdim=True).clamp_min(1e-30))
