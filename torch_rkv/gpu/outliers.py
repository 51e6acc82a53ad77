"""The sparse outliers of a cache append on the GPU (include/rkv/outliers.h; semantics:
reference.select_outliers and reference.outlier_entries): step 4 of cache.py's append, the greedy
selection of each staged block's outliers into the mask that quant.quantize_slabs leaves out of the
ranges, and the end of step 6, each block's entries (position and residual against the dense codes)
written into its page's row."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import dequant, load_codes
from .slots import slot_block
from .spec import CompileSpec, signature

OUTLIER_EMPTY = tl.constexpr(-65536)  # an unused outlier entry: position 0xFFFF, residual 0 (outliers.h)
GROUP_TILE, ELEM_TILE, RESCAN_TILE = 16, 64, 256  # the selection's tiles (groups x elements)
COPY_TILE = 1024  # mask positions / entries a program handles at once
OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


# --------------------------------------------------------------------------------------------------
# 4. Sparse outliers: the greedy selection (include/rkv/outliers.h)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _extremes(x_ptr, ex_ptr, g, gmask, sink, D, T, G, per_row, M, GB: tl.constexpr, MB: tl.constexpr):
    """For each quantizer group g (GB,) of one staged block (rows T x channels G, `per_row` groups a tile
    row, M = T * G elements): the largest and smallest candidates (finite, in a row >= sink, not taken in
    ex), the position of the first of equals, the runners-up (an equal value counts), and the count.
    Elements are visited in position order, MB at a time, as Extremes::add visits them."""
    tr = g // per_row
    cg = g % per_row
    hi = tl.full([GB], float("-inf"), tl.float32)
    hi2 = hi
    lo = tl.full([GB], float("inf"), tl.float32)
    lo2 = lo
    big = 0x7FFFFFFF
    hip = tl.full([GB], big, tl.int32)
    lop = hip
    cnt = tl.zeros([GB], tl.int32)
    for e0 in range(0, M, MB):
        e = e0 + tl.arange(0, MB)
        row = tr[:, None] * T + (e // G)[None, :]
        pos = row * D + cg[:, None] * G + (e % G)[None, :]
        m = gmask[:, None] & (e < M)[None, :]
        v = tl.load(x_ptr + pos, mask=m, other=0.0)
        taken = tl.load(ex_ptr + pos, mask=m, other=1)
        cand = m & (row >= sink) & (taken == 0) & (tl.abs(v) < float("inf"))
        ch = tl.max(tl.where(cand, v, float("-inf")), axis=1)
        chp = tl.min(tl.where(cand & (v == ch[:, None]), pos, big), axis=1)
        ch2 = tl.max(tl.where(cand & (pos != chp[:, None]), v, float("-inf")), axis=1)
        cl = tl.min(tl.where(cand, v, float("inf")), axis=1)
        clp = tl.min(tl.where(cand & (v == cl[:, None]), pos, big), axis=1)
        cl2 = tl.min(tl.where(cand & (pos != clp[:, None]), v, float("inf")), axis=1)
        # merge with the earlier elements, which come first among equals
        up = ch > hi
        hi2 = tl.where(up, tl.maximum(hi, ch2), tl.maximum(hi2, ch))
        hip = tl.where(up, chp, hip)
        hi = tl.where(up, ch, hi)
        down = cl < lo
        lo2 = tl.where(down, tl.minimum(lo, cl2), tl.minimum(lo2, cl))
        lop = tl.where(down, clp, lop)
        lo = tl.where(down, cl, lo)
        cnt += tl.sum(cand.to(tl.int32), axis=1)
    return hi, hi2, hip, lo, lo2, lop, cnt


@triton.jit
def _gains(hi, hi2, lo, lo2, cnt):
    """r^2 - r'^2 = (r - r')(r + r') in float32 for taking each group's high and low end; 0 with fewer
    than two candidates or a NaN (Extremes::gain)."""
    r = hi - lo
    rh = hi2 - lo
    rl = hi - lo2
    gh = (r - rh) * (r + rh)
    gl = (r - rl) * (r + rl)
    gh = tl.where((cnt < 2) | (gh != gh), 0.0, gh)
    gl = tl.where((cnt < 2) | (gl != gl), 0.0, gl)
    return gh, gl


@triton.jit
def _group_state(x, ex, gains, gpos, g, gmask, sink, D, T, G, per_row, M, GB: tl.constexpr, MB: tl.constexpr):
    """Stores the two gains of each group g and the position each would take, at key g * 2 + end
    (end 0: the high end, 1: the low end)."""
    hi, hi2, hip, lo, lo2, lop, cnt = _extremes(x, ex, g, gmask, sink, D, T, G, per_row, M, GB, MB)
    gh, gl = _gains(hi, hi2, lo, lo2, cnt)
    tl.store(gains + 2 * g, gh, mask=gmask)
    tl.store(gains + 2 * g + 1, gl, mask=gmask)
    tl.store(gpos + 2 * g, hip, mask=gmask)
    tl.store(gpos + 2 * g + 1, lop, mask=gmask)


@triton.jit
def select_kernel(
    x_ptr, ex_ptr, gain_ptr, gpos_ptr, table, H, D, block, T, G, per_row, groups, M, count,
    GB: tl.constexpr, MB: tl.constexpr, RB: tl.constexpr, ZB: tl.constexpr,
):
    """The sparse outliers of slab (slot j, head h), `count` greedy steps (include/rkv/outliers.h): ex (the
    slab's bytes of the excluded mask) cleared, then each step takes the largest gain of all groups (gains
    and positions kept per group in gain_ptr / gpos_ptr) and recomputes the one group that lost a value."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    staged, _page, _row, sink_rows = slot_block(table, j)
    if staged:
        sink = sink_rows.to(tl.int32)
        n = j.to(tl.int64) * H + h
        x = x_ptr + n * block * D
        ex = ex_ptr + n * block * D
        gains = gain_ptr + n * groups * 2
        gpos = gpos_ptr + n * groups * 2
        for z0 in range(0, block * D, ZB):
            z = z0 + tl.arange(0, ZB)
            tl.store(ex + z, tl.zeros([ZB], tl.uint8), mask=z < block * D)
        tl.debug_barrier()
        for g0 in range(0, groups, GB):
            g = g0 + tl.arange(0, GB)
            _group_state(x, ex, gains, gpos, g, g < groups, sink, D, T, G, per_row, M, GB, MB)
        tl.debug_barrier()
        for _ in range(count):
            # the best gain, the lowest key among equals (outlier_better): keys grow chunk by chunk
            best = 0.0
            key = 0
            for k0 in range(0, 2 * groups, 2 * GB):
                kk = k0 + tl.arange(0, 2 * GB)
                gv = tl.load(gains + kk, mask=kk < 2 * groups, other=0.0)
                cb = tl.max(gv, axis=0)
                ck = tl.min(tl.where(gv == cb, kk, 0x7FFFFFFF), axis=0)
                better = cb > best
                key = tl.where(better, ck, key)
                best = tl.where(better, cb, best)
            if best > 0.0:
                tl.store(ex + tl.load(gpos + key), 1)
                tl.debug_barrier()
                g1 = key // 2 + tl.arange(0, 1)
                _group_state(x, ex, gains, gpos, g1, g1 < groups, sink, D, T, G, per_row, M, 1, RB)
                tl.debug_barrier()


@triton.jit
def entries_kernel(
    x_ptr, ex_ptr, packed, scale, zero, levels, table, out, out_page_stride,
    H, D, P, block, row_bytes, T, G, groups, count,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_LEVELS: tl.constexpr, PB: tl.constexpr,
):
    """The `count` outlier entries of slab (slot j, head h) into its block's row of `out`: per taken
    position, ascending, position << 16 | the float16 bits of x - x_hat (x_hat: the dense codes and
    float32 metadata just made, decoded; saturated to +-65504), then OUTLIER_EMPTY."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    staged, page, row, _sinks = slot_block(table, j)
    if staged:
        n = j.to(tl.int64) * H + h
        dst = out + page * out_page_stride + (h * (P // block) + row // block) * count
        x = x_ptr + n * block * D
        ex = ex_ptr + n * block * D
        meta = n * (block // T) * groups
        written = 0
        for p0 in range(0, block * D, PB):  # taken positions in ascending order, each its entry
            p = p0 + tl.arange(0, PB)
            taken = tl.load(ex + p, mask=p < block * D, other=0) != 0
            at = written + tl.cumsum(taken.to(tl.int32), axis=0) - 1
            r = p // D
            c = p % D
            code = load_codes(packed + n * block * row_bytes + r * row_bytes, c, row_bytes, taken, BITS)
            mi = meta + (r // T) * groups + c // G
            s = tl.load(scale + mi, mask=taken, other=0.0)
            if SYMMETRIC:
                z = 0.0
            else:
                z = tl.load(zero + mi, mask=taken, other=0.0)
            res = tl.load(x + p, mask=taken, other=0.0) - dequant(code, s, z, levels, BITS, SYMMETRIC, HAS_LEVELS)
            res = tl.where(res != res, res, tl.minimum(tl.maximum(res, -65504.0), 65504.0))
            half = res.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            tl.store(dst + at, (p << 16) | half, mask=taken & (at < count))
            written += tl.sum(taken.to(tl.int32), axis=0)
        for k0 in range(0, count, PB):
            i = k0 + tl.arange(0, PB)
            tl.store(dst + i, tl.full([PB], OUTLIER_EMPTY, tl.int32), mask=(i >= written) & (i < count))


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile configurations
# --------------------------------------------------------------------------------------------------


def _select_spec() -> CompileSpec:
    ptrs = dict(x_ptr="*fp32", ex_ptr="*u8", gain_ptr="*fp32", gpos_ptr="*i32", table="*i64")
    c = dict(GB=GROUP_TILE, MB=ELEM_TILE, RB=RESCAN_TILE, ZB=COPY_TILE)
    return CompileSpec("select", select_kernel, signature(select_kernel, ptrs, c), c, OPTIONS)


def _entries_spec(bits: int, symmetric: bool, levels: bool) -> CompileSpec:
    ptrs = dict(x_ptr="*fp32", ex_ptr="*u8", packed="*u8", scale="*fp32", zero="*fp32", levels="*fp32", table="*i64",
                out="*i32")
    c = dict(BITS=bits, SYMMETRIC=symmetric, HAS_LEVELS=levels, PB=COPY_TILE)
    label = f"entries {bits}-bit {'sym' if symmetric else 'asym'}{' levels' if levels else ''}"
    return CompileSpec(label, entries_kernel, signature(entries_kernel, ptrs, c), c, OPTIONS)


def compile_specs(full: bool) -> list[CompileSpec]:
    """The selection, and the entries at 4 bits (full: every bit width, symmetric and asymmetric, and
    with levels below 8 bits)."""
    if not full:
        return [_select_spec(), _entries_spec(4, False, False)]
    specs = [_select_spec()]
    for bits in (2, 3, 4, 8):
        specs += [_entries_spec(bits, True, False), _entries_spec(bits, False, False)]
        if bits <= 4:
            specs.append(_entries_spec(bits, False, True))
    return specs
