"""Test helpers: fill quantized cache buffers through reference.cache_append, and tolerances."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref
from torch_rkv.layout import CacheLayout
from torch_rkv.ops.structs import CacheFormat, CacheSide, split_sides  # noqa: F401  (CacheFormat: for the tests)
from torch_rkv.scheme import Scheme

BUFFERS = ["k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero", "k_window", "v_window", "k_sink", "v_sink"]


def meta_dtypes(draw) -> dict:
    """A Scheme's metadata dtypes as the property tests draw them (inside a composite strategy): one of
    the three floats for both sides, and now and then float8 e4m3 for the keys, the values or both."""
    e4m3 = torch.float8_e4m3fn
    return dict(meta_dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])),
                k_meta_dtype=draw(st.sampled_from([None, None, e4m3])), v_meta_dtype=draw(st.sampled_from([None, None, e4m3])))


def buffers_args(bufs: dict) -> list:
    return [bufs.get(name) for name in BUFFERS]


def sides(bufs: dict, levels=(None, None)) -> tuple[CacheSide, CacheSide]:
    """A layout's buffers (with their sparse outliers, if any) as the cache ops' wrappers take them."""
    return split_sides(buffers_args(bufs), levels, (bufs.get("k_outliers"), bufs.get("v_outliers")))


def outliers_args(bufs: dict) -> dict:
    """The sparse-outlier buffers of a layout's buffers (None each without outliers), as op keywords."""
    return {name: bufs.get(name) for name in ("k_outliers", "v_outliers")}


def stored_keys(scheme: Scheme, keys_post: torch.Tensor, cos, sin, signs, interleaved=False):
    """What the cache stores for post-RoPE keys (B, H, n, D): pre-RoPE, or rotated, or as is."""
    n = keys_post.shape[-2]
    if scheme.pre_rope:
        return torch_rkv.rope(keys_post, cos, sin, torch.arange(n, device=keys_post.device), interleaved, inverse=True)
    if scheme.k_hadamard:
        return torch_rkv.hadamard(keys_post, signs)
    return keys_post


def random_levels(bits: int, seed: int) -> torch.Tensor:
    """A non-uniform codebook: 2^bits strictly ascending code values within [0, 2^bits - 1], ends free."""
    n = 1 << bits
    cuts = torch.unique(torch.rand(n, generator=torch.Generator().manual_seed(seed)) * (n - 1))
    return cuts if len(cuts) == n else torch.arange(n, dtype=torch.float32)


def levels_of(scheme: Scheme, seed: int, on: bool):
    """(k_levels, v_levels) for a test cache: random codebooks on each side that can take one (asymmetric,
    below 8 bits) when `on`, else None."""
    if not on:
        return None, None
    return tuple(random_levels(getattr(scheme, f"{side}_bits"), seed + i)
                 if not getattr(scheme, f"{side}_symmetric") and getattr(scheme, f"{side}_bits") < 8 else None
                 for i, side in enumerate(("k", "v")))


def case_levels(case, device="cpu"):
    """The codebooks of a test case (case["levels"]: whether it has them), on `device`."""
    return tuple(None if t is None else t.to(device)
                 for t in levels_of(case["scheme"], case["seed"], case.get("levels", False)))


def fill(layout: CacheLayout, keys: torch.Tensor, values: torch.Tensor, lengths: list[int], device="cpu",
         levels=(None, None)):
    """Buffers holding, for each sequence b, its first lengths[b] stored keys / values (B, H, n, D),
    written by reference appends into zeroed buffers: one per sequence, or (a sliding-window ring) as
    many pieces as the ring takes. levels: (k_levels, v_levels) codebooks, or None each."""
    bufs = layout.allocate(device)
    s, w = layout.scheme, layout.sliding_window
    step = layout.packed_capacity - s.block + 1 if w else max(lengths + [1])
    for b, n in enumerate(lengths):
        view = {k: v[b : b + 1] for k, v in bufs.items()}
        for i in range(0, n, step):
            j = min(n, i + step)
            ref.cache_append(*buffers_args(view), torch.tensor([i]), keys[b : b + 1, :, i:j].to(layout.dtype),
                             values[b : b + 1, :, i:j].to(layout.dtype), s.k_bits, s.v_bits, s.block, s.recent,
                             sliding_window=w, k_levels=levels[0], v_levels=levels[1], **outliers_args(view))
    return bufs


def build(case, device="cpu"):
    """(layout, buffers, q, post-RoPE keys, values, cos, sin, k_signs, v_signs)."""
    gen = torch.Generator().manual_seed(case["seed"])
    s, d = case["scheme"], case["d"]
    b = len(case["lengths"])
    layout = CacheLayout(s, b, case["kv_heads"], d, case["capacity"], case["fp_dtype"], case.get("window", 0))
    n_max = layout.max_tokens
    keys = torch.randn(b, case["kv_heads"], n_max, d, generator=gen)
    keys[..., 3] += 4.0  # an outlier channel, as in real keys
    values = torch.randn(b, case["kv_heads"], n_max, d, generator=gen)
    q = torch.randn(b, case["q_heads"], d, generator=gen).to(case["q_dtype"])
    cos, sin = torch_rkv.rope_tables(d, n_max + 3, theta=1e4, rot_dim=case["rot"])
    k_signs = torch_rkv.hadamard_signs(d, 1) if s.k_hadamard else None
    v_signs = torch_rkv.hadamard_signs(d, 2) if s.v_hadamard else None
    ks = stored_keys(s, keys, cos, sin, k_signs, case["interleaved"])
    vs = torch_rkv.hadamard(values, v_signs) if v_signs is not None else values
    bufs = fill(layout, ks, vs, case["lengths"], levels=case_levels(case))
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    bufs = {k: v.to(device) for k, v in bufs.items()}
    rope = (mv(cos), mv(sin)) if s.pre_rope else (None, None)
    return layout, bufs, q.to(device), keys, values, rope, mv(k_signs), mv(v_signs)


def attention_fp32(q, keys, values, lengths, scale=None):
    """Plain fp32 attention of q (B, Hq, D) over keys/values (B, Hkv, n_max, D) truncated per sequence."""
    b_, hq, d = q.shape
    hkv = keys.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b_, hq, d)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        k, v = keys[b, :, :n].float(), values[b, :, :n].float()
        qg = q[b].float().reshape(hkv, hq // hkv, d)
        p = torch.softmax(qg @ k.transpose(-1, -2) * scale, -1)
        out[b] = (p @ v).reshape(hq, d)
    return out


def float_tolerance(q, keys, values, dtype) -> float:
    """Bound for two fp32 evaluations of the same attention that differ in summation order and in the
    exponential (<= 5e-7 relative): a score computed two ways differs by ~ sqrt(D) eps |q||k|, which moves
    each probability by that much relatively, and the output by that times max|v|; plus one unit in the
    last place of the output dtype."""
    d = q.shape[-1]
    eps = torch.finfo(torch.float32).eps
    qmax = q.float().norm(dim=-1).max().item() / math.sqrt(d)
    kmax = keys.float().norm(dim=-1).max().item() if keys.numel() else 0.0
    vmax = values.float().abs().max().item() if values.numel() else 0.0
    score_err = 16 * math.sqrt(d) * eps * qmax * kmax + 1e-6
    out_ulp = torch.finfo(dtype).eps * vmax
    return 4 * score_err * vmax + 64 * eps * vmax + out_ulp


def quantization_bound(q, bufs, values, v_rotated=False, cell: float = 0.5) -> float:
    """Worst case from the stored steps: every value is within half its step, so the output (a convex
    combination) moves by at most max(step_v)/2 per channel (sqrt(D) times that after rotating back
    from a Hadamard space, the largest an orthonormal map stretches a max-norm); every key is within
    half a step per channel, so a score moves by at most |q| scale sqrt(D) max(step_k)/2 (RoPE and
    Hadamard keep norms), and the softmax output by at most twice the largest score change times max|v|."""
    d = q.shape[-1]
    half_k = bufs["k_scale"].float().max().item() * cell
    half_v = bufs["v_scale"].float().max().item() * cell * (math.sqrt(d) if v_rotated else 1.0)
    score = q.float().norm(dim=-1).max().item() / math.sqrt(d) * math.sqrt(d) * half_k
    return half_v + 2 * score * values.abs().max().item() + 1e-5


def refined_buffers(batch, heads, cap, dim, k_bits, v_bits, block, recent, sinks, m, extra, meta, gen):
    """Contiguous buffers (cache_append's names) with refined key channels (k_refine; per-channel asymmetric
    keys), per-token values in groups of 8, random initial contents (an append must write exactly what
    the reference writes, over anything), and random distinct refined channels per kv head (int32)."""
    window = recent + block - 1
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=gen)  # noqa: E731
    f = lambda *s, dtype=torch.float32: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    bufs = dict(
        k_packed=u8(batch, heads, cap, dim * k_bits // 8), k_scale=f(batch, heads, cap // block, dim, dtype=meta),
        k_zero=f(batch, heads, cap // block, dim, dtype=meta),
        v_packed=u8(batch, heads, cap, dim * v_bits // 8), v_scale=f(batch, heads, cap, dim // 8, dtype=meta),
        v_zero=f(batch, heads, cap, dim // 8, dtype=meta),
        k_window=f(batch, heads, window, dim), v_window=f(batch, heads, window, dim),
        k_sink=f(batch, heads, sinks, dim), v_sink=f(batch, heads, sinks, dim),
        k_refine=u8(batch, heads, cap, m * extra // 8))
    channels = torch.stack([torch.randperm(dim, generator=gen)[:m] for _ in range(heads)]).int()
    return bufs, channels
