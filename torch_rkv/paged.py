"""PagedQuantizedKVCache: a pool of quantized pages shared by many sequences of any length.

What a serving engine keeps (vLLM, SGLang, transformers' continuous batching), in torch_rkv's format:
every layer's KV cache lives in fixed-size pages of P tokens (torch_rkv.layout.PageLayout), addressed
through per-sequence block tables; sequences join, grow by any number of tokens, fork and leave at any
step; full pages are final (quantized once) and shared by reference between a sequence and its forks.
Each running sequence also owns a side slot of full-precision rows: its sinks and the ring of its
newest tokens, which keep the QuantizedKVCache semantics (docs/format.md).

One step of a model over the cache:

    batch = cache.schedule([seq_a, seq_b], [1, 37])      # allocates pages; host-side bookkeeping only
    for layer in range(layers):
        ...
        out = cache.prefill(layer, batch, q, k, v)        # chunks: attention over cache + chunk, then append
        # or, one token per sequence: cache.append(layer, batch, k, v); out = cache.attend(layer, batch, q)
    cache.commit(batch)                                   # the sequences now hold their new tokens

The per-layer calls take only tensors (batch.block_tables, side_slots, lengths, ...), so a decode step
traces under torch.compile(fullgraph=True) with the batch size dynamic.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from .cache import layer_outliers, layer_refine
from .channels import channel_buffers
from .codebook import layer_levels, level_buffers
from .layout import PageLayout, default_page_size
from .ops.paged import paged_append, paged_copy, paged_decode_attention, paged_prefill_attention
from .ops.structs import CacheSide, split_sides
from .rotations import RotatedCache, scheme_rotations
from .scheme import Scheme, per_layer


@dataclass
class PagedBatch:
    """One step's sequences as the ops take them (device tensors) and as the host scheduled them."""

    seq_ids: list[int]
    counts: list[int]              # new tokens per sequence this step
    block_tables: torch.Tensor     # (B, max_pages) int32, unused entries 0
    side_slots: torch.Tensor       # (B,) int32
    lengths: torch.Tensor          # (B,) int64: tokens cached before this step
    query_start_loc: torch.Tensor  # (B+1,) int64: rows of the new tokens
    positions: torch.Tensor        # (T,) int64: position of each new token
    max_query_len: int

    @property
    def lengths_after(self) -> torch.Tensor:
        return self.lengths + (self.query_start_loc[1:] - self.query_start_loc[:-1])


@dataclass
class _Sequence:
    pages: list[int]
    slot: int
    length: int = 0


class PagedQuantizedKVCache(RotatedCache, torch.nn.Module):
    """num_layers x num_pages pages of page_size tokens (every kv head), and max_seqs side slots.

    scheme: one for every layer, or one per layer (a per-layer bit allocation, torch_rkv.allocate: the
    layers differ only in their key and value bits and clipping, PER_LAYER; each layer's pages hold its
    own bytes, and the page pool and the sequences' block tables are shared by every layer).
    page_size: a multiple of the scheme's block (default: the block; 16 for per-token schemes).
    max_pages_per_seq: the block tables' width (default: every page), which bounds a sequence's length.
    rope: (cos, sin) (positions, rot_dim / 2), the model's table, for pre-RoPE schemes; it must cover
    max_pages_per_seq * page_size positions. dtype: of the side rows and of appended tokens.
    sliding_window / softcap: every layer's attention sees only the newest sliding_window tokens / soft-caps
    its scores (the ops' arguments; pages before the window are never read, but this cache keeps them:
    an engine such as vLLM frees them; a model mixing sliding and global layers takes a cache per kind).
    """

    def __init__(self, scheme: Scheme | Sequence[Scheme], num_layers: int, kv_heads: int, head_dim: int,
                 num_pages: int, max_seqs: int,
                 page_size: Optional[int] = None, dtype: torch.dtype = torch.float16, device=None,
                 rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, rope_interleaved: bool = False,
                 max_pages_per_seq: Optional[int] = None, sliding_window: int = 0, softcap: float = 0.0,
                 model_layers: Optional[Sequence[int]] = None):
        super().__init__()
        if num_layers < 1 or num_pages < 1 or max_seqs < 1:
            raise ValueError(f"PagedQuantizedKVCache: num_layers ({num_layers}), num_pages ({num_pages}) and max_seqs "
                             f"({max_seqs}) must be >= 1")
        self.schemes = per_layer_schemes(scheme, num_layers)
        if len({s.k_refine > 0 for s in self.schemes}) > 1:
            raise ValueError("PagedQuantizedKVCache: some layers refine key channels and others do not; the pages "
                             "need the refinement region in every layer or in none (k_refine >= 1 everywhere, or 0)")
        scheme = self.scheme = self.schemes[0]  # (its sinks, window, block and rotations are every layer's)
        self.num_layers = num_layers
        page_size = page_size or default_page_size(scheme)
        self.layouts = [PageLayout(s, kv_heads, head_dim, page_size, dtype) for s in self.schemes]
        self.layout = self.layouts[0]
        self.num_pages, self.max_seqs = num_pages, max_seqs
        self.max_pages_per_seq = max_pages_per_seq or num_pages
        self.rope_interleaved = rope_interleaved
        self.sliding_window, self.softcap = sliding_window, float(softcap)
        # each region of the page format in its own tensor (layers, pages, kv_heads, rows, last dim): the same
        # bytes per page as PageLayout's one-buffer page (page_bytes() packs them), but typed, so that
        # torch.compile can trace appends (aot_autograd cannot mutate dtype views of one byte buffer)
        # (a region whose shape differs by layer, the codes of a per-layer allocation: one tensor per layer)
        self.regions = [name for name, _, _ in self.layout.regions()]
        self._per_layer = set()
        for name, shape, dt in self.layout.regions():
            shapes = [{n: s for n, s, _ in lay.regions()}[name] for lay in self.layouts]
            if all(s == shape for s in shapes):
                self.register_buffer(name, torch.zeros(num_layers, num_pages, *shape, dtype=dt, device=device))
                continue
            self._per_layer.add(name)
            for layer, s in enumerate(shapes):
                self.register_buffer(f"{name}_{layer}", torch.zeros(num_pages, *s, dtype=dt, device=device))
        for name, (shape, dt) in self.layout.side_shapes(max_seqs).items():
            self.register_buffer(name, torch.zeros((num_layers, *shape), dtype=dt, device=device))
        self.register_buffer("page_fill", torch.zeros(num_layers, num_pages, dtype=torch.int32, device=device))
        rot = scheme_rotations(scheme, head_dim, rope, rope_interleaved, device, "PagedQuantizedKVCache",
                               self.max_tokens, "a sequence's")
        self.register_rotations(rot)
        for name, t in level_buffers(scheme, num_layers, model_layers, device, "PagedQuantizedKVCache").items():
            self.register_buffer(name, t)
        for name, t in channel_buffers(self.schemes, model_layers, kv_heads, head_dim, device,
                                       "PagedQuantizedKVCache").items():
            self.register_buffer(name, t)
        # host-side bookkeeping: which pages and slots are free, who references each page
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0

    # ------------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence can hold (its block table's width in pages)."""
        return self.max_pages_per_seq * self.page_size

    def nbytes(self) -> int:
        """Exact bytes of the pages, the side slots and the page counts (all layers), from the layouts."""
        return sum(self.num_pages * lay.payload_bytes + self.max_seqs * lay.slot_bytes + 4 * self.num_pages
                   for lay in self.layouts)

    def page_bytes(self, layer: int, page: int) -> torch.Tensor:
        """Page `page` of `layer` in the documented one-buffer byte layout (PageLayout, docs/format.md),
        (page_bytes,) uint8: what an engine that keeps one buffer per page stores."""
        lay = self.layouts[layer]
        out = torch.zeros(lay.page_bytes, dtype=torch.uint8, device=self.page_fill.device)
        for name in self.regions:
            raw = self._region(name, layer)[page].contiguous().view(torch.uint8).reshape(-1)
            out[lay.offsets[name] : lay.offsets[name] + raw.numel()] = raw
        return out

    def free_pages(self) -> int:
        return len(self._free_pages)

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def length(self, seq: int) -> int:
        return self._seq(seq).length

    def pages_of(self, seq: int) -> list[int]:
        return list(self._seq(seq).pages)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # ------------------------------------------------------------------------------------------
    def add(self) -> int:
        """A new empty sequence (a side slot, no pages yet); returns its id."""
        if not self._free_slots:
            raise RuntimeError(f"PagedQuantizedKVCache: all {self.max_seqs} sequence slots are in use")
        seq = self._next_id
        self._next_id += 1
        self._seqs[seq] = _Sequence(pages=[], slot=self._free_slots.pop())
        return seq

    def remove(self, seq: int) -> None:
        """Drop a sequence: its side slot and every page no other sequence references go back to the pool."""
        s = self._seqs.pop(self._check(seq))
        for page in s.pages:
            self._unref(page)
        self._free_slots.append(s.slot)

    def fork(self, seq: int) -> int:
        """A new sequence with the same tokens: full pages shared by reference, the open (partial) page
        and the side rows copied (rkv::paged_copy). For beam search, parallel sampling and a prompt
        prefilled once for many continuations."""
        parent = self._seq(seq)
        if not self._free_slots:
            raise RuntimeError(f"PagedQuantizedKVCache: all {self.max_seqs} sequence slots are in use")
        shared = parent.length // self.page_size  # full pages
        pages = parent.pages[:shared]
        copy_src, copy_dst = parent.pages[shared:], []
        if copy_src and len(self._free_pages) < len(copy_src):
            raise RuntimeError("PagedQuantizedKVCache: no free page for the fork's open page")
        for page in pages:
            self._refs[page] += 1
        for _ in copy_src:
            copy_dst.append(self._take_page())
        child = self.add()
        c = self._seqs[child]
        c.pages, c.length = pages + copy_dst, parent.length
        dev = self.page_fill.device
        src = torch.tensor(copy_src, dtype=torch.int64, device=dev)
        dst = torch.tensor(copy_dst, dtype=torch.int64, device=dev)
        slots = (torch.tensor([parent.slot], device=dev), torch.tensor([c.slot], device=dev))
        for layer in range(self.num_layers):
            paged_copy(*self.sides(layer), src_pages=src, dst_pages=dst, src_slots=slots[0], dst_slots=slots[1],
                       page_fill=self.page_fill[layer])
        return child

    def schedule(self, seqs: Sequence[int], counts: Sequence[int]) -> PagedBatch:
        """Pages for `counts[i]` new tokens of sequence seqs[i] (allocated here), and the step's tensors.
        Nothing is appended until the layers run; commit() then advances the lengths."""
        if len(seqs) != len(counts) or len(set(seqs)) != len(seqs):
            raise ValueError("PagedQuantizedKVCache.schedule: one count per sequence, each sequence once")
        need = 0
        for seq, m in zip(seqs, counts):
            s = self._seq(seq)
            if m < 0 or s.length + m > self.max_tokens:
                raise ValueError(f"PagedQuantizedKVCache.schedule: sequence {seq} of {s.length} tokens cannot take "
                                 f"{m} more (at most {self.max_tokens} tokens: {self.max_pages_per_seq} pages of "
                                 f"{self.page_size})")
            need += max(0, self.layout.pages_for(s.length + m) - len(s.pages))
        if need > len(self._free_pages):
            raise RuntimeError(f"PagedQuantizedKVCache: {need} new pages needed, {len(self._free_pages)} free "
                               "(remove or preempt a sequence)")
        fresh = []
        for seq, m in zip(seqs, counts):
            s = self._seq(seq)
            while len(s.pages) < self.layout.pages_for(s.length + m):
                s.pages.append(self._take_page())
                fresh.append(s.pages[-1])
        dev = self.page_fill.device
        if fresh:  # a recycled page starts empty: nothing quantized in it yet
            self.page_fill[:, torch.tensor(fresh, device=dev)] = 0
        tables = torch.zeros(len(seqs), self.max_pages_per_seq, dtype=torch.int32)
        lengths, starts, positions = [], [0], []
        for i, (seq, m) in enumerate(zip(seqs, counts)):
            s = self._seqs[seq]
            tables[i, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
            lengths.append(s.length)
            starts.append(starts[-1] + m)
            positions.extend(range(s.length, s.length + m))
        return PagedBatch(
            seq_ids=list(seqs), counts=list(counts), block_tables=tables.to(dev),
            side_slots=torch.tensor([self._seqs[s].slot for s in seqs], dtype=torch.int32, device=dev),
            lengths=torch.tensor(lengths, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev), max_query_len=max(counts, default=0))

    def commit(self, batch: PagedBatch) -> None:
        """Every layer ran this step: its sequences hold their new tokens."""
        for seq, m in zip(batch.seq_ids, batch.counts):
            self._seq(seq).length += m

    # ------------------------------------------------------------------------------------------
    def layer_tensors(self, layer: int) -> list[Optional[torch.Tensor]]:
        """The ten tensors the paged ops take for this layer: region views of the pool and side slots."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"PagedQuantizedKVCache: layer {layer} is out of range for {self.num_layers} layers")
        region = self._region
        return [region("k_codes", layer), region("k_scale", layer), region("k_zero", layer), region("v_codes", layer),
                region("v_scale", layer), region("v_zero", layer), self.k_window[layer], self.v_window[layer],
                self.k_sink[layer], self.v_sink[layer]]

    def sides(self, layer: int) -> tuple[CacheSide, CacheSide]:
        """The layer's keys and values as the paged ops take them: page regions, side slots, levels, sparse
        outliers and refined key channels."""
        refine = layer_refine(self, layer, self._region("k_refine", layer))
        return split_sides(self.layer_tensors(layer), layer_levels(self, layer), layer_outliers(self, layer), refine)

    def _region(self, name: str, layer: int) -> Optional[torch.Tensor]:
        """Region `name` of `layer`'s pages (num_pages, kv_heads, rows, last dim), or None (not in the scheme)."""
        if name not in self.regions:
            return None
        return getattr(self, f"{name}_{layer}") if name in self._per_layer else getattr(self, name)[layer]

    def to_storage(self, batch: PagedBatch, k: torch.Tensor, v: torch.Tensor):
        """Post-RoPE keys / values (T, Hkv, D) at batch.positions -> the storage space and dtype."""
        k, v = self.rotations.to_storage(k, v, batch.positions[:, None])
        return k.to(self.layout.dtype), v.to(self.layout.dtype)

    def append(self, layer: int, batch: PagedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new post-RoPE keys / values (T, Hkv, D) into this layer, in place."""
        self._append_storage(layer, batch, *self.to_storage(batch, k, v))

    def _append_storage(self, layer, batch, ks, vs) -> None:
        paged_append(*self.sides(layer), ks, vs, self.schemes[layer].format, lengths=batch.lengths,
                     query_start_loc=batch.query_start_loc, block_tables=batch.block_tables,
                     side_slots=batch.side_slots, page_fill=self.page_fill[layer])

    def attend(self, layer: int, batch: PagedBatch, q: torch.Tensor, scale: Optional[float] = None,
               split_tokens: int = 0, sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode: attention (B, Hq, D) of each sequence's newest post-RoPE query q (B, Hq, D) over all its
        tokens, this step's appended ones included (call append first). sink_logits (Hq,): the layer's learned
        attention sinks (GPT-OSS), None: none."""
        return paged_decode_attention(q, *self.sides(layer), self.schemes[layer].format,
                                      self.options(scale, sink_logits), lengths=batch.lengths_after,
                                      block_tables=batch.block_tables, side_slots=batch.side_slots,
                                      split_tokens=split_tokens)

    def prefill(self, layer: int, batch: PagedBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: Optional[float] = None, split_tokens: int = 0, sink_logits: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """A chunk per sequence: causal attention (T, Hq, D) of the post-RoPE queries q (T, Hq, D) over the
        cache and the chunk itself (in full precision), then the chunk's keys / values (T, Hkv, D)
        appended. Serves chunked prefill, a later turn and speculative verification. sink_logits: as attend's."""
        ks, vs = self.to_storage(batch, k, v)
        out = paged_prefill_attention(q, ks, vs, *self.sides(layer), self.schemes[layer].format,
                                      self.options(scale, sink_logits), query_start_loc=batch.query_start_loc,
                                      max_query_len=batch.max_query_len, lengths=batch.lengths,
                                      block_tables=batch.block_tables, side_slots=batch.side_slots,
                                      split_tokens=split_tokens)
        self._append_storage(layer, batch, ks, vs)
        return out

    # ------------------------------------------------------------------------------------------
    def _seq(self, seq: int) -> _Sequence:
        return self._seqs[self._check(seq)]

    def _check(self, seq: int) -> int:
        if seq not in self._seqs:
            raise KeyError(f"PagedQuantizedKVCache: no sequence {seq}")
        return seq

    def _take_page(self) -> int:
        page = self._free_pages.pop()
        self._refs[page] = 1
        return page

    def _unref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free_pages.append(page)

    def extra_repr(self) -> str:
        lay = self.layout
        if len(set(self.schemes)) == 1:
            what, page = self.scheme.describe(lay.head_dim), f"{lay.page_bytes} B"
        else:
            what = "K/V bits by layer " + " ".join(f"{s.k_bits}{s.v_bits}" for s in self.schemes)
            page = f"{min(x.page_bytes for x in self.layouts)}-{max(x.page_bytes for x in self.layouts)} B"
        return (f"{what}; layers={self.num_layers}, pages={self.num_pages} x {lay.page_size} tokens ({page}), "
                f"sequences<={self.max_seqs}, {self.nbytes() / 2**20:.1f} MiB")


PER_LAYER = ("name", "k_bits", "v_bits", "k_clip", "v_clip")  # what a per-layer scheme list may vary by layer


def per_layer_schemes(scheme: Scheme | Sequence[Scheme], num_layers: int) -> list[Scheme]:
    """One scheme per layer: `scheme` for every layer, or the list, checked: one per layer, each served,
    and differing from layer 0's only in PER_LAYER (the page pool, side slots and rotations are
    shared). Calibrated levels come one table per width, so they take one scheme for every layer."""
    schemes = per_layer(scheme, num_layers, "PagedQuantizedKVCache", f"num_layers={num_layers}")
    for s in set(schemes):
        s.check_served()
    first = schemes[0]
    for layer, s in enumerate(schemes):
        differ = [f.name for f in fields(Scheme)
                  if f.name not in PER_LAYER and getattr(s, f.name) != getattr(first, f.name)]
        if differ:
            raise ValueError(f"PagedQuantizedKVCache: layer {layer}'s scheme {s.name} differs from layer 0's "
                             f"({first.name}) in {', '.join(differ)}; the layers of one cache may differ only in "
                             f"{', '.join(PER_LAYER[1:])}")
    if len(set(schemes)) > 1 and first.levels == "calibrated":
        raise NotImplementedError("PagedQuantizedKVCache: per-layer schemes with calibrated levels (a codebook "
                                  "holds one table per width; give every layer the same scheme)")
    return schemes
