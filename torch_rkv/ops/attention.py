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

import math
from typing import Optional

import torch

from . import _validate


def decode_attention(
    q: torch.Tensor,
    k_packed: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: Optional[torch.Tensor],
    v_packed: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: Optional[torch.Tensor],
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    lengths: torch.Tensor,
    k_bits: int,
    v_bits: int,
    block: int,
    recent: int,
    rope_cos: Optional[torch.Tensor] = None,
    rope_sin: Optional[torch.Tensor] = None,
    rope_interleaved: bool = False,
    k_signs: Optional[torch.Tensor] = None,
    v_signs: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    split_tokens: int = 0,
    sliding_window: int = 0,
    softcap: float = 0.0,
    k_levels: Optional[torch.Tensor] = None,
    v_levels: Optional[torch.Tensor] = None,
    k_outliers: Optional[torch.Tensor] = None,
    v_outliers: Optional[torch.Tensor] = None,
    sink_logits: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention output (B, Hq, D) in q's dtype.

    q (B, Hq, D); k/v_packed (B, Hkv, C, D*bits/8) uint8; k/v_scale and k/v_zero (B, Hkv, C/T, D/G)
    (zero None: symmetric); k/v_window (B, Hkv, W, D) and k/v_sink (B, Hkv, S, D) in one float dtype;
    lengths (B,) int. block: tokens per quantized block (C and W >= recent + block - 1 follow from it);
    recent: tokens kept in full precision. rope_cos/rope_sin (P, rot_dim/2): keys are pre-RoPE.
    k_signs/v_signs (D,): Hadamard-rotated storage. scale: softmax scale (default 1/sqrt(D)).
    split_tokens: tokens per split-K work item (0: chosen from the shapes). No cached token: zero output.
    sliding_window > 0: the query sees only the newest sliding_window tokens, and the buffers are a ring
    of C >= layout.ring_rows packed rows (appended by cache_append with the same window). softcap > 0:
    scores (scaled) become softcap * tanh(score / softcap), Gemma 2's soft-capping. k_levels / v_levels:
    each side's non-uniform code values (quantize's levels; asymmetric sides), None: the uniform grid.
    k_outliers / v_outliers: each side's sparse-outlier entries (cache_append writes them), None: none.
    sink_logits (Hq,) float: learned attention sinks (GPT-OSS), one logit per query head that joins every
    softmax with no value (it takes probability mass from the keys), in the units of the scaled scores;
    None: none. The paged attention ops take it the same way.
    """
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.rkv.decode_attention.default(
        q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink, lengths,
        k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, s, split_tokens,
        sliding_window, softcap, k_levels, v_levels, k_outliers, v_outliers, sink_logits)


@torch.library.register_fake("rkv::decode_attention")
def _decode_attention_fake(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink,
                           v_sink, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved,
                           k_signs, v_signs, scale, split_tokens, sliding_window=0, softcap=0.0, k_levels=None,
                           v_levels=None, k_outliers=None, v_outliers=None, sink_logits=None):
    _validate.decode_attention(q, k_packed, v_packed, k_window, lengths, k_bits, v_bits, block, recent,
                               rope_cos, rope_sin, k_signs)
    _validate.window_and_cap("decode_attention", sliding_window, softcap, k_packed.shape[2], block)
    _validate.cache_levels("decode_attention", q, k_levels, v_levels, k_bits, v_bits, k_zero, v_zero)
    _validate.cache_strides("decode_attention", False, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero)
    _validate.cache_outliers("decode_attention", q, k_packed, v_packed, k_outliers, v_outliers, block, q.shape[-1])
    _validate.sink_logits("decode_attention", q, sink_logits)
    _validate.devices("decode_attention", q, k_packed=k_packed, k_scale=k_scale, k_zero=k_zero, v_packed=v_packed,
                      v_scale=v_scale, v_zero=v_zero, k_window=k_window, v_window=v_window, k_sink=k_sink,
                      v_sink=v_sink, lengths=lengths, rope_cos=rope_cos, rope_sin=rope_sin, k_signs=k_signs,
                      v_signs=v_signs)
    return torch.empty_like(q, memory_format=torch.contiguous_format)
