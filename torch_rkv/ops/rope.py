"""rope: apply or undo rotary position embedding from cos/sin tables.

Tables, not a theta: ``cos``/``sin`` of shape (max_positions, rot_dim / 2) hold one angle per pair, so
every RoPE scaling variant (linear, NTK, YaRN, Llama-3) works by building its table. Pairs are
(j, j + rot_dim/2) (rotate-half, Llama/NeoX) or (2j, 2j+1) (interleaved, GPT-J); channels past rot_dim
pass through. Semantics: :func:`torch_rkv.reference.rope`.
"""

from __future__ import annotations

import torch

from . import _validate


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate x (*, D) at ``positions`` (int, broadcastable to x.shape[:-1]); ``inverse`` undoes it
    exactly (R^T / (cos^2 + sin^2)). Positions outside [0, max_positions) are an error."""
    return torch.ops.rkv.rope.default(x, cos, sin, positions, interleaved, inverse)


def rope_tables(head_dim: int, max_positions: int, theta: float = 10000.0, rot_dim: int | None = None,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (unscaled) RoPE tables (max_positions, rot_dim/2) in float32, Llama's frequencies."""
    rot = head_dim if rot_dim is None else rot_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64, device=device) / rot))
    angles = torch.arange(max_positions, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


@torch.library.register_fake("rkv::rope")
def _rope_fake(x, cos, sin, positions, interleaved, inverse):
    _validate.rope(x, cos, sin, positions)
    return torch.empty_like(x, memory_format=torch.contiguous_format)
