"""A step's work on the vLLM plugin's side pool, before any attention of the step: the sink-store saves,
then the slot inits (SlotTracker's StepPlan). The metadata builder turns them into index tensors once a
step (plan_side_work) and runs them on each of its layers' side pools (run_side_work), so that a layer's
forward holds only its kernel launches. Plain PyTorch, no vLLM: tests/test_vllm_side.py checks it
against one init at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import quantized_count, read_rows
from ..scheme import Scheme
from .vllm_slots import SlotInit


@dataclass(frozen=True)
class SideWork:
    """A step's side-pool work for every layer of a builder (int64 index tensors on the pool's device).

    saves: the sinks of slot save_slots[i] go to sink-store entry save_entries[i], before any init.
    Inits: slot donor_dst[i] takes the sinks of slot donor_src[i], slot stored_dst[i] those of entry
    stored_src[i] (every sink row: those past a short prefix's own tokens are written by its append
    before any read), and window ring row ring_pos[i] of slot ring_slots[i] the quantized row ring_rows[i]
    of page ring_pages[i], dequantized: the window of a prefix-cache hit, whose full-precision rows are
    gone. counts: (saves, donors, stored, ring rows), known on the host when the plan was made."""

    save_slots: torch.Tensor
    save_entries: torch.Tensor
    donor_dst: torch.Tensor
    donor_src: torch.Tensor
    stored_dst: torch.Tensor
    stored_src: torch.Tensor
    ring_pages: torch.Tensor
    ring_rows: torch.Tensor
    ring_slots: torch.Tensor
    ring_pos: torch.Tensor
    counts: tuple[int, int, int, int]


def plan_side_work(inits: list[tuple[SlotInit, list[int]]], saves: list[tuple[int, int]], scheme: Scheme,
                   page_size: int, ring: int, device) -> SideWork | None:
    """The SideWork of a step's saves and inits (each init with its request's pages), for side pools whose
    window ring holds `ring` rows; None when the step has neither."""
    if not inits and not saves:
        return None
    donors, stored, rows = [], [], []
    for init, pages in inits:
        if min(scheme.sinks, init.cached):
            (donors if init.sinks_from >= 0 else stored).append(
                (init.dst, init.sinks_from if init.sinks_from >= 0 else init.sinks_stored))
        for p in range(max(scheme.sinks, quantized_count(init.cached, scheme.recent, scheme.block)), init.cached):
            rows.append((pages[p // page_size], p % page_size, init.dst, p % ring))

    def columns(pairs: list[tuple], width: int) -> list[torch.Tensor]:
        t = torch.tensor(pairs, dtype=torch.int64).reshape(len(pairs), width)
        return [t[:, i].to(device) for i in range(width)]

    return SideWork(*columns(saves, 2), *columns(donors, 2), *columns(stored, 2), *columns(rows, 4),
                    counts=(len(saves), len(donors), len(stored), len(rows)))


def run_side_work(work: SideWork, side: dict, cache: dict, scheme: Scheme, levels: tuple, outliers: tuple,
                  refine=None) -> None:
    """Run a step's SideWork on one layer's side pool `side` (layout.side_shapes' tensors, sink store
    included), reading the window rows from its page regions `cache` (PageLayout.views' names). refine:
    (k_refine, k_channels) of refined key channels, or None."""
    saves, donors, stored, rows = work.counts
    for part, bits, lv, outl, rf in (("k", scheme.k_bits, levels[0], outliers[0], refine),
                                     ("v", scheme.v_bits, levels[1], outliers[1], None)):
        sink, window = side[f"{part}_sink"], side[f"{part}_window"]
        if saves:
            side[f"{part}_sink_store"][work.save_entries] = sink[work.save_slots]
        if donors:
            sink[work.donor_dst] = sink[work.donor_src]
        if stored:
            sink[work.stored_dst] = side[f"{part}_sink_store"][work.stored_src]
        if rows:
            got = read_rows(cache[f"{part}_codes"], cache[f"{part}_scale"], cache.get(f"{part}_zero"), bits,
                            work.ring_pages, work.ring_rows, lv, outl, scheme.block, rf)  # (heads, rows, head_dim)
            window[work.ring_slots, :, work.ring_pos] = got.transpose(0, 1).to(window.dtype)
