"""Command line: python -m torch_rkv {report, plan, calibrate, calibrate-levels, demo, export-model}."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: a subcommand for each job, with its options."""
    parser = argparse.ArgumentParser(prog="python -m torch_rkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    report = sub.add_parser("report", help="measured quality of every scheme on a real model and text (main job)")
    report.add_argument("--model", help="a local transformers model directory (default: SmolLM2-135M-Instruct)")
    report.add_argument("--gguf", help="a local GGUF file")
    report.add_argument("--text", help="a local text file (default: alice29.txt of the Canterbury corpus)")
    report.add_argument("--tokens", type=int, default=None, help="perplexity window (default 2048; up to 8192)")
    mode = report.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a smaller run (1024 tokens, fewer schemes)")
    mode.add_argument("--full", action="store_true", help="also the heavy rows: perplexity at 8192 tokens, "
                                                          "localization at 8192 and 24 needles a length")
    report.add_argument("--json", help="write every number to this file")
    report.add_argument("--out", default="out/report", help="directory for the PNG plots")

    from .plan import add_arguments as plan_arguments

    plan_arguments(sub.add_parser("plan", help="KV-cache memory ledger: bytes per token, fit, longest context"))

    def calibration_arguments(p):
        p.add_argument("--model", help="a local transformers model directory (default: SmolLM2-135M-Instruct)")
        p.add_argument("--gguf", help="a local GGUF file")
        p.add_argument("--text", default="lcet10.txt", help="calibration text: a file, or a Canterbury-corpus name "
                       "(default lcet10.txt; never an evaluation text)")
        p.add_argument("--tokens", type=int, default=512)
        return p

    cal = calibration_arguments(sub.add_parser(
        "calibrate", help="measure a model's per-layer sensitivity on a calibration text (cached): the profile "
        "plan --sensitivity and per-layer allocations use"))
    cal.add_argument("--levels", type=int, nargs="+", default=[2, 3, 4], help="bit widths to choose among")
    written = cal.add_mutually_exclusive_group()
    written.add_argument("--bits", type=float, help="also write the per-layer allocation at this average code bits "
                         "(each layer the key and value bits that pay most; TORCH_RKV_ALLOCATION serves it in vLLM)")
    written.add_argument("--split", type=float, help="also write the per-layer split at this average code bits (every "
                         "layer the same key + value bits: pages of one size)")
    cal.add_argument("--out", help="where --bits or --split writes its file (default: beside the cached profile)")
    cal.add_argument("--sparse", action="store_true", help="the file's layers keep rkv-sparse's outliers")
    cal.add_argument("--lean", action="store_true", help="the file's layers keep rkv-lean's float8 value metadata")
    lev = calibration_arguments(sub.add_parser(
        "calibrate-levels", help="fit a model's per-layer non-uniform levels (a codebook file, cached) on a "
        "calibration text: Scheme(levels='calibrated', codebook=PATH)"))
    lev.add_argument("--pin-ends", action="store_true", help="keep each group's min and max as levels")
    lev.add_argument("--weighting", choices=["attention", "mse"], default="attention",
                     help="weigh each value by what attention reads of it (default), or squared error alone")

    demo = sub.add_parser("demo", help="quantize synthetic RoPE'd keys with each scheme; print error and bytes")
    demo.add_argument("--tokens", type=int, default=1024)
    demo.add_argument("--dim", type=int, default=128)

    sub.add_parser("export-model", help="write the default model as a plain Hugging Face directory (cached) and "
                   "print its path: what vLLM loads")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand `argv` (default: the process's arguments) names; its exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "export-model":
        from .eval import data

        try:
            print(data.model_hf())
        except data.MissingMaterial as e:
            print(f"torch_rkv export-model: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "calibrate":
        from .eval import sensitivity

        return sensitivity.main(args)
    if args.command == "calibrate-levels":
        from .eval import levels

        return levels.main(args)
    if args.command == "report":
        from .eval.report import main as report_main

        return report_main(args)
    if args.command == "plan":
        from .plan import main as plan_main

        return plan_main(args)
    from . import demo as demo_mod

    return demo_mod.run(args.tokens, args.dim)


if __name__ == "__main__":
    sys.exit(main())
