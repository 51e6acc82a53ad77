"""A layer's rotations under a scheme: the RoPE table its pre-RoPE keys are rotated with, and the Hadamard
signs each side is stored under.

The caches (cache.py, paged.py) and the vLLM backend build them here, with scheme_rotations, and turn
the keys and values a model computes into the storage space with Rotations.to_storage. The attention ops
take them as part of their AttentionOptions.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .ops.hadamard import hadamard, hadamard_signs
from .ops.rope import rope
from .ops.structs import AttentionOptions
from .scheme import Scheme


class Rotations(NamedTuple):
    """rope_cos / rope_sin (P, rot_dim/2) float32: the model's RoPE table, where the scheme stores keys
    before RoPE (None: keys stored as the model computes them); rope_interleaved: its pairing. k_signs /
    v_signs (D,): the Hadamard signs of a side stored rotated (None: not rotated)."""

    rope_cos: Optional[torch.Tensor] = None
    rope_sin: Optional[torch.Tensor] = None
    rope_interleaved: bool = False
    k_signs: Optional[torch.Tensor] = None
    v_signs: Optional[torch.Tensor] = None

    def to_storage(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Post-RoPE keys and values (*, D) -> the storage space, in their dtype: RoPE undone at `positions`
        (broadcast to k.shape[:-1]) with the model's own table, then each side Hadamard-rotated."""
        if self.rope_cos is not None:
            k = rope(k, self.rope_cos, self.rope_sin, positions, self.rope_interleaved, inverse=True)
        if self.k_signs is not None:
            k = hadamard(k, self.k_signs)
        if self.v_signs is not None:
            v = hadamard(v, self.v_signs)
        return k, v

    def options(self, scale: Optional[float] = None, sliding_window: int = 0, softcap: float = 0.0,
                sink_logits: Optional[torch.Tensor] = None) -> AttentionOptions:
        """The attention options of a layer that stores its cache under these rotations."""
        return AttentionOptions(self.rope_cos, self.rope_sin, self.rope_interleaved, self.k_signs, self.v_signs,
                                scale, sliding_window, softcap, sink_logits)


class RotatedCache:
    """What the two caches (QuantizedKVCache, PagedQuantizedKVCache) share: rotations from their buffers
    rope_cos, rope_sin, k_signs and v_signs (scheme_rotations made them), and attention options from
    those and their sliding_window and softcap. Buffers, so that Module.to moves them."""

    @property
    def rotations(self) -> Rotations:
        return Rotations(self.rope_cos, self.rope_sin, self.rope_interleaved, self.k_signs, self.v_signs)

    def options(self, scale: Optional[float], sink_logits: Optional[torch.Tensor]) -> AttentionOptions:
        """An attention call's options: the rotations, the window and soft-cap, and the call's own."""
        return self.rotations.options(scale, self.sliding_window, self.softcap, sink_logits)

    def register_rotations(self, rot: Rotations) -> None:
        for name in ("rope_cos", "rope_sin", "k_signs", "v_signs"):
            self.register_buffer(name, getattr(rot, name))


def scheme_rotations(scheme: Scheme, head_dim: int, rope_tables: Optional[tuple] = None, interleaved: bool = False,
                     device=None, owner: str = "", positions: int = 0, positions_of: str = "") -> Rotations:
    """The rotations a layer of `scheme` stores its cache under: the RoPE table (cos, sin) made float32
    and contiguous on `device` where the scheme stores keys before RoPE (then required, and checked to
    cover `positions` positions, which `positions_of` names in the error), and the Hadamard signs of the
    scheme's seed (keys) and seed + 1 (values). owner names the caller in errors."""
    cos = sin = None
    if scheme.pre_rope:
        if rope_tables is None:
            raise ValueError(f"{owner}: scheme {scheme.name} stores pre-RoPE keys and needs the model's rope tables: "
                             "rope=(cos, sin), each (positions, rot_dim / 2)")
        if rope_tables[0].shape[0] < positions:
            raise ValueError(f"{owner}: the rope tables cover {rope_tables[0].shape[0]} positions, fewer than "
                             f"{positions_of} {positions} tokens")
        cos, sin = (t.to(device=device, dtype=torch.float32).contiguous() for t in rope_tables)
    k_signs = hadamard_signs(head_dim, scheme.hadamard_seed, device) if scheme.k_hadamard else None
    v_signs = hadamard_signs(head_dim, scheme.hadamard_seed + 1, device) if scheme.v_hadamard else None
    return Rotations(cos, sin, interleaved, k_signs, v_signs)
