"""hadamard on the GPU (semantics: reference.hadamard, bit for bit like csrc/include/rkv/hadamard.h).

`hadamard_tile` transforms a register tile along its channels; the attention kernels call it to rotate a
query or an output, `_hadamard_kernel` on tiles of x. The butterflies run in the reference's Sylvester
order, stage h = 1, 2, 4, ..., each (v[j], v[j + h]) -> (v[j] + v[j + h], v[j] - v[j + h]) in float32,
then the float32 constant 1/sqrt(n) multiplies; the signs multiply before (forward) or after (inverse).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ops import _validate
from ..reference import hadamard_block
from .codes import kernel_view, load_float, store_rounded
from .spec import CompileSpec

TILE = 2048  # elements of x per program: BLOCK_M blocks of N channels
MAX_STAGES = tl.constexpr(13)  # log2(8192), the largest block the op accepts


@triton.jit
def _butterflies(v, H: tl.constexpr, N: tl.constexpr):
    """Stage H of the transform of each run of N channels of v [M, D], nothing when H >= N: groups of 2H
    channels (which never straddle a run of N) map their members (a, b) = (j, j + H) to (a + b, a - b)."""
    M: tl.constexpr = v.shape[0]
    D: tl.constexpr = v.shape[1]
    if H < N:
        a, b = tl.split(tl.permute(tl.reshape(v, [M * D // (2 * H), 2, H]), [0, 2, 1]))
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 2, 1]), [M, D])
    return v


@triton.jit
def fwht_tile(v, N: tl.constexpr):
    """The unnormalized Walsh-Hadamard transform of each run of N consecutive channels of a float32 tile
    v [M, D] (N a power of two dividing D): the Sylvester butterflies, stage h = 1, 2, ..., N / 2."""
    for stage in tl.static_range(MAX_STAGES):
        v = _butterflies(v, tl.constexpr(1) << stage, N)
    return v


@triton.jit
def hadamard_tile(v, signs, inverse, N: tl.constexpr, HAS_SIGNS: tl.constexpr):
    """reference.hadamard of each run of N channels of a float32 tile v [M, D] (N = hadamard_block(head
    dim), a power of two dividing D).

    signs: float32 broadcastable to v ([1, D] or [M, D]), each channel's sign, read only when HAS_SIGNS
    (pass anything, e.g. 0, when not). inverse (runtime scalar): diag(s) H / sqrt(N) instead of
    H diag(s) / sqrt(N). Returns the transformed float32 tile.

    A head dim that is not a power of two (96: three blocks of 32) fits a tile of the next power of two
    (128) with the channels past it zero-filled: they form blocks of their own, which stay zero.
    Equal bit for bit to reference.hadamard; with +-1 signs whether or not the calling kernel allows FMA
    contraction (a multiply by +-1 is exact), with other sign values only under enable_fp_fusion=False.
    """
    NORM: tl.constexpr = 1.0 / N**0.5  # rounded to float32 where it multiplies, as hadamard_norm is
    if HAS_SIGNS:
        v = v * tl.where(inverse, 1.0, signs)
    v = fwht_tile(v, N) * NORM
    if HAS_SIGNS:
        v = v * tl.where(inverse, signs, 1.0)
    return v


@triton.jit
def _hadamard_kernel(x_ptr, signs_ptr, out_ptr, nblocks, blocks_per_row, inverse, N: tl.constexpr,
                     BLOCK_M: tl.constexpr, HAS_SIGNS: tl.constexpr):
    """Blocks [BLOCK_M * pid, +BLOCK_M) of x seen as (nblocks, N): each row of x (D = blocks_per_row * N
    channels, contiguous) is blocks_per_row consecutive blocks, so block b holds channels
    (b % blocks_per_row) * N + [0, N) of its row. out: x's shape. bfloat16 tensors come as their int16
    views (codes.kernel_view)."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, N)
    mask = (b < nblocks)[:, None] & (c < N)[None, :]
    off = b[:, None] * N + c[None, :]
    v = load_float(x_ptr + off, mask, 0.0)
    s = 0.0
    if HAS_SIGNS:
        ch = (b % blocks_per_row)[:, None] * N + c[None, :]
        s = load_float(signs_ptr + ch, mask, 1.0)
    store_rounded(out_ptr + off, hadamard_tile(v, s, inverse, N, HAS_SIGNS), mask)


def hadamard_norm(n: int) -> float:
    """hadamard.h's hadamard_norm: 1/sqrt(n) in double, rounded to float32 (returned as a Python float)."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))


def block_m(n: int) -> int:
    return max(1, TILE // n)


def num_warps(n: int) -> int:
    return 8 if block_m(n) * n > 4096 else 4


def launch(x: torch.Tensor, signs, out: torch.Tensor, inverse: bool) -> None:
    """Run the kernel on contiguous x (rows, D) and float signs (D,) or None into out (rows, D) of x's
    dtype; no checks (hadamard() makes them)."""
    rows, d = x.shape
    n = hadamard_block(d)
    nblocks = rows * (d // n)
    if nblocks == 0:
        return
    bm = block_m(n)
    _hadamard_kernel[(triton.cdiv(nblocks, bm),)](
        kernel_view(x), None if signs is None else kernel_view(signs), kernel_view(out), nblocks, d // n,
        inverse, N=n, BLOCK_M=bm, HAS_SIGNS=signs is not None,
        num_warps=num_warps(n), enable_fp_fusion=False)


def hadamard(x: torch.Tensor, signs, inverse: bool) -> torch.Tensor:
    _validate.hadamard(x, signs)
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch(x.contiguous().reshape(-1, d), None if signs is None else signs.contiguous(), out.view(-1, d), inverse)
    return out


KERNELS = {"hadamard": hadamard}

_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*i16"}  # (bfloat16: its int16 view)


def _spec(n: int, x_dtype: torch.dtype, has_signs: bool = True) -> CompileSpec:
    sig = {"x_ptr": _PTR[x_dtype], "signs_ptr": "*fp32" if has_signs else "constexpr",
           "out_ptr": _PTR[x_dtype], "nblocks": "i32",
           "blocks_per_row": "i32", "inverse": "i1", "N": "constexpr", "BLOCK_M": "constexpr",
           "HAS_SIGNS": "constexpr"}
    const = {"N": n, "BLOCK_M": block_m(n), "HAS_SIGNS": has_signs}
    if not has_signs:
        const["signs_ptr"] = None
    label = f"hadamard n{n} x={str(x_dtype)[6:]}{' signs' if has_signs else ''}"
    return CompileSpec(label, _hadamard_kernel, sig, const, {"num_warps": num_warps(n), "enable_fp_fusion": False})


def compile_specs(full: bool) -> list[CompileSpec]:
    """The representative: n = 128 with signs in bfloat16. full: the blocks of head dims 64..512 and of 96
    (32), the largest block (8192), without signs, and the other dtypes."""
    if not full:
        return [_spec(128, torch.bfloat16)]
    specs = [_spec(n, torch.bfloat16) for n in (32, 64, 128, 256, 512, 8192)]
    specs += [_spec(128, torch.bfloat16, has_signs=False), _spec(128, torch.float32), _spec(128, torch.float16)]
    return specs
