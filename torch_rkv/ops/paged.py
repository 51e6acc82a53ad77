"""The paged quantized KV cache's ops: append, decode and prefill attention, and page copies.

A layer's cache is a pool of pages (codes and metadata of P tokens of every kv head: k_codes (pages,
Hkv, P, D*bits/8), k_scale / k_zero (pages, Hkv, P/T, D/G), views into one page buffer, see
torch_rkv.layout.PageLayout) and of side slots (k_window (slots, Hkv, W, D), k_sink (slots, Hkv, S, D)),
keys and values alike. Sequence b reads page block_tables[b][t // P] and slot side_slots[b] (int32,
vLLM's block_table_tensor convention); None means page b / slot b (the contiguous layout). Full pages
are final and may be shared by several tables. Semantics: torch_rkv.reference (paged_append,
paged_decode_attention, paged_prefill_attention, paged_copy).
"""

from __future__ import annotations

from typing import Optional

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


def paged_append(k: CacheSide, v: CacheSide, k_new: torch.Tensor, v_new: torch.Tensor, fmt: CacheFormat, *,
                 lengths: torch.Tensor, query_start_loc: torch.Tensor, block_tables: Optional[torch.Tensor] = None,
                 side_slots: Optional[torch.Tensor] = None, page_fill: Optional[torch.Tensor] = None,
                 slot_mapping: Optional[torch.Tensor] = None) -> None:
    """Append sequence b's new tokens, rows query_start_loc[b]..query_start_loc[b+1] of k_new / v_new
    (T, Hkv, D) in the cache's dtype and storage space, after its lengths[b] tokens, in place. Blocks
    the append completes are quantized into their pages (a page is final once full); page_fill (pages,)
    int32 counts the quantized rows of each page and turns a write into them into an error (None: no
    guard); slot_mapping (T,): the engine's slot of each new token, checked against the tables. Each
    side's levels and sparse outliers come with k / v (CacheSide; outliers written per completed block,
    as cache_append's)."""
    torch.ops.rkv.paged_append.default(**cache_kwargs(k, v, "codes"), page_fill=page_fill, block_tables=block_tables,
                                       side_slots=side_slots, lengths=lengths, query_start_loc=query_start_loc,
                                       k_new=k_new, v_new=v_new, **format_kwargs(fmt, clip=True),
                                       slot_mapping=slot_mapping, **side_kwargs(k, v))


@torch.library.register_fake("rkv::paged_append")
def _paged_append_fake(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                       page_fill, block_tables, side_slots, lengths, query_start_loc, k_new, v_new, k_bits, v_bits,
                       block, recent, k_clip=False, v_clip=False, slot_mapping=None, k_levels=None, v_levels=None,
                       k_outliers=None, v_outliers=None, k_refine=None, k_channels=None):
    _validate.paged_append(k_codes, v_codes, k_window, page_fill, block_tables, side_slots, lengths, query_start_loc,
                           k_new, v_new, k_bits, v_bits, block, recent, k_zero, v_zero, k_clip, v_clip, slot_mapping)
    _validate.cache_levels("paged_append", k_new, k_levels, v_levels, k_bits, v_bits, k_zero, v_zero)
    _validate.cache_strides("paged_append", True, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    _validate.cache_outliers("paged_append", k_new, k_codes, v_codes, k_outliers, v_outliers, block, k_new.shape[-1])
    _validate.cache_refine("paged_append", k_new, k_codes, k_zero, k_scale, k_levels, k_outliers, k_bits, k_refine,
                           k_channels)
    _validate.devices("paged_append", k_new, k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes,
                      v_scale=v_scale, v_zero=v_zero, k_window=k_window, v_window=v_window, k_sink=k_sink,
                      v_sink=v_sink, page_fill=page_fill, block_tables=block_tables, side_slots=side_slots,
                      lengths=lengths, query_start_loc=query_start_loc, v_new=v_new, slot_mapping=slot_mapping)
    return None


def paged_decode_attention(q: torch.Tensor, k: CacheSide, v: CacheSide, fmt: CacheFormat,
                           opts: AttentionOptions = AttentionOptions(), *, lengths: torch.Tensor,
                           block_tables: Optional[torch.Tensor] = None, side_slots: Optional[torch.Tensor] = None,
                           split_tokens: int = 0) -> torch.Tensor:
    """Attention (B, Hq, D) of each sequence's newest query q (B, Hq, D) over its lengths[b] cached
    tokens (the newest appended): GQA/MQA, and opts as decode_attention's (pre-RoPE keys rotated in the
    kernel, Hadamard spaces, sliding window, soft-cap, sink logits; pages before the window are never
    read). split_tokens: tokens per split-K work item (0: chosen)."""
    return torch.ops.rkv.paged_decode_attention.default(
        q=q, **cache_kwargs(k, v, "codes"), block_tables=block_tables, side_slots=side_slots, lengths=lengths,
        **format_kwargs(fmt, clip=False), **attention_kwargs(q, opts, split_tokens), **side_kwargs(k, v))


@torch.library.register_fake("rkv::paged_decode_attention")
def _paged_decode_attention_fake(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink,
                                 v_sink, block_tables, side_slots, lengths, k_bits, v_bits, block, recent, rope_cos,
                                 rope_sin, rope_interleaved, k_signs, v_signs, scale, split_tokens, sliding_window=0,
                                 softcap=0.0, k_levels=None, v_levels=None, k_outliers=None, v_outliers=None,
                                 sink_logits=None, k_refine=None, k_channels=None):
    _validate.decode_attention(q, k_codes, v_codes, k_window, lengths, k_bits, v_bits, block, recent, rope_cos,
                               rope_sin, k_signs, block_tables, side_slots, op="paged_decode_attention")
    _validate.window_and_cap("paged_decode_attention", sliding_window, softcap,
                             None if block_tables is not None else k_codes.shape[2], block)
    _validate.cache_levels("paged_decode_attention", q, k_levels, v_levels, k_bits, v_bits, k_zero, v_zero)
    _validate.cache_strides("paged_decode_attention", True, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    _validate.cache_outliers("paged_decode_attention", q, k_codes, v_codes, k_outliers, v_outliers, block, q.shape[-1])
    _validate.cache_refine("paged_decode_attention", q, k_codes, k_zero, k_scale, k_levels, k_outliers, k_bits,
                           k_refine, k_channels)
    _validate.sink_logits("paged_decode_attention", q, sink_logits)
    _validate.devices("paged_decode_attention", q, k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes,
                      v_scale=v_scale, v_zero=v_zero, k_window=k_window, v_window=v_window, k_sink=k_sink,
                      v_sink=v_sink, block_tables=block_tables, side_slots=side_slots, lengths=lengths,
                      rope_cos=rope_cos, rope_sin=rope_sin, k_signs=k_signs, v_signs=v_signs)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k: CacheSide, v: CacheSide,
                            fmt: CacheFormat, opts: AttentionOptions = AttentionOptions(), *,
                            query_start_loc: torch.Tensor, max_query_len: int, lengths: torch.Tensor,
                            block_tables: Optional[torch.Tensor] = None, side_slots: Optional[torch.Tensor] = None,
                            split_tokens: int = 0) -> torch.Tensor:
    """Causal attention (T, Hq, D) of a chunk of new tokens per sequence: q (T, Hq, D) and their keys
    and values k_new / v_new (T, Hkv, D) in the storage space, rows query_start_loc[b].. for sequence b,
    over its lengths[b] cached tokens as stored and the chunk itself in full precision. Call it before
    appending the chunk. max_query_len: the longest chunk. Rows past query_start_loc[B] get zeros. opts:
    as decode_attention's, per query row."""
    return torch.ops.rkv.paged_prefill_attention.default(
        q=q, k_new=k_new, v_new=v_new, query_start_loc=query_start_loc, max_query_len=max_query_len,
        **cache_kwargs(k, v, "codes"), block_tables=block_tables, side_slots=side_slots, lengths=lengths,
        **format_kwargs(fmt, clip=False), **attention_kwargs(q, opts, split_tokens), **side_kwargs(k, v))


@torch.library.register_fake("rkv::paged_prefill_attention")
def _paged_prefill_attention_fake(q, k_new, v_new, query_start_loc, max_query_len, k_codes, k_scale, k_zero, v_codes,
                                  v_scale, v_zero, k_window, v_window, k_sink, v_sink, block_tables, side_slots,
                                  lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved,
                                  k_signs, v_signs, scale, split_tokens, sliding_window=0, softcap=0.0, k_levels=None,
                                  v_levels=None, k_outliers=None, v_outliers=None, sink_logits=None, k_refine=None,
                                  k_channels=None):
    _validate.paged_prefill_attention(q, k_new, v_new, query_start_loc, max_query_len, k_codes, v_codes, k_window,
                                      block_tables, side_slots, lengths, k_bits, v_bits, block, recent, rope_cos,
                                      rope_sin, k_signs)
    _validate.window_and_cap("paged_prefill_attention", sliding_window, softcap,
                             None if block_tables is not None else k_codes.shape[2], block)
    _validate.cache_levels("paged_prefill_attention", q, k_levels, v_levels, k_bits, v_bits, k_zero, v_zero)
    _validate.cache_strides("paged_prefill_attention", True, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    _validate.cache_outliers("paged_prefill_attention", q, k_codes, v_codes, k_outliers, v_outliers, block, q.shape[-1])
    _validate.cache_refine("paged_prefill_attention", q, k_codes, k_zero, k_scale, k_levels, k_outliers, k_bits,
                           k_refine, k_channels)
    _validate.sink_logits("paged_prefill_attention", q, sink_logits)
    _validate.devices("paged_prefill_attention", q, k_new=k_new, v_new=v_new, query_start_loc=query_start_loc,
                      k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes, v_scale=v_scale,
                      v_zero=v_zero, k_window=k_window, v_window=v_window, k_sink=k_sink, v_sink=v_sink,
                      block_tables=block_tables, side_slots=side_slots, lengths=lengths, rope_cos=rope_cos,
                      rope_sin=rope_sin, k_signs=k_signs, v_signs=v_signs)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_copy(k: CacheSide, v: CacheSide, *, src_pages: torch.Tensor, dst_pages: torch.Tensor,
               src_slots: torch.Tensor, dst_slots: torch.Tensor, page_fill: Optional[torch.Tensor] = None) -> None:
    """Copy pages src_pages[i] -> dst_pages[i] (codes, metadata, sparse outliers, refinement codes and page_fill) and side slots
    src_slots[j] -> dst_slots[j] (sinks and window), in place: what a fork copies (its open page and side
    rows; its full pages are shared by reference)."""
    torch.ops.rkv.paged_copy.default(**cache_kwargs(k, v, "codes"), page_fill=page_fill, src_pages=src_pages,
                                     dst_pages=dst_pages, src_slots=src_slots, dst_slots=dst_slots,
                                     **side_kwargs(k, v, levels=False))


@torch.library.register_fake("rkv::paged_copy")
def _paged_copy_fake(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                     page_fill, src_pages, dst_pages, src_slots, dst_slots, k_outliers=None, v_outliers=None,
                     k_refine=None):
    op = "paged_copy"  # csrc/paged_copy.cpp's rules and messages, but the ids' range (data)
    pages = k_codes.shape[0] if k_codes.dim() >= 1 else 0
    for name, t in (("k_codes", k_codes), ("k_scale", k_scale), ("v_codes", v_codes), ("v_scale", v_scale)):
        _validate.value(t.dim() == 4 and t.shape[0] == pages, op,
                        f"{name} must have shape (pages={pages}, kv_heads, rows, ...), got {list(t.shape)}")
    slots = k_window.shape[0] if k_window.dim() >= 1 else 0
    for name, t in (("k_window", k_window), ("v_window", v_window), ("k_sink", k_sink), ("v_sink", v_sink)):
        _validate.value(t.dim() == 4 and t.shape[0] == slots, op,
                        f"{name} must have shape (slots={slots}, kv_heads, rows, head_dim), got {list(t.shape)}")
    for name, t in (("k_outliers", k_outliers), ("v_outliers", v_outliers)):
        if t is not None:
            _validate.dtype(t.dtype == torch.int32, op, f"{name} must be int32 (got {t.dtype})")
            _validate.value(t.dim() == 4 and t.shape[0] == pages, op,
                            f"{name} must have shape (pages={pages}, kv_heads, blocks, outliers), got {list(t.shape)}")
    if k_refine is not None:
        _validate.dtype(k_refine.dtype == torch.uint8, op, f"k_refine must be uint8 (got {k_refine.dtype})")
        _validate.value(k_refine.dim() == 4 and k_refine.shape[0] == pages, op,
                        f"k_refine must have shape (pages={pages}, kv_heads, rows, bytes), got {list(k_refine.shape)}")
    if page_fill is not None:
        _validate.value(page_fill.dim() == 1 and page_fill.shape[0] == pages, op,
                        f"page_fill must have shape ({pages},), got {list(page_fill.shape)}")
    for src, s, dst, d in (("src_pages", src_pages, "dst_pages", dst_pages), ("src_slots", src_slots, "dst_slots",
                                                                                dst_slots)):
        for name, t in ((src, s), (dst, d)):
            _validate.dtype(t.dtype in (torch.int32, torch.int64), op, f"{name} must be int32 or int64 (got {t.dtype})")
            _validate.value(t.dim() == 1, op, f"{name} must be 1-D, got {list(t.shape)}")
        _validate.value(s.shape[0] == d.shape[0], op,
                        f"{src} and {dst} must have the same length, got {s.shape[0]} and {d.shape[0]}")
    _validate.devices(op, k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes, v_scale=v_scale, v_zero=v_zero,
                      k_window=k_window, v_window=v_window, k_sink=k_sink, v_sink=v_sink, page_fill=page_fill,
                      src_pages=src_pages, dst_pages=dst_pages, src_slots=src_slots, dst_slots=dst_slots,
                      k_outliers=k_outliers, v_outliers=v_outliers, k_refine=k_refine)
    return None
