"""pack / unpack on the GPU (semantics: reference.pack / reference.unpack; layout: codes.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import _validate
from .codes import load_codes, pack_bytes

BLOCK = 128


@triton.jit(debug=True)
def _pack_kernel(codes_ptr, out_ptr, d, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block of bytes). A code >= 2^bits trips a device-side assert on a GPU (compiled with
    debug=True for it); the launcher checks CPU tensors on the host."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < nbytes
    i = (tl.program_id(1) * BLOCK * 8 + tl.arange(0, BLOCK * 8)) // BITS  # the codes of these bytes
    c = tl.load(codes_ptr + row * d + i, mask=i < d, other=0)
    tl.device_assert(c < (1 << BITS), "rkv.pack: codes must be < 2^bits")
    v = pack_bytes(codes_ptr + row * d, j, d, mask, BITS)
    tl.store(out_ptr + row * nbytes + j, v.to(tl.uint8), mask=mask)


@triton.jit
def _unpack_kernel(packed_ptr, out_ptr, d, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < d
    c = load_codes(packed_ptr + row * nbytes, i, nbytes, mask, BITS)
    tl.store(out_ptr + row * d + i, c.to(tl.uint8), mask=mask)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    _validate.pack(codes, bits)
    d = codes.shape[-1]
    nbytes = d * bits // 8
    out = torch.empty(*codes.shape[:-1], nbytes, dtype=torch.uint8, device=codes.device)
    if out.numel() == 0:
        return out
    x = codes.contiguous().reshape(-1, d)
    if codes.device.type == "cpu" and x.numel():
        worst = int(x.max())
        if worst >= 1 << bits:
            raise ValueError(f"rkv.pack: codes must be < 2^bits = {1 << bits} (found {worst})")
    _pack_kernel[(x.shape[0], triton.cdiv(nbytes, BLOCK))](x, out, d, nbytes, BITS=bits, BLOCK=BLOCK)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    _validate.unpack(packed, bits)
    nbytes = packed.shape[-1]
    d = nbytes * 8 // bits
    out = torch.empty(*packed.shape[:-1], d, dtype=torch.uint8, device=packed.device)
    if out.numel() == 0:
        return out
    x = packed.contiguous().reshape(-1, nbytes)
    _unpack_kernel[(x.shape[0], triton.cdiv(d, BLOCK))](x, out, d, nbytes, BITS=bits, BLOCK=BLOCK)
    return out


KERNELS = {"pack": pack, "unpack": unpack}


def compile_specs(full: bool) -> list:
    """pack and unpack at every bit width (full) or at 4 bits."""
    from .spec import CompileSpec

    sig = {"codes_ptr": "*u8", "out_ptr": "*u8", "d": "i32", "nbytes": "i32", "BITS": "constexpr",
           "BLOCK": "constexpr"}
    unsig = {"packed_ptr": "*u8", "out_ptr": "*u8", "d": "i32", "nbytes": "i32", "BITS": "constexpr",
             "BLOCK": "constexpr"}
    return [CompileSpec(f"{name} bits={b}", kernel, s, {"BITS": b, "BLOCK": BLOCK})
            for b in ((2, 3, 4, 8) if full else (4,))
            for name, kernel, s in (("pack", _pack_kernel, sig), ("unpack", _unpack_kernel, unsig))]
