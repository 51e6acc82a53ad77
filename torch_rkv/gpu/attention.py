"""decode_attention and paged_decode_attention on the GPU: a split-K decode (FlashDecoding) over the
quantized cache (semantics: reference.paged_decode_attention; the contiguous layout is its one-page case).

Stage 1 runs one program per (sequence, kv head, split). Each loads tiles of BLOCK_N tokens of its split,
wherever each token lives (tokens.load_side: sink rows, packed rows dequantized in registers, the window
ring), rotates pre-RoPE keys at their positions, and scores every query head of the GQA group against the
tile (a [G, N, D] product reduced in registers: a group is a few heads, too few rows for tensor cores). It keeps a running max, sum and weighted value sum per head (online softmax) and
writes them per split. Stage 2 merges the splits of each (sequence, query head) exactly, with the learned
sink logit as one more term of the softmax's sum.

The split length is decided on the device from each sequence's length (num_splits programs share its
tokens), so no launch reads a length back to the host, and a CUDA graph can capture both stages.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..ops import attention as attention_op
from ..ops import paged as paged_op
from . import checks
from .codes import kernel_view
from .spec import CompileSpec
from .tokens import check_cache_kernel, load_side, quantized_count, rope_partner, rope_rows, token_pages


@triton.jit
def _tanh(x):
    """tanh in plain tl (libdevice is not available to the interpreter): odd, via exp of -2|x|."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def score_tile(qg, qp, k, c, s, ROPE: tl.constexpr):
    """Scores [R, N] of query rows qg [R, D] against keys k [N, D], as a [R, N, D] product reduced in
    registers (R is a GQA group's few heads, or a few tokens of them: too few rows for tensor cores to pay
    for the shared memory they need in float32). Pre-RoPE keys (ROPE): q . rope(k) = (k * cos) . q +
    (k * sin) . qp, with qp the query's pair-swapped, signed copy, so the key tile is loaded once and never
    permuted (c, s: the tokens' cos / sin [N, D])."""
    if ROPE:
        return tl.sum(qg[:, None, :] * (k * c)[None, :, :] + qp[:, None, :] * (k * s)[None, :, :], axis=2)
    return tl.sum(qg[:, None, :] * k[None, :, :], axis=2)


@triton.jit
def softmax_step(scores, sees, v, acc, m_i, l_i, softcap):
    """The online-softmax state (acc [R, D], running max m_i and sum l_i [R]) after a tile of scores [R, N]
    (soft-capped when softcap > 0) of which sees [R, N] are visible, with the tile's values v [N, D]."""
    if softcap > 0:
        scores = softcap * _tanh(scores / softcap)
    scores = tl.where(sees, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # a row that has seen nothing yet keeps m = -inf; its factors are taken as 0 rather than NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return acc * alpha[:, None] + pv, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def attend_tile(qg, qp, col, t, visible, sees, n, b, h, slot, d,
                acc, m_i, l_i,
                bt_ptr, bt_stride, page_size, n_sinks, q_end,
                kc_ptr, kc_s0, kc_s1, kc_s2, k_row_bytes, ks_ptr, kz_ptr, km_s0, km_s1, km_s2, k_tile, k_group,
                k_lv_ptr, ko_ptr, ko_s0, ko_s1, ko_s2, k_nout, krf_ptr, krf_s0, krf_s1, krf_s2, kch_ptr, k_nref,
                vc_ptr, vc_s0, vc_s1, vc_s2, v_row_bytes, vs_ptr, vz_ptr, vm_s0, vm_s1, vm_s2, v_tile, v_group,
                v_lv_ptr, vo_ptr, vo_s0, vo_s1, vo_s2, v_nout,
                ksink_ptr, ksk_s0, ksk_s1, ksk_s2, vsink_ptr, vsk_s0, vsk_s1, vsk_s2,
                kwin_ptr, kw_s0, kw_s1, kw_s2, vwin_ptr, vw_s0, vw_s1, vw_s2, win_rows,
                cos_ptr, sin_ptr, half, block, softcap, dim,
                K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr,
                K_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
                K_REFINE: tl.constexpr, PAGED: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """One tile of cached tokens t [N] of a sequence of n tokens (q_end: its quantized count Q(n)) for the
    query rows qg [R, D] (scaled; with pre-RoPE keys also qp, see score_tile, and each channel's table
    column col [D]): the online-softmax state (acc [R, D], m_i, l_i [R]) after it. visible [N]: the tokens
    any row sees (the ones loaded); sees [R, N]: which row sees which."""
    in_sink = visible & (t < n_sinks)
    in_quant = visible & (t >= n_sinks) & (t < q_end)
    in_win = visible & (t >= n_sinks) & (t >= q_end)
    # without block tables a sequence's one page holds its rows, as a ring under a sliding window
    page = token_pages(t, in_quant, b, bt_ptr, bt_stride, page_size, PAGED)
    row = (t % page_size).to(tl.int64)
    k = load_side(t, d, in_sink, in_quant, in_win, page, row, h, slot,
                  kc_ptr, kc_s0, kc_s1, kc_s2, k_row_bytes, ks_ptr, kz_ptr, km_s0, km_s1, km_s2, k_tile, k_group,
                  k_lv_ptr, ko_ptr, ko_s0, ko_s1, ko_s2, block, k_nout,
                  krf_ptr, krf_s0, krf_s1, krf_s2, kch_ptr, k_nref,
                  ksink_ptr, ksk_s0, ksk_s1, ksk_s2, kwin_ptr, kw_s0, kw_s1, kw_s2, win_rows,
                  dim, K_BITS, K_SYM, K_LEVELS, K_OUT, K_REFINE)
    c = k
    s = k
    if ROPE:
        c, s = rope_rows(t, col, visible, cos_ptr, sin_ptr, half)
    scores = score_tile(qg, qp, k, c, s, ROPE)
    v = load_side(t, d, in_sink, in_quant, in_win, page, row, h, slot,
                  vc_ptr, vc_s0, vc_s1, vc_s2, v_row_bytes, vs_ptr, vz_ptr, vm_s0, vm_s1, vm_s2, v_tile, v_group,
                  v_lv_ptr, vo_ptr, vo_s0, vo_s1, vo_s2, block, v_nout,
                  krf_ptr, krf_s0, krf_s1, krf_s2, kch_ptr, 0,
                  vsink_ptr, vsk_s0, vsk_s1, vsk_s2, vwin_ptr, vw_s0, vw_s1, vw_s2, win_rows,
                  dim, V_BITS, V_SYM, V_LEVELS, V_OUT, 0)
    return softmax_step(scores, sees, v, acc, m_i, l_i, softcap)


@triton.jit
def _decode_split_kernel(
        q_ptr, part_ptr, ml_ptr, lengths_ptr, bt_ptr, bt_stride, slots_ptr,
        kc_ptr, kc_s0, kc_s1, kc_s2, k_row_bytes, ks_ptr, kz_ptr, km_s0, km_s1, km_s2, k_tile, k_group,
        k_lv_ptr, ko_ptr, ko_s0, ko_s1, ko_s2, k_nout, krf_ptr, krf_s0, krf_s1, krf_s2, kch_ptr, k_nref,
        vc_ptr, vc_s0, vc_s1, vc_s2, v_row_bytes, vs_ptr, vz_ptr, vm_s0, vm_s1, vm_s2, v_tile, v_group,
        v_lv_ptr, vo_ptr, vo_s0, vo_s1, vo_s2, v_nout,
        ksink_ptr, ksk_s0, ksk_s1, ksk_s2, vsink_ptr, vsk_s0, vsk_s1, vsk_s2,
        kwin_ptr, kw_s0, kw_s1, kw_s2, vwin_ptr, vw_s0, vw_s1, vw_s2, win_rows,
        cos_ptr, sin_ptr, half,
        kv_heads, group_heads, n_sinks, page_size, block, recent, sliding_window, softcap, dim,
        num_splits, split_tokens,
        K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr,
        K_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
        K_REFINE: tl.constexpr, PAGED: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
        HAS_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, kv head h, split): the online-softmax state of query heads h*G..h*G+G-1 over the
    split's tokens, written to part (B, Hq, splits, D) and ml (B, Hq, splits, 2) (running max, sum)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(lengths_ptr + b).to(tl.int32)
    first = tl.where((sliding_window > 0) & (sliding_window < n), n - sliding_window, 0)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + b).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    # the split's tokens: a fixed split_tokens, or the sequence's visible tokens shared by num_splits
    # programs in whole tiles
    if split_tokens > 0:
        per_split = split_tokens
    else:
        per_split = tl.cdiv(tl.cdiv(n - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, n)
    q_end = quantized_count(n, recent, block)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < group_heads
    heads = h * group_heads + g
    q_off = (b * kv_heads * group_heads + heads)[:, None] * dim + d[None, :]
    qm = gm[:, None] & (d < dim)[None, :]
    qg = tl.load(q_ptr + q_off, mask=qm, other=0.0)
    if ROPE:
        partner, col, sign = rope_partner(d, half, INTERLEAVED)
        qp = tl.load(q_ptr + q_off - d[None, :] + partner[None, :], mask=qm, other=0.0) * (-sign)[None, :]
    else:
        col = d
        qp = qg

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        visible = t < hi
        acc, m_i, l_i = attend_tile(
            qg, qp, col, t, visible, visible[None, :], n, b, h, slot, d, acc, m_i, l_i,
            bt_ptr, bt_stride, page_size, n_sinks, q_end,
            kc_ptr, kc_s0, kc_s1, kc_s2, k_row_bytes, ks_ptr, kz_ptr, km_s0, km_s1, km_s2, k_tile, k_group,
            k_lv_ptr, ko_ptr, ko_s0, ko_s1, ko_s2, k_nout, krf_ptr, krf_s0, krf_s1, krf_s2, kch_ptr, k_nref,
            vc_ptr, vc_s0, vc_s1, vc_s2, v_row_bytes, vs_ptr, vz_ptr, vm_s0, vm_s1, vm_s2, v_tile, v_group,
            v_lv_ptr, vo_ptr, vo_s0, vo_s1, vo_s2, v_nout,
            ksink_ptr, ksk_s0, ksk_s1, ksk_s2, vsink_ptr, vsk_s0, vsk_s1, vsk_s2,
            kwin_ptr, kw_s0, kw_s1, kw_s2, vwin_ptr, vw_s0, vw_s1, vw_s2, win_rows,
            cos_ptr, sin_ptr, half, block, softcap, dim,
            K_BITS, V_BITS, K_SYM, V_SYM, K_LEVELS, V_LEVELS, K_OUT, V_OUT, K_REFINE, PAGED, ROPE, INTERLEAVED)

    row = (b * kv_heads * group_heads + heads) * num_splits + split
    tl.store(part_ptr + row[:, None] * dim + d[None, :], acc, mask=gm[:, None] & (d < dim)[None, :])
    tl.store(ml_ptr + row * 2, m_i, mask=gm)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=gm)


@triton.jit
def _merge_kernel(part_ptr, ml_ptr, sinks_ptr, out_ptr, q_heads, num_splits, dim,
                  HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, query head): the softmax-weighted output from the splits' states; a learned sink logit
    joins the sum with no value; a query that saw no token (and no sink) gets zeros."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = s < num_splits
    row = (b * q_heads + hq) * num_splits + s
    m = tl.load(ml_ptr + row * 2, mask=sm, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=sm, other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + hq).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(sm & (m > float("-inf")), tl.exp(m - m_safe), 0.0)
    total = tl.sum(l * w, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    acc = tl.load(part_ptr + row[:, None] * dim + d[None, :], mask=sm[:, None] & (d < dim)[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0)
    o = tl.where(total > 0, o / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + (b * q_heads + hq) * dim + d, o, mask=d < dim)


def block_n(dim: int, group: int) -> int:
    """Tokens per tile: the score and value products are [G, N, D] in registers (8192 floats, 32 a thread
    at 8 warps), so N shrinks as the rows (a GQA group) and the head grow, within 2 and 64."""
    return max(2, min(64, 8192 // (triton.next_power_of_2(dim) * triton.next_power_of_2(group))))


def num_splits(capacity: int, batch: int, kv_heads: int, split_tokens: int, tile: int) -> int:
    """Splits per (sequence, kv head): split_tokens > 0 fixes each split's tokens, so enough splits to
    cover the longest sequence the cache can hold; 0 lets each sequence share its tokens among a count
    that gives the device about 256 programs, at most one per tile of the capacity."""
    if split_tokens > 0:
        return max(1, -(-capacity // split_tokens))
    want = max(1, 256 // max(1, batch * kv_heads))
    return max(1, min(want, -(-capacity // tile), 64))


def _side(codes, scale, zero, levels, outliers, dim, bits):
    """The launch arguments of one side's packed rows."""
    t = codes.shape[2] // max(scale.shape[2], 1)
    g = dim // scale.shape[3]
    o = outliers
    scale, zero = kernel_view(scale), None if zero is None else kernel_view(zero)
    return ([codes, codes.stride(0), codes.stride(1), codes.stride(2), codes.shape[3], scale,
             scale if zero is None else zero, scale.stride(0), scale.stride(1), scale.stride(2), t, g,
             levels if levels is not None else scale,
             o if o is not None else codes, *(o.stride()[:3] if o is not None else (0, 0, 0)),
             o.shape[3] if o is not None else 0],
            dict(SYM=zero is None, LEVELS=levels is not None, OUT=o is not None, BITS=bits))


def refine_args(k_codes, k_refine, k_channels):
    """The launch arguments of the keys' refined channels (dummies and 0 without), and their width (0: none)."""
    if k_refine is None:
        return [k_codes, 0, 0, 0, k_codes, 0], 0
    return ([k_refine, *k_refine.stride()[:3], k_channels.contiguous(), k_channels.shape[1]],
            k_refine.shape[3] * 8 // k_channels.shape[1])


def _rows(t):
    return [t, t.stride(0), t.stride(1), t.stride(2)]


def _hadamard(x, signs, inverse):
    return torch.ops.rkv.hadamard.default(x, signs, inverse)


def _split_launch(qf, part, ml, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink,
                  v_sink, block_tables, side_slots, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin,
                  rope_interleaved, split_tokens, sliding_window, softcap, k_levels, v_levels, k_outliers, v_outliers,
                  k_refine=None, k_channels=None):
    """(grid, runtime args, constexprs, options) of the split stage; qf: the scaled fp32 queries in the keys'
    space, part / ml: its outputs (their split count sets the grid)."""
    bsz, hq, dim = qf.shape
    hkv = k_codes.shape[1]
    splits = part.shape[2]
    k_args, k_f = _side(k_codes, k_scale, k_zero, k_levels, k_outliers, dim, k_bits)
    v_args, v_f = _side(v_codes, v_scale, v_zero, v_levels, v_outliers, dim, v_bits)
    r_args, extra = refine_args(k_codes, k_refine, k_channels)
    rope = rope_cos is not None
    args = [qf, part, ml, lengths, block_tables if block_tables is not None else lengths,
            block_tables.stride(0) if block_tables is not None else 0,
            side_slots if side_slots is not None else lengths,
            *k_args, *r_args, *v_args, *_rows(k_sink), *_rows(v_sink), *_rows(k_window), *_rows(v_window),
            k_window.shape[2], rope_cos if rope else qf, rope_sin if rope else qf, rope_cos.shape[1] if rope else 0,
            hkv, hq // hkv, k_sink.shape[2], k_codes.shape[2], block, recent, sliding_window, float(softcap), dim,
            splits, split_tokens]
    constexprs = dict(K_BITS=k_f["BITS"], V_BITS=v_f["BITS"], K_SYM=k_f["SYM"], V_SYM=v_f["SYM"],
                      K_LEVELS=k_f["LEVELS"], V_LEVELS=v_f["LEVELS"], K_OUT=k_f["OUT"], V_OUT=v_f["OUT"],
                      K_REFINE=extra,
                      PAGED=block_tables is not None, ROPE=rope, INTERLEAVED=bool(rope_interleaved),
                      HAS_SLOTS=side_slots is not None, BLOCK_N=block_n(dim, hq // hkv),
                      BLOCK_G=triton.next_power_of_2(hq // hkv), BLOCK_D=triton.next_power_of_2(dim))
    return (bsz, hkv, splits), args, constexprs, dict(num_warps=num_warps(dim))


def _merge_launch(part, ml, sink_logits, out):
    bsz, hq, splits, dim = part.shape
    args = [part, ml, sink_logits if sink_logits is not None else ml, out, hq, splits, dim]
    constexprs = dict(HAS_SINKS=sink_logits is not None, BLOCK_S=triton.next_power_of_2(splits),
                      BLOCK_D=triton.next_power_of_2(dim))
    return (bsz, hq), args, constexprs, dict(num_warps=4)


def num_warps(dim: int) -> int:
    """Warps of a split program: its [G, N, D] products take 8192 floats, 32 a thread at 8 warps."""
    return 8


def _cache_checks(op, lengths, block_tables, side_slots, k_codes, k_window, rope_cos, sliding_window, k_levels,
                  v_levels, k_bits, v_bits, query_start_loc=None, k_channels=None):
    """The checks of tensor values: on the host for CPU tensors (checks.py), by a device-side assert
    kernel on a GPU (no host sync)."""
    ring = block_tables is None and sliding_window > 0
    if checks.on_host(lengths):
        counts = None
        if query_start_loc is not None:
            starts = query_start_loc.tolist()
            counts = [e - s for s, e in zip(starts, starts[1:])]
        checks.levels(op, "k_levels", k_levels, k_bits)
        checks.levels(op, "v_levels", v_levels, v_bits)
        checks.refine_channels(op, k_channels, k_window.shape[-1])
        checks.cache_data(op, lengths, block_tables, side_slots, k_codes.shape[2], k_codes.shape[0],
                          k_window.shape[0], rope_cos, ring, counts)
        return counts
    if lengths.shape[0]:
        width = block_tables.shape[1] if block_tables is not None else 1
        check_cache_kernel[(lengths.shape[0],)](
            lengths, query_start_loc if query_start_loc is not None else lengths,
            block_tables if block_tables is not None else lengths,
            block_tables.stride(0) if block_tables is not None else 0,
            side_slots if side_slots is not None else lengths, (1 << 40) if ring else width * k_codes.shape[2],
            k_codes.shape[2], k_codes.shape[0], k_window.shape[0], rope_cos.shape[0] if rope_cos is not None else 0,
            HAS_NEW=query_start_loc is not None, PAGED=block_tables is not None, HAS_SLOTS=side_slots is not None,
            BLOCK=128)
    return None


def _paged_decode(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                  block_tables, side_slots, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin,
                  rope_interleaved, k_signs, v_signs, scale, split_tokens, sliding_window, softcap, k_levels, v_levels,
                  k_outliers, v_outliers, sink_logits, k_refine=None, k_channels=None):
    bsz, hq, dim = q.shape
    hkv = k_codes.shape[1]
    checks.cache_layout(op, block_tables is not None or op != "decode_attention", k_codes, k_scale, k_zero, v_codes,
                        v_scale, v_zero, k_window, v_window, k_sink, v_sink, block_tables, side_slots, block, hkv, dim,
                        bsz)
    _cache_checks(op, lengths, block_tables, side_slots, k_codes, k_window, rope_cos, sliding_window, k_levels,
                  v_levels, k_bits, v_bits, k_channels=k_channels)
    out = torch.zeros(bsz, hq, dim, dtype=torch.float32, device=q.device)
    if bsz == 0 or hq == 0:
        return out.to(q.dtype)
    qf = q.float()
    if k_signs is not None:
        qf = _hadamard(qf, k_signs, False)
    qf = (qf * scale).contiguous()
    capacity = k_codes.shape[2] * (block_tables.shape[1] if block_tables is not None else 1)
    if sliding_window > 0:
        capacity = min(capacity, sliding_window)
    splits = num_splits(capacity, bsz, hkv, split_tokens, block_n(dim, hq // hkv))
    part = torch.empty(bsz, hq, splits, dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(bsz, hq, splits, 2, dtype=torch.float32, device=q.device)
    if rope_cos is not None:
        rope_cos, rope_sin = rope_cos.float().contiguous(), rope_sin.float().contiguous()
    grid, args, constexprs, options = _split_launch(
        qf, part, ml, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
        block_tables, side_slots, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved,
        split_tokens, sliding_window, softcap, k_levels, v_levels, k_outliers, v_outliers, k_refine, k_channels)
    _decode_split_kernel[grid](*args, **constexprs, **options)
    grid, args, constexprs, options = _merge_launch(part, ml, sink_logits, out)
    _merge_kernel[grid](*args, **constexprs, **options)
    if v_signs is not None:
        out = _hadamard(out, v_signs, True)
    return out.to(q.dtype)


def paged_decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                           block_tables, side_slots, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin,
                           rope_interleaved, k_signs, v_signs, scale, split_tokens, sliding_window=0, softcap=0.0,
                           k_levels=None, v_levels=None, k_outliers=None, v_outliers=None, sink_logits=None,
                           k_refine=None, k_channels=None):
    paged_op._paged_decode_attention_fake(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink, block_tables,
        side_slots, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved, k_signs, v_signs,
        scale, split_tokens, sliding_window, softcap, k_levels, v_levels, k_outliers, v_outliers, sink_logits,
        k_refine, k_channels)
    return _paged_decode("paged_decode_attention", q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window,
                         v_window, k_sink, v_sink, block_tables, side_slots, lengths, k_bits, v_bits, block, recent,
                         rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, scale, split_tokens, sliding_window,
                         softcap, k_levels, v_levels, k_outliers, v_outliers, sink_logits, k_refine, k_channels)


def decode_attention(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                     lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved, k_signs, v_signs,
                     scale, split_tokens, sliding_window=0, softcap=0.0, k_levels=None, v_levels=None, k_outliers=None,
                     v_outliers=None, sink_logits=None, k_refine=None, k_channels=None):
    attention_op._decode_attention_fake(
        q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink, lengths, k_bits,
        v_bits, block, recent, rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, scale, split_tokens,
        sliding_window, softcap, k_levels, v_levels, k_outliers, v_outliers, sink_logits, k_refine, k_channels)
    return _paged_decode("decode_attention", q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window,
                         v_window, k_sink, v_sink, None, None, lengths, k_bits, v_bits, block, recent, rope_cos,
                         rope_sin, rope_interleaved, k_signs, v_signs, scale, split_tokens, sliding_window, softcap,
                         k_levels, v_levels, k_outliers, v_outliers, sink_logits, k_refine, k_channels)


KERNELS = {"decode_attention": decode_attention, "paged_decode_attention": paged_decode_attention}


def _meta_cache(dim, k_bits, v_bits, k_symmetric=False, levels=False, outliers=False, paged=True, page=128,
                block=128, kv_heads=8, q_heads=32, batch=4, rope=True, v_meta=torch.float16, refine=False):
    """Meta tensors shaped as the launch of one decode step over a paged cache: per-channel keys (a scale
    row per block of tokens), per-token values (their metadata in v_meta), sinks and a window ring; only
    dtypes and strides matter."""
    m = dict(device="meta")
    pages = 64 if paged else batch
    f16 = torch.float16
    def side(bits, tile, group, sym, meta=f16):  # noqa: E306
        codes = torch.empty(pages, kv_heads, page, dim * bits // 8, dtype=torch.uint8, **m)
        scale = torch.empty(pages, kv_heads, page // tile, dim // group, dtype=meta, **m)
        zero = None if sym else torch.empty_like(scale)
        lv = torch.empty(1 << bits, dtype=torch.float32, **m) if levels and not sym and bits <= 4 else None
        out = torch.empty(pages, kv_heads, page // block, 8, dtype=torch.int32, **m) if outliers else None
        return codes, scale, zero, lv, out
    kc, ks, kz, kl, ko = side(k_bits, block, 1, k_symmetric)
    vc, vs, vz, vl, vo = side(v_bits, 1, dim, False, v_meta)
    window = torch.empty(batch, kv_heads, 160, dim, dtype=f16, **m)
    sink = torch.empty(batch, kv_heads, 4, dim, dtype=f16, **m)
    tables = torch.empty(batch, 16, dtype=torch.int32, **m) if paged else None
    slots = torch.empty(batch, dtype=torch.int32, **m) if paged else None
    lengths = torch.empty(batch, dtype=torch.int32, **m)
    cos = torch.empty(4096, dim // 2, dtype=torch.float32, **m) if rope else None
    k_refine = torch.empty(pages, kv_heads, page, 2, dtype=torch.uint8, **m) if refine else None
    k_channels = torch.empty(kv_heads, 8, dtype=torch.int32, **m) if refine else None
    qf = torch.empty(batch, q_heads, dim, dtype=torch.float32, **m)
    part = torch.empty(batch, q_heads, 8, dim, dtype=torch.float32, **m)
    ml = torch.empty(batch, q_heads, 8, 2, dtype=torch.float32, **m)
    return (qf, part, ml, kc, ks, kz, vc, vs, vz, window, window, sink, sink, tables, slots, lengths, k_bits, v_bits,
            block, 32, cos, cos, False, 0, 0, 0.0, kl, vl, ko, vo, k_refine, k_channels)


def meta_cache_cases(full: bool, variants: list) -> list[tuple]:
    """(dim, bits, _meta_cache keywords) of a kernel's compile specs: the rkv layout at every head_dim and
    bit width (full) or at dim 128, 4 bits, then, when full, `variants` ((dim, bits, keywords) each)."""
    cases = [(d, b, {}) for d in ((64, 128, 256, 512) if full else (128,)) for b in ((2, 3, 4, 8) if full else (4,))]
    return cases + (variants if full else [])


def case_label(kernel: str, dim: int, bits: int, variant: dict) -> str:
    """A compile spec's label: the kernel, its head_dim and bits, and its variant's keywords."""
    return f"{kernel} d={dim} bits={bits}" + "".join(f" {k}={v}" for k, v in variant.items())


def compile_specs(full: bool) -> list[CompileSpec]:
    """The decode's split stage at the rkv layout for every head_dim and bit width (full) or at dim 128,
    4 bits; the feature variants (symmetric keys, codebooks, outliers, the contiguous
    layout, refined key channels) at dim 128; the merge stage with and without sink logits."""
    from .spec import from_args

    variants = [(128, 4, dict(k_symmetric=True, rope=False)), (128, 3, dict(levels=True)),
                (128, 2, dict(outliers=True)), (128, 4, dict(paged=False)), (128, 2, dict(refine=True)),
                (128, 2, dict(v_meta=torch.float8_e4m3fn))]
    specs = []
    for dim, bits, variant in meta_cache_cases(full, variants):
        grid, args, constexprs, options = _split_launch(*_meta_cache(dim, bits, bits, **variant))
        specs.append(from_args(case_label("decode split", dim, bits, variant), _decode_split_kernel, args,
                               constexprs, options))
    i32 = torch.empty(4, dtype=torch.int32, device="meta")
    tables = torch.empty(4, 16, dtype=torch.int32, device="meta")
    specs.append(from_args("cache check", check_cache_kernel, [i32, i32, tables, 16, i32, 2048, 128, 64, 4, 4096],
                           dict(HAS_NEW=True, PAGED=True, HAS_SLOTS=True, BLOCK=128)))
    for sinks in (False, True):
        part = torch.empty(4, 32, 8, 128, dtype=torch.float32, device="meta")
        ml = torch.empty(4, 32, 8, 2, dtype=torch.float32, device="meta")
        sl = torch.empty(32, dtype=torch.float32, device="meta") if sinks else None
        grid, args, constexprs, options = _merge_launch(part, ml, sl, torch.empty(4, 32, 128, device="meta"))
        specs.append(from_args(f"decode merge sinks={sinks}", _merge_kernel, args, constexprs, options))
    return specs
