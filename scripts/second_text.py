"""The report's second-text check by itself, for rows you name: each row's perplexity change on alice29 and
on asyoulik.txt over the same number of windows of 2048 tokens (the report's windows), and the two
rankings. `report --full` runs it with 8 windows among an hour of other sections.

    python scripts/second_text.py 8 rkv-4 rkv-3 rkv-2 rkv-lean-alloc-3.7
    # about 25 s a row and window on 2 cores
"""

import argparse
import math
import time

from torch_rkv.eval import data
from torch_rkv.eval.report import Options, Report
from torch_rkv.eval.report.names import FIRST, SECOND, RowName


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("windows", type=int, help="windows of 2048 tokens a text")
    p.add_argument("rows", nargs="+", help="report row names (rkv-4, rkv-lean-alloc-3.7, ...)")
    args = p.parse_args()
    model, tok = data.load_model()
    opts = Options(families=(), loc_lengths=(), decode_schemes=(), chunk_sizes=(), chunk_schemes=(),
                   eight_bits=(), alloc_targets=(), split_targets=(), long_schemes=(),
                   second_text="asyoulik.txt", second_windows=args.windows, second_schemes=tuple(args.rows))
    start = time.time()
    report = Report(model, tok, data.read_text(None), opts, log=lambda s: None)
    loss = {}
    for text in (FIRST, SECOND):
        full = [report._simulated(ids, None, None) for ids in report.windows[text]]
        for name in args.rows:
            sim = report.simulation_of(report.layer_schemes(RowName.parse(name)))
            ppl = [report._simulated(ids, sim, None) for ids in report.windows[text]]
            # the windows' geometric mean of the perplexity ratio
            loss[(text, name)] = math.exp(sum(math.log(a / b) for a, b in zip(ppl, full)) / len(full)) - 1
            print(f"{text:12s} {name:26s} {loss[(text, name)]:+.2%}", flush=True)
    for text in (FIRST, SECOND):
        print(f"{text} ranking: " + " < ".join(sorted(args.rows, key=lambda n: loss[(text, n)])))
    print(f"{time.time() - start:.0f} s, {len(report.windows[FIRST])} windows a text")


if __name__ == "__main__":
    main()
