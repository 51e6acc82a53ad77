"""dequantize on the GPU (semantics: reference.dequantize, bit for bit like the CPU kernel of
csrc/cpu/quant.cpp; layout: codes.py). `dequantize_slabs` decodes N slabs of quantize_slabs' layout at
once; the op launcher reshapes any leading dimensions into slabs."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ops import _validate
from . import checks
from .codes import dequant, kernel_view, load_codes, load_float, store_rounded
from .quant import POINTER, _dummy, _pow2
from .spec import CompileSpec

DEQUANT_ELEMS = 2048  # values a dequantize program writes (BR x BD)
DEQUANTIZE_OPTIONS = dict(num_warps=8, enable_fp_fusion=False)  # bit-exact: no fused multiply-add


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, zero_ptr, levels_ptr, out_ptr, rows, R, T,
                       sp_n, sp_r, ss_n, ss_r, ss_g, sz_n, sz_r, sz_g,
                       BITS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, SYMMETRIC: tl.constexpr,
                       HAS_LEVELS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    RB: tl.constexpr = D * BITS // 8
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    live = r < rows
    slab = r // R
    row = r % R
    blk = row // T
    c = tl.arange(0, BD)
    mask = live[:, None] & (c < D)[None, :]
    codes = load_codes((packed_ptr + slab * sp_n + row * sp_r)[:, None], c[None, :], RB, mask, BITS)
    grp = (c // G)[None, :]
    s = load_float(scale_ptr + (slab * ss_n + blk * ss_r)[:, None] + grp * ss_g, mask, 0.0)
    if SYMMETRIC:
        z = 0.0
    else:
        z = load_float(zero_ptr + (slab * sz_n + blk * sz_r)[:, None] + grp * sz_g, mask, 0.0)
    v = dequant(codes, s, z, levels_ptr, BITS, SYMMETRIC, HAS_LEVELS)
    store_rounded(out_ptr + r[:, None] * D + c[None, :], v, mask)


def dequantize_slabs(packed: torch.Tensor, scale: torch.Tensor, zero, bits: int, levels=None,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decodes N slabs at once, each as reference.dequantize decodes one slice.

    packed: (N, R, D*bits/8) uint8, scale and zero (N, R/T, D/G) of one float dtype, zero None when
    symmetric; any strides (packed rows are made contiguous if they are not). levels: None or (2^bits,)
    float32. Returns (N, R, D) out_dtype, contiguous; group size and block tokens are read off scale's
    shape. Checks nothing: callers validate (the op launcher below does).
    """
    n, r, rb = packed.shape
    d = rb * 8 // bits
    nb, ng = scale.shape[1], scale.shape[2]
    out = torch.empty(n, r, d, dtype=out_dtype, device=packed.device)
    if n * r == 0 or d == 0:
        return out
    if packed.stride(-1) != 1:
        packed = packed.contiguous()
    t, g = r // nb, d // ng
    bd = _pow2(d)
    br = max(1, min(_pow2(n * r), DEQUANT_ELEMS // bd))
    zt = scale if zero is None else zero
    lv = levels.contiguous() if levels is not None else _dummy(packed.device, torch.float32)
    _dequantize_kernel[(triton.cdiv(n * r, br),)](
        packed, kernel_view(scale), kernel_view(zt), lv, kernel_view(out), n * r, r, t,
        packed.stride(0), packed.stride(1), *scale.stride(), *zt.stride(),
        BITS=bits, D=d, G=g, SYMMETRIC=zero is None, HAS_LEVELS=levels is not None, BR=br, BD=bd,
        **DEQUANTIZE_OPTIONS)
    return out


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero, bits: int, out_dtype: torch.dtype, levels=None):
    d = _validate.dequantize(packed, scale, zero, bits, out_dtype)
    _validate.levels("dequantize", "levels", packed, levels, bits, zero is None)
    checks.levels("dequantize", "levels", levels, bits)
    *lead, n, rb = packed.shape
    nb, ng = scale.shape[-2], scale.shape[-1]
    m = math.prod(lead)
    z = None if zero is None else zero.reshape(m, nb, ng)
    out = dequantize_slabs(packed.reshape(m, n, rb), scale.reshape(m, nb, ng), z, bits, levels, out_dtype)
    return out.reshape(*lead, n, d)


KERNELS = {"dequantize": dequantize}


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile configurations
# --------------------------------------------------------------------------------------------------


def _dequantize_spec(bits, d, g, t, meta_dtype, out_dtype, symmetric, has_levels):
    bd = _pow2(d)
    m = POINTER[meta_dtype]
    sig = {"packed_ptr": "*u8", "scale_ptr": m, "zero_ptr": m, "levels_ptr": "*fp32",
           "out_ptr": POINTER[out_dtype],
           "rows": "i64", "R": "i64", "T": "i64",
           **{k: "i64" for k in ("sp_n", "sp_r", "ss_n", "ss_r", "ss_g", "sz_n", "sz_r", "sz_g")}}
    const = dict(ss_g=1, sz_g=1, BITS=bits, D=d, G=g, SYMMETRIC=symmetric, HAS_LEVELS=has_levels,
                 BR=max(1, DEQUANT_ELEMS // bd), BD=bd)
    sig.update({k: "constexpr" for k in const})
    label = f"dequantize bits={bits} D={d} G={g} meta={meta_dtype} out={out_dtype} sym={symmetric} lv={has_levels}"
    return CompileSpec(label, _dequantize_kernel, sig, const, dict(DEQUANTIZE_OPTIONS))


def compile_specs(full: bool) -> list[CompileSpec]:
    """One configuration (full=False), or every bit width x head_dim x group layout (per-token, grouped by
    32, per-channel over 128-token blocks), and each variant (symmetric, levels, output and metadata dtype)
    at head_dim 128 (full=True)."""
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    if not full:
        return [_dequantize_spec(4, 128, 1, 128, f16, f16, False, False)]
    specs = []
    for bits in (2, 3, 4, 8):
        for d in (64, 128, 256, 512):
            for g, t in ((d, 1), (32, 1), (1, 128)):
                specs.append(_dequantize_spec(bits, d, g, t, f16, f16, False, False))
    for meta in (f16, bf16, f32, torch.float8_e4m3fn):
        for out in (f16, bf16, f32) if meta != torch.float8_e4m3fn else (f16,):
            for sym, lv in ((False, False), (True, False), (False, True)):
                specs.append(_dequantize_spec(4, 128, 1, 128, meta, out, sym, lv))
    return specs
