"""Greedy decoding speed of SmolLM2-135M-Instruct with each KV cache, in one run.

    python bench/bench_generate.py [--json] [--prompts 1024 4096] [--new-tokens 64]

Caches: transformers' DynamicCache (full precision), transformers' QuantizedCache with the quanto and HQQ
backends where they are installed (pip install optimum-quanto / hqq), and torch_rkv presets. Each record:
cache, prompt length, decode tokens per second (prefill excluded), the speed relative to DynamicCache
measured in this run, and the KV-cache bytes after the run (torch_rkv: exact buffer bytes; DynamicCache:
its tensors; QuantizedCache: its quantized tensors plus its full-precision residual).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, print_machine  # noqa: E402

from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.eval import data  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402

warnings.filterwarnings("ignore")


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable from a cache object's attributes (for the transformers caches)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        inner = [getattr(obj, a) for a in ("_data", "_scale", "_shift") if isinstance(getattr(obj, a, None), torch.Tensor)]
        return sum(tensor_bytes(t, seen) for t in inner) if inner else obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes(x, seen) for x in vars(obj).values())
    return 0


def decode_speed(model, ids, cache, new_tokens: int) -> float:
    """Tokens per second of greedy decode steps after a prefill, with `cache`."""
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return new_tokens / (time.perf_counter() - start)


def transformers_caches(model):
    from transformers import DynamicCache

    yield "DynamicCache", lambda n: DynamicCache(config=model.config)
    try:
        from transformers import QuantizedCache
    except ImportError:
        return
    for backend, module, bits in (("quanto", "optimum.quanto", 4), ("quanto", "optimum.quanto", 2),
                                  ("hqq", "hqq", 4)):
        try:
            __import__(module)
        except ImportError:
            print(f"# QuantizedCache[{backend}] skipped: {module} is not installed", file=sys.stderr)
            continue
        yield (f"QuantizedCache[{backend},{bits}b]",
               lambda n, b=backend, k=bits: QuantizedCache(backend=b, config=model.config, nbits=k))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--presets", nargs="+", default=["rkv-4", "rkv-3", "kivi-2", "kvquant-4", "quarot-4", "per-token-8"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    print_machine()
    model, tok = data.load_model()
    text = data.read_text()
    all_ids = tok("<|endoftext|>" + text, return_tensors="pt").input_ids
    for n in args.prompts:
        ids = all_ids[:, :n]
        if ids.shape[1] < n:
            print(f"# text too short for a {n}-token prompt", file=sys.stderr)
            continue
        baseline = None
        caches = list(transformers_caches(model))
        for spec in args.presets:
            scheme = S.by_name(spec)
            caches.append((scheme.name, lambda cap, s=scheme: RKVCache(model, s, capacity=cap)))
        for name, make in caches:
            model.set_attn_implementation("sdpa")
            decode_speed(model, ids[:, :16], make(32), 4)  # warm-up: lazy extension builds, allocator
            model.set_attn_implementation("sdpa")
            cache = make(n + args.new_tokens + 1)
            tps = decode_speed(model, ids, cache, args.new_tokens)
            baseline = baseline or tps
            nbytes = cache.nbytes() if isinstance(cache, RKVCache) else tensor_bytes(cache)
            emit({"cache": name, "prompt": n, "new_tokens": args.new_tokens, "tokens_per_s": tps,
                  "vs_dynamic_cache": tps / baseline, "kv_bytes": nbytes}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
