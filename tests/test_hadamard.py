"""rkv::hadamard: reference equivalence, orthonormality, inverses, the block rule, errors."""

import math
import re

import pytest
import torch
from conftest import DEVICES, noncontiguous
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref

DIMS = [2, 4, 8, 32, 64, 96, 128, 160, 256, 1024]


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("device", DEVICES)
@given(dim=st.sampled_from(DIMS), rows=st.integers(0, 5), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       signed=st.booleans(), contiguous=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_reference_bit_for_bit(device, dim, rows, dtype, signed, contiguous, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen).to(dtype).to(device)
    if not contiguous:
        x = noncontiguous(x)
    signs = torch_rkv.hadamard_signs(dim, seed, device=device) if signed else None
    for inverse in (False, True):
        got = torch_rkv.hadamard(x, signs, inverse)
        want = ref.hadamard(x.cpu(), None if signs is None else signs.cpu(), inverse)
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", DIMS)
def test_is_the_orthonormal_block_diagonal_sylvester_matrix(device, dim):
    n = dim & -dim
    eye = torch.eye(dim, device=device)
    mat = torch_rkv.hadamard(eye).double().cpu()  # row i = H e_i
    want = torch.block_diag(*[sylvester(n)] * (dim // n))
    assert torch.allclose(mat, want, atol=1e-6)
    assert torch.allclose(mat @ mat.T, torch.eye(dim, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [64, 96, 128])
def test_self_inverse_and_signed_inverse(device, dim):
    x = torch.randn(7, dim, device=device)
    assert torch.allclose(torch_rkv.hadamard(torch_rkv.hadamard(x)), x, atol=1e-5)
    s = torch_rkv.hadamard_signs(dim, 3, device=device)
    y = torch_rkv.hadamard(x, s)
    assert not torch.allclose(y, torch_rkv.hadamard(x), atol=1e-3)
    assert torch.allclose(torch_rkv.hadamard(y, s, inverse=True), x, atol=1e-5)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)  # orthonormal: norms kept


def test_spreads_an_outlier_channel():
    x = torch.randn(16, 128) * 0.1
    x[:, 5] = 40.0  # one outlier channel, as in real keys
    y = torch_rkv.hadamard(x, torch_rkv.hadamard_signs(128))
    assert x.abs().amax(-1).div(x.pow(2).mean(-1).sqrt()).min() > 10  # peaky before
    assert y.abs().amax(-1).div(y.pow(2).mean(-1).sqrt()).max() < 2  # flat after


def test_signs_are_fixed_by_the_seed():
    assert torch.equal(torch_rkv.hadamard_signs(64, 1), torch_rkv.hadamard_signs(64, 1))
    assert not torch.equal(torch_rkv.hadamard_signs(64, 1), torch_rkv.hadamard_signs(64, 2))
    assert set(torch_rkv.hadamard_signs(64).tolist()) == {-1.0, 1.0}


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_bad_input_names_the_argument(device):
    x = torch.randn(3, 64, device=device)
    cases = [
        (lambda: torch_rkv.hadamard(x[:, :7]), ValueError, "rkv.hadamard: the last dim of x (7) must be even"),
        (lambda: torch_rkv.hadamard(torch.randn(2, 16384, device=device)), ValueError, "the last dim of x (16384)"),
        (lambda: torch_rkv.hadamard(x.long()), TypeError, "rkv.hadamard: x must be float32"),
        (lambda: torch_rkv.hadamard(x, torch.ones(32, device=device)), ValueError, "rkv.hadamard: signs must have shape (64,)"),
        (lambda: torch_rkv.hadamard(x, torch.ones(64, dtype=torch.int8, device=device)), TypeError, "rkv.hadamard: signs must be float32"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            call()
