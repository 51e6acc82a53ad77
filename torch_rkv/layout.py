"""Buffer shapes and exact byte counts of a quantized KV cache, contiguous or paged: the one source of
truth that the caches allocate from and the memory planner counts with (docs/format.md).

Both layouts store a layer the same way (reference.py, "The quantized KV cache"): codes and metadata in
pages of P token rows per kv head, and per sequence a side slot of full-precision rows (S sinks and a
ring of W = recent + block - 1 newest tokens). The contiguous layout is one page of the whole capacity
per sequence; the paged one is a pool of small pages that sequences address through block tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .outliers import outlier_count
from .reference import ring_rows  # the rows a sliding-window ring holds (the planner uses it too)
from .scheme import Scheme

ALIGN = 16  # bytes: every region of a page starts on this boundary, and a page is a multiple of it


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _nbytes(shapes) -> int:
    total = 0
    for shape, dt in shapes:
        n = 1
        for x in shape:
            n *= x
        total += n * dt.itemsize
    return total


def packed_tokens(scheme: Scheme, capacity: int) -> int:
    """Quantized token rows per sequence and head for `capacity` tokens: whole blocks."""
    return round_up(max(0, capacity), scheme.block)


def max_tokens(scheme: Scheme, capacity: int) -> int:
    """Tokens a contiguous cache sized for `capacity` really holds: its rows, whole blocks."""
    return packed_tokens(scheme, capacity)


def binding_window(window: int, capacity: int) -> int:
    """The sliding window a cache of `capacity` tokens keeps a ring for: `window`, or 0 (every token, no
    ring) where the window is at least the capacity, which it then never binds (RKVCache and the
    planner both size a layer by it)."""
    return window if 0 < window < capacity else 0


def window_tokens(scheme: Scheme) -> int:
    """Rows of the full-precision ring: recent + block - 1 tokens at most wait there."""
    return scheme.recent + scheme.block - 1


def page_regions(scheme: Scheme, kv_heads: int, head_dim: int, rows: int):
    """(name, shape (kv_heads, rows or metadata rows, last dim), dtype) of one page's regions, in their
    byte order: codes of keys, then of values, then each side's scales and zeros (absent when
    symmetric), then, with sparse outliers, each side's entries (one row of K int32 per block), then, with
    refined key channels, their codes (k_refine: k_refine x k_refine_bits bits a row; torch_rkv.channels)."""
    s, h, d = scheme, kv_heads, head_dim
    out = [(f"{side}_codes", (h, rows, d * getattr(s, f"{side}_bits") // 8), torch.uint8) for side in ("k", "v")]
    for side in ("k", "v"):
        group = getattr(s, f"{side}_group_size") or d
        meta = (h, rows // getattr(s, f"{side}_block_tokens"), d // group)
        out.append((f"{side}_scale", meta, s.side_meta_dtype(side)))
        if not getattr(s, f"{side}_symmetric"):
            out.append((f"{side}_zero", meta, s.side_meta_dtype(side)))
    if s.outliers:
        k = outlier_count(s.outliers, s.block, d)
        out += [(f"{side}_outliers", (h, rows // s.block, k), torch.int32) for side in ("k", "v")]
    if s.k_refine:
        out.append(("k_refine", (h, rows, s.k_refine * s.k_refine_bits // 8), torch.uint8))
    return out


def side_shapes(scheme: Scheme, kv_heads: int, head_dim: int, slots: int, dtype: torch.dtype, drafts: int = 0,
                sink_store: bool = False):
    """name -> (shape, dtype) of the full-precision side rows of `slots` sequences. drafts: tokens an
    engine may append and take back (speculative decoding's rejected drafts, which the next step writes
    again): the ring holds that many more rows (the ops take any ring of at least window_tokens), so
    that a draft at position t overwrites the row of token t - ring, which no later read needs.
    sink_store: an entry of sinks more a slot, where the vLLM plugin keeps the sinks of a cached prefix
    whose slot went to another request (vllm_slots.SlotTracker)."""
    w, s = window_tokens(scheme), scheme.sinks
    w += drafts if w else 0  # (a scheme without a ring quantizes every token as it is written)
    kinds = (("window", w), ("sink", s)) + ((("sink_store", s),) if sink_store and s else ())
    return {f"{side}_{kind}": ((slots, kv_heads, rows, head_dim), dtype) for kind, rows in kinds for side in ("k", "v")}


def side_bytes(scheme: Scheme, kv_heads: int, head_dim: int, dtype: torch.dtype, drafts: int = 0,
               sink_store: bool = False) -> int:
    """Bytes of one sequence's side slot (sinks and window ring, keys and values; side_shapes)."""
    return _nbytes(side_shapes(scheme, kv_heads, head_dim, 1, dtype, drafts, sink_store).values())


@dataclass(frozen=True)
class CacheLayout:
    """One layer's contiguous buffers for `batch` sequences of up to `capacity` tokens (the layout may
    hold a few more: the rows are rounded up to whole blocks; `max_tokens` is exact). sliding_window > 0:
    a sliding-window layer, whose packed rows are a ring of ring_rows(...) rows whatever the capacity
    (the ops' sliding_window), so its bytes stop growing with the context."""

    scheme: Scheme
    batch: int
    kv_heads: int
    head_dim: int
    capacity: int
    dtype: torch.dtype = torch.float16  # full-precision sinks and window
    sliding_window: int = 0

    def __post_init__(self):
        self.scheme.check_head_dim(self.head_dim)
        if self.capacity < 0 or self.batch < 1 or self.kv_heads < 1 or self.sliding_window < 0:
            raise ValueError(f"CacheLayout: bad sizes batch={self.batch} kv_heads={self.kv_heads} "
                             f"capacity={self.capacity} sliding_window={self.sliding_window}")

    @property
    def packed_capacity(self) -> int:
        """Quantized token rows per sequence and head (a multiple of the scheme's block)."""
        if self.sliding_window > 0:
            return ring_rows(self.sliding_window, self.scheme.block)
        return packed_tokens(self.scheme, self.capacity)

    @property
    def window(self) -> int:
        return window_tokens(self.scheme)

    @property
    def max_tokens(self) -> int:
        return max_tokens(self.scheme, self.capacity)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every buffer; k_zero / v_zero absent when symmetric."""
        out = {}
        for name, shape, dt in page_regions(self.scheme, self.kv_heads, self.head_dim, self.packed_capacity):
            out[name.replace("_codes", "_packed")] = ((self.batch, *shape), dt)
        out.update(side_shapes(self.scheme, self.kv_heads, self.head_dim, self.batch, self.dtype))
        return out

    def allocate(self, device=None) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in self.shapes().items()}

    def nbytes(self) -> int:
        """Exact bytes of all buffers of this layer."""
        return _nbytes(self.shapes().values())


def default_page_size(scheme: Scheme) -> int:
    """The scheme's block, so that a page is the unit of quantization: a full page's codes and metadata
    depend on its own tokens only, which is what lets full pages be shared by reference and cached by
    prefix. Per-token schemes (block 1) take 16 tokens, vLLM's default block size."""
    return scheme.block if scheme.block >= 16 else round_up(16, scheme.block)


@dataclass(frozen=True)
class PageLayout:
    """The byte layout of one page (P tokens of one layer, every kv head) and of a side slot.

    A page is one contiguous run of `page_bytes` bytes holding the regions of page_regions, each at
    `offsets[name]` (ALIGN-aligned), so a pool is a (pages, page_bytes) uint8 tensor whose region views
    the paged ops take. P must be a multiple of the scheme's block."""

    scheme: Scheme
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.float16  # full-precision side rows

    def __post_init__(self):
        self.scheme.check_head_dim(self.head_dim)
        if self.page_size < 1 or self.page_size % self.scheme.block:
            raise ValueError(f"PageLayout: page_size {self.page_size} must be a positive multiple of the scheme's "
                             f"block ({self.scheme.block} tokens): a page holds whole quantization blocks")
        if self.kv_heads < 1:
            raise ValueError(f"PageLayout: kv_heads must be >= 1 (got {self.kv_heads})")

    def regions(self):
        return page_regions(self.scheme, self.kv_heads, self.head_dim, self.page_size)

    @cached_property  # (a frozen dataclass: computed once, per layout)
    def offsets(self) -> dict[str, int]:
        at, out = 0, {}
        for name, shape, dt in self.regions():
            out[name] = at
            at = round_up(at + _nbytes([(shape, dt)]), ALIGN)
        return out

    @property
    def page_bytes(self) -> int:
        name, shape, dt = self.regions()[-1]
        return round_up(self.offsets[name] + _nbytes([(shape, dt)]), ALIGN)

    @property
    def payload_bytes(self) -> int:
        """Bytes of a page that hold codes and metadata (page_bytes less the alignment padding)."""
        return sum(_nbytes([(shape, dt)]) for _, shape, dt in self.regions())

    def side_shapes(self, slots: int):
        return side_shapes(self.scheme, self.kv_heads, self.head_dim, slots, self.dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one sequence's side slot (sinks and window ring, keys and values)."""
        return side_bytes(self.scheme, self.kv_heads, self.head_dim, self.dtype)

    def views(self, pool: torch.Tensor) -> dict[str, torch.Tensor]:
        """The region views (pages, kv_heads, rows, last dim) of a (pages, page_bytes) uint8 pool: each
        contiguous within a page, page_bytes apart."""
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != self.page_bytes:
            raise ValueError(f"PageLayout.views: the pool must be a (pages, {self.page_bytes}) uint8 tensor, got "
                             f"{tuple(pool.shape)} {pool.dtype}")
        out = {}
        for name, shape, dt in self.regions():
            at, n = self.offsets[name], _nbytes([(shape, dt)])
            out[name] = pool[:, at : at + n].view(dt).unflatten(1, shape)
        return out

    def pages_for(self, tokens: int) -> int:
        """Pages a sequence of `tokens` tokens holds (the last one possibly partial)."""
        return -(-tokens // self.page_size)

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes one sequence of `tokens` tokens occupies in a PagedQuantizedKVCache: its pages' codes and
        metadata (page rounding included) and its side slot. An engine that keeps one buffer per page
        adds the alignment padding, page_bytes - payload_bytes a page (0 for the presets at head_dim 64
        and 128)."""
        return self.pages_for(tokens) * self.payload_bytes + self.slot_bytes
