"""Bits per element of a cache of a given length: the codes, what the format spends beside them, and
the tokens it keeps in full precision."""

from __future__ import annotations

from ...reference import full_precision_count
from ...scheme import Scheme


def bits_parts_at(scheme: Scheme, head_dim: int, tokens: int) -> dict[str, float]:
    """effective_bits_at's parts, bits per element of the whole cache: the quantized tokens' codes, their
    metadata and their sparse outliers' side buffer (Scheme.bits_parts), and the full-precision sinks,
    recent window and partial block at 16 bits (an fp16 cache). What the format spends beside the codes is
    all but "codes"."""
    fp = full_precision_count(tokens, scheme.sinks, scheme.recent, scheme.block)
    share = (tokens - fp) / tokens
    return {**{k: share * v for k, v in scheme.bits_parts(head_dim).items()}, "full_precision": fp * 16 / tokens}


def effective_bits_at(scheme: Scheme, head_dim: int, tokens: int) -> float:
    """Bits per element at `tokens` tokens, counting the full-precision sinks, recent window and partial
    block at 16 bits (an fp16 cache), as a cache of that length holds them."""
    return sum(bits_parts_at(scheme, head_dim, tokens).values())
