"""Device helpers every kernel that reads or writes codes shares (docs/format.md's bit layout).

A packed row of D codes of b bits is one little-endian bitstream: code i occupies stream bits
[i*b, (i+1)*b), stream bit 8j+k is bit k of byte j. A 2-, 4- or 8-bit code lies within one byte; a 3-bit
code may straddle two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_codes(row_ptr, d, row_bytes, mask, BITS: tl.constexpr):
    """The codes (int32) at channels d of packed rows beginning at row_ptr (both broadcast to one shape);
    row_bytes: bytes of a row, so a 3-bit code's second byte is never read past the row."""
    s = d * BITS
    byte = s // 8
    v = tl.load(row_ptr + byte, mask=mask, other=0).to(tl.int32)
    if BITS == 3:
        hi = tl.load(row_ptr + byte + 1, mask=mask & (byte + 1 < row_bytes), other=0).to(tl.int32)
        v = v | (hi << 8)
    return (v >> (s % 8)) & ((1 << BITS) - 1)


@triton.jit
def code_values(c, levels_ptr, HAS_LEVELS: tl.constexpr):
    """The value in code units (float32) of each code: itself, or its non-uniform level."""
    if HAS_LEVELS:
        return tl.load(levels_ptr + c)
    return c.to(tl.float32)


@triton.jit
def dequant(c, scale, zero, levels_ptr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr, HAS_LEVELS: tl.constexpr):
    """reference.decode: (code - 2^(bits-1)) * scale (symmetric), or value * scale + zero; float32."""
    v = code_values(c, levels_ptr, HAS_LEVELS)
    if SYMMETRIC:
        return (v - (1 << (BITS - 1))) * scale
    return v * scale + zero


@triton.jit
def pack_bytes(codes_row_ptr, j, d, mask, BITS: tl.constexpr):
    """The packed bytes j (int32, any shape) of a row of d uint8 codes at codes_row_ptr: stream bits
    8j..8j+7, each read from the code that holds it (a code's bits above BITS are dropped)."""
    k = tl.arange(0, 8)
    s = j[:, None] * 8 + k[None, :]
    c = tl.load(codes_row_ptr + s // BITS, mask=mask[:, None] & (s // BITS < d), other=0).to(tl.int32)
    bit = (c >> (s % BITS)) & 1
    return tl.sum(bit << k[None, :], axis=1)



def kernel_view(t):
    """The tensor a kernel gets for t: a bfloat16 tensor as its int16 view and a float8 e4m3 one (metadata)
    as its uint8 view, whose bits load_float and store_rounded convert exactly; any other as it is."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


@triton.jit
def load_float(ptr, mask, other):
    """The float32 values at ptr (other where masked): a float32 or float16 pointer loads and converts; an
    int16 pointer (kernel_view of a bfloat16 tensor) has its bits widened, exact for subnormals too,
    which the interpreter's own bfloat16 conversion flushes to zero; a uint8 pointer (kernel_view of a
    float8 e4m3 tensor) is decoded from its bits, on every GPU arch and in the interpreter alike."""
    if ptr.dtype.element_ty == tl.int16:
        v = (tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return tl.where(mask, v, other)
    if ptr.dtype.element_ty == tl.uint8:
        return tl.where(mask, e4m3_value(tl.load(ptr, mask=mask, other=0).to(tl.int32)), other)
    return tl.load(ptr, mask=mask, other=other).to(tl.float32)


@triton.jit
def e4m3_value(b):
    """The float32 value of float8 e4m3fn bit patterns b (int32 in [0, 255]): 2^(e - 7) (1 + m / 8), or m
    2^-9 where the exponent field e is 0. The NaN pattern is never stored (metadata is finite)."""
    e = (b >> 3) & 0xF
    normal = (((e + 120) << 23) | ((b & 7) << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, (b & 7).to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def e4m3_bits(v):
    """The float8 e4m3fn bit pattern (int32) of float32 v, which must be one of its finite values (as
    round_meta's results are): the inverse of e4m3_value."""
    u = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    normal = ((((u >> 23) & 0xFF) - 120) << 3) | ((u >> 20) & 7)
    mag = tl.where(a < 0.015625, (a * 512.0).to(tl.int32), normal)
    return tl.where(u < 0, mag | 0x80, mag)


@triton.jit
def bf16_bits(v):
    """float32 v rounded to bfloat16 the way torch's CPU kernels round (to nearest even; any NaN becomes
    0x7FC0), as the int16 bit pattern. The interpreter's own float32-to-bfloat16 cast truncates; this
    integer rounding gives the same bits there and on a GPU."""
    u = v.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(v != v, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def store_rounded(ptr, v, mask):
    """Store float32 v at ptr rounded to nearest even: cast for a float32 or float16 pointer; for an int16
    pointer (kernel_view of a bfloat16 output) the bits of bf16_bits(v); for a uint8 pointer (kernel_view
    of float8 e4m3 metadata) the bits of e4m3_bits(v), v already one of its values."""
    if ptr.dtype.element_ty == tl.int16:
        tl.store(ptr, bf16_bits(v), mask=mask)
    elif ptr.dtype.element_ty == tl.uint8:
        tl.store(ptr, e4m3_bits(v).to(tl.uint8), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_codes(row_ptr, c, d, mask, BITS: tl.constexpr):
    """Packs codes c (int32 in [0, 2^BITS), shape [rows, BD]: channel i of each row in column i, BD a power
    of two) into the rows at row_ptr ([rows, 1] pointers), writing the bytes of channels below d; mask
    ([rows, 1]) picks the rows written. d * BITS must be a multiple of 8 (whole bytes per row)."""
    R: tl.constexpr = c.shape[0]
    BD: tl.constexpr = c.shape[1]
    if BITS == 8:
        i = tl.arange(0, BD)[None, :]
        tl.store(row_ptr + i, c.to(tl.uint8), mask=mask & (i < d))
    elif BITS == 3:
        # 8 codes fill 3 bytes: one 24-bit word per 8 channels, written a byte at a time
        k = tl.arange(0, 8)
        word = tl.sum(tl.reshape(c, (R, BD // 8, 8)) << (3 * k)[None, None, :], axis=2)
        w = tl.arange(0, BD // 8)[None, :]
        m = mask & (w * 8 < d)
        tl.store(row_ptr + 3 * w, (word & 0xFF).to(tl.uint8), mask=m)
        tl.store(row_ptr + 3 * w + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=m)
        tl.store(row_ptr + 3 * w + 2, (word >> 16).to(tl.uint8), mask=m)
    else:
        PER: tl.constexpr = 8 // BITS  # codes per byte
        k = tl.arange(0, PER)
        byte = tl.sum(tl.reshape(c, (R, BD // PER, PER)) << (BITS * k)[None, None, :], axis=2)
        j = tl.arange(0, BD // PER)[None, :]
        tl.store(row_ptr + j, byte.to(tl.uint8), mask=mask & (j * PER < d))
