"""paged_append and cache_append on the GPU (semantics: reference.paged_append / reference.cache_append,
bit for bit with the CPU kernel csrc/cpu/cache.cpp).

One append is a fixed sequence of launches whose sizes come from the tensors' shapes only, so a call never
waits for the device. A sequence's m new tokens complete at most m // block + 1 blocks, so the k-th block
that sequence b completes gets staging slot b + query_start_loc[b] // block + k: unique, and below
B + T // block (T: rows of k_new), which sizes the staging buffers.

1. `_plan_kernel`, SB slots a program: which sequence's which block each slot holds (a binary search over
   query_start_loc), its page and row, its sink rows, and whether it is written, into a slot table.
2. `_stage_kernel`, one program per (slot, chunk of its heads x rows x channels): the block's values in
   float32 into the staging buffers, older tokens from the sinks and the window ring, newer ones from
   k_new / v_new. Slots that hold no block are skipped (their staging stays unwritten).
3. `_place_kernel`, one program per chunk of the new tokens' (row, head, channel) values: each token's sink
   row (t < S) or window slot (t >= Q(n + m)). Stream order puts it after 2, which reads the ring slots it
   overwrites.
4. Per side with sparse outliers, `outliers.select_kernel` per (slot, kv head): the greedy selection of
   include/rkv/outliers.h into the mask that quant.quantize_slabs leaves out of the ranges.
5. quant.quantize_slabs per side, over every slot's slabs (refined key channels keep their full range).
6. `_scatter_kernel` per side: each written slot's codes and metadata into its page rows, and page_fill
   advanced; with sparse outliers `outliers.entries_kernel` writes each block's entries (residuals against the
   dense codes just made), and with refined key channels `refine.write_kernel` their codes.

Errors: on CPU tensors (the interpreter) the launchers make every check of the C++ kernel first, with its
messages, so a rejected call writes nothing. On CUDA tensors the data-dependent conditions are
`tl.device_assert`s in the plan and place kernels, which are compiled with debug=True for them (the
staging, quantizing and scatter kernels are not, so they stay fast); a failed assert stops the call, and
the kernels never write out of place besides: a block whose page id is outside the pool or its table,
whose side slot is outside the pool or whose rows the page already holds (page_fill) is not written, nor
are the sink and window rows of a token whose side slot is outside the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import _validate
from . import checks, quant
from . import outliers as outlier_kernels
from . import refine as refine_kernels
from .codes import kernel_view, load_float
from .slots import SLOT_COLUMNS, slot_block
from .spec import CompileSpec, signature

RING_PAGES = 2**31 - 1  # a ring's "table width": every block of a sequence is in its one page
ELEMS = 512  # elements a staging or placing program moves at once
PLAN_SLOTS = 128  # staging slots a planning program resolves at once
COPY_TILE = 1024  # bytes / entries a scatter program handles at once
OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


# --------------------------------------------------------------------------------------------------
# Sequences and slots
# --------------------------------------------------------------------------------------------------


@triton.jit
def _start(qsl_ptr, b, fixed):
    """The first row of k_new holding sequence b's new tokens (int64): query_start_loc[b], or b * fixed
    where every sequence takes `fixed` tokens (fixed >= 0: cache_append, whose qsl_ptr is unused)."""
    s = tl.load(qsl_ptr + b, mask=fixed < 0, other=0).to(tl.int64)
    return tl.where(fixed < 0, s, b.to(tl.int64) * fixed)


@triton.jit
def _last_at_most(target, qsl_ptr, fixed, batch, steps, stride, div):
    """The largest b in [0, batch) with stride * b + start(b) // div <= target (0 when there is none);
    the key grows with b, so a binary search of `steps` >= bit_length(batch) halvings finds it."""
    lo = target * 0
    hi = lo + batch - 1
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        ok = stride * mid + _start(qsl_ptr, mid, fixed) // div <= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _page_of(tables_ptr, has_tables, max_pages, b, t, P, live):
    """(page id, whether the table addresses it) of sequence b's token t >= 0 (read where `live`):
    block_tables[b][t // P], or page b."""
    idx = t // P
    inside = idx < max_pages
    page = tl.load(tables_ptr + b.to(tl.int64) * max_pages + idx, mask=live & inside & (has_tables != 0), other=-1)
    return tl.where(has_tables != 0, page.to(tl.int64), b.to(tl.int64)), inside


@triton.jit
def _slot_of(slots_ptr, has_slots, b):
    s = tl.load(slots_ptr + b, mask=has_slots != 0, other=0)
    return tl.where(has_slots != 0, s.to(tl.int64), b.to(tl.int64))


# --------------------------------------------------------------------------------------------------
# 1-2. The staging slots and the blocks they hold
# --------------------------------------------------------------------------------------------------


@triton.jit(debug=True)
def _plan_kernel(
    table, sink_rows, lengths, qsl, fixed, tables, has_tables, max_pages, slots_ptr, has_slots, page_fill, has_fill,
    n_slots_staged, batch, steps, pages, slots, H, S, P, block,
    SB: tl.constexpr,
):
    """Which block each of SB staging slots holds, a row of the int64 slot table each: (page, row, sink
    rows, written, sequence, first token, side slot, unused). Written: the slot holds a block whose page and
    side slot are inside the pool and whose rows the page does not hold yet. sink_rows (slots x H, int32):
    the quantizer's sink rows of each slab, 0 where nothing is written."""
    j = tl.program_id(0) * SB + tl.arange(0, SB)
    live = j < n_slots_staged
    b = _last_at_most(j, qsl, fixed, batch, steps, 1, block).to(tl.int64)
    start = _start(qsl, b, fixed)
    m = _start(qsl, b + 1, fixed) - start
    n0 = tl.load(lengths + b).to(tl.int64)
    n1 = n0 + m
    k = j - (b + start // block)
    valid = live & (k >= 0) & (k < n1 // block - n0 // block)
    first = (n0 // block + k) * block
    page, inside = _page_of(tables, has_tables, max_pages, b, first, P, valid)
    slot = _slot_of(slots_ptr, has_slots, b)
    in_pool = inside & (page >= 0) & (page < pages) & (slot >= 0) & (slot < slots)
    # the page's quantized rows must end at or before the block's first new row (a full page is final)
    held = tl.load(page_fill + page, mask=valid & in_pool & (has_fill != 0), other=0)
    ok = valid & in_pool & (held <= tl.maximum(first, n0) % P)
    tl.device_assert(~valid | in_pool, "rkv append: a block table or side_slots entry is outside the pool")
    tl.device_assert(~valid | ok, "rkv append: a write into rows a page already holds (a full page is immutable)")
    sinks_here = tl.minimum(tl.maximum(S - first, 0), block)
    row = table + j.to(tl.int64) * SLOT_COLUMNS
    tl.store(row + 0, page, mask=live)
    tl.store(row + 1, first % P, mask=live)
    tl.store(row + 2, sinks_here, mask=live)
    tl.store(row + 3, ok.to(tl.int64), mask=live)
    tl.store(row + 4, b, mask=live)
    tl.store(row + 5, first, mask=live)
    tl.store(row + 6, slot, mask=live)
    for h in range(H):
        tl.store(sink_rows + j.to(tl.int64) * H + h, tl.where(ok, sinks_here, 0).to(tl.int32), mask=live)


@triton.jit
def _stage_kernel(
    k_new, v_new, k_window, v_window, k_sink, v_sink, k_x, v_x, table, lengths, qsl, fixed,
    new_rows, H, D, S, W, block,
    k_sa, k_sb, k_st, k_sh, k_sd, v_sa, v_sb, v_st, v_sh, v_sd,
    EB: tl.constexpr,
):
    """EB of the (head, row, channel) values of the block slot j holds, into the staging buffers (float32
    (slots, H, block, D)): older tokens from the sinks and the window ring, newer ones from k_new / v_new."""
    j = tl.program_id(0)
    row = table + j.to(tl.int64) * SLOT_COLUMNS
    if tl.load(row + 3) != 0:
        b = tl.load(row + 4)
        first = tl.load(row + 5)
        slot = tl.load(row + 6)
        start = _start(qsl, b, fixed)
        n0 = tl.load(lengths + b).to(tl.int64)
        e = tl.program_id(1).to(tl.int64) * EB + tl.arange(0, EB)
        live = e < H * block * D
        h = e // (block * D)
        c = e % D
        t = first + e // D % block
        fresh = live & (t >= n0) & (start + t - n0 < new_rows)
        sunk = live & (t < n0) & (t < S)
        ringed = live & (t < n0) & (t >= S)
        side = (slot * H + h) * D
        sink_at = side * S + t * D + c
        ring_at = side * W + (t % tl.maximum(W, 1)) * D + c
        k_at = start * k_sa + b * k_sb + (t - n0) * k_st + h * k_sh + c * k_sd
        v_at = start * v_sa + b * v_sb + (t - n0) * v_st + h * v_sh + c * v_sd
        kv = load_float(k_new + k_at, fresh, 0.0)
        kv = tl.where(sunk, load_float(k_sink + sink_at, sunk, 0.0), kv)
        kv = tl.where(ringed, load_float(k_window + ring_at, ringed, 0.0), kv)
        vv = load_float(v_new + v_at, fresh, 0.0)
        vv = tl.where(sunk, load_float(v_sink + sink_at, sunk, 0.0), vv)
        vv = tl.where(ringed, load_float(v_window + ring_at, ringed, 0.0), vv)
        out = j.to(tl.int64) * H * block * D + e
        tl.store(k_x + out, kv, mask=live)
        tl.store(v_x + out, vv, mask=live)


# --------------------------------------------------------------------------------------------------
# 3. New tokens into the sinks and the window ring
# --------------------------------------------------------------------------------------------------


@triton.jit(debug=True)
def _place_kernel(
    k_new, v_new, k_window, v_window, k_sink, v_sink,
    lengths, qsl, fixed, tables, has_tables, max_pages, slots_ptr, has_slots, page_fill, has_fill,
    slot_mapping, has_mapping, batch, steps, new_rows, pages, slots, H, D, S, W, P, block, recent,
    k_sa, k_sb, k_st, k_sh, k_sd, v_sa, v_sb, v_st, v_sh, v_sd,
    EB: tl.constexpr,
):
    """EB of the new tokens' (row, head, channel) values into the sinks (token t < S) or the window ring
    (t >= Q(n + m)); rows outside query_start_loc's range are padding. The page checks of the C++ kernel
    are device asserts here (the page rows themselves are written by _scatter_kernel)."""
    e = tl.program_id(0).to(tl.int64) * EB + tl.arange(0, EB)  # (new row, head, channel), flattened
    live = e < new_rows * H * D
    r = e // (H * D)
    h = e // D % H
    c = e % D
    b = _last_at_most(r, qsl, fixed, batch, steps, 0, 1)
    start = _start(qsl, b, fixed)
    end = _start(qsl, b + 1, fixed)
    owned = live & (start <= r) & (r < end)  # rows outside query_start_loc's range are padding
    n0 = tl.load(lengths + b).to(tl.int64)
    i = r - start
    t = n0 + i
    n1 = n0 + end - start
    q1 = block * (tl.maximum(n1 - recent, 0) // block)
    slot = _slot_of(slots_ptr, has_slots, b)
    ok = owned & (slot >= 0) & (slot < slots)
    page, inside = _page_of(tables, has_tables, max_pages, b, t, P, owned)
    in_pool = inside & (page >= 0) & (page < pages)
    held = tl.load(page_fill + page, mask=owned & in_pool & (has_fill != 0), other=0)
    mapped = tl.load(slot_mapping + r, mask=owned & (has_mapping != 0), other=0)
    tl.device_assert(~owned | ok, "rkv append: side_slots names a slot outside the pool")
    tl.device_assert(~owned | in_pool, "rkv append: a block table names a page outside the pool")
    tl.device_assert(~owned | (held <= t % P), "rkv append: a write into rows a page already holds (a full page is immutable)")
    tl.device_assert(~owned | (has_mapping == 0) | (mapped == page * P + t % P),
                     "rkv append: slot_mapping disagrees with the block tables")
    to_sink = ok & (t < S)
    to_ring = ok & (t >= S) & (t >= q1)
    kv = tl.load(k_new + start * k_sa + b * k_sb + i * k_st + h * k_sh + c * k_sd, mask=to_sink | to_ring)
    vv = tl.load(v_new + start * v_sa + b * v_sb + i * v_st + h * v_sh + c * v_sd, mask=to_sink | to_ring)
    side = (slot * H + h) * D
    tl.store(k_sink + side * S + t * D + c, kv, mask=to_sink)
    tl.store(v_sink + side * S + t * D + c, vv, mask=to_sink)
    tl.store(k_window + side * W + (t % tl.maximum(W, 1)) * D + c, kv, mask=to_ring)
    tl.store(v_window + side * W + (t % tl.maximum(W, 1)) * D + c, vv, mask=to_ring)


# --------------------------------------------------------------------------------------------------
# 6. Codes and metadata into the pages (the outlier entries: outliers.py)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _scatter_kernel(
    packed, scale, zero, codes_out, scale_out, zero_out, has_zero, table, page_fill, has_fill,
    H, P, block, row_bytes, T, groups, codes_page_stride, meta_page_stride,
    CB: tl.constexpr,
):
    """CB of the code bytes and metadata values of every head of slot j's block into its page rows
    (the quantizer's slabs of one slot are consecutive, head after head)."""
    j = tl.program_id(0)
    staged, page, first_row, _sinks = slot_block(table, j)
    if staged:
        e = tl.program_id(1).to(tl.int64) * CB + tl.arange(0, CB)
        n_codes = block * row_bytes
        m = e < H * n_codes
        src = j.to(tl.int64) * H * n_codes + e
        dst = page * codes_page_stride + (e // n_codes * P + first_row) * row_bytes + e % n_codes
        tl.store(codes_out + dst, tl.load(packed + src, mask=m), mask=m)
        n_meta = block // T * groups
        m = e < H * n_meta
        src = j.to(tl.int64) * H * n_meta + e
        dst = page * meta_page_stride + (e // n_meta * (P // T) + first_row // T) * groups + e % n_meta
        tl.store(scale_out + dst, tl.load(scale + src, mask=m), mask=m)
        if has_zero != 0:
            tl.store(zero_out + dst, tl.load(zero + src, mask=m), mask=m)
        if (has_fill != 0) & (tl.program_id(1) == 0):  # one append's blocks in one page: the last end stays
            tl.atomic_max(page_fill + page, (first_row + block).to(tl.int32))


# --------------------------------------------------------------------------------------------------
# Host checks (CPU tensors): csrc/checks.cpp and csrc/cache_call.cpp, their rules and messages
# --------------------------------------------------------------------------------------------------


def _check_data(op: str, lengths, starts, counts, new_rows: int, tables, slots, page_fill, slot_mapping,
                pages: int, n_slots: int, page_size: int, ring: bool):
    """check_append_data and check_cache_data (csrc/checks.cpp, csrc/cache_call.cpp): every data-dependent
    condition, in the C++ kernel's order, before anything is written."""
    n = lengths.tolist()
    batch = len(n)
    if starts is not None and batch and not (starts[0] >= 0 and starts[batch] <= new_rows):
        checks.fail(op, f"query_start_loc must lie in [0, {new_rows}] (the rows of k_new)")
    tab = tables.tolist() if tables is not None else None
    slot_ids = slots.tolist() if slots is not None else None
    max_pages = len(tab[0]) if tab else (1 if tables is None else 0)
    max_tokens = 2**40 if ring else max_pages * page_size
    for b in range(batch):
        add, total = counts[b], n[b] + counts[b]
        if not (n[b] >= 0 and add >= 0):
            checks.fail(op, f"sequence {b} has {n[b]} cached and {add} new tokens (query_start_loc must not decrease)")
        if total > max_tokens:
            checks.fail(op, f"appending {add} tokens to sequence {b} of {n[b]} tokens exceeds its capacity of {max_tokens} "
                      f"tokens ({max_pages} {'page' if max_pages == 1 else 'pages'} of {page_size})")
        slot = b if slot_ids is None else slot_ids[b]
        if not 0 <= slot < n_slots:
            checks.fail(op, f"side_slots[{b}] = {slot} is outside the {n_slots} side slots")
        if tab is not None:
            for j in range(-(-total // page_size)):
                if not 0 <= tab[b][j] < pages:
                    checks.fail(op, f"block_tables[{b}][{j}] = {tab[b][j]} is outside the pool of {pages} pages")
    fill = page_fill.tolist() if page_fill is not None else None
    mapping = slot_mapping.tolist() if slot_mapping is not None else None
    writer = {}
    for b in range(batch):
        t = n[b]
        while t < n[b] + counts[b]:  # one run of tokens per page, in token order
            end = min(n[b] + counts[b], (t // page_size + 1) * page_size)
            page = tab[b][t // page_size] if tab is not None else b
            first = writer.setdefault(page, b)
            if first != b:
                checks.fail(op, f"page {page} receives new tokens of sequences {first} and {b} (a page belongs to one "
                          "sequence while it fills)")
            if fill is not None and fill[page] > t % page_size:
                checks.fail(op, f"sequence {b} writes row {t % page_size} of page {page}, which already holds {fill[page]} "
                          "quantized rows (a full page is immutable)")
            if mapping is not None:
                for u in range(t, end):
                    i = starts[b] + u - n[b]
                    if mapping[i] != page * page_size + u % page_size:
                        checks.fail(op, f"slot_mapping[{i}] = {mapping[i]} but the block table puts that token at slot "
                                  f"{page * page_size + u % page_size}")
            t = end


# --------------------------------------------------------------------------------------------------
# The launch sequence
# --------------------------------------------------------------------------------------------------


def _strides(new: torch.Tensor, paged: bool):
    """(a, b, t, h, d): element offset of sequence b's new token i, head h, channel c is start(b) * a + b * b_
    + i * t + h * h_ + c * d (start(b): its first row of k_new; the contiguous input has none)."""
    if paged:
        return new.stride(0), 0, new.stride(0), new.stride(1), new.stride(2)
    return 0, new.stride(0), new.stride(2), new.stride(1), new.stride(3)


def _append(cache, page_fill, tables, slots, lengths, qsl, fixed, k_new, v_new, k_bits, v_bits, block, recent,
            clips, levels, outliers, slot_mapping, ring, paged, refine=None):
    """The launches of one append (the module's steps 1-6), after the checks. paged: k_new (T, H, D) rows
    placed by query_start_loc (qsl); else (B, H, m, D), m = fixed tokens a sequence. ring: one page per
    sequence whose rows are a ring (cache_append's sliding window). clips, levels, outliers: (keys, values).
    refine: (k_refine, k_channels) of refined key channels, or None."""
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink = cache
    batch, heads, dim = lengths.shape[0], k_codes.shape[1], k_new.shape[-1]
    new_rows = k_new.shape[0] if paged else batch * fixed
    if batch == 0 or new_rows == 0:
        return
    page_size = k_codes.shape[2]
    nb = batch + new_rows // block  # staging slots: every block this append can complete has one
    dev = k_new.device
    table = torch.empty(nb, SLOT_COLUMNS.value, dtype=torch.int64, device=dev)
    sink_rows = torch.empty(nb * heads, dtype=torch.int32, device=dev)
    k_x = torch.empty(nb, heads, block, dim, dtype=torch.float32, device=dev)
    v_x = torch.empty_like(k_x)
    steps = batch.bit_length()
    qsl_ptr = qsl if qsl is not None else lengths
    fixed = -1 if paged else fixed
    max_pages = tables.shape[1] if tables is not None else (RING_PAGES if ring else 1)
    fill_ptr = page_fill if page_fill is not None else sink_rows  # (absent tensors: any int32 one, unread)
    index = (lengths, qsl_ptr, fixed, tables if tables is not None else sink_rows, int(tables is not None),
             max_pages, slots if slots is not None else sink_rows, int(slots is not None), fill_ptr,
             int(page_fill is not None))
    pool = (k_codes.shape[0], k_window.shape[0])
    sink_n, window_n = k_sink.shape[2], k_window.shape[2]
    strides = (*_strides(k_new, paged), *_strides(v_new, paged))
    rows = [kernel_view(t) for t in (k_new, v_new, k_window, v_window, k_sink, v_sink)]  # bits, exactly
    _plan_kernel[(triton.cdiv(nb, PLAN_SLOTS),)](table, sink_rows, *index, nb, batch, steps, *pool, heads, sink_n,
                                                 page_size, block, SB=PLAN_SLOTS, **OPTIONS)
    _stage_kernel[(nb, triton.cdiv(heads * block * dim, ELEMS))](
        *rows, k_x, v_x, table, lengths, qsl_ptr, fixed, new_rows, heads, dim, sink_n, window_n, block, *strides,
        EB=ELEMS, **OPTIONS)
    mapping = slot_mapping.long() if slot_mapping is not None else table
    _place_kernel[(triton.cdiv(new_rows * heads * dim, ELEMS),)](
        *rows, *index, mapping, int(slot_mapping is not None), batch, steps, new_rows, *pool, heads, dim, sink_n,
        window_n, page_size, block, recent, *strides, EB=ELEMS, **OPTIONS)
    # the staging slots that hold a block this append writes (the plan's column 3), one flag per slab
    active = table[:, 3].to(torch.int32).repeat_interleave(heads)
    sides = ((k_x, k_codes, k_scale, k_zero, k_bits, clips[0], levels[0], outliers[0], refine),
             (v_x, v_codes, v_scale, v_zero, v_bits, clips[1], levels[1], outliers[1], None))
    for i, (x, codes, scale, zero, bits, clip, lv, out, rf) in enumerate(sides):
        tile, group = page_size // scale.shape[2], dim // scale.shape[3]
        slabs = x.view(nb * heads, block, dim)
        excluded = None
        if out is not None:
            groups, members = (block // tile) * (dim // group), tile * group
            excluded = torch.empty(nb * heads, block, dim, dtype=torch.bool, device=dev)
            gains = torch.empty(nb * heads, groups * 2, dtype=torch.float32, device=dev)
            gpos = torch.empty(nb * heads, groups * 2, dtype=torch.int32, device=dev)
            ok = outlier_kernels
            ok.select_kernel[(nb, heads)](slabs, excluded.view(torch.uint8), gains, gpos, table, heads, dim, block, tile,
                                          group, dim // group, groups, members, out.shape[3], GB=ok.GROUP_TILE,
                                          MB=ok.ELEM_TILE, RB=ok.RESCAN_TILE, ZB=ok.COPY_TILE, **OPTIONS)
        channels = None if rf is None else rf[1].contiguous()  # (refined channels keep their full range)
        packed, sc, zr = quant.quantize_slabs(slabs, bits, group, tile, zero is None, scale.dtype, clip, sink_rows, lv,
                                              excluded, active, channels)
        meta = [kernel_view(t) for t in (sc, zr if zero is not None else sc, scale,
                                           zero if zero is not None else scale)]
        n_codes, n_meta = block * codes.shape[3], block // tile * scale.shape[3]
        _scatter_kernel[(nb, triton.cdiv(heads * max(n_codes, n_meta), COPY_TILE))](
            packed, *meta[:2], codes, *meta[2:], int(zero is not None), table, fill_ptr,
            int(page_fill is not None and i == 0), heads, page_size, block, codes.shape[3], tile, scale.shape[3],
            codes.stride(0), scale.stride(0), CB=COPY_TILE, **OPTIONS)
        if out is not None:
            sc32 = sc.float()
            zr32 = zr.float() if zero is not None else sc32
            lv32 = lv if lv is not None else sc32
            outlier_kernels.entries_kernel[(nb, heads)](
                slabs, excluded.view(torch.uint8), packed, sc32, zr32, lv32, table, out, out.stride(0), heads, dim,
                page_size, block, codes.shape[3], tile, group, scale.shape[3], out.shape[3], BITS=bits,
                SYMMETRIC=zero is None, HAS_LEVELS=lv is not None, PB=outlier_kernels.COPY_TILE, **OPTIONS)
        if rf is not None:
            refine_kernels.write(slabs, meta[0], meta[1], table, channels, rf[0], heads, dim, block, tile, bits)


def _prepare(op, cache, lv_k, lv_v):
    """The levels as the kernels read them; on CPU tensors their values checked first (check_levels)."""
    for arg, lv in (("k_levels", lv_k), ("v_levels", lv_v)):
        if lv is not None:
            checks.levels(op, arg, lv, lv.shape[0].bit_length() - 1)
    return tuple(None if t is None else t.contiguous() for t in (lv_k, lv_v))


def paged_append(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink, page_fill,
                 block_tables, side_slots, lengths, query_start_loc, k_new, v_new, k_bits, v_bits, block, recent,
                 k_clip=False, v_clip=False, slot_mapping=None, k_levels=None, v_levels=None, k_outliers=None,
                 v_outliers=None, k_refine=None, k_channels=None):
    op = "paged_append"
    _validate.paged_append(k_codes, v_codes, k_window, page_fill, block_tables, side_slots, lengths, query_start_loc,
                           k_new, v_new, k_bits, v_bits, block, recent, k_zero, v_zero, k_clip, v_clip, slot_mapping)
    _validate.cache_levels(op, k_new, k_levels, v_levels, k_bits, v_bits, k_zero, v_zero)
    _validate.cache_strides(op, True, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    _validate.cache_outliers(op, k_new, k_codes, v_codes, k_outliers, v_outliers, block, k_new.shape[-1])
    _validate.cache_refine(op, k_new, k_codes, k_zero, k_scale, k_levels, k_outliers, k_bits, k_refine, k_channels)
    checks.refine_channels(op, k_channels, k_new.shape[-1])
    _validate.devices(op, k_new, k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes, v_scale=v_scale,
                      v_zero=v_zero, k_window=k_window, v_window=v_window, k_sink=k_sink, v_sink=v_sink,
                      page_fill=page_fill, block_tables=block_tables, side_slots=side_slots, lengths=lengths,
                      query_start_loc=query_start_loc, v_new=v_new, slot_mapping=slot_mapping)
    cache = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink)
    batch = lengths.shape[0]
    checks.cache_layout(op, True, *cache, block_tables, side_slots, block, k_new.shape[1], k_new.shape[2], batch,
                        page_fill, slot_mapping, k_new.shape[0])
    levels = _prepare(op, cache, k_levels, v_levels)
    if k_new.device.type == "cpu":
        starts = query_start_loc.tolist()
        counts = [starts[b + 1] - starts[b] for b in range(batch)]
        _check_data(op, lengths, starts, counts, k_new.shape[0], block_tables, side_slots, page_fill, slot_mapping,
                    k_codes.shape[0], k_window.shape[0], k_codes.shape[2], False)
    _append(cache, page_fill, block_tables, side_slots, lengths, query_start_loc, 0, k_new, v_new, k_bits, v_bits,
            block, recent, (k_clip, v_clip), levels, (k_outliers, v_outliers), slot_mapping, False, True,
            None if k_refine is None else (k_refine, k_channels))


def cache_append(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink, lengths,
                 k_new, v_new, k_bits, v_bits, block, recent, k_clip=False, v_clip=False, sliding_window=0,
                 k_levels=None, v_levels=None, k_outliers=None, v_outliers=None, k_refine=None, k_channels=None):
    op = "cache_append"
    _validate.cache_append(k_packed, v_packed, k_window, lengths, k_new, v_new, k_bits, v_bits, block, recent, k_zero,
                           v_zero, k_clip, v_clip)
    _validate.window_and_cap(op, sliding_window, 0.0, k_packed.shape[2], block, k_new.shape[2])
    _validate.cache_levels(op, k_new, k_levels, v_levels, k_bits, v_bits, k_zero, v_zero)
    _validate.cache_strides(op, False, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero)
    _validate.cache_outliers(op, k_new, k_packed, v_packed, k_outliers, v_outliers, block, k_new.shape[-1])
    _validate.cache_refine(op, k_new, k_packed, k_zero, k_scale, k_levels, k_outliers, k_bits, k_refine, k_channels)
    checks.refine_channels(op, k_channels, k_new.shape[-1])
    _validate.devices(op, k_new, k_packed=k_packed, k_scale=k_scale, k_zero=k_zero, v_packed=v_packed,
                      v_scale=v_scale, v_zero=v_zero, k_window=k_window, v_window=v_window, k_sink=k_sink,
                      v_sink=v_sink, lengths=lengths, v_new=v_new)
    cache = (k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink)
    batch, m = k_new.shape[0], k_new.shape[2]
    checks.cache_layout(op, False, *cache, None, None, block, k_new.shape[1], k_new.shape[3], batch)
    levels = _prepare(op, cache, k_levels, v_levels)
    ring = sliding_window > 0
    if k_new.device.type == "cpu":
        _check_data(op, lengths, None, [m] * batch, batch * m, None, None, None, None, k_packed.shape[0],
                    k_window.shape[0], k_packed.shape[2], ring)
    _append(cache, None, None, None, lengths, None, m, k_new, v_new, k_bits, v_bits, block, recent,
            (k_clip, v_clip), levels, (k_outliers, v_outliers), None, ring, False,
            None if k_refine is None else (k_refine, k_channels))


KERNELS = {"paged_append": paged_append, "cache_append": cache_append}


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile configurations
# --------------------------------------------------------------------------------------------------

_FP = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*i16"}  # bfloat16 as int16 bits


def _plan_spec(index: str) -> CompileSpec:
    ptrs = dict(table="*i64", sink_rows="*i32", lengths=index, qsl=index, tables="*i32", slots_ptr="*i32",
                page_fill="*i32")
    c = dict(SB=PLAN_SLOTS)
    return CompileSpec(f"plan {index}", _plan_kernel, signature(_plan_kernel, ptrs, c), c, OPTIONS)


def _stage_spec(fp: str, index: str) -> CompileSpec:
    ptrs = {n: fp for n in ("k_new", "v_new", "k_window", "v_window", "k_sink", "v_sink")}
    ptrs.update(k_x="*fp32", v_x="*fp32", table="*i64", lengths=index, qsl=index)
    c = dict(EB=ELEMS)
    return CompileSpec(f"stage {fp} {index}", _stage_kernel, signature(_stage_kernel, ptrs, c), c, OPTIONS)


def _place_spec(fp: str, index: str) -> CompileSpec:
    ptrs = {n: fp for n in ("k_new", "v_new", "k_window", "v_window", "k_sink", "v_sink")}
    ptrs.update(lengths=index, qsl=index, tables="*i32", slots_ptr="*i32", page_fill="*i32", slot_mapping="*i64")
    c = dict(EB=ELEMS)
    return CompileSpec(f"place {fp} {index}", _place_kernel, signature(_place_kernel, ptrs, c), c, OPTIONS)


def _scatter_spec(meta: str) -> CompileSpec:
    ptrs = dict(packed="*u8", scale=meta, zero=meta, codes_out="*u8", scale_out=meta, zero_out=meta, table="*i64",
                page_fill="*i32")
    c = dict(CB=COPY_TILE)
    return CompileSpec(f"scatter {meta}", _scatter_kernel, signature(_scatter_kernel, ptrs, c), c, OPTIONS)


def compile_specs(full: bool) -> list[CompileSpec]:
    """One configuration per kernel; full: every dtype, bit width and flag combination the launchers launch
    (head_dim and block are runtime arguments: the kernels loop over them in fixed tiles)."""
    if not full:
        return [_plan_spec("*i32"), _stage_spec("*fp16", "*i32"), _place_spec("*fp16", "*i32"),
                _scatter_spec("*fp16")]
    specs = [_plan_spec(index) for index in ("*i32", "*i64")]
    for fp in _FP.values():
        for index in ("*i32", "*i64"):
            specs += [_stage_spec(fp, index), _place_spec(fp, index)]
    return specs + [_scatter_spec(meta) for meta in (*_FP.values(), "*u8")]  # u8: float8 e4m3 metadata
