"""Benchmark rkv::decode_attention (one decode step over the quantized cache) against baselines timed in
the same run:

  sdpa_fp32     torch SDPA on a full-precision fp32 cache (B, Hkv, n, D), GQA
  sdpa_bf16     torch SDPA on a bf16 cache (fp16 on GPU)
  deq_sdpa      dequantize the whole packed cache (and apply RoPE to pre-RoPE keys), then SDPA: what HF's
                QuantizedCache does every step
  read          a plain float32 sum over a buffer as large as the packed cache: the machine's read speed

    python bench/bench_decode.py [--json] [--contexts 4096 16384 65536] [--bits 8 4 3 2]
                                 [--values per-token grouped-32 grouped-16] [--cpu-levels avx2 default]
                                 [--levels] [--outliers 0.005]

--cpu-levels also times the fused kernel at each listed torch_rkv CPU level (csrc/cpu/capability.h) in the
same run: ms_<level> and the first level's speedup over each other one. --levels also times the fused kernel
reading the same cache through non-uniform codebooks on both sides (2-4 bits; torch_rkv.codebook):
ms_levels and levels_vs_uniform, the codebook's time over the uniform grid's. --outliers F also times it
with sparse outliers on both sides (F of each block's values; include/rkv/outliers.h), the same cache plus
each block's row of entries (random positions, fp16 residuals): ms_outliers and outliers_vs_dense.
Both ratios are medians over rounds that time the two kernels in turn (common.time_ratio), not ms_* / ms.

Records: bits, key and value schemes, context, batch, heads, head_dim, ms of each, speedups, cache bytes read and
the fused kernel's GB/s and its time relative to the read time for the same bytes. Correctness is
checked once per case (fused vs reference-style dequantize + attention) before timing.

Caches are cold, as in a real decode step where every layer's cache is read once: every method (the fused
kernel, the SDPA baselines, dequantize-then-SDPA and the read) cycles through enough copies of its cache
(like the layers of a model) to exceed the CPU's last-level cache, or the GPU's L2, several times.

On CUDA the records add the kernels' own time (common.device_ms, the profiler's GPU time of a call):
gpu_ms, sdpa_half_gpu_ms, gpu_gbps and gpu_vs_sdpa_half (a time ratio, like time_vs_read). Wall time
(ms) includes the Python and the launches, which a few-microsecond kernel cannot hide; an engine that
replays CUDA graphs pays gpu_ms.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import device_ms, emit, print_machine, time_ms, time_ratio  # noqa: E402

import torch_rkv  # noqa: E402
from torch_rkv.layout import CacheLayout  # noqa: E402
from torch_rkv.ops.structs import AttentionOptions, split_sides  # noqa: E402
from torch_rkv.outliers import outlier_count  # noqa: E402
from torch_rkv.reference import outlier_residuals  # noqa: E402
from torch_rkv.scheme import Scheme  # noqa: E402

SHAPES = {"9q/3kv/d64": (9, 3, 64), "32q/8kv/d128": (32, 8, 128)}
KEY_SCHEMES = {
    "per-token": dict(),
    "per-channel": dict(k_group_size=1, k_block_tokens=128),
    "pre-rope-per-channel": dict(k_group_size=1, k_block_tokens=128, pre_rope=True),
}
VALUE_SCHEMES = {"per-token": dict(), "grouped-32": dict(v_group_size=32), "grouped-16": dict(v_group_size=16)}


def fill_random(layout: CacheLayout, n: int, device) -> dict:
    """Buffers of a cache holding n tokens: quantize random keys/values block by block (fast path)."""
    s = layout.scheme
    bufs = layout.allocate(device)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (layout.batch, layout.kv_heads, layout.packed_capacity, layout.head_dim)
    for side in ("k", "v"):
        store_quantized(bufs, s, side, torch.randn(shape, generator=gen, device=device))
    return bufs


def store_quantized(bufs: dict, s, side: str, x: torch.Tensor):
    """Quantize x (B, H, C, D) as the scheme's `side` ("k" or "v") into the cache buffers; the result."""
    group = getattr(s, f"{side}_group_size") or x.shape[-1]
    q = torch_rkv.quantize(x, getattr(s, f"{side}_bits"), group, getattr(s, f"{side}_block_tokens"),
                           getattr(s, f"{side}_symmetric"), s.side_meta_dtype(side))
    bufs[f"{side}_packed"].copy_(q.packed)
    bufs[f"{side}_scale"].copy_(q.scale)
    if q.zero is not None:
        bufs[f"{side}_zero"].copy_(q.zero)
    return q


def random_outliers(b: int, h: int, blocks: int, positions: int, count: int, seed: int, device) -> torch.Tensor:
    """A (b, h, blocks, count) int32 sparse-outlier buffer: per block `count` distinct positions in order,
    each with a random fp16 residual (docs/format.md, "Sparse outliers")."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.rand(b, h, blocks, positions, generator=gen).argsort(-1)[..., :count].sort(-1).values
    res = torch.randn(b, h, blocks, count, generator=gen).half().view(torch.int16).long() & 0xFFFF
    return ((pos << 16) | res).to(torch.int32).to(device)


def last_level_cache_bytes(device: str = "cpu") -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            return int(f.read().strip().rstrip("K")) * 1024
    except (OSError, ValueError):
        return 32 << 20


def cycled(fn, copies):
    """fn(copy) over the copies in turn, so each call reads a cache that is not in the CPU's (or GPU's) caches."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(copies)
        return fn(copies[state["i"]])

    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4, 3, 2])
    ap.add_argument("--keys", nargs="+", default=["per-channel", "pre-rope-per-channel"], choices=list(KEY_SCHEMES))
    ap.add_argument("--values", nargs="+", default=["per-token"], choices=list(VALUE_SCHEMES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--min-run-time", type=float, default=0.5)
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth, for the GPU report")
    ap.add_argument("--cpu-levels", nargs="+", default=[], choices=["avx2", "default"],
                    help="CPU device: also time the fused kernel at these torch_rkv CPU levels")
    ap.add_argument("--levels", action="store_true",
                    help="also time the fused kernel with non-uniform codebooks (levels_vs_uniform)")
    ap.add_argument("--outliers", type=float, default=0.0,
                    help="also time the fused kernel with this fraction of sparse outliers (outliers_vs_dense)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    chosen = torch_rkv.cpu_capability()
    print_machine()
    dev = args.device
    half = torch.bfloat16 if dev == "cpu" else torch.float16

    for shape_name in args.shapes:
        hq, hkv, d = SHAPES[shape_name]
        for n in args.contexts:
            b = args.batch
            q = torch.randn(b, hq, d, device=dev)
            k32 = torch.randn(b, hkv, n, d, device=dev)
            v32 = torch.randn(b, hkv, n, d, device=dev)
            q4 = q[:, :, None]
            # full-precision caches, cold like the packed ones: cycle through copies beyond the LLC
            # copies of at least 4x the last-level cache in all; a CPU copies slowly, so at most 8 / 16 there
            llc, gpu = last_level_cache_bytes(dev), torch.device(dev).type == "cuda"
            fp_copies = max(1, -(-4 * llc // (2 * k32.nbytes)))
            fp_copies = fp_copies if gpu else min(8, fp_copies)
            kv32 = [(k32, v32)] + [(k32.clone(), v32.clone()) for _ in range(fp_copies - 1)]
            t_fp32 = time_ms(cycled(lambda kv: F.scaled_dot_product_attention(q4, *kv, enable_gqa=True), kv32),
                             args.min_run_time)
            kv16 = [(k.to(half), v.to(half)) for k, v in kv32]
            del kv32
            sdpa_half = cycled(lambda kv: F.scaled_dot_product_attention(q4.to(half), *kv, enable_gqa=True), kv16)
            t_bf16 = time_ms(sdpa_half, args.min_run_time)
            gpu_bf16 = device_ms(sdpa_half) if gpu else None  # the same for every scheme below
            del kv16, sdpa_half
            cos, sin = torch_rkv.rope_tables(d, n, theta=1e4, device=dev)
            for key_name, value_name, bits in itertools.product(args.keys, args.values, args.bits):
                scheme = Scheme(k_bits=bits, v_bits=bits, **KEY_SCHEMES[key_name], **VALUE_SCHEMES[value_name])
                layout = CacheLayout(scheme, b, hkv, d, n, torch.float32)
                bufs = fill_random(layout, n, dev)
                lengths = torch.full((b,), n, device=dev)
                rope = (cos, sin) if scheme.pre_rope else (None, None)
                a = [bufs.get(k) for k in ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero",
                                            "k_window", "v_window", "k_sink", "v_sink")]

                def fused(bufs, lv=None, outl=(None, None)):
                    return torch_rkv.decode_attention(q, *split_sides(bufs, (lv, lv), outl), lengths, scheme.format,
                                                      AttentionOptions(rope[0], rope[1]))

                def deq_sdpa(a=a, lv=None, outl=(None, None)):
                    k = torch_rkv.dequantize(torch_rkv.Quantized(a[0], a[1], a[2], bits, lv), torch.float32)
                    v = torch_rkv.dequantize(torch_rkv.Quantized(a[3], a[4], a[5], bits, lv), torch.float32)
                    if outl[0] is not None:  # each block's residuals at their positions
                        k = k + outlier_residuals(outl[0], scheme.block, d).reshape(k.shape)
                        v = v + outlier_residuals(outl[1], scheme.block, d).reshape(v.shape)
                    if rope[0] is not None:
                        k = torch_rkv.rope(k, cos, sin, torch.arange(n, device=dev))
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)[:, :, 0]

                got, want = fused(a), deq_sdpa()
                err = (got - want).abs().max().item()
                assert err < 1e-3 * want.abs().max().item() + 1e-4, f"fused != dequantize+SDPA ({err})"
                nbytes = sum(t.numel() * t.element_size() for t in a if t is not None)
                ncopies = max(2, -(-4 * llc // nbytes))
                ncopies = ncopies if gpu else min(16, ncopies)
                copies = [a] + [[None if t is None else t.clone() for t in a] for _ in range(ncopies - 1)]
                reads = [torch.randn(-(-nbytes // 4), device=dev) for _ in range(ncopies)]
                t_read = time_ms(cycled(lambda buf: buf.sum(), reads), args.min_run_time)
                t_fused = time_ms(cycled(fused, copies), args.min_run_time)
                t_deq = time_ms(cycled(deq_sdpa, copies), args.min_run_time)
                rec = dict(bits=bits, keys=key_name, values=value_name, context=n, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d,
                           device=dev, ms=t_fused, sdpa_fp32_ms=t_fp32, sdpa_half_ms=t_bf16, deq_sdpa_ms=t_deq,
                           read_ms=t_read, speedup_vs_sdpa_fp32=t_fp32 / t_fused,
                           speedup_vs_sdpa_half=t_bf16 / t_fused, speedup_vs_deq_sdpa=t_deq / t_fused,
                           cache_bytes=nbytes, gbps=nbytes / t_fused / 1e6, read_gbps=nbytes / t_read / 1e6,
                           time_vs_read=t_fused / t_read)
                if gpu:  # kernel time alone (the host's launch cost is left out; common.device_ms)
                    rec["gpu_ms"] = device_ms(cycled(fused, copies))
                    rec["sdpa_half_gpu_ms"] = gpu_bf16
                    rec["gpu_gbps"] = nbytes / rec["gpu_ms"] / 1e6
                    rec["gpu_vs_sdpa_half"] = rec["gpu_ms"] / rec["sdpa_half_gpu_ms"]
                if args.peak_gbps:
                    rec["fraction_of_peak"] = rec["gpu_gbps" if gpu else "gbps"] / args.peak_gbps
                if args.levels and bits < 8:  # a Gaussian-shaped codebook (denser in the middle), same bytes
                    top = (1 << bits) - 1
                    lv = (top / 2 + top / 2 * torch.linspace(-1, 1, top + 1).mul(1.2).sinh() / math.sinh(1.2))
                    lv = lv.clamp(0, top).to(dev)
                    want_lv = deq_sdpa(a, lv)
                    err = (fused(a, lv) - want_lv).abs().max().item()
                    assert err < 1e-3 * want_lv.abs().max().item() + 1e-4, f"fused with levels != dequantize+SDPA ({err})"
                    rec["ms_levels"], rec["levels_vs_uniform"] = time_ratio(
                        cycled(lambda c: fused(c, lv), copies), cycled(fused, copies), 2 * args.min_run_time)
                if args.outliers and bits < 8:
                    per_block = outlier_count(args.outliers, scheme.block, d)
                    outl = tuple(random_outliers(b, hkv, n // scheme.block, scheme.block * d, per_block, seed, dev)
                                 for seed in (1, 2))
                    want_o = deq_sdpa(a, None, outl)
                    err = (fused(a, None, outl) - want_o).abs().max().item()
                    assert err < 1e-3 * want_o.abs().max().item() + 1e-4, f"fused with outliers != dequantize+SDPA ({err})"
                    o_copies = [(c, tuple(t.clone() for t in outl)) for c in copies]
                    rec["ms_outliers"], rec["outliers_vs_dense"] = time_ratio(
                        cycled(lambda c: fused(c[0], None, c[1]), o_copies), cycled(fused, copies), 2 * args.min_run_time)
                for level in args.cpu_levels:
                    torch_rkv._C._set_cpu_capability(level)
                    err = (fused(a) - want).abs().max().item()
                    assert err < 1e-3 * want.abs().max().item() + 1e-4, f"{level} kernel != dequantize+SDPA ({err})"
                    rec[f"ms_{level}"] = time_ms(cycled(fused, copies), args.min_run_time)
                    torch_rkv._C._set_cpu_capability(chosen)
                for level in args.cpu_levels[1:]:
                    rec[f"{args.cpu_levels[0]}_vs_{level}"] = rec[f"ms_{level}"] / rec[f"ms_{args.cpu_levels[0]}"]
                emit(rec, args.json)
                del bufs, a, copies, reads
            del k32, v32
    return 0


if __name__ == "__main__":
    sys.exit(main())
