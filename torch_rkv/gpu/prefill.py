"""paged_prefill_attention on the GPU (semantics: reference.paged_prefill_attention): causal attention of
each sequence's chunk of new tokens over its cache as stored and over the chunk itself in full precision.

One program per (sequence, kv head, BLOCK_M query tokens) holds those tokens' rows for every query head
of the GQA group, and walks the cache's tiles and then the chunk's, with the decode's tile functions
(attention.attend_tile: tokens wherever they live, keys rotated at their positions, online softmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import paged as paged_op
from . import checks
from .attention import (_cache_checks, _hadamard, _meta_cache, _rows, _side, attend_tile, block_n, case_label,
                        meta_cache_cases, refine_args, score_tile, softmax_step)
from .spec import CompileSpec
from .tokens import quantized_count, rope_partner, rope_rows


@triton.jit
def _prefill_kernel(
        q_ptr, kn_ptr, vn_ptr, kn_s0, kn_s1, vn_s0, vn_s1, qsl_ptr, out_ptr, sinks_ptr,
        lengths_ptr, bt_ptr, bt_stride, slots_ptr,
        kc_ptr, kc_s0, kc_s1, kc_s2, k_row_bytes, ks_ptr, kz_ptr, km_s0, km_s1, km_s2, k_tile, k_group,
        k_lv_ptr, ko_ptr, ko_s0, ko_s1, ko_s2, k_nout, krf_ptr, krf_s0, krf_s1, krf_s2, kch_ptr, k_nref,
        vc_ptr, vc_s0, vc_s1, vc_s2, v_row_bytes, vs_ptr, vz_ptr, vm_s0, vm_s1, vm_s2, v_tile, v_group,
        v_lv_ptr, vo_ptr, vo_s0, vo_s1, vo_s2, v_nout,
        ksink_ptr, ksk_s0, ksk_s1, ksk_s2, vsink_ptr, vsk_s0, vsk_s1, vsk_s2,
        kwin_ptr, kw_s0, kw_s1, kw_s2, vwin_ptr, vw_s0, vw_s1, vw_s2, win_rows,
        cos_ptr, sin_ptr, half,
        kv_heads, group_heads, n_sinks, page_size, block, recent, sliding_window, softcap, dim,
        K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr,
        K_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
        K_REFINE: tl.constexpr, PAGED: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
        HAS_SLOTS: tl.constexpr,
        HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr):
    """Program (b, kv head h, block of BLOCK_M new tokens): rows r = (new token r // BLOCK_G, query head
    h*G + r % BLOCK_G). New token i (position n + i) attends causally over the n cached tokens as stored
    and over new tokens 0..i in full precision (k_new / v_new, the storage space), within the sliding
    window; out (T, Hq, D) float32 gets its normalized output (zeros where it sees nothing)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    i0 = tl.program_id(2) * BLOCK_M
    start = tl.load(qsl_ptr + b).to(tl.int64)
    m_new = (tl.load(qsl_ptr + b + 1) - start).to(tl.int32)
    if i0 < m_new:
        n = tl.load(lengths_ptr + b).to(tl.int32)
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + b).to(tl.int64)
        else:
            slot = b.to(tl.int64)
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        i = i0 + r // BLOCK_G
        g = r % BLOCK_G
        d = tl.arange(0, BLOCK_D)
        row_ok = (i < m_new) & (g < group_heads)
        pos = n + i  # each row's query position
        lo = tl.where(sliding_window > 0, pos + 1 - sliding_window, 0)  # the first key each row sees
        qm = row_ok[:, None] & (d < dim)[None, :]
        q_off = ((start + i) * kv_heads * group_heads + h * group_heads + g)[:, None] * dim
        qg = tl.load(q_ptr + q_off + d[None, :], mask=qm, other=0.0)
        if ROPE:
            partner, col, sign = rope_partner(d, half, INTERLEAVED)
            qp = tl.load(q_ptr + q_off + partner[None, :], mask=qm, other=0.0) * (-sign)[None, :]
        else:
            col = d
            qp = qg
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
        q_end = quantized_count(n, recent, block)
        # the cached tokens: from the first any row of the block sees
        first = tl.maximum(tl.min(tl.where(row_ok, lo, n), axis=0), 0)
        for t0 in range(first, n, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            visible = t < n
            sees = visible[None, :] & row_ok[:, None] & (t[None, :] >= lo[:, None])
            acc, m_i, l_i = attend_tile(
                qg, qp, col, t, visible, sees, n, b, h, slot, d, acc, m_i, l_i,
                bt_ptr, bt_stride, page_size, n_sinks, q_end,
                kc_ptr, kc_s0, kc_s1, kc_s2, k_row_bytes, ks_ptr, kz_ptr, km_s0, km_s1, km_s2, k_tile, k_group,
                k_lv_ptr, ko_ptr, ko_s0, ko_s1, ko_s2, k_nout, krf_ptr, krf_s0, krf_s1, krf_s2, kch_ptr, k_nref,
                vc_ptr, vc_s0, vc_s1, vc_s2, v_row_bytes, vs_ptr, vz_ptr, vm_s0, vm_s1, vm_s2, v_tile, v_group,
                v_lv_ptr, vo_ptr, vo_s0, vo_s1, vo_s2, v_nout,
                ksink_ptr, ksk_s0, ksk_s1, ksk_s2, vsink_ptr, vsk_s0, vsk_s1, vsk_s2,
                kwin_ptr, kw_s0, kw_s1, kw_s2, vwin_ptr, vw_s0, vw_s1, vw_s2, win_rows,
                cos_ptr, sin_ptr, half, block, softcap, dim,
                K_BITS, V_BITS, K_SYM, V_SYM, K_LEVELS, V_LEVELS, K_OUT, V_OUT, K_REFINE, PAGED, ROPE, INTERLEAVED)
        # the chunk's own tokens, causal: new token j is seen by rows i >= j
        i_last = tl.minimum(i0 + BLOCK_M, m_new)
        j_first = tl.maximum(tl.min(tl.where(row_ok, lo - n, i_last), axis=0), 0)
        for j0 in range(j_first, i_last, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            visible = j < i_last
            dm = visible[:, None] & (d < dim)[None, :]
            k = tl.load(kn_ptr + (start + j)[:, None] * kn_s0 + h * kn_s1 + d[None, :], mask=dm, other=0.0)
            k = k.to(tl.float32)
            c = k
            s = k
            if ROPE:
                c, s = rope_rows(n + j, col, visible, cos_ptr, sin_ptr, half)
            scores = score_tile(qg, qp, k, c, s, ROPE)
            v = tl.load(vn_ptr + (start + j)[:, None] * vn_s0 + h * vn_s1 + d[None, :], mask=dm, other=0.0)
            sees = visible[None, :] & row_ok[:, None] & (j[None, :] <= i[:, None]) & ((n + j)[None, :] >= lo[:, None])
            acc, m_i, l_i = softmax_step(scores, sees, v.to(tl.float32), acc, m_i, l_i, softcap)
        total = l_i
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h * group_heads + g, mask=row_ok, other=float("-inf")).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
            scale_old = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - m_safe))
            acc = acc * scale_old[:, None]
            total = l_i * scale_old + tl.where(row_ok, tl.exp(sink - m_safe), 0.0)
        o = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
        tl.store(out_ptr + q_off + d[None, :], o, mask=qm)


def _prefill_launch(qf, k_new, v_new, query_start_loc, max_query_len, out, sink_logits, k_codes, k_scale, k_zero,
                    v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink, block_tables, side_slots, lengths,
                    k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved, sliding_window, softcap,
                    k_levels, v_levels, k_outliers, v_outliers, k_refine=None, k_channels=None):
    """(grid, runtime args, constexprs, options) of the prefill kernel; qf: the scaled fp32 queries in the
    keys' space, out: its (T, Hq, D) float32 output."""
    _, hq, dim = qf.shape
    hkv = k_codes.shape[1]
    group = triton.next_power_of_2(hq // hkv)
    # a few new tokens per program at small heads; half the decode's tile of tokens, as a prefill program
    # also holds its rows' positions and the chunk's keys
    rows = max(group, 8 if dim <= 128 else 1)
    block_m = rows // group
    k_args, k_f = _side(k_codes, k_scale, k_zero, k_levels, k_outliers, dim, k_bits)
    v_args, v_f = _side(v_codes, v_scale, v_zero, v_levels, v_outliers, dim, v_bits)
    r_args, extra = refine_args(k_codes, k_refine, k_channels)
    rope = rope_cos is not None
    args = [qf, k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), query_start_loc,
            out, sink_logits if sink_logits is not None else out, lengths,
            block_tables if block_tables is not None else lengths,
            block_tables.stride(0) if block_tables is not None else 0,
            side_slots if side_slots is not None else lengths,
            *k_args, *r_args, *v_args, *_rows(k_sink), *_rows(v_sink), *_rows(k_window), *_rows(v_window),
            k_window.shape[2], rope_cos if rope else qf, rope_sin if rope else qf, rope_cos.shape[1] if rope else 0,
            hkv, hq // hkv, k_sink.shape[2], k_codes.shape[2], block, recent, sliding_window, float(softcap), dim]
    constexprs = dict(K_BITS=k_f["BITS"], V_BITS=v_f["BITS"], K_SYM=k_f["SYM"], V_SYM=v_f["SYM"],
                      K_LEVELS=k_f["LEVELS"], V_LEVELS=v_f["LEVELS"], K_OUT=k_f["OUT"], V_OUT=v_f["OUT"],
                      K_REFINE=extra,
                      PAGED=block_tables is not None, ROPE=rope, INTERLEAVED=bool(rope_interleaved),
                      HAS_SLOTS=side_slots is not None, HAS_SINKS=sink_logits is not None, BLOCK_M=block_m,
                      BLOCK_G=group, BLOCK_N=block_n(dim, 2 * rows), BLOCK_D=triton.next_power_of_2(dim))
    grid = (query_start_loc.shape[0] - 1, hkv, triton.cdiv(max(max_query_len, 1), block_m))
    return grid, args, constexprs, dict(num_warps=4)


def paged_prefill_attention(q, k_new, v_new, query_start_loc, max_query_len, k_codes, k_scale, k_zero, v_codes,
                            v_scale, v_zero, k_window, v_window, k_sink, v_sink, block_tables, side_slots, lengths,
                            k_bits, v_bits, block, recent, rope_cos, rope_sin, rope_interleaved, k_signs, v_signs,
                            scale, split_tokens, sliding_window=0, softcap=0.0, k_levels=None, v_levels=None,
                            k_outliers=None, v_outliers=None, sink_logits=None, k_refine=None, k_channels=None):
    op = "paged_prefill_attention"
    paged_op._paged_prefill_attention_fake(
        q, k_new, v_new, query_start_loc, max_query_len, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window,
        v_window, k_sink, v_sink, block_tables, side_slots, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin,
        rope_interleaved, k_signs, v_signs, scale, split_tokens, sliding_window, softcap, k_levels, v_levels,
        k_outliers, v_outliers, sink_logits, k_refine, k_channels)
    checks.cache_layout(op, True, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink,
                        v_sink, block_tables, side_slots, block, k_codes.shape[1], q.shape[2],
                        query_start_loc.shape[0] - 1)
    counts = _cache_checks(op, lengths, block_tables, side_slots, k_codes, k_window, rope_cos, sliding_window,
                           k_levels, v_levels, k_bits, v_bits, query_start_loc, k_channels)
    if counts and max(counts) > max_query_len:
        raise ValueError(f"rkv.{op}: a chunk of {max(counts)} tokens is longer than max_query_len={max_query_len}")
    t_, hq, dim = q.shape
    out = torch.zeros(t_, hq, dim, dtype=torch.float32, device=q.device)
    if t_ == 0 or hq == 0 or query_start_loc.shape[0] < 2:
        return out.to(q.dtype)
    qf = q.float()
    if k_signs is not None:
        qf = _hadamard(qf, k_signs, False)
    qf = (qf * scale).contiguous()
    if rope_cos is not None:
        rope_cos, rope_sin = rope_cos.float().contiguous(), rope_sin.float().contiguous()
    grid, args, constexprs, options = _prefill_launch(
        qf, k_new, v_new, query_start_loc, max_query_len, out, sink_logits, k_codes, k_scale, k_zero, v_codes, v_scale,
        v_zero, k_window, v_window, k_sink, v_sink, block_tables, side_slots, lengths, k_bits, v_bits, block, recent,
        rope_cos, rope_sin, rope_interleaved, sliding_window, softcap, k_levels, v_levels, k_outliers, v_outliers,
        k_refine, k_channels)
    _prefill_kernel[grid](*args, **constexprs, **options)
    if v_signs is not None:
        out = _hadamard(out, v_signs, True)
    return out.to(q.dtype)


KERNELS = {"paged_prefill_attention": paged_prefill_attention}


def compile_specs(full: bool) -> list[CompileSpec]:
    """The prefill at the rkv layout for every head_dim and bit width (full) or at dim 128, 4 bits; full: also
    rkv-lean's float8 value metadata at dim 128, 2 bits."""
    from .spec import from_args

    specs = []
    for dim, bits, variant in meta_cache_cases(full, [(128, 2, dict(v_meta=torch.float8_e4m3fn)),
                                                      (128, 2, dict(refine=True))]):
        cache = _meta_cache(dim, bits, bits, **variant)
        qf = torch.empty(64, 32, dim, dtype=torch.float32, device="meta")
        new = torch.empty(64, 8, dim, dtype=torch.float16, device="meta")
        qsl = torch.empty(5, dtype=torch.int32, device="meta")
        grid, args, constexprs, options = _prefill_launch(qf, new, new, qsl, 16, qf, None, *cache[3:23],
                                                          *cache[24:])
        specs.append(from_args(case_label("prefill", dim, bits, variant), _prefill_kernel, args, constexprs, options))
    return specs
