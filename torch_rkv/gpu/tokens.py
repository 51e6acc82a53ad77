"""Device helpers of the attention kernels: where each cached token lives, and a tile of tokens of one
side (keys or values) loaded as float32 from wherever each token is (reference.gather_tokens).

A sequence of n cached tokens reads token t from its sink row t (t < S), its quantized row (S <= t < Q,
Q = block * floor(max(0, n - recent) / block)) or its window ring row t % W (max(S, Q) <= t < n). The
quantized row is row t % P of page block_tables[b][t // P]; without block tables it is page b, and with a
sliding window there (a contiguous ring) always page b, row t % P.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import dequant, load_codes, load_float
from .refine import add_refined


@triton.jit
def quantized_count(n, recent, block):
    """Q(n): tokens before it (sinks excepted) are read from their quantized rows."""
    return block * (tl.maximum(n - recent, 0) // block)


@triton.jit
def token_pages(t, in_quant, b, bt_ptr, bt_stride, page_size, PAGED: tl.constexpr):
    """The page of each quantized token t (int64); other lanes get 0."""
    if PAGED:
        page = tl.load(bt_ptr + b * bt_stride + t // page_size, mask=in_quant, other=0)
    else:
        page = tl.zeros_like(t) + b
    return page.to(tl.int64)


@triton.jit
def load_side(t, d, in_sink, in_quant, in_win, page, row, h, slot,
              codes_ptr, c_s0, c_s1, c_s2, row_bytes,
              scale_ptr, zero_ptr, m_s0, m_s1, m_s2, tile_t, group,
              levels_ptr, out_ptr, o_s0, o_s1, o_s2, block, n_out,
              rf_ptr, rf_s0, rf_s1, rf_s2, ch_ptr, n_refine,
              sink_ptr, s_s0, s_s1, s_s2, win_ptr, w_s0, w_s1, w_s2, win_rows,
              dim, BITS: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_LEVELS: tl.constexpr,
              HAS_OUTLIERS: tl.constexpr, REFINE: tl.constexpr):
    """Tokens t [N] at channels d [D] of one side of kv head h, float32 [N, D]: the sink rows, the
    dequantized rows (page [N], row [N] within it; metadata row row // tile_t, group d // group; plus
    each block's sparse outliers, n_out entries per block row; plus with REFINE > 0 the refined key
    channels' residuals, refine.add_refined) and the window ring rows, by the masks in_sink / in_quant /
    in_win [N]. Lanes in none of them, or past dim, are 0."""
    dm = d < dim
    qm = in_quant[:, None] & dm[None, :]
    c = load_codes(codes_ptr + page[:, None] * c_s0 + h * c_s1 + row[:, None] * c_s2, d[None, :], row_bytes, qm, BITS)
    meta = page[:, None] * m_s0 + h * m_s1 + (row // tile_t)[:, None] * m_s2 + (d // group)[None, :]
    sc = load_float(scale_ptr + meta, qm, 0.0)
    if SYMMETRIC:
        zr = sc
    else:
        zr = load_float(zero_ptr + meta, qm, 0.0)
    x = dequant(c, sc, zr, levels_ptr, BITS, SYMMETRIC, HAS_LEVELS)
    if HAS_OUTLIERS:
        # each entry is position << 16 | the float16 bits of its residual, position = row_in_block * dim + d
        e_base = out_ptr + page * o_s0 + h * o_s1 + (row // block) * o_s2
        r_in = row % block
        for k in range(n_out):
            e = tl.load(e_base + k, mask=in_quant, other=-65536)
            pos = (e >> 16) & 0xFFFF
            res = (e & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hit = ((pos < block * dim) & (pos // dim == r_in))[:, None] & ((pos % dim)[:, None] == d[None, :])
            x += tl.where(hit, res[:, None], 0.0)
    if REFINE > 0:
        x = add_refined(x, d, in_quant, page, row, h, scale_ptr, m_s0, m_s1, m_s2, tile_t,
                        rf_ptr, rf_s0, rf_s1, rf_s2, ch_ptr, n_refine, REFINE)
    x = tl.where(qm, x, 0.0)
    sm = in_sink[:, None] & dm[None, :]
    xs = tl.load(sink_ptr + slot * s_s0 + h * s_s1 + t[:, None] * s_s2 + d[None, :], mask=sm, other=0).to(tl.float32)
    wm = in_win[:, None] & dm[None, :]
    xw = tl.load(win_ptr + slot * w_s0 + h * w_s1 + (t % tl.maximum(win_rows, 1))[:, None] * w_s2 + d[None, :], mask=wm,
                 other=0).to(tl.float32)
    return tl.where(sm, xs, tl.where(wm, xw, x))


@triton.jit
def rope_partner(d, half, INTERLEAVED: tl.constexpr):
    """Each channel d's pair partner, its table column and the sign of the partner's term in the rotation
    y[d] = x[d] * cos + x[partner] * sin * sign (sign -1 on a pair's first member). Channels past the
    rotary dims pair with themselves with sign 0."""
    rotated = d < 2 * half
    if INTERLEAVED:
        partner = d ^ 1
        col = d // 2
        first = (d % 2) == 0
    else:
        first = d < half
        partner = tl.where(first, d + half, d - half)
        col = tl.where(first, d, d - half)
    partner = tl.where(rotated, partner, d)
    col = tl.where(rotated, col, -1)
    sign = tl.where(rotated, tl.where(first, -1.0, 1.0), 0.0)
    return partner, col, sign


@triton.jit
def rope_rows(pos, col, valid, cos_ptr, sin_ptr, half):
    """cos and sin [N, D] of positions pos [N] at table columns col [D] (tables (P, half) float32); a
    channel without a pair (col -1) gets cos 1, sin 0."""
    m = valid[:, None] & (col >= 0)[None, :]
    off = pos[:, None] * half + col[None, :]
    c = tl.load(cos_ptr + off, mask=m, other=1.0)
    s = tl.load(sin_ptr + off, mask=m, other=0.0)
    return c, s


@triton.jit(debug=True)
def check_cache_kernel(lengths_ptr, qsl_ptr, bt_ptr, bt_stride, slots_ptr, max_tokens, page_size, pages, slots,
                       rope_positions, HAS_NEW: tl.constexpr, PAGED: tl.constexpr, HAS_SLOTS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Program b: sequence b's tokens (its cached ones, plus its new ones with HAS_NEW) within its table and
    the rope table (rope_positions 0: none), its side slot and its pages within the pools, as device-side
    asserts (this kernel is compiled with debug=True; the attention and append kernels are not, so they
    stay fast). checks.cache_data makes the same checks on the host for CPU tensors."""
    b = tl.program_id(0)
    total = tl.load(lengths_ptr + b).to(tl.int64)
    if HAS_NEW:
        total += (tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b)).to(tl.int64)
    tl.device_assert((total >= 0) & (total <= max_tokens), "rkv: a sequence's tokens exceed what its table holds")
    tl.device_assert((rope_positions == 0) | (total <= rope_positions), "rkv: positions past the rope table")
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + b)
        tl.device_assert((slot >= 0) & (slot < slots), "rkv: side_slots names a slot outside the pool")
    if PAGED:
        for j0 in range(0, tl.cdiv(total, page_size), BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m = j < tl.cdiv(total, page_size)
            page = tl.load(bt_ptr + b * bt_stride + j, mask=m, other=0)
            tl.device_assert((page >= 0) & (page < pages), "rkv: a block table names a page outside the pool")
