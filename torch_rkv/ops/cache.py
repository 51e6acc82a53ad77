"""cache_append: write new tokens into the quantized cache buffers in place.

Per sequence b with n = lengths[b] cached tokens, the m new tokens k_new[b] / v_new[b] become tokens
n..n+m-1: every block the append completes is quantized into the packed rows and metadata (its older
tokens read back from the window ring), new tokens t < S go to the sinks and the rest to the window ring.
Nothing else is written; lengths is not updated (the caller adds m). Appending past the capacity is an
error that leaves the cache unchanged (CUDA: device-side assert). Semantics:
:func:`torch_rkv.reference.cache_append`.
"""

from __future__ import annotations

import torch

from . import _validate
from .structs import CacheFormat, CacheSide, cache_kwargs, format_kwargs, side_kwargs


def cache_append(k: CacheSide, v: CacheSide, lengths: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 fmt: CacheFormat, *, sliding_window: int = 0) -> None:
    """Mutates both sides' buffers (layout: torch_rkv.layout.CacheLayout; levels and sparse outliers in
    k / v). k_new / v_new (B, Hkv, m, D) must have the window's dtype; keys in the cache's storage space
    (pre-RoPE / rotated as the scheme says). fmt: bits, block, recent window and clipped ranges (completed
    blocks quantized with quantize's clipped-range search). sliding_window > 0: the packed rows are a ring
    (token t in row t % C, C >= layout.ring_rows), so a sequence grows past them; at most C - block + 1
    tokens per call, so that the blocks one call completes never overlap. Outliers are written per
    completed block (reference.select_outliers), refinement codes per completed block's refined key channels
    (reference.refine_codes)."""
    torch.ops.rkv.cache_append.default(**cache_kwargs(k, v, "packed"), lengths=lengths, k_new=k_new, v_new=v_new,
                                       **format_kwargs(fmt, clip=True), sliding_window=sliding_window,
                                       **side_kwargs(k, v))


@torch.library.register_fake("rkv::cache_append")
def _cache_append_fake(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                       lengths, k_new, v_new, k_bits, v_bits, block, recent, k_clip=False, v_clip=False,
                       sliding_window=0, k_levels=None, v_levels=None, k_outliers=None, v_outliers=None, k_refine=None,
                       k_channels=None):
    _validate.cache_append(k_packed, v_packed, k_window, lengths, k_new, v_new, k_bits, v_bits, block, recent,
                           k_zero, v_zero, k_clip, v_clip)
    _validate.window_and_cap("cache_append", sliding_window, 0.0, k_packed.shape[2], block, k_new.shape[2])
    _validate.cache_levels("cache_append", k_new, k_levels, v_levels, k_bits, v_bits, k_zero, v_zero)
    _validate.cache_strides("cache_append", False, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero)
    _validate.cache_outliers("cache_append", k_new, k_packed, v_packed, k_outliers, v_outliers, block, k_new.shape[-1])
    _validate.cache_refine("cache_append", k_new, k_packed, k_zero, k_scale, k_levels, k_outliers, k_bits, k_refine,
                           k_channels)
    _validate.devices("cache_append", k_new, k_packed=k_packed, k_scale=k_scale, k_zero=k_zero, v_packed=v_packed,
                      v_scale=v_scale, v_zero=v_zero, k_window=k_window, v_window=v_window, k_sink=k_sink,
                      v_sink=v_sink, lengths=lengths, v_new=v_new)
    return None
