"""The host time of the vLLM plugin's attention layer: how long a layer's forward spends per decode step
outside torch_rkv's ops (Python bookkeeping, tensor views, argument plumbing), beside the time inside
them and the metadata builder's time per step. Runs in the vLLM venv (scripts/vllm_venv.sh):

    .venv-vllm/bin/python bench/bench_vllm_host.py [--scheme rkv-4] [--requests 4] [--prompt 256]
        [--new 64] [--json]

One engine in this process (vLLM's engine core and worker in it, enforce_eager, float32, SmolLM2's HF
export: python -m torch_rkv export-model), its layers' forward, its builder's build and the ops the
forward calls wrapped in wall-clock timers. The ops run synchronously on a CPU, so a forward's time
outside them is its host time. The rows are the decode steps (RKVMetadata.decode): the median and 90th
percentile over every layer of every such step. Issue 47's goal: at most 100 microseconds outside the ops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from common import emit, print_machine

OPS = ("paged_append", "paged_decode_attention", "paged_prefill_attention", "rope", "hadamard")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="rkv-4")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import vllm_engine

    os.environ.update({"TORCH_RKV_SCHEME": args.scheme, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CPU_KVCACHE_SPACE": "1"})
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from torch_rkv.eval import data
    from torch_rkv.integrations import vllm_backend as backend

    inside = [0.0]  # seconds inside the ops during the forward being timed
    forwards: list[tuple[float, float]] = []  # (total, inside the ops) of each decode-step forward
    builds: list[float] = []

    def timed_op(fn):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - t
        return run

    for name in OPS:
        setattr(backend, name, timed_op(getattr(backend, name)))
    forward, build = backend.RKVAttentionImpl.forward, backend.RKVMetadataBuilder.build

    def timed_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
        inside[0] = 0.0
        t = time.perf_counter()
        out = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
        if attn_metadata is not None and attn_metadata.decode:
            forwards.append((time.perf_counter() - t, inside[0]))
        return out

    def timed_build(self, *a, **kw):
        t = time.perf_counter()
        md = build(self, *a, **kw)
        if md.decode:
            builds.append(time.perf_counter() - t)
        return md

    backend.RKVAttentionImpl.forward, backend.RKVMetadataBuilder.build = timed_forward, timed_build

    model_dir = str(data.model_hf(fetch=False))
    ids = AutoTokenizer.from_pretrained(model_dir)("<|endoftext|>" + data.read_text(str(data.text_path(fetch=False)))
                                                  ).input_ids
    prompts = [{"prompt_token_ids": ids[1 + 997 * i: 1 + 997 * i + args.prompt]} for i in range(args.requests)]
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              max_model_len=args.prompt + args.new + 16, kv_transfer_config=vllm_engine.KV_TRANSFER_CONFIG)
    llm.generate(prompts, SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True), use_tqdm=False)

    us = 1e6
    outside = sorted((total - ops) * us for total, ops in forwards)
    ops = sorted(o * us for _, o in forwards)
    row = {"scheme": args.scheme, "requests": args.requests, "layer_forwards": len(forwards),
           "outside_ops_us_median": statistics.median(outside),
           "outside_ops_us_p90": outside[int(0.9 * (len(outside) - 1))],
           "ops_us_median": statistics.median(ops),
           "outside_to_ops": statistics.median(outside) / statistics.median(ops),
           "build_us_median": statistics.median(builds) * us if builds else None}
    print_machine(sys.stdout)
    print(f"# {args.scheme}, {args.requests} requests of {args.prompt} tokens, {args.new} new; decode steps: "
          f"{len(builds)} builds, {len(forwards)} layer forwards")
    print(f"layer forward outside the ops: median {row['outside_ops_us_median']:.1f} us, p90 "
          f"{row['outside_ops_us_p90']:.1f} us (goal: at most 100)")
    print(f"layer forward inside the ops:  median {row['ops_us_median']:.1f} us "
          f"(outside / inside: {row['outside_to_ops']:.2f})")
    if builds:
        print(f"metadata build, once a step:   median {row['build_us_median']:.1f} us")
    if args.json:
        emit(row, True)


if __name__ == "__main__":
    main()
