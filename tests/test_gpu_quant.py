"""The Triton quantize / dequantize kernels (torch_rkv/gpu/quant.py, dequant.py), run by Triton's
interpreter on CPU tensors: bit for bit against reference.quantize / dequantize and the C++ CPU ops, on hostile values, with
per-slab sinks and excluded values (the cache append's use), inside guarded buffers; edges and errors."""

import contextlib
import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_quant import FLOATS, case_levels, make_input, quant_args, quant_cases, random_levels

from torch_rkv import reference as ref
from torch_rkv.gpu import quant as Q  # (first: it chooses the interpreter without a GPU)
from torch_rkv.gpu import dequant as DQ

# the kernels compute with infinities on purpose (empty groups, spans that overflow), which numpy reports
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

GUARD = 40  # elements of guard / canary around a guarded buffer (a multiple of 8: keeps any dtype aligned)
CANARY = 0xA5  # the byte every output buffer starts filled with
INPUT_GUARD = 6e4  # finite in every float dtype and far outside the test data: a read past x changes ranges


class _GuardedTorch:
    """Stands for `torch` inside quant.py: empty / empty_like return views into buffers filled with CANARY
    bytes, GUARD elements either side, so a write past an output or a value never written shows."""

    def __init__(self):
        self.made = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *size, dtype=torch.float32, device=None):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        n, item = math.prod(shape), torch.empty(0, dtype=dtype).element_size()
        buf = torch.full(((n + 2 * GUARD) * item,), CANARY, dtype=torch.uint8, device=device)
        self.made.append((buf, n * item))
        return buf[GUARD * item:(GUARD + n) * item].view(dtype).view(shape)

    def empty_like(self, t):
        return self.empty(*t.shape, dtype=t.dtype, device=t.device)

    def guards_kept(self) -> bool:
        for buf, nbytes in self.made:
            g = (len(buf) - nbytes) // 2
            if not (bool((buf[:g] == CANARY).all()) and bool((buf[g + nbytes:] == CANARY).all())):
                return False
        return True


@contextlib.contextmanager
def guarded_outputs():
    """Within the block, quant.py's outputs live inside canaries; checked on the way out."""
    g = _GuardedTorch()
    Q.torch = g
    try:
        yield
    finally:
        Q.torch = torch
    assert g.guards_kept(), "a kernel wrote outside its output"


def guarded_input(x: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """x's values inside INPUT_GUARD guards: contiguous (guards before and after), or a view whose rows sit
    3 elements apart from guards on both sides, with a guard row before and after each slice."""
    if contiguous:
        buf = torch.full((GUARD + x.numel() + GUARD,), INPUT_GUARD, dtype=x.dtype)
        view = buf[GUARD:GUARD + x.numel()].view(x.shape)
    else:
        wide = torch.full((*x.shape[:-2], x.shape[-2] + 2, x.shape[-1] + 6), INPUT_GUARD, dtype=x.dtype)
        view = wide[..., 1:-1, 3:-3]
    view.copy_(x)
    return view


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"output {i} differs at {(a != b).nonzero()[:5].tolist()}"


def run_quantize(x, bits, group, block, symmetric, meta, clip=False, sink_rows=0, levels=None):
    """The Triton op (guarded outputs), checked against reference.quantize and the C++ CPU op, bit for bit."""
    with guarded_outputs():
        got = Q.quantize(x, bits, group, block, symmetric, meta, clip, sink_rows, levels)
    want = ref.quantize(x, bits, group, block, symmetric, meta, clip, sink_rows, levels)
    assert_same(got, want)
    assert_same(got, torch.ops.rkv.quantize(x, bits, group, block, symmetric, meta, clip, sink_rows, levels))
    return got


def run_dequantize(packed, scale, zero, bits, out_dtype, levels=None):
    with guarded_outputs():
        got = DQ.dequantize(packed, scale, zero, bits, out_dtype, levels)
    want = ref.dequantize(packed, scale, zero, bits, out_dtype, levels)
    assert torch.equal(got, want)
    assert torch.equal(got, torch.ops.rkv.dequantize(packed, scale, zero, bits, out_dtype, levels))
    return got


def round_trip(x, case, levels, sink_rows=0):
    packed, scale, zero = run_quantize(x, *quant_args(case), sink_rows=sink_rows, levels=levels)
    z = None if case["symmetric"] else zero
    if x.shape[-1] == 0:  # nothing to read the group size off: refused, as by the C++ kernel
        with pytest.raises(ValueError, match="rkv.dequantize: scale's last dim"):
            DQ.dequantize(packed, scale, z, case["bits"], torch.float32, levels)
        return
    for out_dtype in {torch.float32, x.dtype}:
        run_dequantize(packed, scale, z, case["bits"], out_dtype, levels)


# --------------------------------------------------------------------------------------------------
# the ops against the reference and the CPU kernels
# --------------------------------------------------------------------------------------------------


@given(case=quant_cases(), sink_rows=st.sampled_from([0, 0, 1, 3, 17, 40]))
def test_quantize_and_dequantize_match_reference_and_cpu(case, sink_rows):
    """Every bit width, group layout, symmetry, input and metadata dtype, clip, levels and sink_rows; x
    inside guards (contiguous or strided), outputs inside canaries."""
    x = guarded_input(make_input({**case, "contiguous": True}, "cpu"), case["contiguous"])
    round_trip(x, case, case_levels(case), sink_rows)


SPECIAL = [math.nan, math.inf, -math.inf, 1e9, -1e9, 3e38, -3e38, 3.4028234663852886e38, 65504.0, 65520.0,
           -65520.0, 0.0, -0.0, 1e-40, -1e-40, 1e-30, 2.5]


@given(case=quant_cases(), data=st.data())
def test_hostile_values(case, data):
    """NaN (encodes as 0), +-Inf (saturate), values beyond the metadata dtype's range, subnormals, signed
    zeros, groups of equal values, all-zero and all-non-finite groups."""
    x = make_input({**case, "contiguous": True}, "cpu")
    mode = data.draw(st.sampled_from(["plain", "rounded", "constant", "non-finite"]))
    if mode == "rounded":  # many equal values: constant groups, clip candidates that tie
        x = (x * 2).round() / 2
    elif mode == "constant":
        x = torch.full_like(x, data.draw(st.sampled_from([0.0, -0.0, 0.3, -2.0, 1e-40, 7e4])))
    elif mode == "non-finite":
        x = torch.full_like(x, data.draw(st.sampled_from([math.nan, math.inf, -math.inf])))
    flat = x.view(-1)
    if flat.numel():
        for u, v in data.draw(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(SPECIAL)),
                                       max_size=12)):
            flat[int(u * flat.numel())] = v
    if not case["contiguous"]:
        x = guarded_input(x, False)
    round_trip(x, case, case_levels(case))


@pytest.mark.parametrize("bits, dim, block", [(2, 128, 48), (3, 256, 20), (4, 512, 12), (8, 128, 40)])
def test_blocks_longer_than_a_chunk(bits, dim, block):
    """block_tokens above the rows a program holds at once: every pass (ranges, clip errors, codes) walks
    the block in chunks, the last one partial; with sinks inside a block and past the first block."""
    x = torch.randn(1, 2 * block, dim, generator=torch.Generator().manual_seed(bits)) * 3
    x[0, 5, 7], x[0, block + 3, 1] = math.nan, math.inf
    lv = random_levels(bits, 1) if bits < 8 else None
    for clip, sinks, levels in ((False, block + 5, None), (True, 3, lv)):
        case = dict(bits=bits, group=1, block=block, symmetric=False, meta=torch.float16, clip=clip)
        round_trip(guarded_input(x), case, levels, sinks)
    case = dict(bits=bits, group=1, block=block, symmetric=True, meta=torch.bfloat16, clip=False)
    round_trip(guarded_input(x.bfloat16(), False), case, None, 7)


@pytest.mark.parametrize("dim, group", [(24, 3), (24, 6), (24, 12), (24, 24), (40, 5), (72, 9), (96, 48)])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_groups_of_any_size(dim, group, bits):
    """Groups that are not a power of two, some of whose codes straddle bytes shared with the next group."""
    if dim * bits % 8:
        pytest.skip("not whole bytes")
    x = torch.randn(3, 4, dim, generator=torch.Generator().manual_seed(dim + group)) * 2
    for block, clip, meta in ((1, False, torch.float16), (2, True, torch.float32), (4, False, torch.bfloat16)):
        case = dict(bits=bits, group=group, block=block, symmetric=False, meta=meta, clip=clip)
        round_trip(guarded_input(x), case, None, 1)
        round_trip(guarded_input(x), {**case, "symmetric": True, "clip": False}, None)


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (0, 3, 8, 16), (1, 16), (3, 1, 8), (5, 1, 1, 64), (4, 0)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_zero_and_one_rows(shape, bits):
    x = torch.randn(shape)
    case = dict(bits=bits, group=8 if shape[-1] else 1, block=1, symmetric=False, meta=torch.float16, clip=True)
    round_trip(x, case, None, 1)


def test_many_block_rows_per_program_with_a_partial_last_program():
    """Per-token rows: a program quantizes several block rows; 37 rows leave the last program partial."""
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(5))
    for bits in (2, 3, 4, 8):
        for group in (128, 32):
            round_trip(guarded_input(x), dict(bits=bits, group=group, block=1, symmetric=bits == 8,
                                              meta=torch.float16, clip=bits == 2), None)


# --------------------------------------------------------------------------------------------------
# the slab launchers the cache append shares
# --------------------------------------------------------------------------------------------------


@given(case=quant_cases(), data=st.data())
def test_quantize_slabs_with_per_slab_sinks_and_excluded_values(case, data):
    """quantize_slabs on (N, R, D) with an int32 tensor of sink rows per slab and an excluded mask (any
    strides) quantizes each slab as reference.quantize(sink_rows=..., excluded=...) does; an int sink
    count is the same as a tensor of it; dequantize_slabs decodes them as reference.dequantize."""
    x = make_input({**case, "contiguous": True}, "cpu")
    r, d = x.shape[-2:]
    n = math.prod(x.shape[:-2])
    x = x.reshape(n, r, d)
    gen = torch.Generator().manual_seed(case["seed"])
    sinks = torch.tensor(data.draw(st.lists(st.integers(-2, r + 2), min_size=n, max_size=n)), dtype=torch.int32)
    density = data.draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    excluded = torch.rand(x.shape, generator=gen) < density
    if data.draw(st.booleans()):  # the same values on other strides
        excluded = excluded.transpose(0, 1).contiguous().transpose(0, 1)
    if not case["contiguous"]:
        x = guarded_input(x, False)
    lv = case_levels(case)
    bits, group, block, symmetric, meta, clip = quant_args(case)
    with guarded_outputs():
        packed, scale, zero = Q.quantize_slabs(x, bits, group, block, symmetric, meta, clip, sinks, lv, excluded)
    assert (zero is None) == symmetric
    for i in range(n):
        want = ref.quantize(x[i], bits, group, block, symmetric, meta, clip, int(sinks[i]), lv, excluded[i])
        assert_same((packed[i], scale[i]), want[:2])
        if not symmetric:
            assert torch.equal(zero[i], want[2])
    common = int(sinks[0]) if n else 0
    with guarded_outputs():
        by_tensor = Q.quantize_slabs(x, bits, group, block, symmetric, meta, clip, torch.full((n,), common,
                                                                                              dtype=torch.int32))
        by_int = Q.quantize_slabs(x, bits, group, block, symmetric, meta, clip, common)
    assert_same(by_tensor[:2], by_int[:2])
    with guarded_outputs():
        back = DQ.dequantize_slabs(packed, scale, zero, bits, lv, torch.float32)
    assert torch.equal(back, ref.dequantize(packed, scale, zero, bits, torch.float32, lv))


def test_dequantize_slabs_on_strided_slabs():
    """Slabs that are every other block of a larger buffer (as blocks of cache pages are)."""
    x = torch.randn(6, 32, 64, generator=torch.Generator().manual_seed(2))
    for bits, group, block, symmetric in ((4, 1, 32, False), (3, 64, 1, True), (2, 16, 4, False)):
        packed, scale, zero = ref.quantize(x, bits, group, block, symmetric, torch.float16)
        z = None if symmetric else zero[::2]
        for out_dtype in FLOATS:
            with guarded_outputs():
                got = DQ.dequantize_slabs(packed[::2], scale[::2], z, bits, None, out_dtype)
            assert torch.equal(got, ref.dequantize(packed[::2], scale[::2], z, bits, out_dtype))


def test_dequantize_rounds_bfloat16_to_nearest_even():
    """Decoded values between two bfloat16 values (the interpreter's own cast would truncate), and
    overflow to infinity."""
    x = torch.tensor([[1.0 + 2**-9, 1.0 + 3 * 2**-9, -1.0 - 3 * 2**-9, 3e38, -3e38, 1.0, 0.0, 0.1]])
    for meta in (torch.float32, torch.float16):
        p, s, z = ref.quantize(x, 8, 8, 1, False, meta)
        run_dequantize(p, s, z, 8, torch.bfloat16)
    p = torch.full((1, 8), 255, dtype=torch.uint8)
    s, z = torch.full((1, 1), 3e38), torch.full((1, 1), 3e38)  # 255 * 3e38 overflows float32 to inf
    assert torch.isinf(run_dequantize(p, s, z, 8, torch.bfloat16)).all()


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------


def _lv(n):
    return torch.arange(n, dtype=torch.float32)


QUANTIZE_BAD = [  # the cases of test_quant.BAD_CALLS, through the Triton launcher
    ((4, 16, 1, False, torch.float16, False, -1), ValueError, "sink_rows must be >= 0"),
    ((5, 16, 1, False, torch.float16), ValueError, "bits must be 2, 3, 4 or 8"),
    ((4, 12, 1, False, torch.float16), ValueError, "group_size (12)"),
    ((4, 0, 1, False, torch.float16), ValueError, "group_size (0)"),
    ((4, 16, 3, False, torch.float16), ValueError, "block_tokens (3)"),
    ((4, 16, 1, False, torch.float64), TypeError, "meta_dtype"),
    ((2, 1, 8, True, torch.float16, True), ValueError, "clip searches asymmetric"),
    ((4, 16, 1, False, torch.float16, False, 0, _lv(8)), ValueError, "levels must have shape (16,)"),
    ((2, 16, 1, False, torch.float16, False, 0, _lv(4).half()), TypeError, "levels must be float32"),
    ((2, 16, 1, True, torch.float16, False, 0, _lv(4)), ValueError, "levels (non-uniform levels) needs asymmetric"),
    ((8, 16, 1, False, torch.float16, False, 0, _lv(256)), ValueError, "non-uniform levels are for 2, 3 or 4 bits"),
    ((2, 16, 1, False, torch.float16, False, 0, torch.tensor([0.0, 2.0, 1.0, 3.0])), ValueError,
     "levels must be strictly ascending code values within [0, 3]"),
    ((2, 16, 1, False, torch.float16, False, 0, torch.tensor([0.0, 1.0, 2.0, math.nan])), ValueError,
     "levels must be strictly ascending code values"),
]


@pytest.mark.parametrize("i", range(len(QUANTIZE_BAD)))
def test_quantize_bad_input_names_the_argument(i):
    args, exc, msg = QUANTIZE_BAD[i]
    x = torch.randn(2, 3, 8, 64)
    with pytest.raises(exc, match=f"rkv.quantize: .*{re.escape(msg)}"):
        Q.quantize(x, *args)
    with pytest.raises(exc, match=f"rkv.quantize: .*{re.escape(msg)}"):
        torch.ops.rkv.quantize(x, *args)  # the C++ kernel says the same


def test_quantize_bad_tensors_name_the_argument():
    x = torch.randn(2, 3, 8, 64)
    for bad, exc, msg in ((x.long(), TypeError, "x must be float32"), (x[0, 0, 0], ValueError, "at least 2 dims"),
                          (x[..., :5], ValueError, "multiple of 8")):
        bits, group = (3, 5) if msg == "multiple of 8" else (4, 16)
        with pytest.raises(exc, match=f"rkv.quantize: .*{re.escape(msg)}"):
            Q.quantize(bad, bits, group, 1, False, torch.float16)


def test_dequantize_bad_input_names_the_argument():
    p, s, z = ref.quantize(torch.randn(2, 3, 8, 64), 4, 16, 1, False, torch.float16)
    calls = [
        ((p, s, z[..., :1], 4, torch.float32), ValueError, "zero must have scale's shape"),
        ((p, s, z.float(), 4, torch.float32), TypeError, "zero must have scale's dtype"),
        ((p, s[..., :3], z, 4, torch.float32), ValueError, "scale's last dim (3 groups)"),
        ((p, s[:, :, :3], z, 4, torch.float32), ValueError, "token-block dim (3)"),
        ((p, s[0], z, 4, torch.float32), ValueError, "scale must have as many dims"),
        ((p.float(), s, z, 4, torch.float32), TypeError, "packed must be uint8"),
        ((p, s, z, 7, torch.float32), ValueError, "bits must be"),
        ((p, s, z, 4, torch.int8), TypeError, "out_dtype"),
        ((p, s, z, 4, torch.float32, _lv(4)), ValueError, "levels must have shape"),
        ((p, s, None, 4, torch.float32, _lv(16)), ValueError, "needs asymmetric codes"),
        ((p, s, z, 4, torch.float32, _lv(16).flip(0)), ValueError, "levels must be strictly ascending"),
    ]
    for args, exc, msg in calls:
        with pytest.raises(exc, match=f"rkv.dequantize: .*{re.escape(msg)}"):
            DQ.dequantize(*args)


# --------------------------------------------------------------------------------------------------
# the per-element helpers against the reference's
# --------------------------------------------------------------------------------------------------


def test_round_meta_is_the_reference_s_on_edges():
    """Directed rounding to each metadata dtype (the float64 -> float32 step, the nextafter on bits, the
    float16 / bfloat16 step with its next_toward, float8 e4m3's grid), saturation and signed zeros."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(v_ptr, up_ptr, down_ptr, n, META: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        v = tl.load(v_ptr + i, mask=i < n, other=0.0)
        tl.store(up_ptr + i, Q.round_meta(v, META, True), mask=i < n)
        tl.store(down_ptr + i, Q.round_meta(v, META, False), mask=i < n)

    vals = [0.0, -0.0, 1e-320, -1e-320, 1e-45, 1.4e-45, 3e-39, 1e-8, -1e-8, 5.9e-8, 0.1, -0.1, 1 / 3, 1.0,
            1.0 + 2**-30, -(1.0 + 2**-30), 65504.0, 65504.5, 65519.9, 65520.0, 7e4, -7e4, 3.3895313892515355e38,
            3.39e38, 3.4028234663852886e38, -3.4028234663852886e38, 1e300 * 0 + 2.0**100 + 1, 12345.678,
            # float8 e4m3's edges: its largest values, normal and subnormal boundaries, a carry into the exponent
            448.0, -448.0, 448.5, 464.0, 479.9, 480.0, 240.0, 241.0, 15.5, 15.99, 0.015625, 0.0156, -0.0156,
            0.001953125, 0.0009765625, 0.00293, -0.00293]
    vals += torch.randn(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64).mul(1e3).tolist()
    v = torch.tensor(vals, dtype=torch.float64)
    for meta, code in Q.META_CODE.items():
        up, down = torch.empty(len(v)), torch.empty(len(v))
        kernel[(1,)](v, up, down, len(v), META=code, BLOCK=triton.next_power_of_2(len(v)))
        assert torch.equal(up, ref.round_meta(v, meta, True)), meta
        assert torch.equal(down, ref.round_meta(v, meta, False)), meta
        assert torch.equal(up.view(torch.int32), ref.round_meta(v, meta, True).view(torch.int32)), meta
