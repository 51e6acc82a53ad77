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


def check_levels(op: str, arg: str, lv: Optional[torch.Tensor], bits: int, symmetric: bool) -> None:
    """Non-uniform levels: (2^bits,) float32 code values, strictly ascending within [0, 2^bits - 1], for
    asymmetric codes of 2 to 4 bits (checks.cpp check_levels)."""
    if lv is None:
        return
    if symmetric:
        raise ValueError(f"rkv.{op}: {arg} (non-uniform levels) needs asymmetric codes; this side is symmetric "
                         "(no zero)")
    if lv.dtype != torch.float32:
        raise TypeError(f"rkv.{op}: {arg} must be float32 (got {lv.dtype})")
    if bits > 4:
        raise ValueError(f"rkv.{op}: {arg}: non-uniform levels are for 2, 3 or 4 bits (got {bits})")
    if lv.shape != (1 << bits,):
        raise ValueError(f"rkv.{op}: {arg} must have shape ({1 << bits},), one value per {bits}-bit code, got "
                         f"{list(lv.shape)}")
    v = lv.cpu()
    if not (bool((v >= 0).all()) and bool((v <= levels(bits)).all()) and bool((v[1:] > v[:-1]).all())):
        raise ValueError(f"rkv.{op}: {arg} must be strictly ascending code values within [0, {levels(bits)}]")


def _next_float(h: torch.Tensor, up: bool) -> torch.Tensor:
    """Next representable float16, bfloat16 or float8 toward +inf (up) or -inf, stepping the bit pattern."""
    nbits = torch.finfo(h.dtype).bits
    sign, full = 1 << (nbits - 1), 1 << nbits
    view = torch.int16 if nbits == 16 else torch.int8
    b = h.view(view).to(torch.int32) & (full - 1)
    neg = (b & sign) != 0
    toward_zero = neg if up else ~neg
    nb = torch.where(toward_zero, b - 1, b + 1)
    nb = torch.where((b & (sign - 1)) == 0, torch.full_like(b, 0x1 if up else sign | 0x1), nb)
    nb = torch.where(nb >= sign, nb - full, nb)
    return nb.to(view).view(h.dtype)


def round_meta(v: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Finite float64 values rounded to ``dtype`` toward +inf (up) or -inf, as float32, saturated to
    the dtype's finite range (a value beyond it becomes the largest finite value of its sign)."""
    f = v.to(torch.float32)
    adj = f.double() < v if up else f.double() > v
    f = torch.where(adj, torch.nextafter(f, torch.full_like(f, math.inf if up else -math.inf)), f)
    mx = torch.finfo(dtype).max
    f = f.clamp(-mx, mx)
    if dtype != torch.float32:
        h = f.to(dtype)
        adj = h.float() < f if up else h.float() > f
        f = torch.where(adj, _next_float(h, up), h).float()
    return f


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


def _tile_error(tiles: torch.Tensor, counted: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                bits: int, lv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum over each tile (*, nb, T, ng, G) of (x_hat - x)^2 for its counted values, float64, (*, nb, ng)."""
    s, z = scale[..., :, None, :, None], zero[..., :, None, :, None]
    err = (decode(encode(tiles, s, z, bits, False, lv), s, z, bits, lv) - tiles).double() ** 2
    return torch.where(counted, err, torch.zeros_like(err)).sum(dim=(-3, -1))


def clip_params(tiles: torch.Tensor, counted: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int,
                meta_dtype: torch.dtype, lv: Optional[torch.Tensor] = None):
    """(scale, zero) of the clipped-range search: candidate j = 0..10 is the range [lo + j*step, hi - j*step]
    with step = (hi - lo) * 0.025 in float32 (none beyond j = 0 when step overflows); the candidate
    with the least squared error over the group's counted values (finite, not sinks; float64 sum) wins,
    ties keep the smaller j. Asymmetric parameters; tiles (*, nb, T, ng, G), lo / hi (*, nb, ng)."""
    step = (hi - lo) * torch.tensor(0.025, dtype=torch.float32)
    searchable = torch.isfinite(step)
    best_scale, best_zero = quant_params(lo, hi, bits, False, meta_dtype)
    best_err = _tile_error(tiles, counted, best_scale, best_zero, bits, lv)
    for j in range(1, CLIP_STEPS):
        cut = torch.tensor(float(j), dtype=torch.float32) * step
        scale, zero = quant_params(lo + cut, hi - cut, bits, False, meta_dtype)
        err = _tile_error(tiles, counted, scale, zero, bits, lv)
        better = searchable & (err < best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_err = torch.where(better, err, best_err)
    return best_scale, best_zero


def expand_meta(m: torch.Tensor, block_tokens: int, group_size: int) -> torch.Tensor:
    """(*, N/T, D/G) -> (*, N, D): each group's value at each of its elements."""
    return m.float().repeat_interleave(block_tokens, dim=-2).repeat_interleave(group_size, dim=-1)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool,
           lv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes (uint8) of float32 x given float32 scale/zero broadcast to x. lv: non-uniform levels (code
    units, ascending; asymmetric): the code of the nearest level to (x - zero) / scale, ties toward the
    lower (the count of midpoints it exceeds)."""
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    pos = scale > 0
    safe = torch.where(pos, scale, torch.ones_like(scale))
    if lv is not None:
        u = torch.where(pos, (x - zero) / safe, torch.zeros_like(x))
        lv = lv.to(device=x.device, dtype=torch.float32)
        mids = (lv[1:] + lv[:-1]) * 0.5
        return (u[..., None] > mids).sum(-1).to(torch.uint8)
    if symmetric:
        qm = sym_bias(bits) - 1
        q = torch.where(pos, torch.round(x / safe), torch.zeros_like(x)).clamp(-qm, qm) + sym_bias(bits)
    else:
        q = torch.where(pos, torch.round((x - zero) / safe), torch.zeros_like(x)).clamp(0, levels(bits))
    return q.to(torch.uint8)


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int,
           lv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 values of codes given float32 scale/zero broadcast to them (zero None: symmetric); lv:
    non-uniform levels, lv[code] * scale + zero."""
    c = codes.float() if lv is None else lv.to(device=codes.device, dtype=torch.float32)[codes.long()]
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
    sink_rows: int = 0,
    levels: Optional[torch.Tensor] = None,
    excluded: Optional[torch.Tensor] = None,
    unclipped: Optional[torch.Tensor] = None,
):
    """x (*, N, D) -> (packed (*, N, D*bits/8) uint8, scale, zero (*, N/T, D/G) meta_dtype).

    Groups are tiles of T = block_tokens tokens x G = group_size channels. Asymmetric: zero = min
    rounded down to meta_dtype, scale = (max - zero) / (2^bits - 1) rounded up, over the group's finite
    values; code = clamp(round((x - zero) / scale), 0, 2^bits - 1). Symmetric: scale = max|x| /
    (2^(bits-1) - 1) rounded up, code = clamp(round(x / scale), -q, q) + 2^(bits-1), zero is empty.
    round is half-to-even; NaN encodes as 0; +-Inf saturate; a group with no finite value gets scale 0.
    clip (asymmetric only): each group's (min, max) is replaced by the best range of clip_params.
    sink_rows (the cache's use, not an op argument): tokens [0, sink_rows) are attention sinks, kept in
    full precision elsewhere; they are encoded like the others but do not set the range of a group they
    share with other tokens (a group made of sinks only takes its range from them).
    levels (asymmetric, 2-4 bits): non-uniform code values in code units, (2^bits,) float32 strictly
    ascending within [0, 2^bits - 1]; the range and scale are unchanged, codes come from encode's lv.
    excluded (the cache's use, a bool mask like x): values kept as sparse outliers (select_outliers),
    encoded like the others but left out of every range and clip error.
    unclipped (the cache's use, a bool mask broadcast to (*, N/T, D/G)): groups that keep their full
    range under clip (refined key channels, refine_codes).
    """
    if clip and symmetric:
        raise ValueError("rkv.quantize: clip searches asymmetric ranges; it needs symmetric=False")
    check_levels("quantize", "levels", levels, bits, symmetric)
    *lead, n, d = x.shape
    t, g = block_tokens, group_size
    xf = x.float()
    tiles = xf.reshape(*lead, n // t, t, d // g, g)
    counted = torch.isfinite(tiles)
    if sink_rows:
        row = torch.arange(n, device=x.device).reshape(n // t, t)
        all_sinks = (row < sink_rows).all(dim=-1, keepdim=True)
        counted = counted & ((row >= sink_rows) | all_sinks)[:, :, None, None]
    if excluded is not None:
        counted = counted & ~excluded.reshape(tiles.shape)
    lo = torch.where(counted, tiles, torch.full_like(tiles, math.inf)).amin(dim=(-3, -1))
    hi = torch.where(counted, tiles, torch.full_like(tiles, -math.inf)).amax(dim=(-3, -1))
    if clip:
        scale, zero = clip_params(tiles, counted, lo, hi, bits, meta_dtype, levels)
        if unclipped is not None:
            full_scale, full_zero = quant_params(lo, hi, bits, symmetric, meta_dtype)
            scale, zero = torch.where(unclipped, full_scale, scale), torch.where(unclipped, full_zero, zero)
    else:
        scale, zero = quant_params(lo, hi, bits, symmetric, meta_dtype)
    codes = encode(xf, expand_meta(scale, t, g), expand_meta(zero, t, g), bits, symmetric, levels)
    zero_out = torch.empty(0, dtype=meta_dtype, device=x.device) if symmetric else zero.to(meta_dtype)
    return pack(codes, bits), scale.to(meta_dtype), zero_out


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: Optional[torch.Tensor],
    bits: int,
    out_dtype: torch.dtype = torch.float32,
    levels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Inverse of quantize; group size and block tokens are read off scale's shape."""
    check_levels("dequantize", "levels", levels, bits, zero is None)
    codes = unpack(packed, bits)
    n, d = codes.shape[-2], codes.shape[-1]
    t = n // scale.shape[-2] if scale.shape[-2] else 1
    g = d // scale.shape[-1]
    z = None if zero is None else expand_meta(zero, t, g)
    return decode(codes, expand_meta(scale, t, g), z, bits, levels).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Sparse outliers (include/rkv/outliers.h): a cache block's values kept outside its dense quantization
# --------------------------------------------------------------------------------------------------

OUTLIER_EMPTY = -65536  # 0xFFFF0000 as int32: position 0xFFFF, residual 0


def _group_view(x: torch.Tensor, t: int, g: int) -> torch.Tensor:
    """x (H, block, D) -> (H, groups, T*G): the quantizer groups of a block in (tile row, channel group)
    order, each group's elements in position order."""
    h, n, d = x.shape
    return x.reshape(h, n // t, t, d // g, g).permute(0, 1, 3, 2, 4).reshape(h, (n // t) * (d // g), t * g)


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def select_outliers(x: torch.Tensor, count: int, tile_rows: int, group: int, sink_rows: int = 0) -> torch.Tensor:
    """The sparse outliers of one block x (H, block, D) float32: a bool mask (H, block, D) of at most `count`
    values per head, chosen greedily (include/rkv/outliers.h). A candidate is a finite value of a row >=
    sink_rows not yet taken. Per quantizer group (tile_rows x group), taking its largest candidate shrinks
    its range r = hi - lo to r' = hi2 - lo, its smallest to r' = hi - lo2; gain = (r - r') * (r + r') in
    float32, 0 with fewer than two candidates (NaN counts as 0). Each step takes the largest gain > 0;
    ties: the lower group, then the high end; among equal values in a group, the lowest position.

    A group only ever loses its current maximum or minimum, so each group is sorted once, both ways
    (equal values in position order), and a step reads four values per group: the i-th from the bottom
    and the j-th from the top, i and j counting what the group gave up at each end. (While a gain is
    positive the two ends cannot meet: a value taken at one end is never the other end's next.)"""
    h, n, d = x.shape
    rows = torch.arange(n).reshape(1, n, 1).expand(h, n, d)
    xv = _group_view(x, tile_rows, group)  # (H, G, M), elements in position order
    cand = _group_view(torch.isfinite(x) & (rows >= sink_rows), tile_rows, group)
    m = xv.shape[-1]
    up_vals, up_at = torch.where(cand, xv, math.inf).sort(dim=-1, stable=True)  # candidates first, ascending
    down_vals, down_at = torch.where(cand, xv, -math.inf).sort(dim=-1, descending=True, stable=True)
    alive = cand.sum(-1)
    low = torch.zeros_like(alive)  # taken from the bottom / the top
    high = torch.zeros_like(alive)
    heads = torch.arange(h)

    def at(vals, i):
        return vals.gather(-1, i.clamp(max=m - 1)[..., None])[..., 0]

    for _ in range(count):
        lo, lo2, hi, hi2 = at(up_vals, low), at(up_vals, low + 1), at(down_vals, high), at(down_vals, high + 1)
        r = hi - lo
        lone = alive < 2  # a group with one candidate left is never emptied
        gains = []
        for r2 in (hi2 - lo, hi - lo2):
            gain = (r - r2) * (r + r2)
            gains.append(torch.where(torch.isnan(gain) | lone, torch.zeros_like(gain), gain))
        g = torch.stack(gains, dim=-1).reshape(h, -1)  # (H, groups * 2): key = group * 2 + (0 high, 1 low)
        best = g.amax(-1)
        key = (g == best[:, None]).int().argmax(-1)
        take = best > 0
        grp, end = key[take] // 2, key[take] % 2
        low[heads[take], grp] += end
        high[heads[take], grp] += 1 - end
        alive[heads[take], grp] -= 1
    ranks = torch.arange(m)
    taken = torch.zeros_like(cand)
    taken.scatter_(-1, up_at, ranks < low[..., None])
    taken |= torch.zeros_like(cand).scatter_(-1, down_at, ranks < high[..., None])
    mask = torch.zeros(h, n * d, dtype=torch.bool)
    pos = _group_view(torch.arange(n * d).reshape(1, n, d).expand(h, n, d), tile_rows, group)
    mask.scatter_(1, pos.reshape(h, -1), taken.reshape(h, -1))
    return mask.reshape(h, n, d)


def outlier_residual(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """What an outlier entry keeps of x - x_hat: float32 rounded to float16, saturated to +-65504."""
    return (x.float() - x_hat.float()).clamp(-65504.0, 65504.0).to(torch.float16)


def outlier_entries(x: torch.Tensor, x_hat: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """The block's entries (H, count) int32: per taken position (ascending) position << 16 | the float16
    bits of x - x_hat (saturated to +-65504), then OUTLIER_EMPTY."""
    h = x.shape[0]
    out = torch.full((h, count), OUTLIER_EMPTY, dtype=torch.int32)
    res = outlier_residual(x, x_hat).view(torch.int16).int() & 0xFFFF
    for i in range(h):
        where = mask[i].reshape(-1).nonzero()[:, 0]
        e = (where.int() << 16) | res[i].reshape(-1)[where]
        out[i, : len(e)] = e.int()
    return out


def outlier_residuals(entries: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    """entries (*, K) int32 -> (*, block, D) float32: each entry's residual at its position (0 elsewhere)."""
    lead = entries.shape[:-1]
    e = entries.reshape(-1, entries.shape[-1]).long() & 0xFFFFFFFF
    pos = e >> 16
    res = (e & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).float()
    used = pos < block * dim
    dense = torch.zeros(e.shape[0], block * dim + 1, dtype=torch.float32, device=entries.device)
    dense.scatter_add_(1, torch.where(used, pos, block * dim), torch.where(used, res, torch.zeros_like(res)))
    return dense[:, : block * dim].reshape(*lead, block, dim)


# --------------------------------------------------------------------------------------------------
# Refined key channels (torch_rkv.channels; docs/format.md, "Refined key channels"): m per-channel key
# channels of each KV head, channels[h] (Hkv, m), keep their code c and their block's unclipped scale and
# zero, and add an `extra`-bit code r for where in c's cell the value lies, packed m to a row like codes:
#     x_hat = c * scale + zero + scale * (2r + 1 - 2^extra) / 2^(extra + 1)
# The second term is refine_residual; |x - x_hat| <= scale / 2^(extra + 1) inside the range.
# --------------------------------------------------------------------------------------------------

REFINE_BITS = (2, 3, 4)  # the widths the kernels store refinement codes at


def refine_bits(refine: torch.Tensor, channels: torch.Tensor) -> int:
    """The refinement width of a buffer whose rows hold channels.shape[-1] codes."""
    return refine.shape[-1] * 8 // channels.shape[-1]


def refine_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, extra: int) -> torch.Tensor:
    """The `extra`-bit refinement codes (uint8) of float32 x whose `bits`-bit codes encode takes with
    float32 scale / zero (broadcast): u = (x - zero) / scale, c = encode's code, r = floor((u - c + 1/2)
    * 2^extra) within [0, 2^extra). NaN is 0, as encode takes it; where scale is 0, u is 0."""
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    pos = scale > 0
    u = torch.where(pos, (x - zero) / torch.where(pos, scale, torch.ones_like(scale)), torch.zeros_like(x))
    code = torch.round(u).clamp(0, levels(bits))
    cells = 1 << extra
    return ((u - code + 0.5) * cells).floor().clamp(0, cells - 1).to(torch.uint8)


def refine_residual(r: torch.Tensor, scale: torch.Tensor, extra: int) -> torch.Tensor:
    """What refinement code r adds to its channel's decoded value: scale * (2r + 1 - 2^extra) /
    2^(extra + 1), float32 (the fraction is exact, the product rounds once)."""
    cells = 1 << extra
    return scale * ((2 * r.float() + 1 - cells) / (2 * cells))


def refined_rows(out: torch.Tensor, refine_rows: torch.Tensor, channels: torch.Tensor, scale: torch.Tensor,
                 extra: int) -> torch.Tensor:
    """Dequantized key rows out (N, H, D) with the refinement rows (N, H, m*extra/8) of channels (H, m)
    added; scale (N, H, D): each element's scale."""
    ch = channels.long().to(out.device).expand(out.shape[0], -1, -1)
    r = unpack(refine_rows, extra)
    return out.scatter_add(-1, ch, refine_residual(r, scale.gather(-1, ch), extra))


def refine_pair(op: str, k_refine: Optional[torch.Tensor], k_channels: Optional[torch.Tensor]):
    """(k_refine, k_channels), or None without refined key channels; they come together."""
    if (k_refine is None) != (k_channels is None):
        raise ValueError(f"rkv.{op}: k_refine and k_channels come together (the refinement codes and which "
                         "channels they refine)")
    return None if k_refine is None else (k_refine, k_channels)


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
# The quantized KV cache: pages, full-precision side rows, and attention over them
# --------------------------------------------------------------------------------------------------
#
# One layer stores (docs/format.md):
#   pages       k_codes (pages, H, P, D*bits/8) uint8 with k_scale / k_zero (pages, H, P/T, D/G); same for v
#   side slots  k_sink (slots, H, S, D) and k_window (slots, H, W, D) in full precision; same for v
# Sequence b owns the pages block_tables[b] (token t: page block_tables[b][t // P], row t % P) and the
# side slot side_slots[b]. The contiguous layout is one page of P = capacity rows per sequence: page b and
# slot b (block_tables and side_slots None).
#
# Tokens are quantized in blocks of `block` tokens (P is a multiple of block, block a multiple of both
# quantizer tiles T): block j covers tokens [j*block, (j+1)*block) and is written into its rows the
# moment its last token arrives, so a full page is final and can be shared. A sequence of n tokens
# reads token t from
#   t < S                      sink[t]          (full precision: the first S tokens)
#   S <= t < Q(n)              its quantized row
#   max(S, Q(n)) <= t < n      window[t % W]    (full-precision ring of the newest tokens)
# with Q(n) = block * floor(max(0, n - recent) / block): at least `recent` newest tokens stay in full
# precision, and W >= recent + block - 1 holds them. Sinks are encoded in their block like any token
# but do not set the range of a group they share with other tokens (quantize's sink_rows).


def quantized_count(n: int, recent: int, block: int) -> int:
    """Q(n): of n cached tokens, those before Q(n) are read from their quantized rows (sinks excepted)."""
    return block * (max(0, n - recent) // block)


def append_keeps_reads(n: int, recent: int, block: int) -> bool:
    """Whether appending token n to n cached tokens leaves every one of them read where it was: no block
    leaves the recent window (Q(n + 1) == Q(n)). Then attention over the n + 1 tokens after the append
    reads the same values as attention over the n before it with token n given fresh (the vLLM plugin's
    decode steps, docs/serving.md)."""
    return quantized_count(n + 1, recent, block) == quantized_count(n, recent, block)


def ring_rows(sliding_window: int, block: int) -> int:
    """Quantized rows per sequence and head of a sliding-window layer's ring (include/rkv/attention.h's
    ring_rows): an append writes a block's rows as soon as the block is complete (its tokens are still
    read from the full-precision ring until they leave the recent window), so the written rows end at
    block * floor(n / block) <= n, and a query reads from n - sliding_window on: the newest
    sliding_window rows, in whole blocks."""
    return -(-sliding_window // block) * block


def full_precision_count(n: int, sinks: int, recent: int, block: int) -> int:
    """How many of n cached tokens are read in full precision: the sinks and the tokens past Q(n)."""
    q = quantized_count(n, recent, block)
    return n - q + min(sinks, q)


def _pages_of(block_tables, b: int) -> torch.Tensor:
    """Sequence b's page ids: its block table row, or [b] in the contiguous layout."""
    return torch.tensor([b]) if block_tables is None else block_tables[b].long().cpu()


def _slot_of(side_slots, b: int) -> int:
    return b if side_slots is None else int(side_slots[b])


def read_rows(codes, scale, zero, bits: int, pages: torch.Tensor, rows: torch.Tensor, lv=None, outliers=None,
              block: int = 1, refine=None) -> torch.Tensor:
    """Quantized rows (page pages[i], row rows[i]) of every head, dequantized: (H, N, D) float32. outliers
    (pages, H, P / block, K): each block's sparse residuals are added at their positions. refine: (buffer
    (pages, H, P, m*extra/8), channels (H, m)), the refined key channels (refined_rows)."""
    per_meta = codes.shape[2] // scale.shape[2]  # tokens per metadata row (the quantizer tile T)
    dev = codes.device
    pages, rows = pages.to(dev), rows.to(dev)
    c = unpack(codes[pages, :, rows], bits)  # (N, H, D)
    g = c.shape[-1] // scale.shape[-1]
    sc = scale[pages, :, rows // per_meta].float().repeat_interleave(g, dim=-1)
    z = None if zero is None else zero[pages, :, rows // per_meta].float().repeat_interleave(g, dim=-1)
    out = decode(c, sc, z, bits, lv)
    if outliers is not None:  # the blocks of these rows only (a pool's whole buffer would be large)
        res = outlier_residuals(outliers[pages, :, rows // block], block, c.shape[-1])  # (N, H, block, D)
        out = out + res[torch.arange(len(rows), device=dev), :, rows % block]
    if refine is not None:
        buf, channels = refine
        out = refined_rows(out, buf[pages, :, rows], channels, sc, refine_bits(buf, channels))
    return out.transpose(0, 1)


def window_start(end: int, window: int) -> int:
    """The first key a query that sees keys [0, end) attends to under a sliding window of `window` keys
    (0: none): the newest `window`, itself included (transformers' and vLLM's semantics)."""
    return end - window if 0 < window < end else 0


def gather_tokens(codes, scale, zero, bits, window, sink, pages, n: int, recent: int, block: int, first: int = 0,
                  ring: bool = False, lv=None, outliers=None, refine=None) -> torch.Tensor:
    """Tokens first..n-1 of one sequence's n cached tokens of one side (keys or values) in order, float32
    (H, n - first, D), from its pages (1-D page ids), its window ring (H, W, D) and its sinks (H, S, D).
    ring: one page whose rows are a ring (a sliding-window layer's contiguous cache): token t in row
    t % P (older rows are overwritten, so `first` must be within the window)."""
    s, p = sink.shape[-2], codes.shape[-2]
    q = quantized_count(n, recent, block)
    parts = [sink[:, first: min(n, s)].float()]
    lo = max(s, first)
    if q > lo:
        t = torch.arange(lo, q)
        page_ids = torch.as_tensor(pages)[torch.zeros_like(t) if ring else t // p]
        parts.append(read_rows(codes, scale, zero, bits, page_ids, t % p, lv, outliers, block, refine))
    if n > max(lo, q):
        parts.append(window[:, [t % window.shape[-2] for t in range(max(lo, q), n)]].float())
    return torch.cat(parts, dim=1)


def _cached(cache, block_tables, side_slots, b: int, n: int, k_bits, v_bits, block, recent, first: int = 0,
            ring: bool = False, k_levels=None, v_levels=None, k_outliers=None, v_outliers=None, k_refine=None):
    """(keys, values) (Hkv, n - first, D) float32 of sequence b's tokens first..n-1, in the storage space.
    k_refine: (buffer, channels) of refined key channels, or None."""
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink = cache
    pages, slot = _pages_of(block_tables, b), _slot_of(side_slots, b)
    keys = gather_tokens(k_codes, k_scale, k_zero, k_bits, k_window[slot], k_sink[slot], pages, n, recent, block,
                         first, ring, k_levels, k_outliers, k_refine)
    values = gather_tokens(v_codes, v_scale, v_zero, v_bits, v_window[slot], v_sink[slot], pages, n, recent, block,
                           first, ring, v_levels, v_outliers)
    return keys, values


def softmax_with_sinks(scores: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax over the last dim of scores, with learned attention sinks (GPT-OSS): one more logit per
    row, `sinks` broadcast to scores[..., :1], that joins the softmax with no value, so its column is
    dropped and the probabilities sum to less than 1. sinks None: the plain softmax."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]


def _attend(qf: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ends: torch.Tensor, scale: float,
            window: int = 0, softcap: float = 0.0, first: int = 0, sink_logits: Optional[torch.Tensor] = None):
    """qf (m, Hq, D) query rows over keys / values (Hkv, N, D) of positions first..first+N-1; row i sees
    keys [window_start(ends[i], window), ends[i]). Scores are scaled, then soft-capped (softcap > 0:
    softcap * tanh(s / softcap)). sink_logits (Hq,): learned attention sinks (GPT-OSS), one more logit per query
    head in every row's softmax, with no value: it takes probability mass from the keys. GQA: query head h
    reads KV head h // (Hq / Hkv). A row that sees no key gets zeros. (m, Hq, D) float32."""
    m, hq, d = qf.shape
    hkv = keys.shape[0]
    qg = qf.reshape(m, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # (Hkv, G, m, D)
    scores = (qg @ keys.transpose(-1, -2)[:, None]) * scale  # (Hkv, G, m, N)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    pos = first + torch.arange(keys.shape[1], device=qf.device)[None, :]
    ends = ends.to(qf.device)[:, None]
    visible = (pos < ends) & ((pos >= ends - window) if window > 0 else True)  # (m, N)
    scores = scores.masked_fill(~visible, -math.inf)
    sinks = None if sink_logits is None else sink_logits.float().to(qf.device).reshape(hkv, hq // hkv, 1, 1)
    probs = softmax_with_sinks(scores, sinks)
    probs = torch.where(visible.any(-1)[:, None], probs, torch.zeros_like(probs))  # no key: 0, not NaN
    out = probs @ values[:, None]  # (Hkv, G, m, D)
    return out.permute(2, 0, 1, 3).reshape(m, hq, d)


def _space(q, k_signs):
    """Queries in fp32, rotated into the keys' Hadamard space when they are stored rotated."""
    qf = q.float()
    return hadamard(qf, k_signs) if k_signs is not None else qf


def paged_decode_attention(
    q: torch.Tensor,
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
    k_window, v_window, k_sink, v_sink,
    block_tables: Optional[torch.Tensor], side_slots: Optional[torch.Tensor], lengths: torch.Tensor,
    k_bits: int, v_bits: int, block: int, recent: int,
    rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None, rope_interleaved: bool = False,
    k_signs: Optional[torch.Tensor] = None, v_signs: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, sliding_window: int = 0, softcap: float = 0.0,
    k_levels: Optional[torch.Tensor] = None, v_levels: Optional[torch.Tensor] = None,
    k_outliers: Optional[torch.Tensor] = None, v_outliers: Optional[torch.Tensor] = None,
    sink_logits: Optional[torch.Tensor] = None,
    k_refine: Optional[torch.Tensor] = None, k_channels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of each sequence's newest query q (B, Hq, D) over its n = lengths[b] cached tokens
    (sliding_window > 0: the newest sliding_window of them; without block tables the pages are then a
    ring, see gather_tokens).

    Keys stored before RoPE (rope_cos/rope_sin given) are rotated to their positions 0..n-1 after
    dequantizing; keys/values stored Hadamard-rotated (k_signs / v_signs given) are used in the rotated
    space: scores with the rotated query, the output rotated back. Query head h reads KV head
    h // (Hq / Hkv). softcap > 0: soft-capped scores (_attend). k_levels / v_levels: each side's
    non-uniform levels (quantize's levels), None: uniform. k_outliers / v_outliers (pages, Hkv, P / block,
    K) int32: each quantized block's sparse outliers (paged_append), added to its dequantized values.
    sink_logits (Hq,): learned attention sinks (_attend), None: none. k_refine (pages, Hkv, P, m*extra/8)
    uint8 with k_channels (Hkv, m): refined key channels (refined_rows), None: none. A sequence with no cached token gets a zero
    output. Computed in float32.
    """
    check_levels("paged_decode_attention", "k_levels", k_levels, k_bits, k_zero is None)
    check_levels("paged_decode_attention", "v_levels", v_levels, v_bits, v_zero is None)
    kr = refine_pair("paged_decode_attention", k_refine, k_channels)
    b_, hq, d = q.shape
    cache = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = _space(q, k_signs)
    out = torch.zeros(b_, hq, d, dtype=torch.float32, device=q.device)
    for b in range(b_):
        n = int(lengths[b])
        first = window_start(n, sliding_window)
        keys, values = _cached(cache, block_tables, side_slots, b, n, k_bits, v_bits, block, recent, first,
                               block_tables is None and sliding_window > 0, k_levels, v_levels, k_outliers, v_outliers,
                               kr)
        if rope_cos is not None:
            keys = rope(keys, rope_cos, rope_sin, torch.arange(first, n, device=q.device), rope_interleaved)
        out[b] = _attend(qf[b][None], keys, values, torch.tensor([n]), scale, sliding_window, softcap, first,
                         sink_logits)[0]
    if v_signs is not None:
        out = hadamard(out, v_signs, inverse=True)
    return out.to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, query_start_loc: torch.Tensor,
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
    k_window, v_window, k_sink, v_sink,
    block_tables: Optional[torch.Tensor], side_slots: Optional[torch.Tensor], lengths: torch.Tensor,
    k_bits: int, v_bits: int, block: int, recent: int,
    rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None, rope_interleaved: bool = False,
    k_signs: Optional[torch.Tensor] = None, v_signs: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, sliding_window: int = 0, softcap: float = 0.0,
    k_levels: Optional[torch.Tensor] = None, v_levels: Optional[torch.Tensor] = None,
    k_outliers: Optional[torch.Tensor] = None, v_outliers: Optional[torch.Tensor] = None,
    sink_logits: Optional[torch.Tensor] = None,
    k_refine: Optional[torch.Tensor] = None, k_channels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of a chunk of new tokens per sequence over its cache and the chunk itself
    (sliding_window, softcap, k_levels, v_levels, k_outliers, v_outliers, sink_logits, k_refine, k_channels: as
    paged_decode_attention's, per query row).

    Sequence b has n = lengths[b] cached tokens and m = query_start_loc[b+1] - query_start_loc[b] new
    ones at positions n..n+m-1: rows query_start_loc[b].. of q (T, Hq, D) and of k_new / v_new (T, Hkv,
    D), the latter in the cache's storage space (pre-RoPE / rotated, as cache_append takes them). New
    token i attends over the n cached tokens as stored (reads as paged_decode_attention) and over new
    tokens 0..i in full precision. Rows past query_start_loc[B] (padding) get zeros. (T, Hq, D) in
    q's dtype.
    """
    kr = refine_pair("paged_prefill_attention", k_refine, k_channels)
    t_, hq, d = q.shape
    cache = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = _space(q, k_signs)
    out = torch.zeros(t_, hq, d, dtype=torch.float32, device=q.device)
    starts = [int(x) for x in query_start_loc]
    for b in range(len(starts) - 1):
        n, lo, hi = int(lengths[b]), starts[b], starts[b + 1]
        first = min(n, window_start(n + 1, sliding_window))  # the earliest key the chunk's first token sees
        keys, values = _cached(cache, block_tables, side_slots, b, n, k_bits, v_bits, block, recent, first,
                               block_tables is None and sliding_window > 0, k_levels, v_levels, k_outliers, v_outliers,
                               kr)
        keys = torch.cat([keys, k_new[lo:hi].float().transpose(0, 1)], dim=1)
        values = torch.cat([values, v_new[lo:hi].float().transpose(0, 1)], dim=1)
        if rope_cos is not None:
            keys = rope(keys, rope_cos, rope_sin, torch.arange(first, n + hi - lo, device=q.device), rope_interleaved)
        ends = n + 1 + torch.arange(hi - lo)
        out[lo:hi] = _attend(qf[lo:hi], keys, values, ends, scale, sliding_window, softcap, first, sink_logits)
    if v_signs is not None:
        out = hadamard(out, v_signs, inverse=True)
    return out.to(q.dtype)


def _paged_append_plan(num_pages: int, p: int, page_fill, block_tables, side_slots, lengths, query_start_loc,
                       slot_mapping, ring: bool) -> list:
    """paged_append's checks, all before its first write, and its plan: (sequence, tokens before and
    after, first row in k_new / v_new, the sequence's pages, its side slot) per sequence."""
    starts = [int(x) for x in query_start_loc]
    plan = []
    for b in range(len(starts) - 1):
        n0, lo, hi = int(lengths[b]), starts[b], starts[b + 1]
        n1 = n0 + hi - lo
        pages = _pages_of(block_tables, b)
        if ring:
            pages = pages.repeat(-(-n1 // p))  # page b for every row of the ring, however long the sequence
        elif n1 > len(pages) * p:
            raise ValueError(f"rkv.paged_append: sequence {b} would hold {n1} tokens, beyond its table's "
                             f"{len(pages)} pages of {p}")
        for t in range(n0, n1):
            page = int(pages[t // p])
            if not 0 <= page < num_pages:
                raise ValueError(f"rkv.paged_append: page id {page} (sequence {b}) is outside the pool of "
                                 f"{num_pages} pages")
            if page_fill is not None and int(page_fill[page]) > t % p:
                raise ValueError(f"rkv.paged_append: sequence {b} writes row {t % p} of page {page}, which already "
                                 f"holds {int(page_fill[page])} quantized rows (a full page is immutable)")
            if slot_mapping is not None and int(slot_mapping[lo + t - n0]) != page * p + t % p:
                raise ValueError(f"rkv.paged_append: slot_mapping[{lo + t - n0}] = {int(slot_mapping[lo + t - n0])} "
                                 f"but the block table puts that token at slot {page * p + t % p}")
        plan.append((b, n0, n1, lo, pages, _slot_of(side_slots, b)))
    return plan


def _write_block(codes, scale, zero, outliers, page: int, row: int, src: torch.Tensor, bits: int, clip: bool,
                 levels, sinks_here: int, refine=None) -> None:
    """One completed block src (H, block, D) quantized into rows row.. of `page` (codes, metadata and,
    with outliers, its row of sparse-outlier entries); its first sinks_here tokens are sink rows. refine
    (buffer, channels (H, m)): those channels keep their full range and get refinement codes
    (refine_codes) in the buffer's rows."""
    block, p = src.shape[1], codes.shape[2]
    per_meta = p // scale.shape[2]  # tokens per metadata row (the quantizer tile)
    group = codes.shape[-1] * 8 // bits // scale.shape[-1]
    taken = None
    if outliers is not None:
        taken = select_outliers(src.float().cpu(), outliers.shape[-1], per_meta, group, sinks_here)
    unclipped = None
    if refine is not None:
        ch = refine[1].long().to(src.device)
        unclipped = torch.zeros(src.shape[0], 1, src.shape[2], dtype=torch.bool, device=src.device)
        unclipped.scatter_(-1, ch[:, None], True)
    c, sc, zr = quantize(src, bits, group, per_meta, zero is None, scale.dtype, clip, sink_rows=sinks_here,
                         levels=levels, excluded=None if taken is None else taken.to(src.device), unclipped=unclipped)
    if refine is not None:
        buf, extra = refine[0], refine_bits(*refine)
        idx = ch[:, None, :].expand(-1, block, -1)
        s_full = expand_meta(sc, per_meta, 1).gather(-1, idx)
        z_full = expand_meta(zr, per_meta, 1).gather(-1, idx)
        r = refine_codes(src.float().gather(-1, idx), s_full, z_full, bits, extra)
        buf[page, :, row : row + block] = pack(r, extra).to(buf.device)
    if outliers is not None:
        x_hat = dequantize(c, sc, zr if zero is not None else None, bits, levels=levels)
        outliers[page, :, row // block] = outlier_entries(src.float().cpu(), x_hat.cpu(), taken,
                                                          outliers.shape[-1]).to(outliers.device)
    codes[page, :, row : row + block] = c
    scale[page, :, row // per_meta : (row + block) // per_meta] = sc
    if zero is not None:
        zero[page, :, row // per_meta : (row + block) // per_meta] = zr


def paged_append(
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
    k_window, v_window, k_sink, v_sink,
    page_fill: Optional[torch.Tensor], block_tables: Optional[torch.Tensor], side_slots: Optional[torch.Tensor],
    lengths: torch.Tensor, query_start_loc: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    k_bits: int, v_bits: int, block: int, recent: int, k_clip: bool = False, v_clip: bool = False,
    slot_mapping: Optional[torch.Tensor] = None, ring: bool = False,
    k_levels: Optional[torch.Tensor] = None, v_levels: Optional[torch.Tensor] = None,
    k_outliers: Optional[torch.Tensor] = None, v_outliers: Optional[torch.Tensor] = None,
    k_refine: Optional[torch.Tensor] = None, k_channels: Optional[torch.Tensor] = None,
) -> None:
    """Append each sequence's new tokens, in place: sequence b's m = query_start_loc[b+1] -
    query_start_loc[b] tokens, rows query_start_loc[b].. of k_new / v_new (T, Hkv, D) in the storage
    space, become its tokens n..n+m-1 (n = lengths[b]).

    Writes exactly: every block the append completes, quantized (its older tokens read from the sinks
    and the window ring, its newer ones from k_new / v_new) into its page rows and metadata rows, with
    page_fill[page] (quantized rows of each page) set past it; sink rows of new tokens t < S; window
    slots of new tokens that stay in full precision (t >= max(S, Q(n + m))). Nothing else changes;
    lengths is not updated. New tokens are used in the window's dtype, so the result does not depend on
    how the tokens were chunked into appends. Errors, before any write: a sequence outgrowing its
    table, a page id out of range, a write into rows a page already holds (a full page is immutable),
    slot_mapping (T,) disagreeing with the tables (entries past query_start_loc[B] are padding). ring
    (no block tables): each sequence's one page is a ring, token t in row t % P (cache_append's
    sliding_window). k_levels / v_levels: blocks are quantized with these non-uniform levels. k_outliers /
    v_outliers (pages, Hkv, P / block, K) int32: each completed block's sparse outliers (select_outliers
    with K = the last dim, its quantizer tiles, sinks never) are left out of its dense ranges, and its
    row of entries (outlier_entries: residuals against the dense codes) is written. k_refine (pages, Hkv,
    P, m*extra/8) uint8 with k_channels (Hkv, m): each completed block's refined key channels keep their
    full range under k_clip, and their refinement codes (refine_codes) are written to its rows.
    """
    kr = refine_pair("paged_append", k_refine, k_channels)
    check_levels("paged_append", "k_levels", k_levels, k_bits, k_zero is None)
    check_levels("paged_append", "v_levels", v_levels, v_bits, v_zero is None)
    for side, clip, zero in (("k", k_clip, k_zero), ("v", v_clip, v_zero)):
        if clip and zero is None:
            raise ValueError(f"rkv.paged_append: {side}_clip needs asymmetric {'keys' if side == 'k' else 'values'} "
                             f"({side}_zero)")
    p, s, w = k_codes.shape[2], k_sink.shape[2], k_window.shape[2]
    plan = _paged_append_plan(k_codes.shape[0], p, page_fill, block_tables, side_slots, lengths, query_start_loc,
                              slot_mapping, ring)
    for b, n0, n1, lo, pages, slot in plan:
        q1 = quantized_count(n1, recent, block)
        for codes, scale, zero, bits, window, sink, new, clip, lv, outliers, refine in (
            (k_codes, k_scale, k_zero, k_bits, k_window[slot], k_sink[slot], k_new, k_clip, k_levels, k_outliers, kr),
            (v_codes, v_scale, v_zero, v_bits, v_window[slot], v_sink[slot], v_new, v_clip, v_levels, v_outliers,
             None),
        ):
            new = new[lo : lo + n1 - n0].to(window.dtype).transpose(0, 1)  # (H, m, D)

            def token(t):
                if t >= n0:
                    return new[:, t - n0]
                return sink[:, t] if t < s else window[:, t % w]

            for j in range(n0 // block, n1 // block):  # the blocks this append completes
                first = j * block
                src = torch.stack([token(t) for t in range(first, first + block)], dim=1)  # (H, block, D)
                _write_block(codes, scale, zero, outliers, int(pages[first // p]), first % p, src, bits, clip, lv,
                             max(0, min(s - first, block)), refine)
            for t in range(n0, min(n1, s)):
                sink[:, t] = new[:, t - n0]
            for t in range(max(n0, s, q1), n1):
                window[:, t % w] = new[:, t - n0]
        if page_fill is not None:
            for j in range(n0 // block, n1 // block):
                page_fill[int(pages[j * block // p])] = j * block % p + block


def paged_copy(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
               page_fill: Optional[torch.Tensor], src_pages: torch.Tensor, dst_pages: torch.Tensor,
               src_slots: torch.Tensor, dst_slots: torch.Tensor, k_outliers=None, v_outliers=None,
               k_refine=None) -> None:
    """Copy pages src_pages[i] -> dst_pages[i] (codes, metadata, sparse outliers, refinement codes and
    page_fill) and side slots src_slots[j] -> dst_slots[j] (sinks and window), in place: a fork's open
    page and side rows."""
    for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, page_fill, k_outliers, v_outliers, k_refine):
        if t is not None:
            t[dst_pages.long()] = t[src_pages.long()]
    for t in (k_window, v_window, k_sink, v_sink):
        t[dst_slots.long()] = t[src_slots.long()]


# The contiguous layout's ops: the paged ones with one page of the whole capacity per sequence.


def _contiguous_new(k_new: torch.Tensor):
    """(B, H, m, D) new tokens -> (B*m, H, D) rows and their query_start_loc."""
    b_, h, m, d = k_new.shape
    return k_new.permute(0, 2, 1, 3).reshape(b_ * m, h, d), torch.arange(b_ + 1) * m


def decode_attention(
    q: torch.Tensor,
    k_packed, k_scale, k_zero, v_packed, v_scale, v_zero,
    k_window, v_window, k_sink, v_sink,
    lengths: torch.Tensor,
    k_bits: int, v_bits: int, block: int, recent: int,
    rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None, rope_interleaved: bool = False,
    k_signs: Optional[torch.Tensor] = None, v_signs: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, sliding_window: int = 0, softcap: float = 0.0,
    k_levels: Optional[torch.Tensor] = None, v_levels: Optional[torch.Tensor] = None,
    k_outliers: Optional[torch.Tensor] = None, v_outliers: Optional[torch.Tensor] = None,
    sink_logits: Optional[torch.Tensor] = None,
    k_refine: Optional[torch.Tensor] = None, k_channels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """paged_decode_attention over the contiguous layout: k_packed (B, Hkv, C, D*bits/8) etc., sequence
    b in page b (C rows; a ring with a sliding window) and side slot b."""
    return paged_decode_attention(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window,
                                  k_sink, v_sink, None, None, lengths, k_bits, v_bits, block, recent, rope_cos,
                                  rope_sin, rope_interleaved, k_signs, v_signs, scale, sliding_window, softcap,
                                  k_levels, v_levels, k_outliers, v_outliers, sink_logits, k_refine, k_channels)


def prefill_attention(q, k_new, v_new, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window,
                      k_sink, v_sink, lengths, k_bits, v_bits, block, recent, rope_cos=None, rope_sin=None,
                      rope_interleaved=False, k_signs=None, v_signs=None, scale=None, sliding_window=0,
                      softcap=0.0, k_levels=None, v_levels=None, k_outliers=None, v_outliers=None,
                      sink_logits=None, k_refine=None, k_channels=None) -> torch.Tensor:
    """paged_prefill_attention over the contiguous layout: q (B, Hq, m, D), k_new / v_new (B, Hkv, m, D);
    (B, Hq, m, D)."""
    kn, qsl = _contiguous_new(k_new)
    vn, _ = _contiguous_new(v_new)
    qn, _ = _contiguous_new(q)
    out = paged_prefill_attention(qn, kn, vn, qsl, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window,
                                  v_window, k_sink, v_sink, None, None, lengths, k_bits, v_bits, block, recent,
                                  rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, scale, sliding_window,
                                  softcap, k_levels, v_levels, k_outliers, v_outliers, sink_logits, k_refine,
                                  k_channels)
    return out.reshape(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)


def cache_append(
    k_packed, k_scale, k_zero, v_packed, v_scale, v_zero,
    k_window, v_window, k_sink, v_sink,
    lengths: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    k_bits: int, v_bits: int, block: int, recent: int, k_clip: bool = False, v_clip: bool = False,
    sliding_window: int = 0, k_levels: Optional[torch.Tensor] = None, v_levels: Optional[torch.Tensor] = None,
    k_outliers: Optional[torch.Tensor] = None, v_outliers: Optional[torch.Tensor] = None,
    k_refine: Optional[torch.Tensor] = None, k_channels: Optional[torch.Tensor] = None,
) -> None:
    """paged_append over the contiguous layout: k_new / v_new (B, Hkv, m, D) after each sequence's
    lengths[b] tokens. sliding_window > 0: the packed rows are a ring of C >= ring_rows rows that takes at
    most C - block + 1 tokens per call (the blocks one call completes never overlap)."""
    if sliding_window > 0:
        c = k_packed.shape[2]
        if c < ring_rows(sliding_window, block) or k_new.shape[2] > c - block + 1:
            raise ValueError(f"rkv.cache_append: a ring of {c} packed rows (sliding_window={sliding_window}) needs "
                             f"at least {ring_rows(sliding_window, block)} rows and takes at most "
                             f"{c - block + 1} tokens per append (k_new has {k_new.shape[2]})")
    kn, qsl = _contiguous_new(k_new)
    vn, _ = _contiguous_new(v_new)
    try:
        paged_append(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink, None,
                     None, None, lengths, qsl, kn, vn, k_bits, v_bits, block, recent, k_clip, v_clip,
                     ring=sliding_window > 0, k_levels=k_levels, v_levels=v_levels, k_outliers=k_outliers,
                     v_outliers=v_outliers, k_refine=k_refine, k_channels=k_channels)
    except ValueError as e:
        raise ValueError(str(e).replace("rkv.paged_append", "rkv.cache_append")) from None
