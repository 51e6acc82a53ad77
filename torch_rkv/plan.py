"""`python -m torch_rkv plan`: the memory ledger. How much context fits on one GPU with each KV scheme.

Byte counts come from torch_rkv.layout.CacheLayout, the code that sizes the real cache's buffers, so a
planned cache is exactly the cache that gets allocated (tests/test_plan.py proves it).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from . import scheme as S
from .integrations.models import uses_sliding_window
from .layout import CacheLayout, PageLayout, default_page_size, round_up
from .scheme import Scheme

GIB = 1024**3
GB = 1000**3


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float  # number of weights

    def weight_bytes(self, bits: float) -> float:
        return self.params * bits / 8


# public config facts (config.json of each release)
MODELS = {
    "llama-2-7b": ModelShape("Llama-2-7B", 32, 32, 128, 6.74e9),
    "llama-3-8b": ModelShape("Llama-3-8B", 32, 8, 128, 8.03e9),
    "llama-3-70b": ModelShape("Llama-3-70B", 80, 8, 128, 70.6e9),
    "mistral-7b": ModelShape("Mistral-7B", 32, 8, 128, 7.24e9),
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 28, 4, 128, 7.62e9),
    "qwen2.5-72b": ModelShape("Qwen2.5-72B", 80, 8, 128, 72.7e9),
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 3, 64, 0.135e9),
}

DEFAULT_SCHEMES = ("per-token-8", "per-token-4", "quarot-4", "kvquant-3", "kivi-2", "rkv-4", "rkv-3", "rkv-mixed-2", "rkv-2")


def from_config(path: str, params: float | None) -> ModelShape:
    """A transformers config.json: layers, KV heads, head_dim; parameters from --params or estimated
    from the config (embeddings + attention + gated MLP)."""
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    if uses_sliding_window(cfg.get("layer_types"), cfg.get("sliding_window"), cfg.get("use_sliding_window", True)):
        # a sliding layer holds only its window: counting it as global would misstate the ledger, and the
        # cache does not serve such layers yet (integrations/models.py)
        raise NotImplementedError(f"{path}: sliding-window layers (sliding_window={cfg.get('sliding_window')}) are "
                                  "not planned yet; torch_rkv's caches serve full-attention layers only")
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    layers = cfg["num_hidden_layers"]
    if params is None:
        inter = cfg.get("intermediate_size", 4 * hidden)
        attn = hidden * head_dim * (heads * 2 + kv * 2)
        mlp = 3 * hidden * inter
        emb = cfg.get("vocab_size", 0) * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
        params = layers * (attn + mlp) + emb
    return ModelShape(cfg.get("_name_or_path") or path, layers, kv, head_dim, float(params))


def kv_bytes(model: ModelShape, scheme: Scheme | None, context: int, batch: int, dtype=torch.float16) -> int:
    """Exact KV-cache bytes of every layer for `batch` sequences of `context` tokens. scheme None: a
    full-precision cache in `dtype` (the baseline)."""
    if scheme is None:
        return 2 * model.layers * batch * model.kv_heads * context * model.head_dim * torch.finfo(dtype).bits // 8
    return model.layers * CacheLayout(scheme, batch, model.kv_heads, model.head_dim, context, dtype).nbytes()


def bytes_per_token(model: ModelShape, scheme: Scheme | None) -> float:
    """Marginal bytes per token (all layers, batch 1): codes and metadata; the fixed sinks and window
    ring do not grow with the context."""
    block = 1 if scheme is None else scheme.block
    a, b = 1 << 16, (1 << 16) + 64 * block
    return (kv_bytes(model, scheme, b, 1) - kv_bytes(model, scheme, a, 1)) / (b - a)


def longest_context(model: ModelShape, scheme: Scheme | None, budget: float, batch: int = 1) -> int:
    """Largest context whose cache fits in `budget` bytes (binary search on the exact byte count)."""
    if budget <= 0 or kv_bytes(model, scheme, 1, batch) > budget:
        return 0
    lo, hi = 1, 1
    while kv_bytes(model, scheme, hi, batch) <= budget and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv_bytes(model, scheme, mid, batch) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def most_sequences(model: ModelShape, scheme: Scheme | None, budget: float, context: int) -> int:
    one = kv_bytes(model, scheme, context, 1)
    if one > budget:
        return 0
    n = int(budget // one)
    while n > 0 and kv_bytes(model, scheme, context, n) > budget:
        n -= 1
    return n


def paged_sequence_bytes(model: ModelShape, scheme: Scheme | None, context: int, page_size: int | None = None,
                         dtype=torch.float16) -> int:
    """Exact bytes one sequence of `context` tokens holds in a paged cache, every layer: its pages (the
    last one partial: page rounding included), their page counts and its side slot of full-precision
    rows (PagedQuantizedKVCache, from PageLayout). scheme None: a full-precision paged cache in `dtype`
    (pages of 16 tokens, vLLM's default)."""
    if scheme is None:
        p = page_size or 16
        return 2 * model.layers * model.kv_heads * round_up(context, p) * model.head_dim * torch.finfo(dtype).bits // 8
    layout = PageLayout(scheme, model.kv_heads, model.head_dim, page_size or default_page_size(scheme), dtype)
    return model.layers * (layout.sequence_bytes(context) + 4 * layout.pages_for(context))


def paged_sequences(model: ModelShape, scheme: Scheme | None, budget: float, context: int,
                    page_size: int | None = None) -> int:
    """Sequences of `context` tokens a paged cache of `budget` bytes holds at once."""
    return max(0, int(budget // paged_sequence_bytes(model, scheme, context, page_size)))


def plan(model: ModelShape, gpu_bytes: float, weight_bytes: float, reserve_bytes: float, context: int, batch: int,
         schemes: list[tuple[str, Scheme | None]]) -> list[dict]:
    budget = gpu_bytes - weight_bytes - reserve_bytes
    rows = []
    for name, scheme in schemes:
        need = kv_bytes(model, scheme, context, batch)
        rows.append({
            "scheme": name,
            "bits_per_element": 16.0 if scheme is None else scheme.effective_bits(model.head_dim),
            "bytes_per_token": bytes_per_token(model, scheme),
            "kv_bytes": need,
            "fits": need <= budget,
            "longest_context_batch1": longest_context(model, scheme, budget),
            "max_sequences_at_context": most_sequences(model, scheme, budget, context),
            "paged_sequences_at_context": paged_sequences(model, scheme, budget, context),
            "paged_bytes_per_sequence": paged_sequence_bytes(model, scheme, context),
        })
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3-70b", help=f"a preset ({', '.join(MODELS)}) or use --config")
    p.add_argument("--config", help="config.json of any transformers model")
    p.add_argument("--params", type=float, help="number of weights (with --config; default: estimated)")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory in GB (1e9 bytes)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--weight-bits", type=float, default=4.0, help="bits per weight (default 4)")
    weights.add_argument("--weight-gb", type=float, help="weight memory in GB instead of --weight-bits")
    p.add_argument("--reserve-gb", type=float, default=4.0, help="activations, workspace, fragmentation (GB)")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), help="presets like rkv-3 or kivi-2")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    if args.config:
        model = from_config(args.config, args.params)
    elif args.model.lower() in MODELS:
        model = MODELS[args.model.lower()]
    else:
        raise SystemExit(f"torch_rkv plan: unknown model {args.model!r}; use one of {', '.join(MODELS)} or --config")
    weight = args.weight_gb * GB if args.weight_gb is not None else model.weight_bytes(args.weight_bits)
    schemes: list[tuple[str, Scheme | None]] = [("fp16", None)]
    for spec in args.schemes:
        schemes.append((spec, S.by_name(spec)))
    rows = plan(model, args.gpu_gb * GB, weight, args.reserve_gb * GB, args.context, args.batch, schemes)
    if args.json:
        print(json.dumps({"model": model.__dict__, "rows": rows}, indent=1))
        return 0
    budget = args.gpu_gb * GB - weight - args.reserve_gb * GB
    print(f"{model.name}: {model.layers} layers x {model.kv_heads} KV heads x head_dim {model.head_dim}, "
          f"{model.params / 1e9:.2f}B weights = {weight / GB:.1f} GB; GPU {args.gpu_gb:.0f} GB, reserve "
          f"{args.reserve_gb:.0f} GB -> {budget / GB:.1f} GB for the KV cache")
    print(f"context {args.context:,} tokens x batch {args.batch}\n")
    print(f"{'scheme':14s} {'bits/el':>7s} {'KB/token':>9s} {'KV cache GB':>12s} {'fits':>5s} "
          f"{'longest ctx (b=1)':>18s} {'seqs @ ctx':>11s} {'paged':>6s}")
    for r in rows:
        print(f"{r['scheme']:14s} {r['bits_per_element']:7.2f} {r['bytes_per_token'] / 1024:9.1f} "
              f"{r['kv_bytes'] / GB:12.2f} {'yes' if r['fits'] else 'no':>5s} {r['longest_context_batch1']:18,d} "
              f"{r['max_sequences_at_context']:11d} {r['paged_sequences_at_context']:6d}")
    print("\nseqs @ ctx: a contiguous cache of that batch; paged: PagedQuantizedKVCache, page rounding and each "
          "sequence's side slot (sinks and window) included")
    return 0
