"""The ledger: exact bytes of a KV cache, from torch_rkv.layout's CacheLayout and PageLayout, the code that
sizes the real cache's buffers, so a planned cache is exactly the cache that gets allocated
(tests/test_plan.py proves it). Bytes of every layer, marginal bytes a token, the longest context and the
most sequences a budget holds, contiguous or paged, and each layer's layout under a per-layer allocation."""

from __future__ import annotations

import torch

from ..layout import CacheLayout, PageLayout, binding_window, default_page_size
from ..scheme import Scheme
from .shape import ModelShape

# the units of memory: GB, what the command line and its report count in, and GiB
GIB = 1024**3
GB = 1000**3


def kv_bytes(model: ModelShape, scheme: Scheme | None, context: int, batch: int, dtype=torch.float16) -> int:
    """Exact KV-cache bytes of every layer for `batch` sequences of `context` tokens, and a hybrid's
    recurrent states (ModelShape.state_bytes: in full precision, whatever the scheme). A sliding layer's
    cache is its ring (CacheLayout with sliding_window: the same bytes at any context longer than the
    window; RKVCache's binding_window). scheme None: a full-precision cache in `dtype` (the baseline),
    min(context, window) tokens in a sliding layer."""
    full_kv, full_dim = model.full_shape
    states = batch * model.state_bytes(dtype)
    if scheme is None:
        def fp(tokens, kv_heads=model.kv_heads, head_dim=model.head_dim):
            return 2 * batch * kv_heads * tokens * head_dim * torch.finfo(dtype).bits // 8

        sliding = fp(min(context, model.sliding_window)) if model.sliding_layers else 0
        return model.full_layers * fp(context, full_kv, full_dim) + model.sliding_layers * sliding + states
    full = CacheLayout(scheme, batch, full_kv, full_dim, context, dtype).nbytes() if model.full_layers else 0
    window = binding_window(model.sliding_window or 0, context)
    sliding = CacheLayout(scheme, batch, model.kv_heads, model.head_dim, context, dtype,
                          sliding_window=window).nbytes() if model.sliding_layers else 0
    return model.full_layers * full + model.sliding_layers * sliding + states


def bytes_per_token(model: ModelShape, scheme: Scheme | None) -> float:
    """Marginal bytes per token at a 64K context (all layers, batch 1): codes and metadata; the fixed
    sinks and window ring do not grow with the context, nor does a sliding layer whose window is shorter."""
    block = 1 if scheme is None else scheme.block
    a, b = 1 << 16, (1 << 16) + 64 * block
    return (kv_bytes(model, scheme, b, 1) - kv_bytes(model, scheme, a, 1)) / (b - a)


def longest_context(model: ModelShape, scheme: Scheme | None, budget: float, batch: int = 1) -> int | None:
    """Largest context whose cache fits in `budget` bytes (binary search on the exact byte count). None:
    no limit, every layer slides and their caches fit (they stop growing at the window)."""
    if budget <= 0 or kv_bytes(model, scheme, 1, batch) > budget:
        return 0
    if not model.full_layers and kv_bytes(model, scheme, 1 << 40, batch) <= budget:
        return None
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
    """Most sequences of `context` tokens whose contiguous cache fits in `budget` bytes."""
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
    rows (PagedQuantizedKVCache, from PageLayout), and a hybrid's recurrent states. scheme None: a
    full-precision paged cache in `dtype` (pages of 16 tokens, vLLM's default).

    A sliding layer holds at most ceil((W + P) / P) pages of P tokens: its newest W tokens straddle at
    most ceil(W / P) + 1 pages, and pages wholly before the window are never read again, so an engine
    frees them (vLLM does). An upper bound for an engine that frees them; one that does not holds every
    page like a full layer."""
    p = page_size or (16 if scheme is None else default_page_size(scheme))

    def pages(layer_context: int) -> int:
        return -(-layer_context // p)

    sliding = min(pages(context), pages(model.sliding_window + p)) if model.sliding_layers else 0
    total = model.state_bytes(dtype)
    for layers, held, (kv_heads, head_dim) in ((model.full_layers, pages(context), model.full_shape),
                                               (model.sliding_layers, sliding, (model.kv_heads, model.head_dim))):
        if scheme is None:
            total += layers * held * 2 * kv_heads * p * head_dim * torch.finfo(dtype).bits // 8
        else:
            layout = PageLayout(scheme, kv_heads, head_dim, p, dtype)
            # codes and metadata, the page's block-table entry, and the layer's side slot
            total += layers * (held * (layout.payload_bytes + 4) + layout.slot_bytes)
    return total


def paged_sequences(model: ModelShape, scheme: Scheme | None, budget: float, context: int,
                    page_size: int | None = None) -> int:
    """Sequences of `context` tokens a paged cache of `budget` bytes holds at once."""
    return max(0, int(budget // paged_sequence_bytes(model, scheme, context, page_size)))


def layer_layouts(model: ModelShape, schemes: list[Scheme], context: int, batch: int,
                  dtype=torch.float16) -> list[CacheLayout]:
    """Each layer's CacheLayout under a per-layer allocation (a sliding layer: its ring)."""
    return [CacheLayout(s, batch, *model.shape_of(i), context, dtype,
                        sliding_window=binding_window(model.window_of(i), context)) for i, s in enumerate(schemes)]


def layouts_bytes(model: ModelShape, schemes: list[Scheme], context: int, batch: int, dtype=torch.float16) -> int:
    """The bytes of every layer's CacheLayout under a per-layer allocation."""
    return sum(lay.nbytes() for lay in layer_layouts(model, schemes, context, batch, dtype))


def ledger_rows(model: ModelShape, budget: float, context: int, batch: int,
                schemes: list[tuple[str, Scheme | None]]) -> list[dict]:
    """The ledger's row of each scheme (None: a full-precision cache of that name) for a cache of `budget`
    bytes: its bytes for `batch` sequences of `context` tokens, whether they fit, the longest context of
    one sequence, and how many sequences of `context` tokens a contiguous or a paged cache holds."""
    rows = []
    for name, scheme in schemes:
        if scheme is not None:
            scheme.check_served()  # (the report's simulated peers have no cache to count)
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
