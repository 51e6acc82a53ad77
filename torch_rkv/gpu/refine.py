"""Refined key channels on the GPU (semantics: reference.refine_codes / refine_residual / refined_rows,
bit for bit with include/rkv/quant.h): the append's refinement codes of each staged block, written into its
page rows after quant.quantize_slabs has coded the block with those channels' ranges unclipped, and the
residual the attention kernels add to a refined channel's dequantized key."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import load_codes, load_float, store_codes
from .quant import _rint
from .slots import slot_block
from .spec import CompileSpec, signature

ROWS = 32  # block rows a program codes at once
OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


@triton.jit
def refine_code(x, scale, zero, BITS: tl.constexpr, EXTRA: tl.constexpr):
    """The EXTRA-bit refinement code (int32) of float32 x whose BITS-bit code has scale / zero: where x lies
    within its code's cell, u = (x - zero) / scale, c = its code, floor((u - c + 1/2) * 2^EXTRA), clamped."""
    x = tl.where(x != x, 0.0, x)
    pos = scale > 0.0
    u = tl.where(pos, tl.div_rn(x - zero, tl.where(pos, scale, 1.0)), 0.0)
    c = tl.minimum(tl.maximum(_rint(u), 0.0), (1 << BITS) - 1)
    r = tl.floor(((u - c) + 0.5) * (1 << EXTRA))
    return tl.minimum(tl.maximum(r, 0.0), (1 << EXTRA) - 1).to(tl.int32)


@triton.jit
def refine_residual(r, scale, EXTRA: tl.constexpr):
    """What refinement code r adds to its channel's decoded value: scale * (2r + 1 - 2^EXTRA) / 2^(EXTRA+1)."""
    return scale * tl.div_rn((2 * r + 1 - (1 << EXTRA)).to(tl.float32), float(2 << EXTRA))


@triton.jit
def add_refined(x, d, in_quant, page, row, h, scale_ptr, m_s0, m_s1, m_s2, tile_t,
                rf_ptr, rf_s0, rf_s1, rf_s2, ch_ptr, n_refine, EXTRA: tl.constexpr):
    """Dequantized keys x [N, D] (channels d) with each quantized token's refined channels' residuals added:
    token i's codes are row row[i] of page page[i] of the refinement buffer, its scales the metadata row
    row // tile_t (one scale a channel)."""
    row_bytes = n_refine * EXTRA // 8
    base = rf_ptr + page * rf_s0 + h * rf_s1 + row * rf_s2
    meta = page * m_s0 + h * m_s1 + (row // tile_t) * m_s2
    for j in range(n_refine):
        c = tl.load(ch_ptr + h * n_refine + j)
        r = load_codes(base, j, row_bytes, in_quant, EXTRA)
        s = load_float(scale_ptr + meta + c, in_quant, 0.0)
        x += tl.where((d == c)[None, :], refine_residual(r, s, EXTRA)[:, None], 0.0)
    return x


@triton.jit
def write_kernel(x_ptr, scale, zero, table, channels, out, o_s0, o_s1, o_s2, H, D, block, T, n_refine,
                 BITS: tl.constexpr, EXTRA: tl.constexpr, RB: tl.constexpr, MB: tl.constexpr):
    """Program (slot j, head h, rows chunk): the refinement codes of the staged block's rows into its page
    rows of `out`, from its float32 values x (slots x H, block, D) and the scales / zeros the quantizer just
    made ((slots x H, block / T, D) in the metadata dtype, codes.kernel_view: keys are one group a channel)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    staged, page, row0, _sinks = slot_block(table, j)
    if staged:
        n = j.to(tl.int64) * H + h
        r = tl.program_id(2) * RB + tl.arange(0, RB)
        k = tl.arange(0, MB)
        rm = r < block
        km = k < n_refine
        c = tl.load(channels + h * n_refine + k, mask=km, other=0)
        m = rm[:, None] & km[None, :]
        x = tl.load(x_ptr + n * block * D + r[:, None] * D + c[None, :], mask=m, other=0.0)
        meta = n * (block // T) * D + (r // T)[:, None] * D + c[None, :]
        s = load_float(scale + meta, m, 0.0)
        z = load_float(zero + meta, m, 0.0)
        codes = tl.where(m, refine_code(x, s, z, BITS, EXTRA), 0)
        dst = out + page * o_s0 + h * o_s1 + (row0 + r).to(tl.int64) * o_s2
        store_codes(dst[:, None], codes, n_refine, rm[:, None], EXTRA)


def write(slabs, scale, zero, table, channels, out, heads: int, dim: int, block: int, tile: int, bits: int) -> None:
    """The append's step 6 for refined key channels: every written slot's codes (out: the refinement buffer;
    scale / zero: the quantizer's, as codes.kernel_view gives them)."""
    m = channels.shape[1]
    extra = out.shape[3] * 8 // m
    grid = (table.shape[0], heads, triton.cdiv(block, ROWS))
    write_kernel[grid](slabs, scale, zero, table, channels, out, out.stride(0), out.stride(1), out.stride(2), heads, dim,
                       block, tile, m, BITS=bits, EXTRA=extra, RB=ROWS, MB=max(8, triton.next_power_of_2(m)),
                       **OPTIONS)


def compile_specs(full: bool) -> list[CompileSpec]:
    """The write at 2-bit keys with 2-bit refinement of 8 channels and float16 metadata (full: every key width x
    refinement width, and the other metadata dtypes: float32, bfloat16 and float8 e4m3 as their bits)."""
    cases = [(b, e, "*fp16") for b in (2, 3, 4) for e in (2, 3, 4)] if full else [(2, 2, "*fp16")]
    cases += [(2, 2, meta) for meta in ("*fp32", "*i16", "*u8")] if full else []
    specs = []
    for bits, extra, meta in cases:
        ptrs = dict(x_ptr="*fp32", scale=meta, zero=meta, table="*i64", channels="*i32", out="*u8", o_s0="i64",
                    o_s1="i64", o_s2="i64")
        c = dict(BITS=bits, EXTRA=extra, RB=ROWS, MB=8)
        specs.append(CompileSpec(f"refine write {bits}-bit keys +{extra} meta {meta}", write_kernel,
                                 signature(write_kernel, ptrs, c), c, OPTIONS))
    return specs
