"""The named structures the cache ops' wrappers take: one side's buffers, the format both sides are
coded in, and the attention options.

The op schemas stay flat (a torch.library schema has no structs); C++ groups the same arguments as
CacheTensors and SideView. The wrappers in this package unpack these structures and call the ops by
keyword, so a call site names what it passes instead of spreading twenty positional arguments.
NamedTuples, so that torch.compile traces their construction and reads.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch


class CacheSide(NamedTuple):
    """One side's (the keys' or the values') buffers of one layer's cache.

    Contiguous cache (cache_append, decode_attention): codes (B, Hkv, C, D*bits/8) uint8, scale and zero
    (B, Hkv, C/T, D/G), window (B, Hkv, W, D), sink (B, Hkv, S, D). Paged cache: codes, scale and zero
    one entry a page (pages, Hkv, P, ...), window and sink one entry a side slot. zero None: a symmetric
    side. levels: the side's non-uniform code values (quantize's levels), None: the uniform grid.
    outliers: the side's sparse-outlier entries (layout.CacheLayout), None: none. refine and channels
    (keys only): refined key channels, the refinement codes (like codes, m*extra/8 bytes a row) and
    which channels of each kv head they refine (Hkv, m) int32 (reference.refined_rows), None: none."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    window: torch.Tensor
    sink: torch.Tensor
    levels: Optional[torch.Tensor] = None
    outliers: Optional[torch.Tensor] = None
    refine: Optional[torch.Tensor] = None
    channels: Optional[torch.Tensor] = None


class CacheFormat(NamedTuple):
    """How the two sides are coded: bits a code of each side, tokens a quantized block, tokens kept in
    full precision at the end (recent), and whether completed blocks take quantize's clipped range.
    Scheme.format gives a scheme's."""

    k_bits: int
    v_bits: int
    block: int
    recent: int
    k_clip: bool = False
    v_clip: bool = False


class AttentionOptions(NamedTuple):
    """What an attention op does besides reading the cache.

    rope_cos / rope_sin (P, rot_dim/2) float32: the keys are stored before RoPE and rotated in the kernel
    at their positions (None: stored as attended); rope_interleaved: pairs (2i, 2i+1) instead of
    rotate-half's (i, i + rot_dim/2). k_signs / v_signs (D,): the side is stored Hadamard-rotated with
    these signs. scale: the softmax scale (None: 1/sqrt(D)). sliding_window > 0: each query sees its
    newest sliding_window tokens. softcap > 0: Gemma 2's soft-capping of the scaled scores.
    sink_logits (Hq,): learned attention sinks (GPT-OSS), one logit a query head in every softmax."""

    rope_cos: Optional[torch.Tensor] = None
    rope_sin: Optional[torch.Tensor] = None
    rope_interleaved: bool = False
    k_signs: Optional[torch.Tensor] = None
    v_signs: Optional[torch.Tensor] = None
    scale: Optional[float] = None
    sliding_window: int = 0
    softcap: float = 0.0
    sink_logits: Optional[torch.Tensor] = None


def split_sides(tensors, levels=(None, None), outliers=(None, None), refine=(None, None)) -> tuple[CacheSide, CacheSide]:
    """The keys' and values' CacheSide of a layer's ten buffers in the ops' order (k codes, scale, zero,
    v codes, scale, zero, k window, v window, k sink, v sink), with each side's levels and outliers, and
    the keys' refined channels (refine: (codes, channels))."""
    t = tensors
    return (CacheSide(t[0], t[1], t[2], t[6], t[8], levels[0], outliers[0], *refine),
            CacheSide(t[3], t[4], t[5], t[7], t[9], levels[1], outliers[1]))


def cache_kwargs(k: CacheSide, v: CacheSide, codes: str) -> dict:
    """The ten cache buffers as the ops name them (codes: "packed" for the contiguous ops, "codes" for
    the paged ones)."""
    return {f"k_{codes}": k.codes, "k_scale": k.scale, "k_zero": k.zero, f"v_{codes}": v.codes,
            "v_scale": v.scale, "v_zero": v.zero, "k_window": k.window, "v_window": v.window,
            "k_sink": k.sink, "v_sink": v.sink}


def format_kwargs(fmt: CacheFormat, clip: bool) -> dict:
    """The format's arguments as the ops name them (clip: the writing ops also take k_clip / v_clip)."""
    out = {"k_bits": fmt.k_bits, "v_bits": fmt.v_bits, "block": fmt.block, "recent": fmt.recent}
    if clip:
        out.update(k_clip=fmt.k_clip, v_clip=fmt.v_clip)
    return out


def attention_kwargs(q: torch.Tensor, opts: AttentionOptions, split_tokens: int) -> dict:
    """The attention ops' options by name, the scale resolved against q's head_dim."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if opts.scale is None else opts.scale
    return {"rope_cos": opts.rope_cos, "rope_sin": opts.rope_sin, "rope_interleaved": opts.rope_interleaved,
            "k_signs": opts.k_signs, "v_signs": opts.v_signs, "scale": scale, "split_tokens": split_tokens,
            "sliding_window": opts.sliding_window, "softcap": opts.softcap, "sink_logits": opts.sink_logits}


def side_kwargs(k: CacheSide, v: CacheSide, levels: bool = True) -> dict:
    """Each side's levels, sparse outliers and the keys' refined channels by name (levels False: the op
    takes the buffers it copies only: outliers and refinement codes)."""
    out = {"k_outliers": k.outliers, "v_outliers": v.outliers, "k_refine": k.refine}
    if levels:
        out.update(k_levels=k.levels, v_levels=v.levels, k_channels=k.channels)
    return out
