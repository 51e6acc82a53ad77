"""Per-layer allocations that fit a budget: the K/V bits of each layer, from a sensitivity profile, whose cache
(or a vLLM engine's pages and side pool) fits in a number of bytes. allocation_for_budget lets every layer
keep its own bits; split_for_budget keeps one total of key + value bits in every layer."""

from __future__ import annotations

import torch

from ..allocate import Allocation, Sensitivity, allocate, allocate_split, layer_scheme
from ..scheme import Scheme
from .ledger import GB, layer_layouts, layouts_bytes
from .shape import ModelShape
from .vllm import VllmEngine, vllm_bytes


def _lowest(model: ModelShape, profile: Sensitivity, budget: float, context: int, batch: int,
            dtype, nbytes) -> tuple[list[int], int]:
    """(each layer's packed rows, the cache's bytes) at the profile's lowest level; refuses a profile of
    another model, or a budget that does not hold even that. nbytes(schemes): the bytes to fit
    (_bytes_to_fit)."""
    if profile.layers != model.layers:
        raise ValueError(f"plan: the sensitivity profile has {profile.layers} layers, {model.name} has {model.layers} "
                         "layers")
    schemes = [layer_scheme(min(profile.levels), min(profile.levels), profile.levels)] * model.layers
    low = layer_layouts(model, schemes, context, batch, dtype)
    lowest = nbytes(schemes)
    if budget < lowest:
        raise ValueError(f"plan: {budget / GB:.2f} GB does not hold {batch} x {context:,} tokens even at "
                         f"{min(profile.levels)} bits in every layer ({lowest / GB:.2f} GB)")
    return [lay.packed_capacity for lay in low], lowest


def _bytes_to_fit(model: ModelShape, context: int, batch: int, dtype, engine: VllmEngine | None):
    """nbytes(schemes): the bytes a per-layer allocation takes, as the layers' CacheLayouts or, with an
    engine, as its vLLM pages and side pool (vllm_bytes)."""
    def nbytes(schemes: list[Scheme]) -> int:
        if engine is None:
            return layouts_bytes(model, schemes, context, batch, dtype)
        return vllm_bytes(model, engine, schemes, context, batch)
    return nbytes


def _allocatable(model: ModelShape) -> None:
    """Refuse a per-layer allocation for a model it cannot plan: layers of two shapes (and in vLLM, the plugin
    publishes an allocation's pages unrounded, vllm_backend._publish_pages), KV-shared or recurrent layers."""
    model.one_shape("a per-layer allocation (its knapsack weighs every layer's rows alike)")
    model.own_caches("a per-layer allocation (its sensitivity profile measures every layer)")


def allocation_for_budget(model: ModelShape, profile: Sensitivity, budget: float, context: int, batch: int = 1,
                          dtype=torch.float16, engine: VllmEngine | None = None) -> tuple[Allocation, int, list[int]]:
    """(the per-layer K/V bits of least predicted cost whose cache of `batch` sequences of `context` tokens
    fits in `budget` bytes, its exact bytes, each layer's packed rows). A choice changes only the layer's
    code bytes, rows x head_dim x bits / 8 per kv head and side, so the knapsack weighs each layer by its
    rows (a sliding layer's ring holds fewer) and everything else is a fixed cost, counted at the lowest
    level. engine: a vLLM engine with the plugin, whose pages and side pool must fit (vllm_bytes; a
    layer's rows are then the tokens of the blocks it holds for a request, and each page's bytes per token are
    rounded up to the dtype, so the exact bytes are checked and the budget cut until they fit)."""
    _allocatable(model)
    nbytes = _bytes_to_fit(model, context, batch, dtype, engine)
    rows, lowest = _lowest(model, profile, budget, context, batch, dtype, nbytes)
    if engine is not None:  # a layer's pages hold the requests' whole blocks (a sliding one's: its window's)
        lowest_level = min(profile.levels)
        rows = engine.pool(model, [layer_scheme(lowest_level, lowest_level, profile.levels)] * model.layers) \
            .layer_rows(context)
    per_unit = batch * model.kv_heads * model.head_dim  # bits of code per (row x bit)
    fixed = lowest - 2 * min(profile.levels) * sum(rows) * per_unit // 8
    units = int((budget - fixed) * 8 // per_unit)
    while True:
        alloc = allocate(profile, units, weights=rows)
        exact = nbytes(alloc.schemes())
        if exact <= budget:
            return alloc, exact, rows
        units -= max(1, int((exact - budget) * 8 // per_unit))


def split_for_budget(model: ModelShape, profile: Sensitivity, budget: float, context: int, batch: int = 1,
                     dtype=torch.float16, engine: VllmEngine | None = None) -> tuple[Allocation, int, list[int]]:
    """allocation_for_budget for an allocation whose layers all keep the same key + value bits
    (allocate_split: every page the same bytes, for an engine with one page size): the most bits per
    layer whose cache (or the vLLM engine's pages and side pool) fits `budget`, each layer's split the
    one of least predicted cost."""
    _allocatable(model)
    nbytes = _bytes_to_fit(model, context, batch, dtype, engine)
    rows, _ = _lowest(model, profile, budget, context, batch, dtype, nbytes)
    # the totals a layer can keep: a key level plus a value level (levels 2 and 4 have no 5)
    for total in sorted({k + v for k in profile.levels for v in profile.levels}, reverse=True):
        alloc = allocate_split(profile, total / 2)
        exact = nbytes(alloc.schemes())
        if exact <= budget:
            return alloc, exact, rows
    raise AssertionError("unreachable: _lowest checked that the lowest total fits")
