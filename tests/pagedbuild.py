"""Test helpers for the paged layout: pools with canaries, random block tables, fills through the
reference, and the ten tensors the paged ops take."""

from __future__ import annotations

import torch

from torch_rkv import reference as ref
from torch_rkv.layout import PageLayout
from torch_rkv.ops.structs import CacheSide, split_sides
from torch_rkv.scheme import Scheme

SIDES = ("k_window", "v_window", "k_sink", "v_sink")


class Pool:
    """One layer's paged cache: a (pages, page_bytes) byte pool, its region views, side slots and
    page_fill; canary-filled (random bytes everywhere) unless zeros=True."""

    def __init__(self, layout: PageLayout, pages: int, slots: int, gen: torch.Generator, zeros: bool = False):
        self.layout = layout
        if zeros:
            self.raw = torch.zeros(pages, layout.page_bytes, dtype=torch.uint8)
        else:
            self.raw = torch.randint(0, 256, (pages, layout.page_bytes), generator=gen, dtype=torch.uint8)
        self.side = {}
        for name, (shape, dt) in layout.side_shapes(slots).items():
            self.side[name] = torch.zeros(shape, dtype=dt) if zeros else torch.randn(shape, generator=gen).to(dt)
        self.fill = torch.zeros(pages, dtype=torch.int32)
        self._rebuild()

    def _rebuild(self):
        self.views = self.layout.views(self.raw)

    def clone(self, device="cpu") -> "Pool":
        out = object.__new__(Pool)
        out.layout = self.layout
        out.raw = self.raw.clone().to(device)
        out.side = {k: v.clone().to(device) for k, v in self.side.items()}
        out.fill = self.fill.clone().to(device)
        out._rebuild()
        return out

    def tensors(self) -> list:
        v = self.views
        return [v["k_codes"], v["k_scale"], v.get("k_zero"), v["v_codes"], v["v_scale"], v.get("v_zero"),
                *(self.side[n] for n in SIDES)]

    def sides(self, levels=(None, None), outliers=(None, None)) -> tuple[CacheSide, CacheSide]:
        """The pool as the paged ops' wrappers take it, with each side's levels and outliers."""
        return split_sides(self.tensors(), levels, outliers)

    def equal(self, other: "Pool") -> bool:
        same = torch.equal(self.raw.cpu(), other.raw.cpu()) and torch.equal(self.fill.cpu(), other.fill.cpu())
        return same and all(torch.equal(self.side[n].cpu().view(torch.uint8), other.side[n].cpu().view(torch.uint8))
                            for n in self.side)


def random_tables(gen: torch.Generator, pages: int, lengths: list[int], page_size: int, width: int) -> torch.Tensor:
    """Disjoint random pages for each sequence, enough for its length; the rest of a row 0."""
    order = torch.randperm(pages, generator=gen).tolist()
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, n in enumerate(lengths):
        need = -(-n // page_size)
        assert need <= width and need <= len(order), "the test asked for more pages than the pool holds"
        tables[b, :need] = torch.tensor([order.pop() for _ in range(need)], dtype=torch.int32)
    return tables


def fill(pool: Pool, scheme: Scheme, tables, slots, keys: torch.Tensor, values: torch.Tensor, lengths: list[int],
         chunk: int = 0, levels=(None, None)):
    """Append each sequence's first lengths[b] tokens of keys / values (B, H, n, D, storage space) through
    reference.paged_append, in chunks of `chunk` tokens (0: all at once), with codebooks `levels`."""
    n_done = [0] * len(lengths)
    while any(d < n for d, n in zip(n_done, lengths)):
        counts = [min(n - d, chunk or n) for d, n in zip(n_done, lengths)]
        rows_k = torch.cat([keys[b, :, d : d + m].transpose(0, 1) for b, (d, m) in enumerate(zip(n_done, counts))])
        rows_v = torch.cat([values[b, :, d : d + m].transpose(0, 1) for b, (d, m) in enumerate(zip(n_done, counts))])
        qsl = torch.tensor([0] + counts).cumsum(0)
        ref.paged_append(*pool.tensors(), pool.fill, tables, slots, torch.tensor(n_done), qsl,
                         rows_k.to(pool.layout.dtype), rows_v.to(pool.layout.dtype), scheme.k_bits, scheme.v_bits,
                         scheme.block, scheme.recent, scheme.k_clip, scheme.v_clip, k_levels=levels[0],
                         v_levels=levels[1])
        n_done = [d + m for d, m in zip(n_done, counts)]
