"""A preallocated quantized KV cache for a whole model: static shapes, in-place appends, fused decode.

Every buffer has a leading layer dimension and is allocated once, so a decode step (append + attention)
has static shapes that torch.compile and CUDA graphs can capture; the sequence lengths are a tensor, so
growing a sequence never recompiles. Keys arrive post-RoPE, as models compute them; the cache stores
them in the scheme's space (pre-RoPE: rotation undone exactly with the model's own table; Hadamard:
rotated) and attention works in that space.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .channels import channel_buffers
from .codebook import layer_levels, level_buffers
from .layout import CacheLayout
from .ops.attention import decode_attention
from .ops.cache import cache_append
from .ops.hadamard import hadamard
from .ops.paged import paged_prefill_attention
from .ops.quant import Quantized, dequantize
from .ops.rope import rope
from .ops.structs import CacheSide, split_sides
from .reference import outlier_residuals, quantized_count, refine_bits, refined_rows
from .rotations import RotatedCache, scheme_rotations
from .scheme import Scheme

BUFFERS = ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero", "k_window", "v_window", "k_sink", "v_sink")


def layer_refine(cache, layer: int, k_refine: Optional[torch.Tensor]) -> tuple:
    """(k_refine, k_channels) of a cache's layer given its refinement region, or (None, None) without refined
    key channels (the caches keep each layer's channels as a k_channels_<layer> buffer,
    channels.channel_buffers)."""
    channels = getattr(cache, f"k_channels_{layer}")
    return (None, None) if channels is None else (k_refine, channels)


def layer_outliers(cache, layer: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(k_outliers, v_outliers) of a cache's layer (its sparse-outlier buffers, layout.page_regions), or
    None each (a scheme without outliers). Both caches keep them as buffers under these names."""
    return tuple(None if getattr(cache, name, None) is None else getattr(cache, name)[layer]
                 for name in ("k_outliers", "v_outliers"))


class QuantizedKVCache(RotatedCache, torch.nn.Module):
    """layers x batch x kv_heads x capacity x head_dim, stored as `scheme` says.

    rope: (cos, sin) tables of shape (P, rot_dim/2), P >= max_tokens, the model's own rotation (needed
    when scheme.pre_rope). dtype: full-precision dtype of sinks and window (and of appended tokens).
    sliding_window > 0: sliding-window layers (each query sees the newest sliding_window tokens, as the
    model's mask says): the packed rows are a ring of layout.ring_rows rows, so the cache holds the
    window (plus block rounding and the full-precision tail), not the capacity, while positions still
    run to the capacity. softcap > 0: attention-logit soft-capping (Gemma 2), in every attention call.
    model_layers: the model's index of each of the cache's layers (default 0..num_layers-1), which a
    scheme with calibrated levels reads its per-layer codebook by.
    """

    def __init__(
        self,
        scheme: Scheme,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float16,
        device=None,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        rope_interleaved: bool = False,
        sliding_window: int = 0,
        softcap: float = 0.0,
        model_layers: Optional[Sequence[int]] = None,
    ):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"QuantizedKVCache: num_layers must be >= 1 (got {num_layers})")
        scheme.check_served()
        self.scheme = scheme
        self.num_layers = num_layers
        self.layout = CacheLayout(scheme, batch, kv_heads, head_dim, capacity, dtype, sliding_window)
        self.rope_interleaved = rope_interleaved
        self.sliding_window = sliding_window
        self.softcap = float(softcap)
        for name, (shape, dt) in self.layout.shapes().items():
            self.register_buffer(name, torch.zeros((num_layers, *shape), dtype=dt, device=device))
        self.register_buffer("lengths", torch.zeros(num_layers, batch, dtype=torch.int64, device=device))
        rot = scheme_rotations(scheme, head_dim, rope, rope_interleaved, device, "QuantizedKVCache",
                               self.layout.max_tokens, "the cache's")
        self.register_rotations(rot)
        for name, t in level_buffers(scheme, num_layers, model_layers, device, "QuantizedKVCache").items():
            self.register_buffer(name, t)
        for name, t in channel_buffers([scheme] * num_layers, model_layers, kv_heads, head_dim, device,
                                       "QuantizedKVCache").items():
            self.register_buffer(name, t)

    # ---------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Tokens per sequence the buffers hold (>= the capacity asked for: blocks are whole)."""
        return self.layout.max_tokens

    def layer_buffers(self, layer: int) -> list[Optional[torch.Tensor]]:
        """The layer's ten buffers in the ops' order (BUFFERS)."""
        self._check_layer(layer)
        return [None if getattr(self, name, None) is None else getattr(self, name)[layer] for name in BUFFERS]

    def sides(self, layer: int) -> tuple[CacheSide, CacheSide]:
        """The layer's keys and values as the cache ops take them: buffers, levels, sparse outliers and refined
        key channels."""
        refine = layer_refine(self, layer, self.k_refine[layer] if self.scheme.k_refine else None)
        return split_sides(self.layer_buffers(layer), layer_levels(self, layer), layer_outliers(self, layer), refine)

    def nbytes(self) -> int:
        """Exact bytes of the KV buffers (all layers), from the same layout that allocated them."""
        return self.num_layers * self.layout.nbytes()

    def seq_length(self, layer: int = 0) -> int:
        """Tokens cached in this layer (its longest sequence). Read from `lengths`, the one record of
        lengths that eager and compiled appends both keep; on a GPU this reads device memory (a sync), so
        the decode path itself never calls it."""
        self._check_layer(layer)
        return int(self.lengths[layer].max()) if self.lengths.shape[1] else 0

    def reset(self) -> None:
        self.lengths.zero_()

    # ---------------------------------------------------------------------------------------------
    def to_storage(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Post-RoPE keys / values (B, Hkv, m, D) -> the cache's storage space and dtype."""
        pos = self.lengths[layer][:, None, None] + torch.arange(k.shape[-2], device=k.device)  # (B, 1, m)
        k, v = self.rotations.to_storage(k, v, pos)
        return k.to(self.layout.dtype), v.to(self.layout.dtype)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append m new tokens (B, Hkv, m, D) to every sequence of this layer, in place. Their positions
        are the cache slots: lengths[layer] .. lengths[layer] + m - 1."""
        self._check_layer(layer)
        lay = self.layout
        want = (lay.batch, lay.kv_heads, lay.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != want:
                raise ValueError(f"QuantizedKVCache.append: {name} must have shape (batch={lay.batch}, "
                                 f"kv_heads={lay.kv_heads}, tokens, head_dim={lay.head_dim}), got {list(t.shape)}")
        self.append_stored(layer, *self.to_storage(layer, k, v))

    def append_stored(self, layer: int, ks: torch.Tensor, vs: torch.Tensor) -> None:
        """Append tokens already in the storage space and dtype (to_storage), after the capacity check."""
        m = ks.shape[-2]
        # checked on the lengths' device: no host sync per step, and the same check eager and compiled,
        # on CPU (raises here) and CUDA (a device-side assert)
        torch._assert_async((self.lengths[layer] + m <= self.capacity).all(),
                            f"QuantizedKVCache: appending {m} tokens to layer {layer} exceeds the capacity of "
                            f"{self.capacity} tokens")
        s = self.scheme
        # a ring takes at most its rows - block + 1 tokens per append (the blocks one append completes
        # must not wrap onto each other): a long prefill goes in pieces
        step = m if self.sliding_window == 0 else self.layout.packed_capacity - s.block + 1
        for i in range(0, m, step):
            cache_append(*self.sides(layer), self.lengths[layer], ks[:, :, i : i + step], vs[:, :, i : i + step],
                         s.format, sliding_window=self.sliding_window)
            self.lengths[layer] += min(step, m - i)

    def attend(self, layer: int, q: torch.Tensor, scale: Optional[float] = None, split_tokens: int = 0,
               sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of q (B, Hq, D), the newest token's post-RoPE query, over this layer's cache. sink_logits
        (Hq,): the layer's learned attention sinks (GPT-OSS; decode_attention), None: none."""
        self._check_layer(layer)
        return decode_attention(q, *self.sides(layer), self.lengths[layer], self.scheme.format,
                                self.options(scale, sink_logits), split_tokens=split_tokens)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                split_tokens: int = 0, sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A chunk of m new tokens per sequence: causal attention of their post-RoPE queries q (B, Hq, m, D)
        over this layer's cache as stored and over the chunk itself in full precision, then the chunk's
        post-RoPE keys / values (B, Hkv, m, D) appended. Returns (B, Hq, m, D) in q's dtype. The served
        form of a second turn, chunked prefill or speculative verification (rkv::paged_prefill_attention
        over the contiguous layout). sink_logits: as attend's."""
        self._check_layer(layer)
        ks, vs = self.to_storage(layer, k, v)
        out = self.attend_chunk(layer, q, ks, vs, scale, split_tokens, sink_logits)
        self.append_stored(layer, ks, vs)
        return out

    def attend_chunk(self, layer: int, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                     scale: Optional[float] = None, split_tokens: int = 0,
                     sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """prefill's attention without its append: the chunk given in storage form (to_storage), so that
        several layers can attend over one chunk before it is appended once (KV-shared layers)."""
        self._check_layer(layer)
        b, hq, m, d = q.shape
        rows = lambda t: t.transpose(1, 2).reshape(b * m, t.shape[1], d)  # noqa: E731  (B, H, m, D) -> (B*m, H, D)
        qsl = torch.arange(b + 1, device=q.device) * m
        out = paged_prefill_attention(rows(q), rows(ks), rows(vs), *self.sides(layer), self.scheme.format,
                                      self.options(scale, sink_logits), query_start_loc=qsl, max_query_len=m,
                                      lengths=self.lengths[layer], split_tokens=split_tokens)
        return out.reshape(b, m, hq, d).transpose(1, 2)

    def dequantized(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's cached keys (post-RoPE, original space) and values in full precision,
        (B, Hkv, n, D) float32, read as attention reads them; all sequences must hold the same number of
        tokens. Reads the lengths on the host (a sync on a GPU)."""
        self._check_layer(layer)
        n = self.seq_length(layer)
        if self.sliding_window > 0 and n > self.layout.packed_capacity:
            raise ValueError(f"QuantizedKVCache.dequantized: layer {layer} holds a ring whose oldest of {n} tokens "
                             "are overwritten (sliding_window); only the window is cached")
        if bool((self.lengths[layer] != n).any()):
            raise ValueError(f"QuantizedKVCache.dequantized: the sequences of layer {layer} hold different numbers "
                             f"of tokens ({self.lengths[layer].tolist()})")
        bufs = dict(zip(BUFFERS, self.layer_buffers(layer)))
        s, lay = self.scheme, self.layout
        q = quantized_count(n, s.recent, s.block)
        out = []
        for side, lv, entries in zip(("k", "v"), layer_levels(self, layer), layer_outliers(self, layer)):
            bits = getattr(s, f"{side}_bits")
            t = getattr(s, f"{side}_block_tokens")
            parts = [bufs[f"{side}_sink"][:, :, : min(n, s.sinks)].float()]
            if q > s.sinks:
                zero = bufs[f"{side}_zero"]
                qt = Quantized(bufs[f"{side}_packed"][:, :, :q], bufs[f"{side}_scale"][:, :, : q // t],
                               None if zero is None else zero[:, :, : q // t], bits, lv)
                deq = dequantize(qt, torch.float32)
                if entries is not None:  # the sparse outliers' residuals, as attention adds them
                    res = outlier_residuals(entries[:, :, : q // s.block], s.block, lay.head_dim)
                    deq = deq + res.reshape(deq.shape)
                if side == "k" and s.k_refine:  # the refined channels' residuals, likewise
                    deq = self._refined(layer, deq, qt.scale, t)
                parts.append(deq[:, :, s.sinks :])
            if n > max(s.sinks, q):
                slots = torch.arange(max(s.sinks, q), n, device=self.lengths.device)
                parts.append(bufs[f"{side}_window"][:, :, slots % lay.window].float())
            out.append(torch.cat(parts, dim=2))
        k, v = out
        if self.k_signs is not None:
            k = hadamard(k, self.k_signs, inverse=True)
        if self.v_signs is not None:
            v = hadamard(v, self.v_signs, inverse=True)
        if s.pre_rope:
            k = rope(k, self.rope_cos, self.rope_sin, torch.arange(n, device=k.device), self.rope_interleaved)
        return k, v

    def _refined(self, layer: int, deq: torch.Tensor, scale: torch.Tensor, block_tokens: int) -> torch.Tensor:
        """Dequantized keys deq (B, Hkv, q, D) of this layer with their refined channels' residuals added."""
        b, h, q, d = deq.shape
        rows = self.k_refine[layer][:, :, :q]
        channels = getattr(self, f"k_channels_{layer}")
        flat = lambda t: t.transpose(1, 2).reshape(b * q, h, t.shape[-1])  # noqa: E731  (B, H, q, x) -> (B*q, H, x)
        sc = scale.float().repeat_interleave(block_tokens, dim=2)
        out = refined_rows(flat(deq), flat(rows), channels, flat(sc), refine_bits(rows, channels))
        return out.reshape(b, q, h, d).transpose(1, 2)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"QuantizedKVCache: layer {layer} is out of range for {self.num_layers} layers")

    def extra_repr(self) -> str:
        lay = self.layout
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (f"{self.scheme.describe(lay.head_dim)}; layers={self.num_layers}, batch={lay.batch}, "
                f"kv_heads={lay.kv_heads}, head_dim={lay.head_dim}, capacity={self.capacity}{window}, "
                f"{self.nbytes() / 2**20:.1f} MiB")
