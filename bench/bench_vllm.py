"""vLLM with the torch_rkv plugin against vLLM's own KV cache (`auto`, the model dtype), one engine
process per row (scripts/vllm_engine.py), all in this run. Runs in the vLLM venv (scripts/vllm_venv.sh):

  pressure   N concurrent requests at a KV budget where the `auto` cache holds only --fit of them at
             once (kv_cache_memory_bytes); requests/s and output tokens/s. Goal: rkv-4 and rkv-3 at
             least 2x `auto`. The plugin's side pool (full-precision sinks and window rows) is
             memory outside that budget, so `auto+side` runs `auto` again with the largest side pool
             added to its budget: the comparison at the same total memory (vs_auto_same_memory).
  roomy      the same workload with room for all of them (VLLM_CPU_KVCACHE_SPACE=2). Goal: at least
             0.9x `auto`.
  decode     one request at a --context-token prompt: the decode step time (first to last token over
             the steps between, vLLM's own request timestamps), rkv-4 against `auto`.

    .venv-vllm/bin/python bench/bench_vllm.py [--json] [--cases pressure roomy decode]
        [--requests 16 --prompt 1024 --new 64 --fit 4] [--context 16384] [--dtype bfloat16] [--in-process]
        [--allocation FILE] [--compiled]

--compiled runs every engine in vLLM's default mode instead of enforce_eager (on CPU: the model traced
once by Dynamo and compiled by Inductor, about a minute more a start; attention stays an opaque op); its
decode case needs --context within SmolLM2's 8192 positions (e.g. --context 8000).

--allocation FILE adds a row `allocation`: per-layer bits (TORCH_RKV_ALLOCATION, e.g. from `python -m
torch_rkv calibrate --bits 3`), whose layers' pages differ in bytes and which vLLM runs with one metadata
builder per distinct layer scheme; compare it with the uniform scheme of the same average bits.

Prompts are alice29 tokens (the report's text) through the default model's HF export
(python -m torch_rkv export-model). The throughput rows take the wall time of one generate call with
every request submitted at once (greedy, fixed output length); each row is one engine, timed once after
vLLM's start (its load time is not counted). By default each engine runs vLLM's multiprocess layout
(what a server runs); --in-process keeps its engine core and worker in one process.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import vllm_engine
from common import emit, print_machine

SCHEMES = ("auto", "rkv-4", "rkv-3")
SAME = "auto+side"  # pressure: auto at the KV budget plus the largest side pool of the plugin's rows
ALLOCATION = "allocation"  # the row of --allocation's per-layer bits


def model_bytes_per_token(model_dir: str, dtype: str) -> int:
    """vLLM's own cache: K and V of every KV head in every layer, in the model dtype."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * (4 if dtype == "float32" else 2)


def side_pool_mib(log: str) -> float:
    """The plugin's side pool (sinks and window rows in full precision, outside vLLM's KV budget) at its
    largest, from the plugin's log lines: each metadata builder's last (an allocation's layers have one
    builder per distinct scheme, each logging its own layers' share)."""
    by_builder = {layer: float(mib) for mib, layer in re.findall(
        r"torch_rkv: side pool of \d+ slots, ([\d.]+) MiB over \d+ layers from (\S+)", log)}
    return sum(by_builder.values())


def engine_run(model_dir, scheme, engine_args, tasks, in_process: bool, allocation: str | None = None) -> dict:
    """One engine: `scheme` ("auto": vLLM's own cache; "allocation": the per-layer bits of `allocation`)."""
    job = {"model": model_dir, "engine": {"disable_log_stats": False, **engine_args}, "tasks": tasks}
    if scheme == ALLOCATION:
        return vllm_engine.run(None, job, timeout=1800, in_process=in_process, allocation=allocation)
    return vllm_engine.run(None if scheme == "auto" else scheme, job, timeout=1800, in_process=in_process)


def throughput_row(run: dict) -> dict:
    t = run["timed"]
    return {"kv_tokens": run["kv_tokens"], "wall_s": t["wall_s"], "requests_per_s": t["requests"] / t["wall_s"],
            "output_tokens_per_s": t["output_tokens"] / t["wall_s"],
            "preemptions": int(run["metrics"].get("vllm:num_preemptions", 0) or 0)}


def decode_row(run: dict) -> dict:
    t = run["decode"]
    decode_s = t["last_token_ts"][0] - t["first_token_ts"][0]
    return {"step_ms": 1e3 * decode_s / (t["generated"][0] - 1), "prefill_s": t["wall_s"] - decode_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--in-process", action="store_true",
                    help="vLLM's engine core and worker in the engine's process (scripts/vllm_engine.py)")
    ap.add_argument("--cases", nargs="+", default=["pressure", "roomy", "decode"],
                    choices=["pressure", "roomy", "decode"])
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--fit", type=float, default=4, help="requests the auto cache holds under pressure")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--decode-new", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--allocation", help="also a row of these per-layer bits (an allocation file)")
    ap.add_argument("--compiled", action="store_true", help="vLLM's default compiled mode, not enforce_eager")
    args = ap.parse_args()
    if args.compiled and "decode" in args.cases and args.context + args.decode_new > 8192:
        # (vLLM's own compiled rotary checks its bounds; eager mode reads past the table, timing only)
        ap.error(f"--compiled: the decode case needs --context + --decode-new within SmolLM2's 8192 positions "
                 f"(got {args.context} + {args.decode_new}; e.g. --context 8000)")
    if args.allocation:
        args.schemes.append(ALLOCATION)

    from transformers import AutoTokenizer

    from torch_rkv.eval import data

    model_dir = str(data.model_hf())
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("<|endoftext|>" + data.read_text()).input_ids
    print_machine()
    print(f"# vLLM {__import__('vllm').__version__}, model {Path(model_dir).name}, dtype {args.dtype}, "
          f"{os.cpu_count()} CPUs, {'in-process engine' if args.in_process else 'multiprocess engine'}, "
          f"{'compiled' if args.compiled else 'enforce_eager'}",
          file=sys.stderr)

    need = args.prompt + args.new
    prompts = [[ids[0]] + ids[1 + i * 997 : i * 997 + args.prompt] for i in range(args.requests)]
    if any(len(p) != args.prompt for p in prompts):
        raise SystemExit(f"--prompt {args.prompt} x --requests {args.requests}: alice29 has {len(ids)} tokens")
    long_ids = (ids * (args.context // len(ids) + 1))[: args.context]
    work = [{"kind": "timed", "prompts": prompts, "max_tokens": args.new}]
    decode = [{"kind": "timed", "name": "decode", "prompts": [long_ids], "max_tokens": args.decode_new}]
    seqs = max(16, args.requests)
    common = {"dtype": args.dtype, "max_num_seqs": seqs, "enforce_eager": not args.compiled}  # every engine's
    budget = int(args.fit * need * model_bytes_per_token(model_dir, args.dtype))
    # the 16K decode shares the roomy engines (beyond SmolLM2's 8K trained positions: timing only)
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    cases = [("pressure", {"max_model_len": need, "kv_cache_memory_bytes": budget}, work),
             ("roomy", {"max_model_len": max(need, args.context + args.decode_new) if "decode" in args.cases else need},
              work)]
    runs: dict = {}
    for case, extra, tasks in cases:
        wanted = case in args.cases or (case == "roomy" and "decode" in args.cases)
        if not wanted:
            continue
        for s in args.schemes:
            t = (tasks if case in args.cases else []) + (decode if case == "roomy" and "decode" in args.cases
                                                          and s in ("auto", "rkv-4") else [])
            if t:
                runs[case, s] = engine_run(model_dir, s, {**common, **extra}, t, args.in_process, args.allocation)
        if case not in args.cases:
            continue
        budgets = {s: budget for s in args.schemes}
        side = max(side_pool_mib(runs[case, s]["log"]) for s in args.schemes)
        if case == "pressure" and "auto" in args.schemes and side:
            # the plugin's side pool is memory outside the KV budget: auto again with that memory added
            budgets[SAME] = budget + int(side * 2**20)
            more = {**common, **extra, "kv_cache_memory_bytes": budgets[SAME]}
            runs[case, SAME] = engine_run(model_dir, "auto", more, tasks, args.in_process)
        rows = {s: throughput_row(runs[case, s]) for s in budgets}
        for s, r in rows.items():
            tps = r["output_tokens_per_s"]
            emit({"case": case, "scheme": s, "requests": args.requests, "prompt": args.prompt, "new": args.new,
                  "kv_budget_mib": budgets[s] / 2**20 if case == "pressure" else None,
                  "side_pool_mib": side_pool_mib(runs[case, s]["log"]), **r,
                  "vs_auto": tps / rows["auto"]["output_tokens_per_s"] if "auto" in rows else None,
                  "vs_auto_same_memory": tps / rows[SAME]["output_tokens_per_s"] if SAME in rows else None}, args.json)
    if "decode" in args.cases:
        rows = {s: decode_row(runs["roomy", s]) for s in args.schemes if s in ("auto", "rkv-4")}
        for s, r in rows.items():
            ratio = rows["auto"]["step_ms"] / r["step_ms"] if "auto" in rows else None
            emit({"case": "decode", "scheme": s, "context": args.context, **r, "speed_vs_auto": ratio}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
