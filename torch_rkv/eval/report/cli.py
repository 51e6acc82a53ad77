"""`python -m torch_rkv report`: the options from the command line, the run, the printed tables and --json."""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict

import torch

from .. import data
from .options import Options
from .report import Report
from .tables import format_tables


def main(args) -> int:
    """Run the report the arguments ask for; 2 when its model or text is missing or too short for it."""
    opts = Options.quick() if args.quick else Options.full() if getattr(args, "full", False) else Options()
    if args.tokens:
        opts.tokens = args.tokens
    opts.out_dir = args.out
    start = time.time()
    try:
        model, tok = data.load_model(args.model, args.gguf)
        text = data.read_text(args.text)
    except data.MissingMaterial as e:
        print(f"torch_rkv report: {e}", file=sys.stderr)
        return 2
    if opts.long_tokens > model.config.max_position_embeddings:  # the long row at the model's own window
        opts.long_tokens = model.config.max_position_embeddings
        opts.loc_lengths = tuple(min(n, opts.long_tokens) for n in opts.loc_lengths)
    if opts.tokens > model.config.max_position_embeddings:
        print(f"torch_rkv report: --tokens {opts.tokens} exceeds the model's {model.config.max_position_embeddings}",
              file=sys.stderr)
        return 2
    # rows a model cannot run are left out, each named, and the others run (Options.unrunnable)
    from ...integrations import models

    left_out = []
    for refusal, without in opts.unrunnable(models.inspect(model)):
        opts = without(opts)
        left_out.append(f"left out: {refusal}")
        print(f"torch_rkv report: {left_out[-1]}", flush=True)
    torch.manual_seed(0)
    report = Report(model, tok, text, opts, log=lambda s: print(s, flush=True))
    results = report.run()
    if left_out:
        results["left_out"] = left_out
    results["options"] = {k: v for k, v in asdict(opts).items() if k != "timings"}
    results["timings_s"] = {**opts.timings, "total": round(time.time() - start, 1)}
    results["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "threads": torch.get_num_threads()}
    print(format_tables(results))
    if left_out:
        print("\n" + "\n".join(left_out))
    print(f"\nplots: {', '.join(results['plots'].values())}")
    print(f"total {results['timings_s']['total']:.0f} s: " +
          ", ".join(f"{k} {v:.0f} s" for k, v in opts.timings.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"json: {args.json}")
    return 0
