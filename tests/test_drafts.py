"""Speculative decoding's rejected drafts at the paged ops (what the vLLM plugin relies on, docs/serving.md):
a step appends the next token and up to k drafts, and the next step resumes after the accepted ones,
writing the rejected positions again. With a side ring of window_tokens + k rows and k < recent, every
length a sequence resumes at reads exactly the tokens of a sequence that never saw a draft."""

import random

import pytest
import torch

from torch_rkv import reference as ref
from torch_rkv import scheme as presets
from torch_rkv.layout import PageLayout, side_shapes
from torch_rkv.ops import paged as ops
from torch_rkv.ops.structs import split_sides

D, PAGE, PAGES = 64, 128, 6


def cache(scheme, ring_drafts):
    """One sequence's pages (PAGES of PAGE tokens, one KV head of D) and side slot, its ring holding
    ring_drafts more rows than window_tokens."""
    layout = PageLayout(scheme, 1, D, PAGE, torch.float32)
    views = layout.views(torch.zeros(PAGES, layout.page_bytes, dtype=torch.uint8))
    side = {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in
            side_shapes(scheme, 1, D, 1, torch.float32, ring_drafts).items()}
    return [views["k_codes"], views["k_scale"], views.get("k_zero"), views["v_codes"], views["v_scale"],
            views.get("v_zero"), side["k_window"], side["v_window"], side["k_sink"], side["v_sink"]]


TABLES, SLOTS = torch.arange(PAGES, dtype=torch.int32)[None], torch.zeros(1, dtype=torch.int32)


def append(scheme, c, n, k, v):
    ops.paged_append(*split_sides(c), k, v, scheme.format, lengths=torch.tensor([n]),
                     query_start_loc=torch.tensor([0, k.shape[0]]), block_tables=TABLES, side_slots=SLOTS)


def largest_gap(name, drafts, ring_drafts, seed=0, end=PAGES * PAGE - 8) -> float:
    """Run one sequence with drafts (a random number a step, a random number of them accepted, the
    rejected ones random values of another scale) beside one without; the largest difference between
    the keys and values the two read, at every length the drafted one resumes at."""
    s = presets.by_name(name)
    gen = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(end + 8, 1, D, generator=gen) for _ in range(2))
    plain, drafted = cache(s, 0), cache(s, ring_drafts)
    for c in (plain, drafted):
        append(s, c, 0, keys[:100], values[:100])
    n = plain_n = 100
    rng, gap = random.Random(seed), 0.0
    while n < end - drafts - 1:
        k = rng.randint(0, drafts)
        accepted = rng.randint(0, k)
        ks, vs = keys[n : n + 1 + k].clone(), values[n : n + 1 + k].clone()
        ks[1 + accepted :] = 3 * torch.randn(k - accepted, 1, D, generator=gen)
        vs[1 + accepted :] = 3 * torch.randn(k - accepted, 1, D, generator=gen)
        append(s, drafted, n, ks, vs)
        n += 1 + accepted  # the verified tokens and the one the next step brings
        while plain_n < n:
            append(s, plain, plain_n, keys[plain_n : plain_n + 1], values[plain_n : plain_n + 1])
            plain_n += 1
        got = ref._cached(drafted, TABLES, SLOTS, 0, n, s.k_bits, s.v_bits, s.block, s.recent)
        want = ref._cached(plain, TABLES, SLOTS, 0, n, s.k_bits, s.v_bits, s.block, s.recent)
        gap = max(gap, *((a - b).abs().max().item() for a, b in zip(got, want)))
    return gap


@pytest.mark.parametrize("name", ["rkv-8", "rkv-3", "rkv-2", "kivi-2", "per-token-4"])
@pytest.mark.parametrize("drafts", [1, 3, 7])
def test_rejected_drafts_leave_what_plain_decoding_stores(name, drafts):
    assert largest_gap(name, drafts, drafts) == 0.0


def test_the_ring_needs_its_draft_rows_and_the_drafts_a_recent_window():
    """A plain ring loses rows a rejected draft overwrote; a scheme without a recent window (kvquant)
    quantizes a step's tokens at once and writes them nowhere else, so a rollback cannot read them:
    the plugin refuses num_speculative_tokens >= recent."""
    assert largest_gap("rkv-8", 3, 0) > 1.0
    assert largest_gap("kvquant-8", 3, 3) > 1.0
