"""The checks of tensor values the C++ kernels make (csrc/checks.cpp: check_levels, check_cache_data),
with the same messages, for the Triton launchers. They read values on the host, so they run on CPU
tensors (the interpreter's path) only; on CUDA a launch never waits for the device to check them."""

from __future__ import annotations

from typing import Optional

import torch

from ..ops import _validate


def fail(op: str, msg: str, exc=ValueError):
    raise exc(f"rkv.{op}: {msg}")


def on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def levels(op: str, arg: str, lv: Optional[torch.Tensor], bits: int) -> None:
    """Non-uniform levels strictly ascending within [0, 2^bits - 1] (shape and dtype: _validate.levels)."""
    if lv is None or not on_host(lv):
        return
    top = float((1 << bits) - 1)
    vals = lv.tolist()
    for i, v in enumerate(vals):
        if not (0.0 <= v <= top and (i == 0 or v > vals[i - 1])):
            raise ValueError(f"rkv.{op}: {arg} must be strictly ascending code values within [0, {top:g}] (entry {i} "
                             f"is {v:g})")


def refine_channels(op: str, channels: Optional[torch.Tensor], dim: int) -> None:
    """Each kv head's refined key channels distinct and below head_dim (check_refine; shape and dtype:
    _validate.cache_refine). On a GPU a device-side assert, with no host sync: the kernels index the
    scales and staged values by these channels."""
    if channels is None:
        return
    if not on_host(channels):
        ok = ((channels >= 0) & (channels < dim)).all()
        if channels.shape[-1] > 1:
            ordered = channels.sort(dim=-1).values
            ok = ok & (ordered[:, 1:] != ordered[:, :-1]).all()
        torch._assert_async(ok, f"rkv.{op}: k_channels must name distinct channels in [0, head_dim={dim})")
        return
    for h, row in enumerate(channels.tolist()):
        seen = set()
        for j, c in enumerate(row):
            if not 0 <= c < dim or c in seen:
                fail(op, f"k_channels[{h}] must name distinct channels in [0, head_dim={dim}); entry {j} is {c}")
            seen.add(c)


def cache_data(op: str, lengths: torch.Tensor, block_tables: Optional[torch.Tensor],
               side_slots: Optional[torch.Tensor], page_size: int, pages: int, slots: int,
               rope_cos: Optional[torch.Tensor], ring: bool, new_counts: Optional[list] = None) -> None:
    """Each sequence's tokens within its table, its rope positions within the table of rope_cos, its side
    slot and its pages within the pools (check_cache_data). new_counts: the tokens an append or a prefill
    adds to each sequence (None: a decode step)."""
    if not on_host(lengths):
        return
    width = block_tables.shape[1] if block_tables is not None else 1
    max_tokens = (1 << 40) if ring else width * page_size
    n = lengths.tolist()
    for b, nb in enumerate(n):
        add = new_counts[b] if new_counts is not None else 0
        total = nb + add
        if nb < 0 or add < 0:
            raise ValueError(f"rkv.{op}: sequence {b} has {nb} cached and {add} new tokens (query_start_loc must not "
                             "decrease)")
        pages_txt = f"{width} page{'' if width == 1 else 's'} of {page_size}"
        if new_counts is not None and total > max_tokens:
            raise ValueError(f"rkv.{op}: appending {add} tokens to sequence {b} of {nb} tokens exceeds its capacity of "
                             f"{max_tokens} tokens ({pages_txt})")
        if new_counts is None and total > max_tokens:
            raise ValueError(f"rkv.{op}: lengths[{b}] = {nb} is outside [0, {max_tokens}] ({pages_txt} tokens)")
        if rope_cos is not None and total > rope_cos.shape[0]:
            raise ValueError(f"rkv.{op}: sequence {b} needs rope positions up to {total - 1} but rope_cos has "
                             f"{rope_cos.shape[0]}")
        slot = int(side_slots[b]) if side_slots is not None else b
        if not 0 <= slot < slots:
            raise ValueError(f"rkv.{op}: side_slots[{b}] = {slot} is outside the {slots} side slots")
        if block_tables is None:
            continue
        for j in range(-(-total // page_size)):
            page = int(block_tables[b, j])
            if not 0 <= page < pages:
                raise ValueError(f"rkv.{op}: block_tables[{b}][{j}] = {page} is outside the pool of {pages} pages")


def cache_layout(op: str, paged: bool, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window,
                  k_sink, v_sink, block_tables, side_slots, block: int, kv_heads: int, dim: int,
                  batch: int, page_fill=None, slot_mapping=None, new_rows: int = 0):
    """The shape, dtype and layout rules of checks.cpp check_cache and paged_append_call that the fake
    kernels (ops/_validate.py) leave to the kernels, with their messages: the Triton kernels address the
    buffers by these rules, so every launcher makes them on every device."""
    if dim < 1 or kv_heads < 1:
        fail(op, f"head_dim ({dim}) and kv_heads ({kv_heads}) must be >= 1")
    for name, t in (("block_tables", block_tables), ("side_slots", side_slots)):
        if t is not None and not t.is_contiguous():
            fail(op, f"{name} must be contiguous")
    for side, codes, scale, zero in (("k", k_codes, k_scale, k_zero), ("v", v_codes, v_scale, v_zero)):
        sc, zr = f"{side}_scale", f"{side}_zero"
        p = f"{side}_{'codes' if paged else 'packed'}"
        _validate.meta_dtype(op, sc, scale.dtype)
        if not (scale.dim() == 4 and scale.shape[0] == codes.shape[0] and scale.shape[1] == kv_heads):
            fail(op, f"{sc} must have shape ({codes.shape[0]}, {kv_heads}, blocks, groups), got {list(scale.shape)}")
        rows, nb, ng = codes.shape[2], scale.shape[2], scale.shape[3]
        if not (ng >= 1 and dim % ng == 0):
            fail(op, f"{sc}'s last dim ({ng} groups) must divide head_dim ({dim})")
        if not ((nb >= 1 and rows % nb == 0 and block % (rows // nb) == 0) or (nb == 0 and rows == 0)):
            fail(op, f"{sc} has {nb} token blocks for {rows} rows: its block size must divide block ({block})")
        if not (_validate.rows_contiguous(codes) and _validate.rows_contiguous(scale)):
            fail(op, f"{p} and {sc} must be contiguous within each page (their pages may be any stride apart)")
        if zero is not None:
            if zero.dtype != scale.dtype:
                fail(op, f"{zr} must have {sc}'s dtype", TypeError)
            if zero.shape != scale.shape:
                fail(op, f"{zr} must have {sc}'s shape {list(scale.shape)}, got {list(zero.shape)}")
            if not (_validate.rows_contiguous(zero) and zero.stride(0) == scale.stride(0)):
                fail(op, f"{zr} must be laid out as {sc} (contiguous within each page, the same page stride)")
    kc, vc = ("k_codes", "v_codes") if paged else ("k_packed", "v_packed")
    if v_codes.shape[0] != k_codes.shape[0] or v_codes.shape[2] != k_codes.shape[2]:
        fail(op, f"{vc} {list(v_codes.shape)} must have {kc}'s pages and rows {list(k_codes.shape)}")
    page_size = k_codes.shape[2]
    what = "page size" if paged else "packed capacity"
    if page_size >= 2**31:
        fail(op, f"the {what} ({page_size}) must be below 2^31 rows")
    if page_size % block:
        fail(op, f"the {what} ({page_size}) must be a multiple of block ({block})")
    slotted = side_slots is not None
    for name, t in (("k_window", k_window), ("v_window", v_window), ("k_sink", k_sink), ("v_sink", v_sink)):
        _validate.float_input(op, name, t)
        if t.dtype != k_window.dtype:
            fail(op, f"{name} must have k_window's dtype ({k_window.dtype}), got {t.dtype}", TypeError)
        if not (t.dim() == 4 and (slotted or t.shape[0] == batch) and t.shape[1] == kv_heads and t.shape[3] == dim):
            fail(op, f"{name} must have shape ({'slots' if slotted else batch}, {kv_heads}, tokens, {dim}), got "
                      f"{list(t.shape)}")
        if not t.is_contiguous():
            fail(op, f"{name} must be contiguous")
    w, s = k_window.shape[2], k_sink.shape[2]
    if not (v_window.shape[2] == w and v_sink.shape[2] == s and k_sink.shape[0] == k_window.shape[0]
            and v_window.shape[0] == k_window.shape[0] and v_sink.shape[0] == k_window.shape[0]):
        fail(op, "k_window, v_window, k_sink and v_sink must have the same slots, and the windows (and the sinks) "
                  "the same rows")
    if page_fill is not None:
        if not (page_fill.dim() == 1 and page_fill.shape[0] == k_codes.shape[0] and page_fill.is_contiguous()):
            fail(op, f"page_fill must be a contiguous ({k_codes.shape[0]},) tensor, one count per page, got "
                      f"{list(page_fill.shape)}")
    if slot_mapping is not None and not (slot_mapping.dim() == 1 and slot_mapping.shape[0] == new_rows):
        fail(op, f"slot_mapping must have shape ({new_rows},), got {list(slot_mapping.shape)}")
