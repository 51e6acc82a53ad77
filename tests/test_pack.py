"""rkv::pack / rkv::unpack: the docs/format.md byte layout, exact density, round trips, errors."""

import re

import pytest
import torch
from conftest import DEVICES, noncontiguous
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref


@st.composite
def code_cases(draw):
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    per = {2: 4, 3: 8, 4: 2, 8: 1}[bits]  # smallest row holding whole bytes
    dim = per * draw(st.integers(0, 40))
    lead = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    return bits, (*lead, dim), draw(st.integers(0, 2**16)), draw(st.booleans())


@pytest.mark.parametrize("device", DEVICES)
@given(case=code_cases())
def test_pack_unpack_match_reference_and_round_trip(device, case):
    bits, shape, seed, contiguous = case
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, shape, generator=gen, dtype=torch.uint8).to(device)
    if not contiguous:
        codes = noncontiguous(codes)
    packed = torch_rkv.pack(codes, bits)
    assert packed.shape == (*shape[:-1], shape[-1] * bits // 8)  # exact density
    assert torch.equal(packed.cpu(), ref.pack(codes.cpu(), bits))
    assert torch.equal(torch_rkv.unpack(packed, bits), codes)
    assert torch.equal(ref.unpack(packed.cpu(), bits), codes.cpu())


def test_layout_known_bytes():
    """The worked examples of docs/format.md."""
    c4 = torch.tensor([[0x1, 0x2, 0xA, 0xF]], dtype=torch.uint8)
    assert torch_rkv.pack(c4, 4).tolist() == [[0x21, 0xFA]]
    c2 = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert torch_rkv.pack(c2, 2).tolist() == [[0b00111001]]
    c3 = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.uint8)
    word = sum(v << (3 * i) for i, v in enumerate(range(8)))  # 24-bit little-endian word
    assert torch_rkv.pack(c3, 3).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]
    assert torch_rkv.pack(c3, 3).tolist() == [[0x88, 0xC6, 0xFA]]


@pytest.mark.parametrize("device", DEVICES)
def test_pack_rejects_codes_that_do_not_fit(device):
    codes = torch.zeros(2, 8, dtype=torch.uint8, device=device)
    codes[1, 3] = 4
    if device == "cuda":
        pytest.skip("a device-side assert would poison the CUDA context; checked on CPU")
    with pytest.raises(ValueError, match=re.escape("rkv.pack: codes must be < 2^bits = 4 (found 4)")):
        torch_rkv.pack(codes, 2)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_bad_input_names_the_argument(device):
    codes = torch.zeros(2, 8, dtype=torch.uint8, device=device)
    cases = [
        (lambda: torch_rkv.pack(codes, 5), ValueError, "rkv.pack: bits must be 2, 3, 4 or 8 (got 5)"),
        (lambda: torch_rkv.pack(codes.float(), 4), TypeError, "rkv.pack: codes must be uint8"),
        (lambda: torch_rkv.pack(codes[:, :6], 3), ValueError, "rkv.pack: the last dim of codes (6) times bits (3)"),
        (lambda: torch_rkv.unpack(codes, 1), ValueError, "rkv.unpack: bits must be"),
        (lambda: torch_rkv.unpack(codes[:, :2], 3), ValueError, "does not hold a whole number of 3-bit codes"),
        (lambda: torch_rkv.unpack(codes.int(), 4), TypeError, "rkv.unpack: packed must be uint8"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            call()
