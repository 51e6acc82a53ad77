"""Benchmark rkv::quantize / rkv::dequantize against reference.py, eager and torch.compile'd, in one run.

    python bench/bench_quant.py [--json] [--tokens 16384 --heads 8 --dim 128] [--bits 4 2]

One record per case: op, bits, grouping, shape, ms and GB/s for torch_rkv, the eager reference and the
compiled reference, and the speedups (ratios of times measured in this same run). Outputs are checked
against the reference once before timing. Goal (CPU): >= 2x the eager reference and >= 1x the compiled
reference for 4-bit and 2-bit on a 16K x 8 x 128 cache.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, print_machine, time_ms  # noqa: E402

import torch_rkv  # noqa: E402
from torch_rkv import reference as ref  # noqa: E402

GROUPINGS = {  # name -> (group_size or None for dim, block_tokens)
    "per-token": (None, 1),
    "grouped-32": (32, 1),
    "per-channel-128": (1, 128),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--groupings", nargs="+", default=list(GROUPINGS), choices=list(GROUPINGS))
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd reference")
    ap.add_argument("--min-run-time", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    print_machine()

    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.heads, args.tokens, args.dim, device=args.device).to(dtype)
    in_bytes = x.numel() * x.element_size()
    for grouping in args.groupings:
        group, block = GROUPINGS[grouping]
        group = group or args.dim
        for bits in args.bits:
            q = torch_rkv.quantize(x, bits, group, block)
            packed, scale, zero = ref.quantize(x, bits, group, block)
            assert torch.equal(q.packed, packed) and torch.equal(q.scale, scale) and torch.equal(q.zero, zero)
            q_bytes = q.nbytes()
            cases = {
                "quantize": (lambda: torch_rkv.quantize(x, bits, group, block),
                             lambda: ref.quantize(x, bits, group, block), in_bytes + q_bytes),
                "dequantize": (lambda: torch_rkv.dequantize(q, dtype),
                               lambda: ref.dequantize(q.packed, q.scale, q.zero, bits, dtype), in_bytes + q_bytes),
            }
            for op, (ours, reference, nbytes) in cases.items():
                rec = {"op": op, "bits": bits, "grouping": grouping, "shape": [args.heads, args.tokens, args.dim],
                       "dtype": args.dtype, "device": args.device}
                t_ours = time_ms(ours, args.min_run_time)
                t_eager = time_ms(reference, args.min_run_time)
                rec.update(ms=t_ours, gbps=nbytes / t_ours / 1e6, eager_ms=t_eager, speedup_vs_eager=t_eager / t_ours)
                if not args.no_compile:
                    torch._dynamo.reset()
                    compiled = torch.compile(reference)
                    compiled()  # compile outside the timing
                    t_comp = time_ms(compiled, args.min_run_time)
                    rec.update(compiled_ms=t_comp, speedup_vs_compiled=t_comp / t_ours)
                emit(rec, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
