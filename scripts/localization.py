"""The report's localization test alone, for schemes and lengths you name: what `--full` runs (24 needles a
length, four documents of six), without the rest of the report. The names are the report's
(`rkv-4`, `rkv-alloc-2.5`, `rkv-sparse-alloc-2.5`, ...); full precision is always measured, as the
reference of every delta.

    python scripts/localization.py rkv-4 rkv-sparse-alloc-2.5 --lengths 4096 8192
    # 22 minutes on 2 cores (with the sensitivity profile's 3 on a machine's first run): full
    # precision 4, rkv-4 9, rkv-sparse-alloc-2.5 10
"""

import argparse
import time

import torch

from torch_rkv.eval import data
from torch_rkv.eval.report import Options, Report, format_localization


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("schemes", nargs="+")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--documents", type=int, default=4, help="per length, six needles each")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok = data.load_model(None, None)
    opts = Options(loc_lengths=tuple(args.lengths), loc_schemes=tuple(args.schemes), loc_documents=args.documents,
                   families=(), bits=(),  # (the ETA counts only what runs)
                   alloc_targets=(), split_targets=(), decode_schemes=(), chunk_schemes=())
    report = Report(model, tok, data.read_text(str(data.text_path())), opts, log=lambda s: print(s, flush=True))
    start = time.time()
    rows = report.localization()
    print(format_localization(rows))
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
