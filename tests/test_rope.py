"""rkv::rope: reference equivalence, exact undo, pair norms, layouts, partial rotary, errors."""

import re

import pytest
import torch
from conftest import DEVICES, noncontiguous
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def rope_cases(draw):
    dim = draw(st.sampled_from([2, 8, 16, 64, 128]))
    rot = draw(st.sampled_from([r for r in (2, 4, dim // 2, dim) if r <= dim and r % 2 == 0]))
    n = draw(st.integers(0, 9))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    pos_kind = draw(st.sampled_from(["tokens", "full", "scalar"]))
    return dict(dim=dim, rot=rot, shape=(*lead, n, dim), pos_kind=pos_kind,
                interleaved=draw(st.booleans()), dtype=draw(st.sampled_from(FLOATS)),
                table_dtype=draw(st.sampled_from([torch.float32, torch.float16])),
                scaling=draw(st.sampled_from([1.0, 1.3])), contiguous=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def make(case, device):
    gen = torch.Generator().manual_seed(case["seed"])
    x = (torch.randn(case["shape"], generator=gen) * 3).to(case["dtype"]).to(device)
    cos, sin = torch_rkv.rope_tables(case["dim"], 4096, theta=1e4, rot_dim=case["rot"])
    cos, sin = (cos * case["scaling"]).to(case["table_dtype"]), (sin * case["scaling"]).to(case["table_dtype"])
    n = case["shape"][-2]
    if case["pos_kind"] == "tokens":
        pos = torch.randint(0, 4096, (n,), generator=gen)
    elif case["pos_kind"] == "full":
        pos = torch.randint(0, 4096, case["shape"][:-1], generator=gen).int()
    else:
        pos = torch.tensor(7)
    if not case["contiguous"]:
        x = noncontiguous(x)
    return x, cos.to(device), sin.to(device), pos.to(device)


@pytest.mark.parametrize("device", DEVICES)
@given(case=rope_cases())
def test_rope_matches_reference_bit_for_bit(device, case):
    x, cos, sin, pos = make(case, device)
    for inverse in (False, True):
        got = torch_rkv.rope(x, cos, sin, pos, case["interleaved"], inverse)
        want = ref.rope(x.cpu(), cos.cpu(), sin.cpu(), pos.cpu(), case["interleaved"], inverse)
        assert got.dtype == x.dtype and got.is_contiguous()
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@given(case=rope_cases())
def test_undo_inverts_apply_and_pair_norms_are_kept(device, case):
    case = {**case, "dtype": torch.float32}
    x, cos, sin, pos = make(case, device)
    y = torch_rkv.rope(x, cos, sin, pos, case["interleaved"])
    back = torch_rkv.rope(y, cos, sin, pos, case["interleaved"], inverse=True)
    if x.numel() == 0:
        return
    tol = 8 * torch.finfo(torch.float32).eps * (x.abs().amax().item() + 1)
    assert (back - x).abs().max() <= tol
    half = case["rot"] // 2
    x0, x1 = ref.rope_pairs(x, half, case["interleaved"])
    y0, y1 = ref.rope_pairs(y, half, case["interleaved"])
    norm_x, norm_y = (x0**2 + x1**2).sqrt(), (y0**2 + y1**2).sqrt()
    # each pair's norm is multiplied by the table's |(cos, sin)|: 1 for a plain table, the attention
    # scaling for a YaRN-style one, up to the table dtype's rounding
    p = pos.long().expand(x.shape[:-1])
    gain = (cos.float()[p] ** 2 + sin.float()[p] ** 2).sqrt()
    assert torch.allclose(norm_y, norm_x * gain, rtol=1e-5, atol=tol)
    assert torch.equal(y[..., case["rot"]:], x[..., case["rot"]:])  # partial rotary: the rest passes


def test_matches_transformers_apply_rotary_pos_emb():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(0)
    q = torch.randn(2, 4, 10, 64)
    cos, sin = torch_rkv.rope_tables(64, 64, theta=1e5)
    pos = torch.arange(10)
    hf_cos = torch.cat([cos[pos], cos[pos]], -1)[None]
    hf_sin = torch.cat([sin[pos], sin[pos]], -1)[None]
    want, _ = llama.apply_rotary_pos_emb(q, q, hf_cos, hf_sin)
    assert torch.allclose(torch_rkv.rope(q, cos, sin, pos), want, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_positions_beyond_the_table_are_an_error(device):
    if device == "cuda":
        pytest.skip("a device-side assert would poison the CUDA context; checked on CPU")
    x = torch.randn(3, 8)
    cos, sin = torch_rkv.rope_tables(8, 16)
    for bad in (torch.tensor([0, 16, 2]), torch.tensor([-1, 0, 0])):
        with pytest.raises(ValueError, match=r"rkv.rope: positions contains -?\d+, outside the cos/sin table of 16"):
            torch_rkv.rope(x, cos, sin, bad)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_bad_input_names_the_argument(device):
    x = torch.randn(2, 3, 8, device=device)
    cos, sin = (t.to(device) for t in torch_rkv.rope_tables(8, 16))
    pos = torch.arange(3, device=device)
    cases = [
        (lambda: torch_rkv.rope(x.int(), cos, sin, pos), TypeError, "rkv.rope: x must be float32"),
        (lambda: torch_rkv.rope(x, cos, sin.half(), pos), TypeError, "rkv.rope: sin must have cos's dtype"),
        (lambda: torch_rkv.rope(x, cos, sin, pos.float()), TypeError, "rkv.rope: positions must be int32 or int64"),
        (lambda: torch_rkv.rope(x, cos[0], sin[0], pos), ValueError, "rkv.rope: cos must have shape (positions, rot_dim / 2)"),
        (lambda: torch_rkv.rope(x, cos, sin[:, :2], pos), ValueError, "rkv.rope: sin must have cos's shape"),
        (lambda: torch_rkv.rope(x[..., :6], cos, sin, pos), ValueError, "rkv.rope: cos/sin have 4 pairs per position"),
        (lambda: torch_rkv.rope(x, cos, sin, torch.arange(4, device=device)), ValueError, "rkv.rope: positions of shape [4]"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            call()
