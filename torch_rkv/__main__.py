"""Command line: python -m torch_rkv {demo}."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_rkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a key-like tensor with each scheme; print error and bytes")
    demo.add_argument("--tokens", type=int, default=1024)
    demo.add_argument("--dim", type=int, default=128)
    report = sub.add_parser("report", help="the main job (until the real-model report lands: the demo)")
    report.add_argument("--tokens", type=int, default=1024)
    report.add_argument("--dim", type=int, default=128)
    args = parser.parse_args(argv)
    from . import demo as demo_mod

    return demo_mod.run(args.tokens, args.dim)


if __name__ == "__main__":
    sys.exit(main())
