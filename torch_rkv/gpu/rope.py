"""rope on the GPU (semantics: reference.rope, bit for bit like csrc/include/rkv/rope.h).

`rope_tile` rotates a register tile of rows at their positions; the attention kernels call it on a tile of
dequantized pre-RoPE keys, and `_rope_kernel` on a tile of x. Bit for bit needs the kernel compiled with
enable_fp_fusion=False: a GPU would otherwise contract `x * c - p * s` into an FMA, which rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import _validate
from .codes import kernel_view, load_float, store_rounded
from .spec import CompileSpec

TILE = 1024  # elements of x per program: BLOCK_R rows of BLOCK_D channels
NUM_WARPS = 4


@triton.jit
def rope_rotate(x, p, c, s, first, inverse):
    """One member of each rotated pair (float32 tensors of one shape, or broadcastable): x the member, p its
    partner, c / s the pair's table values, first whether x is the pair's first member (x0). Applies
    (x0, x1) -> (x0 c - x1 s, x1 c + x0 s), or with `inverse` (a runtime scalar) undoes it,
    ((x0 c + x1 s) / n, (x1 c - x0 s) / n) with n = c c + s s, each step rounded as rope.h rounds it."""
    xc = x * c
    ps = p * s
    y = tl.where(first != inverse, xc - ps, xc + ps)
    if inverse:
        y = tl.div_rn(y, c * c + s * s)
    return y


@triton.jit
def rope_tile(x, pos, row_mask, cos_ptr, sin_ptr, half, interleaved, inverse):
    """Rotate each row of a register tile by the table rows at its position (reference.rope, rope.h).

    x: float32 [N, BLOCK_D], channel ch of a row in column ch; BLOCK_D (a power of two) may exceed the head
    dim, the columns past it are returned as they are. pos: [N] integer positions, the table row of each
    tile row. row_mask: [N] bool, the rows whose table rows are read; a masked row reads cos = 1 and
    sin = 0, the identity, so it stays finite where it was (no division by zero when undoing).
    cos_ptr / sin_ptr: the tables, (positions, half) with rows `half` elements apart (contiguous), float32
    or float16 (a bfloat16 table as kernel_view's int16 view), read as float32 (codes.load_float).
    half: pairs per position (rot_dim / 2, 2 * half <= head dim).
    interleaved: pairs (2j, 2j + 1) (GPT-J) instead of (j, j + half) (rotate-half, Llama / NeoX).
    inverse: undo the rotation (exact inverse for scaled tables). half, interleaved and inverse are runtime
    scalars. Channels from 2 * half on pass through (partial rotary).

    Returns the rotated float32 tile. Each pair member is computed from its partner, taken from the tile
    by a gather along the channels, and the table values at (pos, pair index). Equal bit for bit to
    reference.rope when the calling kernel is compiled with enable_fp_fusion=False.
    """
    BLOCK_D: tl.constexpr = x.shape[1]
    ch = tl.arange(0, BLOCK_D)
    rot = ch < 2 * half
    lower = ch < half
    j = tl.where(interleaved, ch // 2, tl.where(lower, ch, ch - half))
    first = tl.where(interleaved, (ch % 2) == 0, lower)
    partner = tl.where(interleaved, ch ^ 1, tl.where(lower, ch + half, ch - half))
    partner = tl.where(rot, partner, ch)
    p = tl.gather(x, tl.broadcast_to(partner[None, :], x.shape), axis=1)
    m = row_mask[:, None] & rot[None, :]
    t = pos.to(tl.int64)[:, None] * half + j[None, :]
    c = load_float(cos_ptr + t, m, 1.0)
    s = load_float(sin_ptr + t, m, 0.0)
    y = rope_rotate(x, p, c, s, first[None, :], inverse)
    return tl.where(rot[None, :], y, x)


@triton.jit(debug=True)
def _rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, rows, dim, half, table_rows, interleaved, inverse,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [BLOCK_R * pid, +BLOCK_R) of x (rows, dim), contiguous, into out (same shape); bfloat16
    tensors come as their int16 views (codes.kernel_view). A position outside the table trips a
    device-side assert on a GPU (the kernel is compiled with debug=True for it; the launcher checks CPU
    tensors on the host), and its row comes out NaN where asserts are off."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ch = tl.arange(0, BLOCK_D)
    row_ok = r < rows
    pos = tl.load(pos_ptr + r, mask=row_ok, other=0).to(tl.int64)
    in_table = (pos >= 0) & (pos < table_rows)
    tl.device_assert(in_table | ~row_ok, "rkv.rope: positions outside the cos/sin table")
    mask = row_ok[:, None] & (ch < dim)[None, :]
    off = r[:, None] * dim + ch[None, :]
    x = load_float(x_ptr + off, mask, 0.0)
    y = rope_tile(x, pos, row_ok & in_table, cos_ptr, sin_ptr, half, interleaved, inverse)
    y = tl.where(in_table[:, None], y, float("nan"))
    store_rounded(out_ptr + off, y, mask)


def block_rows(block_d: int) -> int:
    return max(1, TILE // block_d)


def launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
           interleaved: bool, inverse: bool) -> None:
    """Run the kernel on contiguous x (rows, dim), tables (P, half), positions (rows,) into out (rows,
    dim) of x's dtype; no checks (rope() makes them)."""
    rows, dim = x.shape
    if rows == 0:
        return
    block_d = triton.next_power_of_2(dim)
    br = block_rows(block_d)
    _rope_kernel[(triton.cdiv(rows, br),)](
        kernel_view(x), kernel_view(out), kernel_view(cos), kernel_view(sin), pos, rows, dim, cos.shape[1],
        cos.shape[0], interleaved, inverse,
        BLOCK_R=br, BLOCK_D=block_d, num_warps=NUM_WARPS, enable_fp_fusion=False)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool,
         inverse: bool) -> torch.Tensor:
    _validate.rope(x, cos, sin, positions)
    dim = x.shape[-1]
    pos = positions.expand(x.shape[:-1]).reshape(-1)
    if x.device.type == "cpu" and pos.numel():
        # the CPU kernel's data check; on a GPU the kernel asserts it (a host check would cost a sync)
        bad = ((pos < 0) | (pos >= cos.shape[0])).nonzero()
        if bad.numel():
            raise ValueError(f"rkv.rope: positions contains {int(pos[bad[0, 0]])}, outside the cos/sin table of "
                             f"{cos.shape[0]} positions")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch(x.contiguous().reshape(-1, dim), cos.contiguous(), sin.contiguous(), pos.contiguous(),
           out.view(-1, dim), interleaved, inverse)
    return out


KERNELS = {"rope": rope}

_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*i16"}  # (bfloat16: its int16 view)


def _spec(block_d: int, x_dtype: torch.dtype, table_dtype: torch.dtype = torch.float32,
          pos_type: str = "*i64") -> CompileSpec:
    sig = {"x_ptr": _PTR[x_dtype], "out_ptr": _PTR[x_dtype], "cos_ptr": _PTR[table_dtype], "sin_ptr": _PTR[table_dtype],
           "pos_ptr": pos_type, "rows": "i32", "dim": "i32", "half": "i32", "table_rows": "i32",
           "interleaved": "i1", "inverse": "i1", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
    label = f"rope d{block_d} x={str(x_dtype)[6:]} table={str(table_dtype)[6:]} pos={pos_type[1:]}"
    return CompileSpec(label, _rope_kernel, sig, {"BLOCK_R": block_rows(block_d), "BLOCK_D": block_d},
                       {"num_warps": NUM_WARPS, "enable_fp_fusion": False})


def compile_specs(full: bool) -> list[CompileSpec]:
    """One head dim per x dtype at the representative size; full: every head dim the attention kernels
    use (64..512) in bfloat16 (the longest store path), plus the table and position types at 128."""
    if not full:
        return [_spec(128, torch.bfloat16)]
    specs = [_spec(d, torch.bfloat16) for d in (64, 128, 256, 512)]
    specs += [_spec(128, dt) for dt in (torch.float32, torch.float16)]
    specs += [_spec(128, torch.float16, torch.float16, "*i32"), _spec(128, torch.float32, torch.bfloat16, "*i32")]
    return specs
