"""paged_copy's GPU implementation (torch_rkv/gpu/copy.py: torch index ops, no Triton kernel), on CPU
tensors: against reference.paged_copy on canary-filled pools, and the C++ op's errors."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pagedbuild import Pool

from torch_rkv import reference as ref
from torch_rkv import scheme as presets
from torch_rkv.gpu import copy as gpu_copy
from torch_rkv.layout import PageLayout

PAGES, SLOTS = 6, 4
SCHEMES = {
    "kivi": presets.kivi(4, block=16, recent=4),  # asymmetric: zero buffers
    "per_token": presets.per_token(3),
    "sparse": presets.recommended_sparse(2),  # sparse outliers
}


def pool_of(name: str, seed: int) -> Pool:
    s = SCHEMES[name]
    layout = PageLayout(s, 2, 32, max(32, s.block), torch.float16)
    pool = Pool(layout, PAGES, SLOTS, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    pool.fill = torch.randint(0, layout.page_size + 1, (PAGES,), dtype=torch.int32, generator=gen)
    return pool


def outliers(pool: Pool) -> list:
    return [pool.views.get("k_outliers"), pool.views.get("v_outliers")]


@st.composite
def moves(draw, count):
    """src -> dst pairs: distinct destinations, sources anywhere (a source may be another pair's destination)."""
    n = draw(st.integers(0, count))
    dst = draw(st.permutations(range(count)))[:n]
    src = [draw(st.integers(0, count - 1)) for _ in range(n)]
    return src, dst


@given(name=st.sampled_from(sorted(SCHEMES)), pages=moves(PAGES), slots=moves(SLOTS),
       id_dtype=st.sampled_from([torch.int32, torch.int64]), with_fill=st.booleans(), seed=st.integers(0, 2**16))
def test_paged_copy_matches_reference(name, pages, slots, id_dtype, with_fill, seed):
    pool = pool_of(name, seed)
    want, cpu = pool.clone(), pool.clone()
    ids = [torch.tensor(v, dtype=id_dtype) for v in (*pages, *slots)]
    ref.paged_copy(*want.tensors(), want.fill if with_fill else None, *ids, *outliers(want))
    torch.ops.rkv.paged_copy(*cpu.tensors(), cpu.fill if with_fill else None, *ids, *outliers(cpu))
    assert gpu_copy.paged_copy(*pool.tensors(), pool.fill if with_fill else None, *ids, *outliers(pool)) is None
    # every byte of every page (codes, metadata, outliers, padding), page_fill and every side slot
    assert pool.equal(want) and pool.equal(cpu)


def test_paged_copy_overlapping_moves_gather_first():
    """A page that is both a source and a destination is read before it is written: a swap swaps."""
    pool = pool_of("kivi", 1)
    before = pool.raw.clone()
    sides = {k: v.clone() for k, v in pool.side.items()}
    gpu_copy.paged_copy(*pool.tensors(), pool.fill, torch.tensor([0, 1]), torch.tensor([1, 0]),
                        torch.tensor([2, 3]), torch.tensor([3, 2]))
    assert torch.equal(pool.raw[0], before[1]) and torch.equal(pool.raw[1], before[0])
    assert torch.equal(pool.raw[2:], before[2:])
    for k, v in sides.items():
        assert torch.equal(pool.side[k][[0, 1, 3, 2]], v)


def test_paged_copy_names_bad_ids():
    pool = pool_of("kivi", 2)
    t = pool.tensors()
    one = torch.tensor([1])
    with pytest.raises(ValueError, match=re.escape("rkv.paged_copy: src_pages[0] = 6 or dst_pages[0] = 0 is outside "
                                                   "the 6 pages")):
        gpu_copy.paged_copy(*t, pool.fill, torch.tensor([6]), torch.tensor([0]), one, one)
    with pytest.raises(ValueError, match=re.escape("rkv.paged_copy: src_slots[1] = 0 or dst_slots[1] = -1 is outside "
                                                   "the 4 side slots")):
        gpu_copy.paged_copy(*t, pool.fill, one, one, torch.tensor([0, 0]), torch.tensor([1, -1]))
    with pytest.raises(ValueError, match=re.escape("rkv.paged_copy: dst_pages names pages 3 twice")):
        gpu_copy.paged_copy(*t, pool.fill, torch.tensor([1, 2]), torch.tensor([3, 3]), one, one)
    with pytest.raises(ValueError, match=re.escape("rkv.paged_copy: dst_slots names side slots 1 twice")):
        gpu_copy.paged_copy(*t, pool.fill, one, one, torch.tensor([0, 0]), torch.tensor([1, 1]))


def test_paged_copy_names_bad_buffers():
    """The fake kernel's shape, dtype and device rules (csrc/paged_copy.cpp's messages)."""
    pool = pool_of("sparse", 3)
    t = pool.tensors()
    ko, vo = outliers(pool)
    one = torch.tensor([1])

    def call(tensors=t, src=one, dst=one, k_outliers=ko, v_outliers=vo):
        gpu_copy.paged_copy(*tensors, pool.fill, src, dst, one, one, k_outliers, v_outliers)

    cases = [
        ({"k_outliers": ko.float()}, TypeError, "rkv.paged_copy: k_outliers must be int32"),
        ({"v_outliers": vo[:3]}, ValueError, "rkv.paged_copy: v_outliers must have shape (pages=6, kv_heads, blocks, "
                                             "outliers), got [3,"),
        ({"dst": torch.tensor([2, 3])}, ValueError,
         "rkv.paged_copy: src_pages and dst_pages must have the same length, got 1 and 2"),
        ({"src": one.float()}, TypeError, "rkv.paged_copy: src_pages must be int32 or int64"),
        ({"src": one.to("meta")}, ValueError, "rkv.paged_copy: src_pages is on meta"),
        ({"tensors": [t[0], t[1][:3], *t[2:]]}, ValueError, "rkv.paged_copy: k_scale must have shape (pages=6, "),
        ({"tensors": [*t[:9], t[9][:1]]}, ValueError, "rkv.paged_copy: v_sink must have shape (slots=4, "),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            call(**kw)
