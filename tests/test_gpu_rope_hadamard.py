"""The Triton rope and hadamard kernels (torch_rkv/gpu/rope.py, hadamard.py), run by Triton's interpreter on
CPU tensors: bit for bit against reference.py and the C++ CPU ops, guarded buffers, edges and errors."""

import math
import re

import pytest
import torch
import triton
import triton.language as tl
from conftest import noncontiguous
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref
from torch_rkv.gpu import hadamard as gpu_hadamard  # (first: it chooses the interpreter without a GPU)
from torch_rkv.gpu import rope as gpu_rope

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
TABLE = 64  # positions in the tables
GUARD = 37  # elements of NaN / canary around a guarded buffer


def guarded(values: torch.Tensor, fill: float):
    """A contiguous copy of values inside a larger buffer whose GUARD elements either side hold fill:
    (the buffer, the view)."""
    buf = torch.full((GUARD + values.numel() + GUARD,), fill, dtype=values.dtype)
    view = buf[GUARD:GUARD + values.numel()].view(values.shape)
    view.copy_(values)
    return buf, view


def guards_kept(buf: torch.Tensor, n: int, fill: float) -> bool:
    want = torch.full((GUARD,), fill, dtype=buf.dtype)
    return torch.equal(buf[:GUARD], want) and torch.equal(buf[GUARD + n:], want)


# --------------------------------------------------------------------------------------------------
# rope
# --------------------------------------------------------------------------------------------------


def rope_tables(kind: str, dim: int, rot: int, dtype: torch.dtype, gen: torch.Generator):
    """plain: Llama's frequencies; scaled: YaRN-like (times 1.3); random: any cos / sin, far from unit norm."""
    if kind == "random":
        cos, sin = torch.randn(TABLE, rot // 2, generator=gen) * 2, torch.randn(TABLE, rot // 2, generator=gen) * 2
    else:
        cos, sin = torch_rkv.rope_tables(dim, TABLE, theta=1e4, rot_dim=rot)
        if kind == "scaled":
            cos, sin = cos * 1.3, sin * 1.3
    return cos.to(dtype), sin.to(dtype)


@st.composite
def rope_cases(draw):
    dim = draw(st.sampled_from([2, 8, 64, 96, 128, 256, 512]))
    rot = draw(st.sampled_from(sorted({r for r in (2, 6, dim // 2, dim) if 2 <= r <= dim and r % 2 == 0})))
    n = draw(st.integers(0, 9))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    return dict(dim=dim, rot=rot, shape=(*lead, n, dim), pos_kind=draw(st.sampled_from(["tokens", "full", "scalar",
                                                                                        "ones"])),
                interleaved=draw(st.booleans()), dtype=draw(st.sampled_from(FLOATS)),
                table_dtype=draw(st.sampled_from(FLOATS)), table=draw(st.sampled_from(["plain", "scaled", "random"])),
                contiguous=draw(st.booleans()), pos_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                seed=draw(st.integers(0, 2**16)))


def make_rope(case):
    gen = torch.Generator().manual_seed(case["seed"])
    shape = case["shape"]
    x = (torch.randn(shape, generator=gen) * 3).to(case["dtype"])
    cos, sin = rope_tables(case["table"], case["dim"], case["rot"], case["table_dtype"], gen)
    kind = case["pos_kind"]
    if kind == "tokens":
        pos = torch.randint(0, TABLE, (shape[-2],), generator=gen)
    elif kind == "full":
        pos = torch.randint(0, TABLE, shape[:-1], generator=gen)
    elif kind == "ones":  # size-1 dims broadcast
        pos = torch.randint(0, TABLE, (1,) * (len(shape) - 2) + (shape[-2],), generator=gen)
    else:
        pos = torch.tensor(TABLE - 1)
    if not case["contiguous"]:
        x = noncontiguous(x)
    return x, cos, sin, pos.to(case["pos_dtype"])


@given(case=rope_cases())
def test_rope_matches_reference_and_cpu_kernel_bit_for_bit(case):
    x, cos, sin, pos = make_rope(case)
    for inverse in (False, True):
        got = gpu_rope.rope(x, cos, sin, pos, case["interleaved"], inverse)
        want = ref.rope(x, cos, sin, pos, case["interleaved"], inverse)
        assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, want)
        assert torch.equal(got, torch.ops.rkv.rope(x, cos, sin, pos, case["interleaved"], inverse))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim,rot", [(64, 64), (96, 32), (128, 128), (256, 128), (512, 512)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_reads_and_writes_only_its_rows(dtype, dim, rot, interleaved):
    """x and the tables inside NaN guards, out inside canaries, rows not a multiple of the tile: a read past
    a row or the table would bring a NaN in, a write past out would change a canary."""
    gen = torch.Generator().manual_seed(dim)
    rows = gpu_rope.block_rows(triton.next_power_of_2(dim)) + 3
    xs = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    cos, sin = rope_tables("random", dim, rot, torch.float32, gen)
    pos = torch.randint(0, TABLE, (rows,), generator=gen)
    pos[0], pos[-1] = 0, TABLE - 1  # the table's first and last rows
    _, x = guarded(xs, float("nan"))
    _, cg = guarded(cos, float("nan"))
    _, sg = guarded(sin, float("nan"))
    for inverse in (False, True):
        buf, out = guarded(torch.zeros(rows, dim, dtype=dtype), 7.0)
        gpu_rope.launch(x, cg, sg, pos, out, interleaved, inverse)
        assert torch.equal(out, ref.rope(xs, cos, sin, pos, interleaved, inverse))
        assert guards_kept(buf, rows * dim, 7.0)


@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (64,), (2, 0, 8), (17, 128)])
def test_rope_edges(shape):
    """No rows, one row, a 1-D x, rows past a tile."""
    x = torch.randn(shape)
    cos, sin = torch_rkv.rope_tables(shape[-1], TABLE)
    pos = torch.arange(math.prod(shape[:-1])).reshape(shape[:-1]) % TABLE
    for inverse in (False, True):
        got = gpu_rope.rope(x, cos, sin, pos, False, inverse)
        assert got.shape == x.shape and torch.equal(got, ref.rope(x, cos, sin, pos, False, inverse))


def test_rope_positions_beyond_the_table():
    """On CPU tensors the launcher raises the CPU kernel's error; the kernel itself (what runs on a GPU,
    where the check would cost a host sync) writes NaN rows there and the right values elsewhere."""
    x = torch.randn(3, 8)
    cos, sin = torch_rkv.rope_tables(8, 16)
    for bad in (torch.tensor([0, 16, 2]), torch.tensor([-1, 0, 0])):
        with pytest.raises(ValueError, match=re.escape(f"rkv.rope: positions contains {int(bad[bad != 0][0])}, "
                                                       "outside the cos/sin table of 16 positions")):
            gpu_rope.rope(x, cos, sin, bad, False, False)
        out = torch.zeros_like(x)
        gpu_rope.launch(x, cos, sin, bad, out, False, False)
        ok = (bad >= 0) & (bad < 16)
        assert out[~ok].isnan().all()
        assert torch.equal(out[ok], ref.rope(x[ok], cos, sin, bad[ok]))


def test_rope_bad_input_names_the_argument():
    x = torch.randn(2, 3, 8)
    cos, sin = torch_rkv.rope_tables(8, 16)
    pos = torch.arange(3)
    call = gpu_rope.rope
    cases = [
        (lambda: call(x.int(), cos, sin, pos, False, False), TypeError, "rkv.rope: x must be float32"),
        (lambda: call(x, cos, sin.half(), pos, False, False), TypeError, "rkv.rope: sin must have cos's dtype"),
        (lambda: call(x, cos, sin, pos.float(), False, False), TypeError, "rkv.rope: positions must be int32 or int64"),
        (lambda: call(x, cos[0], sin[0], pos, False, False), ValueError,
         "rkv.rope: cos must have shape (positions, rot_dim / 2)"),
        (lambda: call(x, cos, sin[:, :2], pos, False, False), ValueError, "rkv.rope: sin must have cos's shape"),
        (lambda: call(x[..., :6], cos, sin, pos, False, False), ValueError,
         "rkv.rope: cos/sin have 4 pairs per position"),
        (lambda: call(x, cos, sin, torch.arange(4), False, False), ValueError, "rkv.rope: positions of shape [4]"),
        (lambda: call(x, cos.to("meta"), sin, pos, False, False), ValueError, "rkv.rope: cos is on meta"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            fn()


# --------------------------------------------------------------------------------------------------
# hadamard
# --------------------------------------------------------------------------------------------------

HADAMARD_DIMS = [2, 4, 8, 32, 64, 96, 128, 160, 256, 512, 1024]


def make_signs(kind: str, dim: int, dtype: torch.dtype, seed: int):
    if kind == "none":
        return None
    if kind == "pm1":
        return torch_rkv.hadamard_signs(dim, seed).to(dtype)
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed)).to(dtype)  # any float: still exact


@given(dim=st.sampled_from(HADAMARD_DIMS), lead=st.lists(st.integers(0, 4), min_size=1, max_size=2),
       dtype=st.sampled_from(FLOATS), signs=st.sampled_from(["none", "pm1", "random"]),
       signs_dtype=st.sampled_from(FLOATS), contiguous=st.booleans(), seed=st.integers(0, 2**16))
def test_hadamard_matches_reference_and_cpu_kernel_bit_for_bit(dim, lead, dtype, signs, signs_dtype, contiguous, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, dim, generator=gen) * 3).to(dtype)
    if not contiguous:
        x = noncontiguous(x)
    s = make_signs(signs, dim, signs_dtype, seed)
    for inverse in (False, True):
        got = gpu_hadamard.hadamard(x, s, inverse)
        assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, ref.hadamard(x, s, inverse))
        assert torch.equal(got, torch.ops.rkv.hadamard(x, s, inverse))


@pytest.mark.parametrize("dim", [8192, 6144])
def test_hadamard_largest_blocks(dim):
    """The largest block the op accepts (8192), and 3 blocks of 2048."""
    x = torch.randn(2, dim)
    s = torch_rkv.hadamard_signs(dim, 1)
    for inverse in (False, True):
        assert torch.equal(gpu_hadamard.hadamard(x, s, inverse), ref.hadamard(x, s, inverse))


@pytest.mark.parametrize("log2n", range(1, 14))
def test_hadamard_norm_is_the_float32_constant(log2n):
    """The kernel's 1/sqrt(n) (a constexpr) is hadamard.h's hadamard_norm: float32(1 / sqrt(n)) in double."""
    n = 1 << log2n
    e0 = torch.zeros(1, n)
    e0[0, 0] = 1.0
    want = torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32)
    assert gpu_hadamard.hadamard_norm(n) == want.item()
    assert torch.equal(gpu_hadamard.hadamard(e0, None, False), want.expand(1, n))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", [2, 96, 128, 512])
def test_hadamard_reads_and_writes_only_its_rows(dtype, dim):
    """x and signs inside NaN guards, out inside canaries, block count not a multiple of the tile."""
    n = dim & -dim
    rows = (gpu_hadamard.block_m(n) + 3 + dim // n - 1) // (dim // n)  # past one tile of blocks
    gen = torch.Generator().manual_seed(dim)
    xs = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    ss = torch.randn(dim, generator=gen)
    _, x = guarded(xs, float("nan"))
    _, s = guarded(ss, float("nan"))
    for inverse in (False, True):
        for signs, plain in ((s, ss), (None, None)):
            buf, out = guarded(torch.zeros(rows, dim, dtype=dtype), 7.0)
            gpu_hadamard.launch(x, signs, out, inverse)
            assert torch.equal(out, ref.hadamard(xs, plain, inverse))
            assert guards_kept(buf, rows * dim, 7.0)


def test_hadamard_tile_padded_head_dim():
    """hadamard_tile's contract for a head dim that is not a power of two: 96 in a tile of 128, zero-filled
    past 96, blocks of 32, signs [1, D] masked to 1 past 96."""
    @triton.jit
    def kernel(x_ptr, s_ptr, out_ptr, dim, inverse, M: tl.constexpr, D: tl.constexpr, N: tl.constexpr):
        r = tl.arange(0, M)
        c = tl.arange(0, D)
        mask = (c < dim)[None, :] & (r < M)[:, None]
        v = tl.load(x_ptr + r[:, None] * dim + c[None, :], mask=mask, other=0.0)
        s = tl.load(s_ptr + c, mask=c < dim, other=1.0)[None, :]
        y = gpu_hadamard.hadamard_tile(v, s, inverse, N, True)
        tl.store(out_ptr + r[:, None] * dim + c[None, :], y, mask=mask)

    x, s = torch.randn(4, 96), torch_rkv.hadamard_signs(96, 5)
    for inverse in (False, True):
        out = torch.empty_like(x)
        kernel[(1,)](x, s, out, 96, inverse, M=4, D=128, N=32)
        assert torch.equal(out, ref.hadamard(x, s, inverse))


@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (64,), (3, 0, 96)])
def test_hadamard_edges(shape):
    x = torch.randn(shape)
    s = torch_rkv.hadamard_signs(shape[-1])
    got = gpu_hadamard.hadamard(x, s, False)
    assert got.shape == x.shape and torch.equal(got, ref.hadamard(x, s))


def test_hadamard_bad_input_names_the_argument():
    x = torch.randn(3, 64)
    call = gpu_hadamard.hadamard
    cases = [
        (lambda: call(x[:, :7], None, False), ValueError, "rkv.hadamard: the last dim of x (7) must be even"),
        (lambda: call(torch.randn(2, 16384), None, False), ValueError, "the last dim of x (16384)"),
        (lambda: call(x.long(), None, False), TypeError, "rkv.hadamard: x must be float32"),
        (lambda: call(x, torch.ones(32), False), ValueError, "rkv.hadamard: signs must have shape (64,)"),
        (lambda: call(x, torch.ones(64, dtype=torch.int8), False), TypeError, "rkv.hadamard: signs must be float32"),
        (lambda: call(x, torch.ones(64, device="meta"), False), ValueError, "rkv.hadamard: signs is on meta"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            fn()


def test_bfloat16_in_and_out_bit_for_bit():
    """With cos = 1 and sin = -2^-8, x0 + x1 2^-8 lands exactly halfway between two bfloat16 values: ties go
    to the even one (the interpreter's own cast truncates). Subnormals survive the load (the interpreter's
    own bfloat16 conversion flushes them); infinity, overflow and NaN come out as the CPU kernel's."""
    big = 3.3895313892515355e38  # the largest bfloat16
    pairs = [(1.0, 1.0), (1.0078125, 1.0), (-1.0, -1.0), (-1.0078125, -1.0), (2.0**-130, 0.0), (0.0, 2.0**-130),
             (-0.0, 0.0), (big, big), (float("inf"), 1.0), (float("nan"), 1.0), (3.0, 5.0)]
    x = torch.tensor(pairs).to(torch.bfloat16)
    cos, sin = torch.ones(1, 1), torch.full((1, 1), -(2.0**-8))
    pos = torch.zeros(len(pairs), dtype=torch.long)
    for inverse in (False, True):
        got = gpu_rope.rope(x, cos, sin, pos, False, inverse)
        want = ref.rope(x, cos, sin, pos, False, inverse)
        cpu = torch.ops.rkv.rope(x, cos, sin, pos, False, inverse)
        assert torch.equal(got.view(torch.int16), cpu.view(torch.int16))  # NaN: 0x7FC0 both
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])
    y = gpu_rope.rope(x, cos, sin, pos, False, False).float()
    assert y[0, 0] == 1.0 and y[1, 0] == 1.015625  # the ties: down to even, up to even
    assert y[4, 0] == 2.0**-130 and y[7, 0] == float("inf")


def test_hadamard_bfloat16_subnormals_and_specials():
    """bfloat16 subnormals are read exactly (the interpreter's own conversion flushes them), and infinity
    and NaN come out as the CPU kernel's bits."""
    x = torch.tensor([[2.0**-130, 2.0**-131, 2.0**-129, -(2.0**-133)], [1.0, float("inf"), 2.0, 3.0],
                      [float("nan"), 0.0, -0.0, 1.0]]).to(torch.bfloat16)
    for inverse in (False, True):
        got = gpu_hadamard.hadamard(x, None, inverse)
        assert torch.equal(got.view(torch.int16), torch.ops.rkv.hadamard(x, None, inverse).view(torch.int16))
        want = ref.hadamard(x, None, inverse)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])
    assert (gpu_hadamard.hadamard(x[:1], None, False) != 0).all()
