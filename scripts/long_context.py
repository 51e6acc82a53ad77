"""The report's long-context rows by themselves: each named scheme's perplexity change at --tokens tokens
(default 8192, SmolLM2's window), its bits at the window split into codes, metadata, outliers and
full-precision tokens, its top-8 attention recall and its mean KL divergence from full precision.
`report --full` measures its own set of these rows among an hour of others; this measures any set in
minutes, to find where a quality goal is reached.

    python scripts/long_context.py rkv-2 rkv-alloc-2.2 rkv-sparse-alloc-2.2 rkv-alloc-2.3 rkv-alloc-2.5
    # about a minute a row on 2 cores, the sensitivity profile cached (rkv-alloc-<bits>: the report's
    # per-layer allocation at that average code bits; rkv-sparse-alloc-<bits>: with 0.5% outliers)
    python scripts/long_context.py --goals --decode --json OUT
    # the rows put forward for issue 50's three goals (GOALS), each checked against its goal; --decode
    # also feeds each row's scheme 384 tokens one at a time through RKVCache and the fused kernels, and
    # prints how far that perplexity is from the simulation's on the same window (the decode protocol)
"""

import argparse
import json
import time

import torch

from torch_rkv.eval import data
from torch_rkv.eval.report import GOALS, Options, Report, RowName, format_long_context, kl_bound


def goal_lines(rows: list[dict]) -> list[str]:
    """Whether each goal's row met it: its bits, delta and recall, and its KL against the baseline's."""
    by_name = {str(x["scheme"]): x for x in rows}
    out = []
    for (bits, delta, recall), name in GOALS:
        r = by_name[name]
        kl_most = kl_bound(r["bits_at_window"])
        met = r["bits_at_window"] <= bits and r["delta"] <= delta and r["top8_recall"] >= recall
        out.append(f"goal <= {bits} bits, <= +{delta:.2f}" + (f", recall >= {recall}" if recall else "")
                   + f": {name} {r['bits_at_window']:.2f} bits {r['delta']:+.3f} recall {r['top8_recall']:.3f} "
                   + ("met" if met else "NOT met") + f"; KL {r['kl']:.4f} (half the baseline's: {kl_most:.4f}) "
                   + ("met" if r["kl"] <= kl_most else "NOT met"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--goals", action="store_true", help="also run the rows put forward for issue 50's goals, and "
                   "say whether each met its goal")
    p.add_argument("--decode", action="store_true", help="also the decode protocol of each row")
    p.add_argument("schemes", nargs="*", help="names the report takes: presets (rkv-2), rkv-alloc-<bits>, "
                   "rkv-sparse-alloc-<bits>, rkv-split-<bits>")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--text", default=None, help="a local text file (default: alice29.txt)")
    p.add_argument("--json", help="also write the rows here: a list with one entry per row (name, bits at the "
                   "window, delta, top-8 recall, mean KL from full precision, and the rest the report keeps)")
    args = p.parse_args()
    if args.goals:
        args.schemes += [name for _, name in GOALS if name not in args.schemes]
    if not args.schemes:
        p.error("name at least one scheme, or --goals")
    model, tok = data.load_model()
    if args.tokens > model.config.max_position_embeddings:
        p.error(f"--tokens {args.tokens} exceeds the model's {model.config.max_position_embeddings}")
    opts = Options(tokens=min(2048, args.tokens), long_tokens=args.tokens, long_schemes=tuple(args.schemes),
                   families=(), loc_lengths=(), decode_schemes=tuple(args.schemes) if args.decode else (),
                   chunk_sizes=(), chunk_schemes=(),
                   second_schemes=(), eight_bits=(), alloc_targets=(), split_targets=())
    torch.manual_seed(0)
    start = time.time()
    report = Report(model, tok, data.read_text(args.text), opts, log=lambda s: print(s, flush=True))
    for name in args.schemes:
        if RowName.parse(name).profiled:
            widths = " ".join(f"{s.k_bits}{s.v_bits}" for s in report.layer_schemes(name))
            print(f"{name}: K/V bits by layer {widths}", flush=True)
    rows = report.long_context()
    print(format_long_context(rows))
    if args.goals and args.tokens == 8192 and args.text is None:
        print("\n".join(goal_lines(rows)))
    if args.decode:
        print("\nDecode protocol: token by token through RKVCache and the kernels against the simulation")
        for x in report.decode_protocol():
            print(f"{x['scheme']:22s} {x['tokens']} tokens: decoded {x['decoded_ppl']:.4f}, simulated "
                  f"{x['simulated_ppl']:.4f}, relative difference {x['relative_difference']:+.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"name": x["scheme"], **{k: v for k, v in x.items() if k != "scheme"}} for x in rows], f,
                      indent=1)
    print(f"\n{time.time() - start:.0f} s, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
