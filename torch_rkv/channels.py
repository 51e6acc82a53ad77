"""Refined key channels: a few pre-RoPE key channels per KV head stored with more bits than the rest.

Keys carry most of the loss at every width (docs/measurements.md, "Where the loss comes from"), and
within a head a few channels carry most of the keys' share: an error e in channel c moves a score by
q_c e, and both the queries' energy and the keys' block ranges sit in a few channels. A refined channel
keeps its code c and its block's scale and zero, with its range unclipped, and adds an `extra`-bit code r
for where in c's cell the value lies:

    x_hat = zero + scale * (c - 1/2 + (r + 1/2) / 2^extra)

so its error is at most scale / 2^(extra + 1), against scale / 2 for the channel's code alone. Which
channels are refined is decided per (layer, KV head) on a calibration text (torch_rkv.eval.channels)
and stored as a ranking in a small JSON file; a scheme names the file and how many channels it refines
(Scheme.k_refine, k_refine_bits, channels).

The caches store them (layout.page_regions: k_refine, m * extra / 8 bytes a row; the ranking's top m
channels of each layer in a k_channels buffer, channel_buffers), and every cache op reads and writes
them (reference.refine_codes / refined_rows: the spec the kernels follow bit for bit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from . import reference as ref
from .files import write_text_atomic
from .ops.quant import quantize
from .reference import expand_meta

FORMAT = "torch_rkv.key_channels/1"


@dataclass
class KeyChannels:
    """ranks[layer][kv_head]: that head's key channels, every one of them, most important first. Stored as

        {"format": "torch_rkv.key_channels/1", "model": ..., "calibration": ..., "ranks": [[[...]]]}"""

    ranks: list = field(default_factory=list)
    model: str = ""
    calibration: str = ""

    def __post_init__(self):
        for i, layer in enumerate(self.ranks):
            for h, order in enumerate(layer):
                if sorted(order) != list(range(len(order))):
                    raise ValueError(f"KeyChannels ({self.model or 'unnamed'}): layer {i} head {h} does not rank "
                                     f"each of its {len(order)} channels once")

    def top(self, layer: int, count: int, head_dim: int | None = None) -> torch.Tensor:
        """The `count` most important channels of each KV head of `layer`, int64 (heads, count); head_dim:
        the keys' channels, which the ranking must rank (None: not checked)."""
        if not 0 <= layer < len(self.ranks):
            raise ValueError(f"KeyChannels ({self.model or 'unnamed'}): layer {layer} is out of range for "
                             f"{len(self.ranks)} layers")
        ranks = torch.tensor(self.ranks[layer], dtype=torch.int64)
        if head_dim is not None and ranks.shape[1] != head_dim:
            raise ValueError(f"KeyChannels ({self.model or 'unnamed'}): ranks {ranks.shape[1]} channels, the keys "
                             f"have {head_dim}")
        if not 0 <= count <= ranks.shape[1]:
            raise ValueError(f"KeyChannels ({self.model or 'unnamed'}): k_refine {count} is not within the "
                             f"head's {ranks.shape[1]} channels")
        return ranks[:, :count]

    def mask(self, layer: int, count: int, head_dim: int) -> torch.Tensor:
        """bool (heads, head_dim): True at the refined channels of each KV head of `layer`."""
        top = self.top(layer, count, head_dim)
        return torch.zeros(top.shape[0], head_dim, dtype=torch.bool).scatter_(1, top, True)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "model": self.model, "calibration": self.calibration,
                           "ranks": self.ranks})

    @classmethod
    def from_json(cls, text: str, where: str = "key channels") -> "KeyChannels":
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"{where}: not a torch_rkv key-channel file (format {d.get('format')!r}, expected "
                             f"{FORMAT!r})")
        return cls(d["ranks"], d.get("model", ""), d.get("calibration", ""))

    def save(self, path) -> None:
        write_text_atomic(path, self.to_json())


@lru_cache(maxsize=16)
def load(path: str) -> KeyChannels:
    """The key-channel file at `path` (read once per process)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"key-channel file {path} does not exist (torch_rkv.eval.channels calibrates one)")
    return KeyChannels.from_json(p.read_text(), str(path))


def refine(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, extra: int) -> torch.Tensor:
    """x (float32) decoded through its code at `bits` and an `extra`-bit refinement within the code's cell,
    with scale and zero per element (the block's unclipped range, expanded), float32, as the cache kernels
    decode it (reference.refine_codes / refine_residual). Where scale is 0 (a constant channel) the value
    is zero, as the plain code decodes it."""
    codes = ref.encode(x, scale, zero, bits, False)
    r = ref.refine_codes(x, scale, zero, bits, extra)
    return ref.decode(codes, scale, zero, bits) + ref.refine_residual(r, scale, extra)


def channel_buffers(schemes, model_layers, kv_heads: int, head_dim: int, device, owner: str) -> dict:
    """A cache's refined key channels: {"k_channels_<i>": int32 (kv_heads, m_i)} for each of its layers i
    (model layer model_layers[i]; None: i), the top m_i = k_refine channels of the schemes' ranking file,
    or None for a layer without refined channels. owner names the cache in errors."""
    schemes = list(schemes)
    model_layers = list(range(len(schemes))) if model_layers is None else list(model_layers)
    out = {}
    for i, (s, layer) in enumerate(zip(schemes, model_layers)):
        top = None
        if s.k_refine:
            top = load(s.channels).top(layer, s.k_refine, head_dim)
            if top.shape[0] != kv_heads:
                raise ValueError(f"{owner}: the key-channel file {s.channels} ranks {top.shape[0]} kv heads in layer "
                                 f"{layer}, the cache has {kv_heads}")
            top = top.to(device=device, dtype=torch.int32)
        out[f"k_channels_{i}"] = top
    return out


def block_params(x: torch.Tensor, scheme, sinks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The unclipped scale and zero of each of keys x's (*, n, D) per-channel blocks under `scheme`, as
    the cache rounds them, expanded to x's shape (float32). sinks: x's first rows, encoded but not in
    the range."""
    s, n = scheme, x.shape[-2]
    q = quantize(x, s.k_bits, s.k_group_size, s.k_block_tokens, False, s.side_meta_dtype("k"), False, sinks)
    return tuple(expand_meta(m, s.k_block_tokens, s.k_group_size)[..., :n, :] for m in (q.scale, q.zero))


def round_trip(x: torch.Tensor, coded: torch.Tensor, scheme, layer: int, sinks: int = 0) -> torch.Tensor:
    """Keys x (B, Hkv, n, D) of `layer` in the storage space after the cache's round trip: `coded`, the
    scheme's plain codes, with its refined channels (scheme.k_refine of the ranking file) decoded
    through their refinement instead."""
    mask = load(scheme.channels).mask(layer, scheme.k_refine, x.shape[-1]).to(x.device)[None, :, None, :]
    scale, zero = block_params(x, scheme, sinks)
    return torch.where(mask, refine(x.float(), scale, zero, scheme.k_bits, scheme.k_refine_bits), coded)
