"""Argument checks of the fake kernels: the same rules and messages as torch_rkv/csrc/checks.cpp.

The C++ checks guard the real kernels; these run when an op is traced (torch.compile, meta or fake
tensors), so a bad call fails at trace time with the error eager mode would give. Shape conditions that
involve symbolic sizes go through torch._check_value so they become runtime asserts, not guards.
"""

from __future__ import annotations

import torch

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (2, 3, 4, 8)


def value(cond, op: str, msg: str) -> None:
    torch._check_value(cond, lambda: f"rkv.{op}: {msg}")


def dtype(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise TypeError(f"rkv.{op}: {msg}")


def bits(op: str, arg: str, b: int) -> None:
    value(b in BITS, op, f"{arg} must be 2, 3, 4 or 8 (got {b})")


def float_input(op: str, arg: str, t: torch.Tensor) -> None:
    dtype(t.dtype in FLOAT_TYPES, op, f"{arg} must be float32, float16 or bfloat16 (got {t.dtype})")


def meta_dtype(op: str, arg: str, dt: torch.dtype) -> None:
    dtype(dt in FLOAT_TYPES, op, f"{arg} must be float32, float16 or bfloat16 (got {dt})")


def same_device(op: str, ref: torch.Tensor, arg: str, t: torch.Tensor) -> None:
    value(t.device == ref.device, op, f"{arg} is on {t.device} but the input is on {ref.device}")


def devices(op: str, ref: torch.Tensor, **tensors) -> None:
    """Every given tensor (None skipped) on ref's device."""
    for arg, t in tensors.items():
        if t is not None:
            same_device(op, ref, arg, t)


def row_packable(op: str, arg: str, dim, b: int) -> None:
    value((dim * b) % 8 == 0, op,
          f"the last dim of {arg} ({dim}) times bits ({b}) must be a multiple of 8 to pack whole bytes")


def quantize(x: torch.Tensor, b: int, group_size, block_tokens, md: torch.dtype, symmetric: bool = False,
             clip: bool = False) -> None:
    bits("quantize", "bits", b)
    value(not (clip and symmetric), "quantize", "clip searches asymmetric ranges; it needs symmetric=False")
    float_input("quantize", "x", x)
    meta_dtype("quantize", "meta_dtype", md)
    value(x.dim() >= 2, "quantize", f"x must have at least 2 dims (..., tokens, dim), got shape {list(x.shape)}")
    n, d = x.shape[-2], x.shape[-1]
    row_packable("quantize", "x", d, b)
    value(group_size >= 1 and d % group_size == 0, "quantize",
          f"group_size ({group_size}) must be >= 1 and divide the last dim of x ({d})")
    value(block_tokens >= 1 and n % block_tokens == 0, "quantize",
          f"block_tokens ({block_tokens}) must be >= 1 and divide the token dim of x ({n}); "
          "quantize whole blocks and keep the rest in full precision")


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero, b: int, out_dtype: torch.dtype):
    """Returns (dim, group_size, block_tokens) read off the shapes."""
    op = "dequantize"
    bits(op, "bits", b)
    dtype(packed.dtype == torch.uint8, op, f"packed must be uint8 (got {packed.dtype})")
    float_input(op, "scale", scale)
    meta_dtype(op, "out_dtype", out_dtype)
    same_device(op, packed, "scale", scale)
    value(packed.dim() >= 2, op, f"packed must have at least 2 dims, got shape {list(packed.shape)}")
    value(scale.dim() == packed.dim(), op,
          f"scale must have as many dims as packed ({packed.dim()}), got shape {list(scale.shape)}")
    value(scale.shape[:-2] == packed.shape[:-2], op,
          f"the leading dims of scale {list(scale.shape)} must equal those of packed {list(packed.shape)}")
    n = packed.shape[-2]
    value((packed.shape[-1] * 8) % b == 0, op,
          f"the last dim of packed ({packed.shape[-1]} bytes) does not hold a whole number of {b}-bit codes")
    d = packed.shape[-1] * 8 // b
    nb, ng = scale.shape[-2], scale.shape[-1]
    value(ng >= 1 and d % ng == 0, op, f"scale's last dim ({ng} groups) must divide the code dim ({d})")
    value((nb >= 1 and n % nb == 0) or (nb == 0 and n == 0), op,
          f"scale's token-block dim ({nb}) must divide the token dim of packed ({n})")
    if zero is not None:
        dtype(zero.dtype == scale.dtype, op, f"zero must have scale's dtype ({scale.dtype}), got {zero.dtype}")
        value(zero.shape == scale.shape, op, f"zero must have scale's shape {list(scale.shape)}, got {list(zero.shape)}")
        same_device(op, packed, "zero", zero)
    return d


def pack(codes: torch.Tensor, b: int) -> None:
    bits("pack", "bits", b)
    dtype(codes.dtype == torch.uint8, "pack", f"codes must be uint8 (got {codes.dtype})")
    value(codes.dim() >= 1, "pack", "codes must have at least 1 dim")
    row_packable("pack", "codes", codes.shape[-1], b)


def unpack(packed: torch.Tensor, b: int) -> None:
    bits("unpack", "bits", b)
    dtype(packed.dtype == torch.uint8, "unpack", f"packed must be uint8 (got {packed.dtype})")
    value(packed.dim() >= 1, "unpack", "packed must have at least 1 dim")
    value((packed.shape[-1] * 8) % b == 0, "unpack",
          f"the last dim of packed ({packed.shape[-1]} bytes) does not hold a whole number of {b}-bit codes")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    op = "rope"
    float_input(op, "x", x)
    float_input(op, "cos", cos)
    dtype(sin.dtype == cos.dtype, op, f"sin must have cos's dtype ({cos.dtype}), got {sin.dtype}")
    dtype(positions.dtype in (torch.int32, torch.int64), op,
          f"positions must be int32 or int64 (got {positions.dtype})")
    for arg, t in (("cos", cos), ("sin", sin), ("positions", positions)):
        same_device(op, x, arg, t)
    value(x.dim() >= 1, op, "x must have at least 1 dim")
    value(cos.dim() == 2, op, f"cos must have shape (positions, rot_dim / 2), got {list(cos.shape)}")
    value(sin.shape == cos.shape, op, f"sin must have cos's shape {list(cos.shape)}, got {list(sin.shape)}")
    d = x.shape[-1]
    value(cos.shape[1] >= 1 and 2 * cos.shape[1] <= d, op,
          f"cos/sin have {cos.shape[1]} pairs per position, but x's last dim ({d}) holds at most {d // 2}")
    rows = list(x.shape[:-1])
    ok = positions.dim() <= len(rows) and all(
        p == r or p == 1 for p, r in zip(reversed(positions.shape), reversed(rows)))
    value(ok, op, f"positions of shape {list(positions.shape)} must broadcast to x.shape[:-1] = {rows}")


def hadamard(x: torch.Tensor, signs) -> None:
    op = "hadamard"
    float_input(op, "x", x)
    value(x.dim() >= 1, op, "x must have at least 1 dim")
    d = x.shape[-1]
    value(d >= 2 and (d & -d) >= 2 and d <= 8192, op,
          f"the last dim of x ({d}) must be even and at most 8192 (a power of two is transformed whole, "
          "other sizes in blocks of their largest power-of-two divisor)")
    if signs is not None:
        float_input(op, "signs", signs)
        same_device(op, x, "signs", signs)
        value(signs.dim() == 1 and signs.shape[0] == d, op, f"signs must have shape ({d},), got {list(signs.shape)}")


def decode_attention(q, k_packed, v_packed, k_window, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin,
                     k_signs) -> None:
    """The shape rules a traced call can check; csrc/checks.cpp checks the rest when the kernel runs."""
    op = "decode_attention"
    float_input(op, "q", q)
    value(q.dim() == 3, op, f"q must have shape (batch, q_heads, head_dim), got {list(q.shape)}")
    bits(op, "k_bits", k_bits)
    bits(op, "v_bits", v_bits)
    value(block >= 1, op, f"block must be >= 1 (got {block})")
    value(recent >= 0, op, f"recent must be >= 0 (got {recent})")
    value(k_packed.dim() == 4, op, f"k_packed must have shape (batch, kv_heads, capacity, bytes), got {list(k_packed.shape)}")
    hkv = k_packed.shape[1]
    value(hkv >= 1 and q.shape[1] % hkv == 0, op,
          f"q has {q.shape[1]} heads, which is not a multiple of the cache's {hkv} kv heads")
    for name, t, b in (("k_packed", k_packed, k_bits), ("v_packed", v_packed, v_bits)):
        dtype(t.dtype == torch.uint8, op, f"{name} must be uint8 (got {t.dtype})")
        value(t.dim() == 4 and t.shape[0] == q.shape[0] and t.shape[-1] * 8 == q.shape[-1] * b, op,
              f"{name} must have shape (batch={q.shape[0]}, kv_heads, capacity, {q.shape[-1] * b // 8}) for "
              f"head_dim {q.shape[-1]} at {b} bits, got {list(t.shape)}")
    value(k_window.dim() == 4 and k_window.shape[2] >= recent + block - 1, op,
          f"the window ring ({k_window.shape[2] if k_window.dim() == 4 else '?'} tokens) must hold "
          f"recent + block - 1 = {recent + block - 1} tokens")
    dtype(lengths.dtype in (torch.int32, torch.int64), op, f"lengths must be int32 or int64 (got {lengths.dtype})")
    value(lengths.dim() == 1 and lengths.shape[0] == q.shape[0], op,
          f"lengths must have shape ({q.shape[0]},), got {list(lengths.shape)}")
    value((rope_cos is None) == (rope_sin is None), op,
          "give both rope_cos and rope_sin (pre-RoPE keys) or neither")
    value(rope_cos is None or k_signs is None, op,
          "keys cannot be both pre-RoPE (rope_cos) and Hadamard-rotated (k_signs): RoPE does not commute with the rotation")


def cache_append(k_packed, v_packed, k_window, lengths, k_new, v_new, k_bits, v_bits, block, recent,
                 k_zero=None, v_zero=None, k_clip=False, v_clip=False) -> None:
    op = "cache_append"
    value(not (k_clip and k_zero is None), op, "k_clip needs asymmetric keys (k_zero)")
    value(not (v_clip and v_zero is None), op, "v_clip needs asymmetric values (v_zero)")
    float_input(op, "k_new", k_new)
    value(k_new.dim() == 4, op, f"k_new must have shape (batch, kv_heads, tokens, head_dim), got {list(k_new.shape)}")
    value(v_new.shape == k_new.shape, op, f"v_new must have k_new's shape {list(k_new.shape)}, got {list(v_new.shape)}")
    bits(op, "k_bits", k_bits)
    bits(op, "v_bits", v_bits)
    value(block >= 1, op, f"block must be >= 1 (got {block})")
    value(recent >= 0, op, f"recent must be >= 0 (got {recent})")
    b, h, _, d = k_new.shape
    for name, t, nb in (("k_packed", k_packed, k_bits), ("v_packed", v_packed, v_bits)):
        dtype(t.dtype == torch.uint8, op, f"{name} must be uint8 (got {t.dtype})")
        value(t.dim() == 4 and t.shape[0] == b and t.shape[1] == h and t.shape[-1] * 8 == d * nb, op,
              f"{name} must have shape (batch={b}, kv_heads={h}, capacity, {d * nb // 8}) for head_dim {d} at "
              f"{nb} bits, got {list(t.shape)}")
    dtype(k_new.dtype == k_window.dtype and v_new.dtype == k_window.dtype, op,
          f"k_new and v_new must have the cache's full-precision dtype (k_window: {k_window.dtype}), got "
          f"{k_new.dtype} and {v_new.dtype}")
    dtype(lengths.dtype in (torch.int32, torch.int64), op, f"lengths must be int32 or int64 (got {lengths.dtype})")
    value(lengths.dim() == 1 and lengths.shape[0] == b, op, f"lengths must have shape ({b},), got {list(lengths.shape)}")
