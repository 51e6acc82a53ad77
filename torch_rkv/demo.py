"""A small synthetic demo: RoPE'd keys with outlier channels, quantized with each scheme."""

from __future__ import annotations

import torch

import torch_rkv

SCHEMES = [
    # name, pre-rope, hadamard, group_size (None: dim), block_tokens
    ("per-token", False, False, None, 1),
    ("grouped g=32", False, False, 32, 1),
    ("per-channel T=128", False, False, 1, 128),
    ("pre-RoPE per-channel", True, False, 1, 128),
    ("Hadamard + per-token", False, True, None, 1),
]


def synthetic_keys(tokens: int, dim: int, seed: int = 0):
    """Pre-RoPE keys with a few large channels (as real models have) and their RoPE'd version."""
    gen = torch.Generator().manual_seed(seed)
    chan_scale = torch.ones(dim)
    chan_scale[torch.randperm(dim, generator=gen)[:4]] = 12.0
    pre = torch.randn(tokens, dim, generator=gen) * chan_scale + torch.randn(dim, generator=gen) * 2
    cos, sin = torch_rkv.rope_tables(dim, tokens, theta=1e4)
    return pre, torch_rkv.rope(pre, cos, sin, torch.arange(tokens)), (cos, sin)


def run(tokens: int, dim: int) -> int:
    pre, post, (cos, sin) = synthetic_keys(tokens, dim)
    pos = torch.arange(tokens)
    signs = torch_rkv.hadamard_signs(dim)
    print(f"torch_rkv demo: {tokens} synthetic RoPE'd keys x {dim} channels with 4 outlier channels")
    print(f"{'scheme':24s} {'bits':>4s} {'bits/elem':>9s} {'rel. error':>10s}")
    for name, pre_rope, had, group, block in SCHEMES:
        for bits in (8, 4, 3, 2):
            x = pre if pre_rope else post
            if had:
                x = torch_rkv.hadamard(x, signs)
            q = torch_rkv.quantize(x, bits, group_size=group or dim, block_tokens=block)
            y = q.dequantize()
            if had:
                y = torch_rkv.hadamard(y, signs, inverse=True)
            if pre_rope:
                y = torch_rkv.rope(y, cos, sin, pos)
            err = ((y - post).norm() / post.norm()).item()
            print(f"{name:24s} {bits:4d} {8 * q.nbytes() / post.numel():9.3f} {err:10.4f}")
    return 0
