"""The Triton kernels' device-side asserts: on a GPU they stop a call whose data is bad (a page or slot
outside its pool, a position past the rope table, a code of too many bits, a write into a full page),
which the launchers do not read on the host there. Triton's interpreter skips device asserts unless its
builder's options say debug, so these tests turn that on and run each asserting kernel on CPU tensors
past the host checks, with bad data and with the good data next to it."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
from pagedbuild import Pool  # noqa: E402

from torch_rkv.gpu import cache as gpu_cache  # noqa: E402
from torch_rkv.gpu import pack as gpu_pack  # noqa: E402
from torch_rkv.gpu import rope as gpu_rope  # noqa: E402
from torch_rkv.gpu.tokens import check_cache_kernel  # noqa: E402
from torch_rkv.layout import PageLayout  # noqa: E402
from torch_rkv.scheme import by_name  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the asserts are checked under Triton's interpreter (CPU tensors)")


@pytest.fixture
def asserts(monkeypatch):
    """Device asserts on in Triton's interpreter; a failed one raises an error carrying its message."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions(debug=True))

    def raises(message: str):
        return pytest.raises(Exception, match=message)
    return raises


def check(lengths, tables, slots, max_tokens=384, page_size=128, pages=8, n_slots=4, rope_positions=0):
    lengths, tables = torch.tensor(lengths, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32)
    slots = torch.tensor(slots, dtype=torch.int32)
    check_cache_kernel[(lengths.shape[0],)](lengths, lengths, tables, tables.stride(0), slots, max_tokens, page_size,
                                            pages, n_slots, rope_positions, HAS_NEW=False, PAGED=True,
                                            HAS_SLOTS=True, BLOCK=16)


def test_the_attention_checks_stop_bad_pages_slots_lengths_and_positions(asserts):
    check([5, 300], [[0, 1, 2], [3, 4, 7]], [0, 3])  # (the largest page and slot: fine)
    check([5, 384], [[0, 1, 2], [3, 4, 7]], [0, 3], rope_positions=384)
    with asserts("a block table names a page outside the pool"):
        check([5, 300], [[0, 1, 2], [3, 4, 8]], [0, 3])
    with asserts("a block table names a page outside the pool"):
        check([5, 300], [[0, 1, 2], [3, -1, 7]], [0, 3])
    with asserts("side_slots names a slot outside the pool"):
        check([5, 300], [[0, 1, 2], [3, 4, 7]], [0, 4])
    with asserts("a sequence's tokens exceed what its table holds"):
        check([5, 385], [[0, 1, 2], [3, 4, 7]], [0, 3])
    with asserts("positions past the rope table"):
        check([5, 300], [[0, 1, 2], [3, 4, 7]], [0, 3], rope_positions=299)


def test_pack_stops_a_code_of_too_many_bits(asserts):
    codes = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.uint8)
    out = torch.empty(1, 2, dtype=torch.uint8)
    gpu_pack._pack_kernel[(1, 1)](codes, out, 8, 2, BITS=2, BLOCK=16)
    codes[0, 5] = 4
    with asserts("codes must be < 2\\^bits"):
        gpu_pack._pack_kernel[(1, 1)](codes, out, 8, 2, BITS=2, BLOCK=16)


def test_rope_stops_a_position_past_its_table(asserts):
    x, cos, sin = torch.randn(3, 8), torch.ones(4, 4), torch.zeros(4, 4)
    out = torch.empty_like(x)
    gpu_rope.launch(x, cos, sin, torch.tensor([0, 3, 1]), out, False, False)
    with asserts("positions outside the cos/sin table"):
        gpu_rope.launch(x, cos, sin, torch.tensor([0, 4, 1]), out, False, False)


def test_the_append_stops_bad_pages_slots_and_writes_into_full_pages(asserts, monkeypatch):
    """paged_append's plan and place kernels, past its host check: two sequences of 20 and 5 tokens into
    pages of 16 (blocks of 8)."""
    monkeypatch.setattr(gpu_cache, "_check_data", lambda *args, **kwargs: None)
    s = by_name("rkv-4")
    s = s.replace(k_block_tokens=8, v_block_tokens=min(s.v_block_tokens, 8), recent=8)
    gen = torch.Generator().manual_seed(0)

    def append(tables, slots, fill=None, lengths=(0, 0), counts=(20, 5)):
        pool = Pool(PageLayout(s, 2, 32, 16, torch.float32), 4, 2, gen)
        qsl = torch.tensor([0, *counts]).cumsum(0)
        k, v = torch.randn(sum(counts), 2, 32, generator=gen), torch.randn(sum(counts), 2, 32, generator=gen)
        gpu_cache.paged_append(*pool.tensors(), fill, torch.tensor(tables, dtype=torch.int32),
                               torch.tensor(slots, dtype=torch.int32), torch.tensor(lengths), qsl, k, v, s.k_bits,
                               s.v_bits, s.block, s.recent, s.k_clip, s.v_clip)

    append([[0, 1], [2, 3]], [0, 1])
    with asserts("a block table (or side_slots entry )?names a page outside the pool|outside the pool"):
        append([[0, 4], [2, 3]], [0, 1])
    with asserts("side_slots (entry )?(names a slot )?(is )?outside the pool"):
        append([[0, 1], [2, 3]], [0, 2])
    full = torch.tensor([16, 0, 0, 0], dtype=torch.int32)  # page 0's 16 rows are quantized: a full page
    with asserts("a write into rows a page already holds"):
        append([[0, 1], [2, 3]], [0, 1], fill=full)
