"""Where the quantization loss comes from, and what refined key channels buy (torch_rkv.channels).

Each at --tokens of alice29 (the report's window and rows): a row's bits at the window, perplexity change,
KL divergence from full precision and top-8 recall; with --split also keys only and values only. A row
is a report row name (rkv-2, rkv-lean-alloc-2.1), optionally with +<m>: every layer's scheme refining
its m most important key channels per KV head by --extra bits (the ranking calibrated on lcet10.txt by
torch_rkv.eval.channels on first use, then cached).

    python scripts/key_channels.py rkv-2 rkv-3 rkv-2+8 rkv-3+8 --split
    # 2048 tokens: about 15 s a row on 2 cores, after a calibration pass of 15 s
    python scripts/key_channels.py rkv-lean-2+8 rkv-lean-3+8 --tokens 8192
    # about 3 minutes a row
    python scripts/key_channels.py rkv-lean-2+8 --spread 0.5 --tokens 8192
    # 8 channels a head on average, more where the keys are sensitive (the allocation's profile)
"""

import argparse
import time

import torch

from torch_rkv.eval import data, perplexity
from torch_rkv.eval.report import Options, Report
from torch_rkv.scheme import refined


def counts(report: Report, m: int, spread: float | None) -> list[int]:
    """Refined channels per layer: m in each, or (spread p) m on average, each layer's share following its
    keys' sensitivity, the profile's 3-to-2-bit key drop to the power p (the allocation's profile)."""
    layers = report.attention.layers
    if spread is None:
        return [m] * layers
    w = torch.tensor([k for k, _ in report.profile().drops[3]]).clamp_min(1e-6).pow(spread)
    return (w / w.mean() * m).round().clamp(0, report.head_dim).long().tolist()


def row_schemes(report: Report, spec: str, path, extra: int, recent: int | None, spread: float | None):
    """The row's scheme of each layer, with its refined key channels if it names a count (and `recent`
    full-precision tokens if given)."""
    name, _, count = spec.partition("+")
    schemes = report.layer_schemes(name)
    if recent is not None:
        schemes = [s.replace(recent=recent) for s in schemes]
    if not count:
        return schemes
    return [refined(s, c, str(path), extra) for s, c in zip(schemes, counts(report, int(count), spread))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", nargs="+", help="report row names (rkv-2, rkv-lean-alloc-2.1), each optionally with "
                   "+<m>: m key channels per KV head refined")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--extra", type=int, default=2, help="bits the refinement adds to each refined channel")
    p.add_argument("--spread", type=float, help="refine m channels a head on average, each layer's count "
                   "following its keys' sensitivity to this power (0.5 measured best)")
    p.add_argument("--recent", type=int, help="every row's recent window instead of its own")
    p.add_argument("--split", action="store_true", help="also keys only and values only")
    args = p.parse_args()
    for spec in args.rows:
        if not spec.partition("+")[2].isdigit() and "+" in spec:
            p.error(f"{spec}: the suffix is +<channels>")
    torch.manual_seed(0)
    start = time.time()
    model, tok = data.load_model()
    opts = Options(tokens=args.tokens, families=(), loc_lengths=(), decode_schemes=(), chunk_sizes=(),
                   chunk_schemes=(), second_schemes=(), eight_bits=(), alloc_targets=(), split_targets=(),
                   long_schemes=())
    report = Report(model, tok, data.read_text(None), opts, log=lambda s: None)
    path = report.key_channels() if any("+" in r for r in args.rows) else None
    ids = report.ids
    reference = report._logprobs(ids, None)
    fp = perplexity.perplexity_of(reference, ids)
    print(f"full precision {fp:.3f} on {ids.shape[1]} tokens" + (f"; key channels ranked in {path}" if path else ""))
    print(f"{'row':26s} side  bits    delta      KL   top8")
    for spec in args.rows:
        schemes = row_schemes(report, spec, path, args.extra, args.recent, args.spread)
        bits = report.bits_at(schemes, ids.shape[1])
        for keys, values in ((True, True), (True, False), (False, True)) if args.split else ((True, True),):
            sim = report.simulation_of(schemes, fidelity_queries=64)
            sim.quantize_keys, sim.quantize_values = keys, values
            lp = report._logprobs(ids, sim)
            delta = perplexity.perplexity_of(lp, ids) - fp
            kl = perplexity.token_kl(reference, lp).mean().item()
            print(f"{spec:26s} {'K' if keys else '-'}{'V' if values else '-'}   {bits:5.2f}  {delta:+7.3f}  {kl:.4f}  "
                  f"{sim.fidelity.recall:.3f}", flush=True)
    print(f"{time.time() - start:.0f} s, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
