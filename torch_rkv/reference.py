"""Pure-PyTorch semantics of every torch_rkv op: the spec the kernels are tested against.

Readable top to bottom, no speed concerns. The C++/CUDA kernels reproduce the quantize, dequantize, pack,
unpack, rope and hadamard functions here bit for bit (same fp32 operations in the same order, see
csrc/include/rkv/*.h); attention matches to float tolerance.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

# --------------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------------


def levels(bits: int) -> int:
    """Largest asymmetric code."""
    return (1 << bits) - 1


def sym_bias(bits: int) -> int:
    """Stored code of the value 0 in symmetric quantization."""
    return 1 << (bits - 1)


def _next16(h: torch.Tensor, up: bool) -> torch.Tensor:
    """Next representable float16 / bfloat16 toward +inf (up) or -inf."""
    b = h.view(torch.int16).to(torch.int32) & 0xFFFF
    neg = (b & 0x8000) != 0
    toward_zero = neg if up else ~neg
    nb = torch.where(toward_zero, b - 1, b + 1)
    nb = torch.where((b & 0x7FFF) == 0, torch.full_like(b, 0x0001 if up else 0x8001), nb)
    nb = torch.where(nb >= 0x8000, nb - 0x10000, nb)
    return nb.to(torch.int16).view(h.dtype)


def round_meta(v: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Finite float64 values rounded to ``dtype`` toward +inf (up) or -inf, as float32, saturated to
    the dtype's finite range."""
    f = v.to(torch.float32)
    adj = f.double() < v if up else f.double() > v
    f = torch.where(adj, torch.nextafter(f, torch.full_like(f, math.inf if up else -math.inf)), f)
    if dtype != torch.float32:
        h = f.to(dtype)
        adj = h.float() < f if up else h.float() > f
        f = torch.where(adj, _next16(h, up), h).float()
    mx = torch.finfo(dtype).max
    return f.clamp(-mx, mx)


def quant_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool, meta_dtype: torch.dtype):
    """(scale, zero) as float32 from each group's finite min and max; lo > hi marks an empty group."""
    empty = ~(lo <= hi)
    lo = torch.where(empty, torch.zeros_like(lo), lo) + 0.0  # -0 -> +0, whichever zero the reduction met
    hi = torch.where(empty, torch.zeros_like(hi), hi) + 0.0
    if symmetric:
        amax = torch.maximum(lo.abs(), hi.abs())
        scale = round_meta(amax.double() / (sym_bias(bits) - 1), meta_dtype, up=True)
        zero = torch.zeros_like(scale)
    else:
        zero = round_meta(lo.double(), meta_dtype, up=False)
        scale = round_meta((hi.double() - zero.double()) / levels(bits), meta_dtype, up=True)
    zeros = torch.zeros_like(scale)
    return torch.where(empty, zeros, scale), torch.where(empty, zeros, zero)


CLIP_STEPS = 11


def _tile_error(tiles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Sum over each tile (*, nb, T, ng, G) of (x_hat - x)^2 for its finite values, float64, (*, nb, ng)."""
    s, z = scale[..., :, None, :, None], zero[..., :, None, :, None]
    err = (decode(encode(tiles, s, z, bits, False), s, z, bits) - tiles).double() ** 2
    return torch.where(torch.isfinite(tiles), err, torch.zeros_like(err)).sum(dim=(-3, -1))


def clip_params(tiles: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, meta_dtype: torch.dtype):
    """(scale, zero) of the clipped-range search: candidate j = 0..10 is the range [lo + j*step, hi - j*step]
    with step = (hi - lo) * 0.025 in float32 (none beyond j = 0 when step overflows); the candidate
    with the least squared error over the group's finite values (float64 sum) wins, ties keep the
    smaller j. Asymmetric parameters; tiles (*, nb, T, ng, G), lo / hi (*, nb, ng)."""
    step = (hi - lo) * torch.tensor(0.025, dtype=torch.float32)
    searchable = torch.isfinite(step)
    best_scale, best_zero = quant_params(lo, hi, bits, False, meta_dtype)
    best_err = _tile_error(tiles, best_scale, best_zero, bits)
    for j in range(1, CLIP_STEPS):
        cut = torch.tensor(float(j), dtype=torch.float32) * step
        scale, zero = quant_params(lo + cut, hi - cut, bits, False, meta_dtype)
        err = _tile_error(tiles, scale, zero, bits)
        better = searchable & (err < best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_err = torch.where(better, err, best_err)
    return best_scale, best_zero


def _expand_meta(m: torch.Tensor, block_tokens: int, group_size: int) -> torch.Tensor:
    """(*, N/T, D/G) -> (*, N, D): each group's value at each of its elements."""
    return m.float().repeat_interleave(block_tokens, dim=-2).repeat_interleave(group_size, dim=-1)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """Codes (uint8) of float32 x given float32 scale/zero broadcast to x."""
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    pos = scale > 0
    safe = torch.where(pos, scale, torch.ones_like(scale))
    if symmetric:
        qm = sym_bias(bits) - 1
        q = torch.where(pos, torch.round(x / safe), torch.zeros_like(x)).clamp(-qm, qm) + sym_bias(bits)
    else:
        q = torch.where(pos, torch.round((x - zero) / safe), torch.zeros_like(x)).clamp(0, levels(bits))
    return q.to(torch.uint8)


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """float32 values of codes given float32 scale/zero broadcast to them (zero None: symmetric)."""
    c = codes.float()
    if zero is None:
        return (c - sym_bias(bits)) * scale
    return c * scale + zero


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    block_tokens: int = 1,
    symmetric: bool = False,
    meta_dtype: torch.dtype = torch.float16,
    clip: bool = False,
):
    """x (*, N, D) -> (packed (*, N, D*bits/8) uint8, scale, zero (*, N/T, D/G) meta_dtype).

    Groups are tiles of T = block_tokens tokens x G = group_size channels. Asymmetric: zero = min
    rounded down to meta_dtype, scale = (max - zero) / (2^bits - 1) rounded up, over the group's finite
    values; code = clamp(round((x - zero) / scale), 0, 2^bits - 1). Symmetric: scale = max|x| /
    (2^(bits-1) - 1) rounded up, code = clamp(round(x / scale), -q, q) + 2^(bits-1), zero is empty.
    round is half-to-even; NaN encodes as 0; +-Inf saturate; a group with no finite value gets scale 0.
    clip (asymmetric only): each group's (min, max) is replaced by the best range of clip_params.
    """
    if clip and symmetric:
        raise ValueError("rkv.quantize: clip searches asymmetric ranges; it needs symmetric=False")
    *lead, n, d = x.shape
    t, g = block_tokens, group_size
    xf = x.float()
    tiles = xf.reshape(*lead, n // t, t, d // g, g)
    finite = torch.isfinite(tiles)
    lo = torch.where(finite, tiles, torch.full_like(tiles, math.inf)).amin(dim=(-3, -1))
    hi = torch.where(finite, tiles, torch.full_like(tiles, -math.inf)).amax(dim=(-3, -1))
    if clip:
        scale, zero = clip_params(tiles, lo, hi, bits, meta_dtype)
    else:
        scale, zero = quant_params(lo, hi, bits, symmetric, meta_dtype)
    codes = encode(xf, _expand_meta(scale, t, g), _expand_meta(zero, t, g), bits, symmetric)
    zero_out = torch.empty(0, dtype=meta_dtype, device=x.device) if symmetric else zero.to(meta_dtype)
    return pack(codes, bits), scale.to(meta_dtype), zero_out


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: Optional[torch.Tensor],
    bits: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of quantize; group size and block tokens are read off scale's shape."""
    codes = unpack(packed, bits)
    n, d = codes.shape[-2], codes.shape[-1]
    t = n // scale.shape[-2] if scale.shape[-2] else 1
    g = d // scale.shape[-1]
    z = None if zero is None else _expand_meta(zero, t, g)
    return decode(codes, _expand_meta(scale, t, g), z, bits).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Bit packing (docs/format.md): a row is a little-endian bitstream, code i at bits [i*b, (i+1)*b).
# --------------------------------------------------------------------------------------------------


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (*, D) uint8 -> (*, D*bits/8) uint8."""
    *lead, d = codes.shape
    shifts = torch.arange(bits, device=codes.device)
    stream = (codes.to(torch.int32)[..., None] >> shifts) & 1  # (*, D, bits): bit k of code i
    stream = stream.reshape(*lead, d * bits // 8, 8)  # stream bit 8j+k -> byte j, bit k
    weights = 1 << torch.arange(8, device=codes.device)
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed (*, B) uint8 -> codes (*, B*8/bits) uint8."""
    *lead, nbytes = packed.shape
    stream = (packed.to(torch.int32)[..., None] >> torch.arange(8, device=packed.device)) & 1
    stream = stream.reshape(*lead, nbytes * 8 // bits, bits)
    weights = 1 << torch.arange(bits, device=packed.device)
    return (stream * weights).sum(-1).to(torch.uint8)


# --------------------------------------------------------------------------------------------------
# Rotary embedding
# --------------------------------------------------------------------------------------------------


def rope_pairs(x: torch.Tensor, half: int, interleaved: bool):
    """The two members (x0, x1) of each rotated pair: (j, j+half) or (2j, 2j+1)."""
    if interleaved:
        return x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    return x[..., :half], x[..., half : 2 * half]


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate pairs of x (*, D) by the (cos, sin) table rows (P, rot_dim/2) at positions.

    apply: (x0, x1) -> (x0 c - x1 s, x1 c + x0 s); undo: ((x0 c + x1 s) / n, (x1 c - x0 s) / n) with
    n = c^2 + s^2, the exact inverse even for scaled tables. Channels past rot_dim are unchanged.
    """
    half = cos.shape[-1]
    pos = positions.long().expand(x.shape[:-1])
    if pos.numel() and (pos.min() < 0 or pos.max() >= cos.shape[0]):
        raise ValueError(f"rkv.rope: positions outside the cos/sin table of {cos.shape[0]} positions")
    c, s = cos.float()[pos], sin.float()[pos]
    out = x.float().clone()
    x0, x1 = rope_pairs(out, half, interleaved)
    x0, x1 = x0.clone(), x1.clone()
    if inverse:
        n = c * c + s * s
        y0, y1 = (x0 * c + x1 * s) / n, (x1 * c - x0 * s) / n
    else:
        y0, y1 = x0 * c - x1 * s, x1 * c + x0 * s
    o0, o1 = rope_pairs(out, half, interleaved)
    o0.copy_(y0)
    o1.copy_(y1)
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Hadamard
# --------------------------------------------------------------------------------------------------


def hadamard_block(dim: int) -> int:
    """Transform block: the largest power of two dividing dim (dim itself if a power of two)."""
    return dim & -dim


def hadamard(x: torch.Tensor, signs: Optional[torch.Tensor] = None, inverse: bool = False) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of x (*, D) in blocks of hadamard_block(D).

    forward: H diag(signs) x / sqrt(n); inverse: diag(signs) H x / sqrt(n). Sylvester order: stage
    h = 1, 2, 4, ... maps (v[j], v[j+h]) -> (v[j] + v[j+h], v[j] - v[j+h]).
    """
    d = x.shape[-1]
    n = hadamard_block(d)
    v = x.float()
    if signs is not None and not inverse:
        v = v * signs.float()
    lead = v.shape[:-1]
    h = 1
    while h < n:
        v = v.reshape(*lead, d // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    norm = torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32, device=x.device)
    v = v.reshape(x.shape) * norm
    if signs is not None and inverse:
        v = v * signs.float()
    return v.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# The quantized KV cache layout and decode attention over it
# --------------------------------------------------------------------------------------------------
#
# Per sequence of n tokens and per KV head, token t lives in exactly one place:
#   t < S                      sink[t]                         (full precision, the first S tokens)
#   S <= t < S + Q(n)          packed row t - S                (quantized; metadata row (t - S) / T_k)
#   S + Q(n) <= t < n          window[(t - S) % W]             (full precision ring of the newest tokens)
# with Q(n) = block * floor(max(0, n - S - recent) / block): only whole blocks are quantized and at
# least `recent` newest tokens stay in full precision. W >= recent + block - 1 holds every window token.


def quantized_count(n: int, sinks: int, recent: int, block: int) -> int:
    """Q(n): how many of n tokens sit in the packed buffers."""
    return block * (max(0, n - sinks - recent) // block)


def gather_tokens(packed, scale, zero, bits, window, sink, n: int, recent: int, block: int) -> torch.Tensor:
    """All n cached tokens of one sequence in order, as float32 (H, n, D), from one quantized tensor
    (packed (H, C, D*bits/8), scale/zero (H, C/T, D/G)), its window ring (H, W, D) and sinks (H, S, D)."""
    s = sink.shape[-2]
    q = quantized_count(n, s, recent, block)
    parts = [sink[:, : min(n, s)].float()]
    if q:
        t = packed.shape[-2] // scale.shape[-2]  # tokens per metadata row
        parts.append(dequantize(packed[:, :q], scale[:, : q // t], None if zero is None else zero[:, : q // t], bits))
    if n > s + q:
        slots = [(i - s) % window.shape[-2] for i in range(s + q, n)]
        parts.append(window[:, slots].float())
    return torch.cat(parts, dim=1)


def decode_attention(
    q: torch.Tensor,
    k_packed, k_scale, k_zero, v_packed, v_scale, v_zero,
    k_window, v_window, k_sink, v_sink,
    lengths: torch.Tensor,
    k_bits: int, v_bits: int, block: int, recent: int,
    rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None, rope_interleaved: bool = False,
    k_signs: Optional[torch.Tensor] = None, v_signs: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of each sequence's newest query q (B, Hq, D) over its n = lengths[b] cached tokens.

    Keys stored before RoPE (rope_cos/rope_sin given) are rotated to their positions 0..n-1 after
    dequantizing; keys/values stored Hadamard-rotated (k_signs / v_signs given) are used in the rotated
    space: scores with the rotated query, the output rotated back. Query head h reads KV head
    h // (Hq / Hkv). A sequence with no cached token gets a zero output. Computed in float32.
    """
    b_, hq, d = q.shape
    hkv = k_packed.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float()
    if k_signs is not None:
        qf = hadamard(qf, k_signs)
    out = torch.zeros(b_, hq, d, dtype=torch.float32, device=q.device)
    for b in range(b_):
        n = int(lengths[b])
        if n == 0:
            continue
        keys = gather_tokens(k_packed[b], k_scale[b], None if k_zero is None else k_zero[b], k_bits,
                             k_window[b], k_sink[b], n, recent, block)
        values = gather_tokens(v_packed[b], v_scale[b], None if v_zero is None else v_zero[b], v_bits,
                               v_window[b], v_sink[b], n, recent, block)
        if rope_cos is not None:
            keys = rope(keys, rope_cos, rope_sin, torch.arange(n, device=q.device), rope_interleaved)
        qg = qf[b].reshape(hkv, hq // hkv, d)
        probs = torch.softmax((qg @ keys.transpose(-1, -2)) * scale, dim=-1)
        out[b] = (probs @ values).reshape(hq, d)
    if v_signs is not None:
        out = hadamard(out, v_signs, inverse=True)
    return out.to(q.dtype)


def cache_append(
    k_packed, k_scale, k_zero, v_packed, v_scale, v_zero,
    k_window, v_window, k_sink, v_sink,
    lengths: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    k_bits: int, v_bits: int, block: int, recent: int, k_clip: bool = False, v_clip: bool = False,
) -> None:
    """Append k_new / v_new (B, Hkv, m, D) after each sequence's lengths[b] tokens, in place.

    Writes exactly: sink rows of new tokens t < S; every block that the append completes, quantized
    (reading its older tokens from the window ring, its newer ones from k_new / v_new), into its packed
    rows and metadata rows; window slots of new tokens that stay in full precision. Nothing else changes;
    lengths is not updated (the caller adds m). New tokens are used in the window's dtype, so the result
    does not depend on how the tokens were chunked into appends.
    """
    for side, clip, zero in (("k", k_clip, k_zero), ("v", v_clip, v_zero)):
        if clip and zero is None:
            raise ValueError(f"rkv.cache_append: {side}_clip needs asymmetric {'keys' if side == 'k' else 'values'} "
                             f"({side}_zero)")
    s, w = k_sink.shape[-2], k_window.shape[-2]
    m = k_new.shape[-2]
    for b in range(k_new.shape[0]):
        n0 = int(lengths[b])
        n1 = n0 + m
        if n1 > s + k_packed.shape[-2] + recent:
            raise ValueError(f"rkv.cache_append: appending {m} tokens to sequence {b} of {n0} tokens exceeds the "
                             f"capacity of {s + k_packed.shape[-2] + recent} tokens")
        q0, q1 = quantized_count(n0, s, recent, block), quantized_count(n1, s, recent, block)
        for new, packed, scale, zero, bits, window, sink, clip in (
            (k_new[b], k_packed[b], k_scale[b], k_zero, k_bits, k_window[b], k_sink[b], k_clip),
            (v_new[b], v_packed[b], v_scale[b], v_zero, v_bits, v_window[b], v_sink[b], v_clip),
        ):
            new = new.to(window.dtype)
            zb = None if zero is None else zero[b]

            def token(t):
                return window[:, (t - s) % w] if t < n0 else new[:, t - n0]

            for t in range(n0, min(n1, s)):
                sink[:, t] = new[:, t - n0]
            per_row = packed.shape[-2] // scale.shape[-2] if scale.shape[-2] else 1
            for j in range(q0 // block, q1 // block):
                rows = range(s + j * block, s + (j + 1) * block)
                src = torch.stack([token(t) for t in rows], dim=1)  # (H, block, D)
                p, sc, zr = quantize(src, bits, packed.shape[-1] * 8 // bits // scale.shape[-1], per_row,
                                     zb is None, scale.dtype, clip)
                packed[:, j * block : (j + 1) * block] = p
                scale[:, j * block // per_row : (j + 1) * block // per_row] = sc
                if zb is not None:
                    zb[:, j * block // per_row : (j + 1) * block // per_row] = zr
            for t in range(max(n0, s + q1), n1):
                window[:, (t - s) % w] = new[:, t - n0]
