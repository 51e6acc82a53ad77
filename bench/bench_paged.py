"""Benchmark the paged quantized KV cache's ops against baselines timed in the same run (rkv-4: pre-RoPE
per-channel 4-bit keys in blocks of 128, Hadamard per-token 4-bit values, pages of 128 tokens):

  decode     rkv::paged_decode_attention over random block tables against rkv::decode_attention over the
             contiguous layout holding the same tokens: batch 1 at 16K tokens, batch 8 ragged 4K-16K.
             Goal: within 10% (paged / contiguous <= 1.10).
  prefill    rkv::paged_prefill_attention of 512 new tokens over a 16K-token quantized prefix against
             dequantize-then-SDPA (the prefix dequantized to fp32, RoPE applied, the chunk appended, SDPA
             with the causal mask of the chunk). Goals: at least 3x faster; peak extra memory (allocations
             during the call, from torch.profiler) under 10% of the dequantized copy.
  batch16    one rkv::paged_decode_attention call for 16 sequences of ragged lengths (1K-16K) against 16
             rkv::decode_attention calls, one per sequence.
  step       a decode step's attention for the same 16 sequences, one new token each (the append, the
             same either way, left out): rkv::paged_prefill_attention over the cache before the token,
             given fresh, against rkv::paged_decode_attention over the cache holding it in its window
             (the vLLM plugin's two orders, docs/serving.md).

    python bench/bench_paged.py [--json] [--shapes 9q/3kv/d64 32q/8kv/d128] [--cases decode prefill batch16 step]

Every case checks its result against the baseline before timing. Caches are cold: each method cycles
through enough copies (like the layers of a model) to exceed the last-level cache. Each pair is timed
alternately, three rounds (the prefill pair once: it takes seconds), and the medians are reported.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import cycled, last_level_cache_bytes, store_quantized  # noqa: E402
from common import emit, print_machine, time_ms  # noqa: E402

import torch_rkv  # noqa: E402
from torch_rkv import reference as ref  # noqa: E402
from torch_rkv import scheme as presets  # noqa: E402
from torch_rkv.layout import CacheLayout, PageLayout  # noqa: E402
from torch_rkv.ops import paged as ops  # noqa: E402
from torch_rkv.ops.structs import AttentionOptions, split_sides  # noqa: E402

SHAPES = {"9q/3kv/d64": (9, 3, 64), "32q/8kv/d128": (32, 8, 128)}
NAMES = ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero", "k_window", "v_window", "k_sink", "v_sink")


def contiguous_cache(scheme, lengths, hkv, d, gen, capacity=None):
    """A contiguous cache whose sequences hold lengths[b] tokens of random data. The full-precision rows
    (sinks, window) hold the dequantized values of the same tokens' quantized rows, so that reading
    every token from its quantized row (the dequantize-then-SDPA baseline) gives what attention reads."""
    layout = CacheLayout(scheme, len(lengths), hkv, d, capacity or max(lengths), torch.float32)
    bufs = layout.allocate()
    c = layout.packed_capacity
    for side in ("k", "v"):
        q = store_quantized(bufs, scheme, side, torch.randn(len(lengths), hkv, c, d, generator=gen))
        deq = torch_rkv.dequantize(q)
        for b, n in enumerate(lengths):
            bufs[f"{side}_sink"][b] = deq[b, :, : scheme.sinks]
            for t in range(max(scheme.sinks, ref.quantized_count(n, scheme.recent, scheme.block)), n):
                bufs[f"{side}_window"][b, :, t % layout.window] = deq[b, :, t]
    return layout, bufs


def paged_copy_of(layout: CacheLayout, bufs: dict, lengths, page: int, gen):
    """The same tokens in pages at random pool positions: (region tensors, side tensors, tables)."""
    s, b_ = layout.scheme, layout.batch
    per_seq = layout.packed_capacity // page
    pages = b_ * per_seq
    order = torch.randperm(pages, generator=gen)
    tables = order.reshape(b_, per_seq).to(torch.int32)
    plan = PageLayout(s, layout.kv_heads, layout.head_dim, page, torch.float32)
    regions = {}
    for name, shape, dt in plan.regions():
        src = bufs[name.replace("_codes", "_packed")]  # (B, H, C or C/T, X)
        rows = shape[1]
        per_page = src.reshape(b_, layout.kv_heads, per_seq, rows, shape[2]).permute(0, 2, 1, 3, 4)
        out = torch.empty(pages, *shape, dtype=dt)
        out[tables.long().reshape(-1)] = per_page.reshape(pages, *shape)
        regions[name] = out
    tensors = [regions["k_codes"], regions["k_scale"], regions.get("k_zero"), regions["v_codes"], regions["v_scale"],
               regions.get("v_zero"), bufs["k_window"], bufs["v_window"], bufs["k_sink"], bufs["v_sink"]]
    return tensors, tables


def copies_for(tensors, limit=12):
    nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    n = min(limit, max(2, -(-4 * last_level_cache_bytes() // nbytes)))
    return [tensors] + [[None if t is None else t.clone() for t in tensors] for _ in range(n - 1)], nbytes


def paired(fa, fb, min_run_time, rounds=3):
    """Median ms of fa and of fb, timed alternately (A B A B ...): the machines here drift by 10-20%
    between runs, which a single A-then-B timing would read as a difference."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(time_ms(fa, min_run_time))
        tb.append(time_ms(fb, min_run_time))
    return sorted(ta)[rounds // 2], sorted(tb)[rounds // 2]


def peak_extra_bytes(fn) -> int:
    """Peak of the bytes allocated during fn() and not yet freed, from torch.profiler's CPU memory records:
    the allocations of the innermost ops and the frees the profiler reports on their own, in time order
    (frees it folds into an enclosing op are left out, so this is an upper bound)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                     if e.self_cpu_memory_usage != 0 and (e.name == "[memory]" or not e.cpu_children))
    live = peak = 0
    for _, change in records:
        live += change
        peak = max(peak, live)
    return peak


def rope_args(scheme, d, n):
    cos, sin = torch_rkv.rope_tables(d, n, theta=1e5)
    signs = torch_rkv.hadamard_signs(d, scheme.hadamard_seed + 1) if scheme.v_hadamard else None
    return cos, sin, signs


def ragged(shape_name, lengths, gen) -> SimpleNamespace:
    """rkv-4 sequences of `lengths` tokens: the contiguous buffers (bufs), their paged copy (paged,
    tables, slots), one query a sequence (q) and the format (fmt) and rope / sign options (opts) every
    attention op takes."""
    hq, hkv, d = SHAPES[shape_name]
    s = presets.recommended(4)
    layout, bufs = contiguous_cache(s, lengths, hkv, d, gen)
    cos, sin, signs = rope_args(s, d, layout.max_tokens)
    paged, tables = paged_copy_of(layout, bufs, lengths, 128, gen)
    return SimpleNamespace(s=s, hkv=hkv, d=d, layout=layout, bufs=bufs, paged=paged, tables=tables,
                           slots=torch.arange(len(lengths), dtype=torch.int32),
                           q=torch.randn(len(lengths), hq, d, generator=gen), fmt=s.format,
                           opts=AttentionOptions(cos, sin, False, None, signs))


def decode_case(shape_name, batch, lengths, min_run_time, as_json, gen):
    c = ragged(shape_name, lengths, gen)
    s, q, paged, tables, slots, fmt, opts = c.s, c.q, c.paged, c.tables, c.slots, c.fmt, c.opts
    n = torch.tensor(lengths)
    contiguous = [c.bufs[k] for k in NAMES]

    def run_contiguous(t):
        return torch_rkv.decode_attention(q, *split_sides(t), n, fmt, opts)

    def run_paged(t):
        return ops.paged_decode_attention(q, *split_sides(t), fmt, opts, lengths=n, block_tables=tables,
                                          side_slots=slots)

    want, got = run_contiguous(contiguous), run_paged(paged)
    assert (got - want).abs().max().item() < 1e-4, "paged != contiguous"
    c_copies, nbytes = copies_for(contiguous)
    p_copies, _ = copies_for(paged)
    t_c, t_p = paired(cycled(run_contiguous, c_copies), cycled(run_paged, p_copies), min_run_time)
    emit(dict(case="decode", shape=shape_name, batch=batch, lengths=f"{min(lengths)}-{max(lengths)}", scheme=s.name,
              contiguous_ms=t_c, paged_ms=t_p, paged_vs_contiguous=t_p / t_c, goal_met=t_p / t_c <= 1.10,
              cache_bytes=nbytes), as_json)


def prefill_case(shape_name, prefix, chunk, min_run_time, as_json, gen):
    hq, hkv, d = SHAPES[shape_name]
    s = presets.recommended(4)
    layout, bufs = contiguous_cache(s, [prefix], hkv, d, gen, capacity=prefix + chunk)
    cos, sin, signs = rope_args(s, d, layout.max_tokens)
    paged, tables = paged_copy_of(layout, bufs, [prefix], 128, gen)
    slots = torch.zeros(1, dtype=torch.int32)
    q = torch.randn(chunk, hq, d, generator=gen)
    k_new = torch.randn(chunk, hkv, d, generator=gen)  # storage space: pre-RoPE keys, rotated values
    v_new = torch.randn(chunk, hkv, d, generator=gen)
    qsl = torch.tensor([0, chunk])
    n = torch.tensor([prefix])
    opts = AttentionOptions(cos, sin, False, None, signs)
    where = {"query_start_loc": qsl, "max_query_len": chunk, "lengths": n, "block_tables": tables, "side_slots": slots}

    def fused(t):
        return ops.paged_prefill_attention(q, k_new, v_new, *split_sides(t), s.format, opts, **where)

    positions = torch.arange(prefix + chunk)
    mask = positions[None, :] <= prefix + torch.arange(chunk)[:, None]

    def dequantize_then_sdpa(t):
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = t[:6]
        # the prefix's rows, page by page in table order: what a paged engine would have to dequantize
        pages = tables[0, : -(-prefix // 128)].long()
        kq = torch_rkv.Quantized(k_codes[pages], k_scale[pages], None if k_zero is None else k_zero[pages], s.k_bits)
        vq = torch_rkv.Quantized(v_codes[pages], v_scale[pages], None if v_zero is None else v_zero[pages], s.v_bits)
        k = torch_rkv.dequantize(kq).transpose(0, 1).reshape(hkv, -1, d)[:, :prefix]
        v = torch_rkv.dequantize(vq).transpose(0, 1).reshape(hkv, -1, d)[:, :prefix]
        k = torch.cat([k, k_new.transpose(0, 1)], dim=1)
        v = torch.cat([v, v_new.transpose(0, 1)], dim=1)
        k = torch_rkv.rope(k, cos, sin, positions)
        v = torch_rkv.hadamard(v, signs, inverse=True)
        qr = torch_rkv.rope(q, cos, sin, prefix + torch.arange(chunk)[:, None]).transpose(0, 1)
        return F.scaled_dot_product_attention(qr[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]

    qr = torch_rkv.rope(q, cos, sin, prefix + torch.arange(chunk)[:, None])
    got = ops.paged_prefill_attention(qr, k_new, v_new, *split_sides(paged), s.format, opts, **where)
    want = dequantize_then_sdpa(paged).transpose(0, 1)
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item() + 1e-4, "fused != dequantize+SDPA"
    copies, nbytes = copies_for(paged, limit=4)
    t_fused, t_deq = paired(cycled(fused, copies), cycled(dequantize_then_sdpa, copies), min_run_time, rounds=1)
    copy_bytes = 2 * hkv * prefix * d * 4  # the dequantized keys and values, fp32
    extra_fused = peak_extra_bytes(lambda: fused(paged))
    extra_deq = peak_extra_bytes(lambda: dequantize_then_sdpa(paged))
    output = chunk * hq * d * 4
    emit(dict(case="prefill", shape=shape_name, prefix=prefix, chunk=chunk, scheme=s.name, fused_ms=t_fused,
              deq_sdpa_ms=t_deq, speedup=t_deq / t_fused, speed_goal_met=t_deq / t_fused >= 3.0,
              dequantized_copy_mb=copy_bytes / 2**20, fused_extra_mb=(extra_fused - output) / 2**20,
              deq_sdpa_extra_mb=(extra_deq - output) / 2**20,
              fused_extra_vs_copy=(extra_fused - output) / copy_bytes,
              memory_goal_met=(extra_fused - output) / copy_bytes < 0.10, cache_bytes=nbytes), as_json)


def batch16_case(shape_name, min_run_time, as_json, gen):
    lengths = [int(x) for x in torch.linspace(1024, 16384, 16)]
    c = ragged(shape_name, lengths, gen)
    s, q, bufs, paged, tables, slots, fmt, opts = c.s, c.q, c.bufs, c.paged, c.tables, c.slots, c.fmt, c.opts
    n = torch.tensor(lengths)
    # 16 contiguous caches of one sequence each, sized to their own length
    singles = []
    for b, length in enumerate(lengths):
        lay, one = contiguous_cache(s, [length], c.hkv, c.d, torch.Generator().manual_seed(b))
        for name in NAMES:
            if bufs[name] is not None:
                rows = one[name].shape[2]
                one[name].copy_(bufs[name][b : b + 1, :, :rows])
        singles.append([one[k] for k in NAMES])

    def run_paged(t):
        return ops.paged_decode_attention(q, *split_sides(t), fmt, opts, lengths=n, block_tables=tables,
                                          side_slots=slots)

    def run_singles(caches):
        return torch.cat([torch_rkv.decode_attention(q[b : b + 1], *split_sides(c), n[b : b + 1], fmt, opts)
                          for b, c in enumerate(caches)])

    assert (run_paged(paged) - run_singles(singles)).abs().max().item() < 1e-4, "one call != 16 calls"
    p_copies, nbytes = copies_for(paged)
    s_copies = [singles] + [[[None if t is None else t.clone() for t in c] for c in singles]
                            for _ in range(len(p_copies) - 1)]
    t_p, t_s = paired(cycled(run_paged, p_copies), cycled(run_singles, s_copies), min_run_time)
    emit(dict(case="batch16", shape=shape_name, lengths="1024-16384", scheme=s.name, one_call_ms=t_p,
              sixteen_calls_ms=t_s, speedup=t_s / t_p, cache_bytes=nbytes), as_json)


def step_case(shape_name, min_run_time, as_json, gen):
    s = presets.recommended(4)
    lengths = []
    for x in torch.linspace(1024, 16384, 16):
        n = int(x)
        while not ref.append_keeps_reads(n, s.recent, s.block):
            n -= 1  # a step the plugin gives the decode kernel
        lengths.append(n)
    c = ragged(shape_name, [n + 1 for n in lengths], gen)  # the caches holding the new token
    q, paged, tables, slots, fmt, opts = c.q, c.paged, c.tables, c.slots, c.fmt, c.opts
    k_new, v_new = (torch.stack([c.bufs[f"{side}_window"][b, :, n % c.layout.window] for b, n in enumerate(lengths)])
                    for side in ("k", "v"))  # (16, hkv, d): the new token of each sequence, in storage space
    qsl = torch.arange(17)
    n = torch.tensor(lengths)

    def run_prefill(t):
        return ops.paged_prefill_attention(q, k_new, v_new, *split_sides(t), fmt, opts, query_start_loc=qsl,
                                           max_query_len=1, lengths=n, block_tables=tables, side_slots=slots)

    def run_decode(t):
        return ops.paged_decode_attention(q, *split_sides(t), fmt, opts, lengths=n + 1, block_tables=tables,
                                          side_slots=slots)

    assert (run_prefill(paged) - run_decode(paged)).abs().max().item() < 1e-4, "the two kernels disagree"
    copies, nbytes = copies_for(paged)
    t_p, t_d = paired(cycled(run_prefill, copies), cycled(run_decode, copies), min_run_time)
    emit(dict(case="step", shape=shape_name, lengths="1024-16384", scheme=s.name, prefill_kernel_ms=t_p,
              decode_kernel_ms=t_d, speedup=t_p / t_d, cache_bytes=nbytes), as_json)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--cases", nargs="+", default=["decode", "prefill", "batch16", "step"])
    ap.add_argument("--min-run-time", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    print_machine()
    gen = torch.Generator().manual_seed(0)
    torch.set_grad_enabled(False)
    for shape in args.shapes:
        if "decode" in args.cases:
            decode_case(shape, 1, [16384], args.min_run_time, args.json, gen)
            decode_case(shape, 8, [int(x) for x in torch.linspace(4096, 16384, 8)], args.min_run_time, args.json, gen)
        if "prefill" in args.cases:
            prefill_case(shape, 16384, 512, args.min_run_time, args.json, gen)
        if "batch16" in args.cases:
            batch16_case(shape, args.min_run_time, args.json, gen)
        if "step" in args.cases:
            step_case(shape, args.min_run_time, args.json, gen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
