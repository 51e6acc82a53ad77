"""decode_attention: one decode step of attention that reads the quantized cache directly.

For each sequence b, the newest query q[b] (all query heads) attends over its lengths[b] cached tokens:
the first S tokens from the full-precision sinks, then whole quantized blocks from the packed buffers,
then the newest tokens from a full-precision window ring (reference.gather_tokens documents the layout).
Keys stored before RoPE are rotated in the kernel, at their positions, from cos/sin tables; keys/values
stored after a Hadamard rotation are used in the rotated space (the query is rotated once, the output
rotated back once). GQA/MQA: query head h reads KV head h // (Hq / Hkv). Split-K over the sequence
(split_tokens per split) with an exact merge. Semantics: :func:`torch_rkv.reference.decode_attention`.
"""

from __future__ import annotations

import torch

from . import _validate
from .structs import (
    AttentionOptions,
    CacheFormat,
    CacheSide,
    attention_kwargs,
    cache_kwargs,
    format_kwargs,
    side_kwargs,
)


def decode_attention(q: torch.Tensor, k: CacheSide, v: CacheSide, lengths: torch.Tensor, fmt: CacheFormat,
                     opts: AttentionOptions = AttentionOptions(), *, split_tokens: int = 0) -> torch.Tensor:
    """Attention output (B, Hq, D) in q's dtype.

    q (B, Hq, D); k / v: each side's buffers (CacheSide: codes (B, Hkv, C, D*bits/8) uint8, scale and zero
    (B, Hkv, C/T, D/G), window (B, Hkv, W, D) and sink (B, Hkv, S, D) in one float dtype, levels and
    sparse outliers as cache_append wrote them); lengths (B,) int. fmt: bits, block and recent window
    (C and W >= recent + block - 1 follow from them). opts: RoPE tables (keys stored pre-RoPE), Hadamard
    signs, scale, sliding window (the buffers are then a ring of C >= layout.ring_rows packed rows,
    appended by cache_append with the same window), soft-cap and sink logits (AttentionOptions).
    split_tokens: tokens per split-K work item (0: chosen from the shapes). No cached token: zero output.
    """
    return torch.ops.rkv.decode_attention.default(
        q=q, **cache_kwargs(k, v, "packed"), lengths=lengths, **format_kwargs(fmt, clip=False),
        **attention_kwargs(q, opts, split_tokens), **side_kwargs(k, v))


@torch.library.register_fake("rkv::decode_attention")
def _decode_attention_fake(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink,
                           v_sink, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved,
                           k_signs, v_signs, scale, split_tokens, sliding_window=0, softcap=0.0, k_levels=None,
                           v_levels=None, k_outliers=None, v_outliers=None, sink_logits=None, k_refine=None,
                           k_channels=None):
    _validate.decode_attention(q, k_packed, v_packed, k_window, lengths, k_bits, v_bits, block, recent,
                               rope_cos, rope_sin, k_signs)
    _validate.window_and_cap("decode_attention", sliding_window, softcap, k_packed.shape[2], block)
    _validate.cache_levels("decode_attention", q, k_levels, v_levels, k_bits, v_bits, k_zero, v_zero)
    _validate.cache_strides("decode_attention", False, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero)
    _validate.cache_outliers("decode_attention", q, k_packed, v_packed, k_outliers, v_outliers, block, q.shape[-1])
    _validate.cache_refine("decode_attention", q, k_packed, k_zero, k_scale, k_levels, k_outliers, k_bits, k_refine,
                           k_channels)
    _validate.sink_logits("decode_attention", q, sink_logits)
    _validate.devices("decode_attention", q, k_packed=k_packed, k_scale=k_scale, k_zero=k_zero, v_packed=v_packed,
                      v_scale=v_scale, v_zero=v_zero, k_window=k_window, v_window=v_window, k_sink=k_sink,
                      v_sink=v_sink, lengths=lengths, rope_cos=rope_cos, rope_sin=rope_sin, k_signs=k_signs,
                      v_signs=v_signs)
    return torch.empty_like(q, memory_format=torch.contiguous_format)
