"""quantize on the GPU (semantics: reference.quantize, bit for bit like
the CPU kernels of csrc/cpu/quant.cpp and csrc/cpu/block_quant.h, whose arithmetic is include/rkv/quant.h;
layout: codes.py).

Both quantize and dequantize (dequant.py) are built on slab launchers that the cache append shares:

* `quantize_slabs(x, ...)` quantizes x (N, R, D), N independent slabs of R token rows, each slab as
  reference.quantize quantizes one (*, R, D) slice: tiles of block_tokens rows x group_size channels, with
  the slab's own sink rows and an optional mask of values left out of the ranges (sparse outliers).
* `dequant.dequantize_slabs(packed, scale, zero, ...)` decodes such slabs back.

One program of `_quantize_kernel` owns whole block rows (block_tokens token rows x all D channels): it reads
their tokens in chunks of BT rows to find each group's finite min and max, derives the group parameters
(and runs the clipped-range search), writes them, and reads the tokens again to encode and pack them.
Short block rows (per-token and grouped layouts) are handled BB at a time in one program.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ops import _validate
from . import checks
from .codes import bf16_bits, dequant, kernel_view, load_float, store_codes, store_rounded
from .spec import CompileSpec

ELEMS = 4096  # values of x a quantize program holds at a time (BT x BD) when it walks one long block row
ROWS_ELEMS = 1024  # values of x a quantize program holds when it takes several short block rows (BB x BT x BD):
# each block row carries its own offsets and flags in every thread that holds part of it
# launch options: bit-exact arithmetic (no fused multiply-add); for quantize, maxnreg lifts ptxas's habit of
# spilling a few registers to reach the next occupancy step (the compile check refuses any spill)
QUANTIZE_OPTIONS = dict(num_warps=8, maxnreg=255, enable_fp_fusion=False)
CLIP_STEPS = tl.constexpr(11)  # reference.CLIP_STEPS: candidates of the clipped-range search
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite float32

# metadata dtypes as the kernels' META constexpr
META_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
# the pointer type a kernel gets for a tensor of each float dtype (codes.kernel_view: bfloat16 as int16,
# float8 e4m3 as uint8)
POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*i16", torch.float8_e4m3fn: "*u8"}


# --------------------------------------------------------------------------------------------------
# Per-element arithmetic (include/rkv/quant.h)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _next_f32(f, UP: tl.constexpr):
    """nextafterf(f, +inf) (UP) or nextafterf(f, -inf) of non-NaN float32 f, on its bits."""
    b = f.to(tl.int32, bitcast=True)
    if UP:
        toward_zero = b < 0
        from_zero = 1  # the smallest positive subnormal
    else:
        toward_zero = b >= 0
        from_zero = -2147483647  # 0x80000001, the smallest negative subnormal
    nb = tl.where(toward_zero, b - 1, b + 1)
    nb = tl.where((b & 0x7FFFFFFF) == 0, from_zero, nb)
    return nb.to(tl.float32, bitcast=True)


@triton.jit
def _next16(b, UP: tl.constexpr):
    """reference._next16 on the bit pattern b (int32 in [0, 0xFFFF]) of a float16 or bfloat16."""
    if UP:
        toward_zero = (b & 0x8000) != 0
        from_zero = 0x0001
    else:
        toward_zero = (b & 0x8000) == 0
        from_zero = 0x8001
    nb = tl.where(toward_zero, b - 1, b + 1)
    return tl.where((b & 0x7FFF) == 0, from_zero, nb)


@triton.jit
def _f16_value(b):
    """The float32 value of the float16 bit pattern b (int32 in [0, 0xFFFF])."""
    return b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_outward(f, UP: tl.constexpr):
    """float32 f, within [-448, 448], rounded toward +inf (UP) or -inf to a float8 e4m3fn value, on its
    bits: below 2^-6 the grid is the multiples of 2^-9; above, the 3 leading mantissa bits, the rest
    dropped (toward zero) or carried up (away from zero; a carry steps the exponent)."""
    a = tl.abs(f)
    q = a * 512.0
    q_lo = q.to(tl.int32)  # floor: q >= 0
    q_hi = q_lo + (q_lo.to(tl.float32) < q).to(tl.int32)
    u = a.to(tl.int32, bitcast=True)
    kept = u & -1048576  # 0xFFF00000: sign, exponent and 3 mantissa bits
    dropped = u != kept
    small = a < 0.015625
    down = tl.where(small, q_lo.to(tl.float32) * 0.001953125, kept.to(tl.float32, bitcast=True))
    up = tl.where(small, q_hi.to(tl.float32) * 0.001953125,
                  (kept + dropped.to(tl.int32) * 1048576).to(tl.float32, bitcast=True))
    neg = f.to(tl.int32, bitcast=True) < 0  # the sign bit: -0 stays -0, as the cast to float8 keeps it
    if UP:
        return tl.where(neg, -down, up)
    return tl.where(neg, -up, down)


@triton.jit
def round_meta(v, META: tl.constexpr, UP: tl.constexpr):
    """reference.round_meta: finite float64 v rounded toward +inf (UP) or -inf to the metadata dtype
    (META: 0 float32, 1 float16, 2 bfloat16, 3 float8 e4m3fn), as the float32 value, saturated to the
    dtype's finite range."""
    f = v.to(tl.float32)
    if UP:
        adj = f.to(tl.float64) < v
    else:
        adj = f.to(tl.float64) > v
    f = tl.where(adj, _next_f32(f, UP), f)
    if META == 3:
        f = _e4m3_outward(tl.minimum(tl.maximum(f, -448.0), 448.0), UP)
        mx: tl.constexpr = 448.0
    elif META == 1:
        h = f.to(tl.float16)  # round to nearest even
        hf = h.to(tl.float32)
        if UP:
            adj = hf < f
        else:
            adj = hf > f
        nb = _next16(h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF, UP)
        f = tl.where(adj, _f16_value(nb), hf)
        mx: tl.constexpr = 65504.0
    elif META == 2:
        hb = bf16_bits(f).to(tl.int32) & 0xFFFF
        hf = (hb << 16).to(tl.float32, bitcast=True)
        if UP:
            adj = hf < f
        else:
            adj = hf > f
        f = tl.where(adj, (_next16(hb, UP) << 16).to(tl.float32, bitcast=True), hf)
        mx: tl.constexpr = 3.3895313892515355e38
    else:
        mx: tl.constexpr = FLT_MAX
    return tl.minimum(tl.maximum(f, -mx), mx)


@triton.jit
def quant_params(lo, hi, symmetric, BITS: tl.constexpr, META: tl.constexpr):
    """reference.quant_params / make_qparams: (scale, zero) float32 of groups with finite min lo and max hi;
    lo > hi (or NaN) marks an empty group, which gets scale 0 and zero 0. symmetric: runtime flag."""
    empty = ~(lo <= hi)
    # -0 -> +0 (the reductions may meet either zero), and 0 for an empty group
    lo = tl.where(empty | (lo == 0.0), 0.0, lo)
    hi = tl.where(empty | (hi == 0.0), 0.0, hi)
    if symmetric:
        amax = tl.maximum(tl.abs(lo), tl.abs(hi))
        scale = round_meta(amax.to(tl.float64) / ((1 << (BITS - 1)) - 1), META, True)
        zero = tl.zeros_like(scale)
    else:
        zero = round_meta(lo.to(tl.float64), META, False)
        scale = round_meta((hi.to(tl.float64) - zero.to(tl.float64)) / ((1 << BITS) - 1), META, True)
    return tl.where(empty, 0.0, scale), tl.where(empty, 0.0, zero)


@triton.jit
def _rint(y):
    """Round half to even of float32 y, for callers that clamp the result into [-2^22, 2^22]. For |y| < 2^22,
    y + 1.5 * 2^23 lies in (2^23, 2^24), where the float32 values are exactly the integers: the one
    rounding of that addition is y's nearest integer, ties to the even one (1.5 * 2^23 is even), and the
    subtraction is exact. Larger |y| is returned as is; it clamps like its rounding would. NaN-free y."""
    magic = 12582912.0  # 1.5 * 2^23
    return tl.where(tl.abs(y) < 4194304.0, (y + magic) - magic, y)


@triton.jit
def encode(x, scale, zero, levels_ptr, symmetric, has_levels, BITS: tl.constexpr):
    """reference.encode: the codes (int32) of float32 x under float32 scale / zero (broadcast to x); NaN
    encodes as 0 (or the level nearest 0), +-Inf saturate. has_levels: the codes are the count of the
    midpoints of the non-uniform levels at levels_ptr that (x - zero) / scale exceeds. symmetric and
    has_levels are runtime flags."""
    x = tl.where(x != x, 0.0, x)
    pos = scale > 0.0
    safe = tl.where(pos, scale, 1.0)
    if has_levels:
        u = tl.where(pos, tl.div_rn(x - zero, safe), 0.0)
        q = tl.zeros(x.shape, tl.int32)
        for i in range((1 << BITS) - 1):
            mid = (tl.load(levels_ptr + i) + tl.load(levels_ptr + i + 1)) * 0.5
            q += (u > mid).to(tl.int32)
    elif symmetric:
        qm: tl.constexpr = (1 << (BITS - 1)) - 1
        r = tl.where(pos, _rint(tl.div_rn(x, safe)), 0.0)
        q = tl.minimum(tl.maximum(r, -qm), qm).to(tl.int32) + (1 << (BITS - 1))
    else:
        r = tl.where(pos, _rint(tl.div_rn(x - zero, safe)), 0.0)
        q = tl.minimum(tl.maximum(r, 0.0), (1 << BITS) - 1).to(tl.int32)
    return q


# --------------------------------------------------------------------------------------------------
# Group reductions over a block row's channels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _reduce(v, axis: tl.constexpr, OP: tl.constexpr):
    if OP == 0:
        return tl.min(v, axis=axis)
    elif OP == 1:
        return tl.max(v, axis=axis)
    else:
        return tl.sum(v, axis=axis)


# A block row's group values are held on a group axis of NGS entries per block row: BD (G = 1, one group per
# channel), 1 (G = D), BD / G (G another power of two) or NGP, a power of two >= D / G (any other G, whose
# channels are matched to groups through a [NGP, BD] membership mask). Entry i is group i; entries from
# D / G on are padding, never stored.


@triton.jit
def _group_ids(D: tl.constexpr, G: tl.constexpr, NGP: tl.constexpr, BD: tl.constexpr):
    """The group index of each entry of the group axis."""
    if G == 1:
        return tl.arange(0, BD)
    elif G == D:
        return tl.arange(0, 1)
    elif (G & (G - 1)) == 0:
        return tl.arange(0, BD // G)
    else:
        return tl.arange(0, NGP)


@triton.jit
def _membership(G: tl.constexpr, NGP: tl.constexpr, BD: tl.constexpr):
    """[NGP, BD]: whether channel c belongs to group g."""
    return tl.arange(0, NGP)[:, None] == (tl.arange(0, BD) // G)[None, :]


@triton.jit
def _to_groups(v, D: tl.constexpr, G: tl.constexpr, NGP: tl.constexpr, OP: tl.constexpr):
    """v [BB, BT, BD]: values of BT rows of BB block rows (BD a power of two >= D; columns from D on and
    rows past the tile hold OP's neutral value). Returns [BB, NGS]: the min (OP 0), max (1) or sum (2) over
    each group's rows and channels, reduced along the channels first where groups are powers of two."""
    BB: tl.constexpr = v.shape[0]
    BT: tl.constexpr = v.shape[1]
    BD: tl.constexpr = v.shape[2]
    if G == 1:
        return _reduce(v, 1, OP)
    elif G == D:
        return _reduce(_reduce(v, 2, OP), 1, OP)[:, None]
    elif (G & (G - 1)) == 0:
        return _reduce(_reduce(tl.reshape(v, (BB, BT, BD // G, G)), 3, OP), 1, OP)
    else:
        if OP == 0:
            neutral = float("inf")
        elif OP == 1:
            neutral = float("-inf")
        else:
            neutral = 0.0
        per_channel = _reduce(v, 1, OP)
        return _reduce(tl.where(_membership(G, NGP, BD)[None, :, :], per_channel[:, None, :], neutral), 2, OP)


@triton.jit
def _to_channels(v, D: tl.constexpr, G: tl.constexpr, NGP: tl.constexpr, BD: tl.constexpr):
    """v [BB, NGS] group values -> [BB, 1, BD] or [BB, 1, 1]: each channel's group's value, broadcastable
    against a [BB, BT, BD] tile."""
    BB: tl.constexpr = v.shape[0]
    if G == 1:
        return v[:, None, :]
    elif G == D:
        return v[:, :, None]
    elif (G & (G - 1)) == 0:
        return tl.reshape(tl.broadcast_to(v[:, :, None], (BB, BD // G, G)), (BB, BD))[:, None, :]
    else:
        # each channel belongs to one group: the sum picks its value (v + 0 = v)
        return tl.sum(tl.where(_membership(G, NGP, BD)[None, :, :], v[:, :, None], 0.0), axis=1)[:, None, :]


# --------------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tile(x_ptr, ex_ptr, x_row0, e_row0, live, first_counted, k, T, sx_r, sx_d, se_r, se_d, has_excluded,
          D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Rows k .. k+BT-1 of the program's block rows: x [BB, BT, BD] float32 (0 outside), the mask of
    values inside the tensor, and the mask of values that set ranges and clip errors (finite, not a sink
    row, not excluded). x_row0 / e_row0 [BB]: offsets of each block row's first row."""
    r = k + tl.arange(0, BT)
    c = tl.arange(0, BD)
    inside = live[:, None, None] & (r < T)[None, :, None] & (c < D)[None, None, :]
    r64 = r.to(tl.int64)[None, :, None]
    c64 = c.to(tl.int64)[None, None, :]
    x = load_float(x_ptr + x_row0[:, None, None] + r64 * sx_r + c64 * sx_d, inside, 0.0)
    counted = inside & (tl.abs(x) <= FLT_MAX) & (r[None, :, None] >= first_counted[:, None, None])
    if has_excluded:
        ex = tl.load(ex_ptr + e_row0[:, None, None] + r64 * se_r + c64 * se_d, mask=inside, other=0)
        counted = counted & (ex == 0)
    return x, inside, counted


@triton.jit
def _clip_error(x_ptr, ex_ptr, levels_ptr, x_row0, e_row0, live, first_counted, scale, zero, T, sx_r, sx_d,
                se_r, se_d, has_excluded, has_levels, BITS: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                NGP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Per group [BB, NGS]: the float64 sum of (x_hat - x)^2 over its counted values, under the asymmetric
    group parameters scale / zero [BB, NGS] (reference._tile_error; include/rkv/quant.h clip_error)."""
    s = _to_channels(scale, D, G, NGP, BD)
    z = _to_channels(zero, D, G, NGP, BD)
    acc = tl.zeros(scale.shape, tl.float64)
    for k in range(0, T, BT):
        x, inside, counted = _tile(x_ptr, ex_ptr, x_row0, e_row0, live, first_counted, k, T, sx_r, sx_d, se_r,
                                   se_d, has_excluded, D, BT, BD)
        q = encode(x, s, z, levels_ptr, 0, has_levels, BITS)
        if has_levels:
            xh = dequant(q, s, z, levels_ptr, BITS, False, True)
        else:
            xh = dequant(q, s, z, levels_ptr, BITS, False, False)
        e = (xh - x).to(tl.float64)
        acc += _to_groups(tl.where(counted, e * e, 0.0), D, G, NGP, 2)
    return acc


@triton.jit
def _quantize_kernel(x_ptr, ex_ptr, sinks_ptr, levels_ptr, active_ptr, packed_ptr, scale_ptr, zero_ptr,
                     n_blocks, blocks_per_slab, T, sx_n, sx_r, sx_d, se_n, se_r, se_d,
                     sink_rows, sinks_per_slab, symmetric, has_levels, has_excluded, has_active,
                     unclip_ptr, unclip_heads, n_unclip,
                     BITS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, NGP: tl.constexpr, META: tl.constexpr,
                     CLIP: tl.constexpr, BB: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    NG: tl.constexpr = D // G
    RB: tl.constexpr = D * BITS // 8
    gb = tl.program_id(0) * BB + tl.arange(0, BB)  # global block rows: slab * blocks_per_slab + block
    live = gb < n_blocks
    slab = (gb // blocks_per_slab).to(tl.int64)
    if has_active:  # slabs marked inactive are neither read nor written
        live = live & (tl.load(active_ptr + slab, mask=live, other=0) != 0)
        if tl.sum(live.to(tl.int32), axis=0) == 0:
            return
    first = (gb % blocks_per_slab) * T  # each block row's first row within its slab
    x_row0 = slab * sx_n + first.to(tl.int64) * sx_r
    e_row0 = slab * se_n + first.to(tl.int64) * se_r
    # sink rows (reference.quantize's sink_rows, per slab): a block row's leading sinks set no range
    # unless the whole block row is sinks
    if sinks_per_slab:
        sinks = tl.load(sinks_ptr + slab, mask=live, other=0)
    else:
        sinks = tl.zeros([BB], tl.int32) + sink_rows
    in_block = tl.minimum(tl.maximum(sinks - first, 0), T)
    first_counted = tl.where(in_block < T, in_block, 0)

    # 1. each group's finite min and max over its counted values
    gid = _group_ids(D, G, NGP, BD)
    lo = tl.full([BB, gid.shape[0]], float("inf"), tl.float32)
    hi = tl.full([BB, gid.shape[0]], float("-inf"), tl.float32)
    for k in range(0, T, BT):
        x, inside, counted = _tile(x_ptr, ex_ptr, x_row0, e_row0, live, first_counted, k, T, sx_r, sx_d, se_r,
                                   se_d, has_excluded, D, BT, BD)
        lo = tl.minimum(lo, _to_groups(tl.where(counted, x, float("inf")), D, G, NGP, 0))
        hi = tl.maximum(hi, _to_groups(tl.where(counted, x, float("-inf")), D, G, NGP, 1))

    # 2. group parameters [BB, NGS]
    scale, zero = quant_params(lo, hi, symmetric, BITS, META)
    if CLIP:
        full_scale = scale
        full_zero = zero
        # candidate j = 1..10: [lo + j*step, hi - j*step]; strictly less error wins, so ties keep the
        # smaller j; no candidate beyond j = 0 where the step is not finite (an empty group included)
        step = (hi - lo) * 0.025
        searchable = tl.abs(step) <= FLT_MAX
        best = _clip_error(x_ptr, ex_ptr, levels_ptr, x_row0, e_row0, live, first_counted, scale, zero, T, sx_r,
                           sx_d, se_r, se_d, has_excluded, has_levels, BITS, D, G, NGP, BT, BD)
        for j in range(1, CLIP_STEPS):
            cut = step * j
            s_j, z_j = quant_params(lo + cut, hi - cut, 0, BITS, META)
            err = _clip_error(x_ptr, ex_ptr, levels_ptr, x_row0, e_row0, live, first_counted, s_j, z_j, T, sx_r,
                              sx_d, se_r, se_d, has_excluded, has_levels, BITS, D, G, NGP, BT, BD)
            better = searchable & (err < best)
            scale = tl.where(better, s_j, scale)
            zero = tl.where(better, z_j, zero)
            best = tl.where(better, err, best)
        if n_unclip > 0:  # groups that keep their full range: the slab's head's refined key channels
            hits = tl.zeros([BB, gid.shape[0]], tl.int32)
            for u in range(n_unclip):
                c = tl.load(unclip_ptr + (slab % unclip_heads) * n_unclip + u, mask=live, other=-1)
                hits += (gid[None, :] == c[:, None]).to(tl.int32)
            scale = tl.where(hits != 0, full_scale, scale)
            zero = tl.where(hits != 0, full_zero, zero)
    leader = live[:, None] & (gid < NG)[None, :]
    meta = gb.to(tl.int64)[:, None] * NG + gid[None, :]
    # the values are exact in the metadata dtype, so rounding them changes nothing
    store_rounded(scale_ptr + meta, scale, leader)
    if symmetric == 0:
        store_rounded(zero_ptr + meta, zero, leader)

    # 3. codes, a chunk of rows at a time, packed into their rows
    s = _to_channels(scale, D, G, NGP, BD)
    z = _to_channels(zero, D, G, NGP, BD)
    t = tl.arange(0, BT)
    for k in range(0, T, BT):
        x, inside, counted = _tile(x_ptr, ex_ptr, x_row0, e_row0, live, first_counted, k, T, sx_r, sx_d, se_r,
                                   se_d, has_excluded, D, BT, BD)
        q = encode(x, s, z, levels_ptr, symmetric, has_levels, BITS)
        row = gb.to(tl.int64)[:, None] * T + (k + t)[None, :]  # packed rows are contiguous
        row_ok = live[:, None] & (k + t < T)[None, :]
        store_codes(packed_ptr + tl.reshape(row, (BB * BT,))[:, None] * RB, tl.reshape(q, (BB * BT, BD)), D,
                    tl.reshape(row_ok, (BB * BT,))[:, None], BITS)


_DUMMIES: dict = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor standing for an absent optional argument (the kernel never reads it)."""
    key = (device, dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(1, dtype=dtype, device=device)
    return _DUMMIES[key]


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _group_shape(d: int, g: int) -> int:
    """NGP: the padded group count the membership-mask reduction needs (1 where another path serves)."""
    if g == 1 or g == d or (g & (g - 1)) == 0:
        return 1
    return _pow2(d // g)


def quantize_tiles(d: int, g: int, t: int, n_blocks: int):
    """(BB, BT, BD, NGP): block rows per program, rows per chunk, padded channels, padded groups."""
    bd, ngp = _pow2(d), _group_shape(d, g)
    bt = min(_pow2(t), max(1, ELEMS // bd))
    bb = 1
    if bt >= t:  # whole block rows fit: take several
        bb = max(1, min(_pow2(n_blocks), ROWS_ELEMS // (bt * bd), ROWS_ELEMS // (ngp * bd)))
    return bb, bt, bd, ngp


def quantize_slabs(x: torch.Tensor, bits: int, group_size: int, block_tokens: int, symmetric: bool,
                   meta_dtype: torch.dtype, clip: bool = False, sink_rows=None, levels=None, excluded=None,
                   active=None, unclipped=None):
    """Quantizes N slabs at once, each exactly as reference.quantize quantizes one (R, D) slice.

    x: (N, R, D) float32 / float16 / bfloat16 on any strides; block_tokens divides R, group_size divides D,
    D * bits is a multiple of 8.
    sink_rows: None, a Python int (every slab), or an int32 tensor (N,) on x's device: rows [0, sink_rows[i])
    of slab i are sinks (reference.quantize's sink_rows).
    levels: None or the non-uniform levels (2^bits,) float32 on x's device (asymmetric, 2-4 bits).
    excluded: None or a bool tensor (N, R, D) on x's device, any strides: values left out of every range and
    clip error (reference.quantize's excluded), still encoded.
    active: None (every slab) or an integer tensor (N,) on x's device: slabs whose entry is 0 are skipped,
    their outputs left unwritten (the cache append's staging slots that hold no block).
    unclipped: None or an int32 tensor (H, m) on x's device: the groups of slab i's head i % H that keep their
    full range under clip, m of them (refined key channels, one channel a group; reference.quantize's
    unclipped, as a mask).
    Returns (packed (N, R, D*bits/8) uint8, scale (N, R/T, D/G) meta_dtype, zero of scale's shape or None when
    symmetric), all contiguous. Checks nothing: callers validate (the op launcher below does).
    """
    n, r, d = x.shape
    t, g = block_tokens, group_size
    nb = r // t
    dev = x.device
    packed = torch.empty(n, r, d * bits // 8, dtype=torch.uint8, device=dev)
    scale = torch.empty(n, nb, d // g, dtype=meta_dtype, device=dev)
    zero = None if symmetric else torch.empty_like(scale)
    n_blocks = n * nb
    if n_blocks == 0 or d == 0:
        return packed, scale, zero
    if isinstance(sink_rows, torch.Tensor):
        sinks, sink_const, per_slab = sink_rows.to(torch.int32).contiguous(), 0, 1
    else:
        sinks, sink_const, per_slab = _dummy(dev, torch.int32), min(int(sink_rows or 0), r), 0
    ex = excluded.view(torch.uint8) if excluded is not None else _dummy(dev, torch.uint8)
    ex_strides = excluded.stride() if excluded is not None else (0, 0, 0)
    lv = levels.contiguous() if levels is not None else _dummy(dev, torch.float32)
    act = active.contiguous() if active is not None else _dummy(dev, torch.int32)
    unclip = unclipped.contiguous() if unclipped is not None else _dummy(dev, torch.int32)
    bb, bt, bd, ngp = quantize_tiles(d, g, t, n_blocks)
    _quantize_kernel[(triton.cdiv(n_blocks, bb),)](
        kernel_view(x), ex, sinks, lv, act, packed, kernel_view(scale),
        kernel_view(scale if zero is None else zero), n_blocks, nb, t, *x.stride(), *ex_strides,
        sink_const, per_slab, int(symmetric), int(levels is not None), int(excluded is not None),
        int(active is not None), unclip, unclip.shape[0] if unclipped is not None else 1,
        unclip.shape[1] if unclipped is not None else 0,
        BITS=bits, D=d, G=g, NGP=ngp, META=META_CODE[meta_dtype], CLIP=bool(clip), BB=bb, BT=bt, BD=bd,
        **QUANTIZE_OPTIONS)
    return packed, scale, zero


def quantize(x: torch.Tensor, bits: int, group_size: int, block_tokens: int, symmetric: bool,
             meta_dtype: torch.dtype, clip: bool = False, sink_rows: int = 0, levels=None):
    _validate.quantize(x, bits, group_size, block_tokens, meta_dtype, symmetric, clip, sink_rows)
    _validate.levels("quantize", "levels", x, levels, bits, symmetric)
    checks.levels("quantize", "levels", levels, bits)
    *lead, n, d = x.shape
    packed, scale, zero = quantize_slabs(x.reshape(math.prod(lead), n, d), bits, group_size, block_tokens,
                                         symmetric, meta_dtype, clip, sink_rows, levels, None)
    packed = packed.reshape(*lead, n, d * bits // 8)
    scale = scale.reshape(*lead, n // block_tokens, d // group_size)
    zero = torch.empty(0, dtype=meta_dtype, device=x.device) if zero is None else zero.reshape(scale.shape)
    return packed, scale, zero


# --------------------------------------------------------------------------------------------------
KERNELS = {"quantize": quantize}


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile configurations
# --------------------------------------------------------------------------------------------------


def _quantize_spec(bits, d, g, t, x_dtype, meta_dtype, clip=False, n_blocks=1024):
    bb, bt, bd, ngp = quantize_tiles(d, g, t, n_blocks)
    m = POINTER[meta_dtype]
    sig = {"x_ptr": POINTER[x_dtype], "ex_ptr": "*u8", "sinks_ptr": "*i32", "levels_ptr": "*fp32",
           "active_ptr": "*i32", "packed_ptr": "*u8", "scale_ptr": m, "zero_ptr": m,
           "n_blocks": "i32", "blocks_per_slab": "i32", "T": "i32",
           "sx_n": "i64", "sx_r": "i64", "sx_d": "i64", "se_n": "i64", "se_r": "i64", "se_d": "i64",
           "sink_rows": "i32", "sinks_per_slab": "i32", "symmetric": "i32", "has_levels": "i32",
           "has_excluded": "i32", "has_active": "i32", "unclip_ptr": "*i32", "unclip_heads": "i32",
           "n_unclip": "i32"}
    # unit strides as Triton's launcher specializes them: constants
    const = dict(sx_d=1, BITS=bits, D=d, G=g, NGP=ngp, META=META_CODE[meta_dtype], CLIP=clip, BB=bb, BT=bt, BD=bd)
    sig.update({k: "constexpr" for k in const})
    label = f"quantize bits={bits} D={d} G={g} T={t} x={x_dtype} meta={meta_dtype} clip={clip}"
    return CompileSpec(label, _quantize_kernel, sig, const, dict(QUANTIZE_OPTIONS))


def compile_specs(full: bool) -> list[CompileSpec]:
    """One configuration (full=False), or every bit width x head_dim x group layout (per-token, grouped by
    32, per-channel over 128-token blocks) x float16 / bfloat16 input x clip, and float32 input and each
    metadata dtype at one layout (full=True). The other flags of _quantize_kernel (symmetric, levels, sinks,
    excluded) are runtime arguments; clip is a constant because its search doubles the registers the
    kernel needs."""
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    if not full:
        return [_quantize_spec(4, 128, 1, 128, f16, f16)]
    specs = []
    for bits in (2, 3, 4, 8):
        for d in (64, 128, 256, 512):
            for g, t in ((d, 1), (32, 1), (1, 128)):
                for xd in (f16, bf16):
                    for clip in (False, True):
                        specs.append(_quantize_spec(bits, d, g, t, xd, f16, clip))
    specs.append(_quantize_spec(4, 128, 1, 128, f32, f16))
    for meta in (f32, bf16, torch.float8_e4m3fn):
        specs.append(_quantize_spec(4, 128, 1, 128, f16, meta))
    return specs
