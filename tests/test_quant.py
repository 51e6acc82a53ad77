"""rkv::quantize / rkv::dequantize against reference.py, their error bound, and their edge cases."""

import math

import pytest
import torch
from conftest import DEVICES, noncontiguous
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
METAS = [*FLOATS, torch.float8_e4m3fn]  # the metadata dtypes
EPS32 = torch.finfo(torch.float32).eps


@st.composite
def quant_cases(draw):
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    dim = draw(st.sampled_from([8, 16, 24, 64, 128]))
    grouping = draw(st.sampled_from(["token", "grouped", "channel", "tile"]))
    divisors = [g for g in range(1, dim + 1) if dim % g == 0]
    block = draw(st.sampled_from([1, 2, 4, 8, 32]))
    if grouping == "token":
        group, block = dim, 1
    elif grouping == "grouped":
        group, block = draw(st.sampled_from(divisors)), 1
    elif grouping == "channel":
        group = 1
    else:
        group = draw(st.sampled_from(divisors))
    nblocks = draw(st.integers(0, 3))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    symmetric = draw(st.booleans())
    return dict(
        shape=(*lead, nblocks * block, dim), bits=bits, group=group, block=block,
        symmetric=symmetric, clip=not symmetric and draw(st.booleans()), dtype=draw(st.sampled_from(FLOATS)),
        meta=draw(st.sampled_from(METAS)), scale=draw(st.sampled_from([1e-3, 1.0, 30.0])),
        contiguous=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
        levels=not symmetric and bits < 8 and draw(st.booleans()),  # a random non-uniform codebook
    )


def random_levels(bits: int, seed: int) -> torch.Tensor:
    """2^bits strictly ascending code values within [0, 2^bits - 1] (ends free: interior cells and the
    saturating ends both get exercised)."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 << bits
    cuts = torch.sort(torch.rand(n, generator=gen)).values * (n - 1)
    return torch.unique(cuts) if len(torch.unique(cuts)) == n else torch.arange(n, dtype=torch.float32)


def case_levels(case, device="cpu"):
    return random_levels(case["bits"], case["seed"]).to(device) if case.get("levels") else None


def make_input(case, device):
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["shape"], generator=gen) * case["scale"]
    # a few outlier channels, as real keys have
    if x.numel():
        x[..., 0] *= 8
    x = x.to(case["dtype"]).to(device)
    return x if case["contiguous"] else noncontiguous(x)


def quant_args(case):
    return case["bits"], case["group"], case["block"], case["symmetric"], case["meta"], case["clip"]


@pytest.mark.parametrize("device", DEVICES)
@given(case=quant_cases())
def test_quantize_matches_reference_bit_for_bit(device, case):
    x = make_input(case, device)
    lv = case_levels(case)
    q = torch_rkv.quantize(x, *quant_args(case), levels=None if lv is None else lv.to(device))
    packed, scale, zero = ref.quantize(x.cpu(), *quant_args(case), levels=lv)
    assert torch.equal(q.packed.cpu(), packed)
    assert torch.equal(q.scale.cpu(), scale)
    if case["symmetric"]:
        assert q.zero is None
    else:
        assert torch.equal(q.zero.cpu(), zero)
    for out_dtype in (torch.float32, case["dtype"]):
        got = torch_rkv.dequantize(q, out_dtype).cpu()
        want = ref.dequantize(packed, scale, None if case["symmetric"] else zero, case["bits"], out_dtype, lv)
        assert torch.equal(got, want)


def in_meta_range(x, meta):
    """Where the error bounds hold: values inside the metadata dtype's range (float8 e4m3: |x| <= 448);
    values beyond it saturate to its end of the grid."""
    return x.float().cpu().abs() <= torch.finfo(meta).max


def half_step_bound(x, q):
    """|x - x_hat| <= scale/2 for the stored scale, plus the fp32 rounding of the few operations that
    compute the code and the value (each at most one ulp of the magnitudes involved)."""
    s = ref.expand_meta(q.scale, q.block_tokens, q.group_size)
    z = ref.expand_meta(q.zero, q.block_tokens, q.group_size) if q.zero is not None else torch.zeros_like(s)
    xf = x.float()
    return s / 2 + 4 * EPS32 * (xf.abs() + z.abs() + s * (2 ** q.bits))


@pytest.mark.parametrize("device", DEVICES)
@given(case=quant_cases())
def test_dequantize_within_half_a_step(device, case):
    case = {**case, "clip": False}  # a clipped range saturates the values beyond it by design
    x = make_input(case, device)
    q = torch_rkv.quantize(x, *quant_args(case))
    err = (torch_rkv.dequantize(q).cpu() - x.float().cpu()).abs()
    bound = half_step_bound(x.cpu(), q._replace(scale=q.scale.cpu(), zero=None if q.zero is None else q.zero.cpu()))
    inside = in_meta_range(x, case["meta"])
    assert bool((err <= bound)[inside].all()), f"max excess {(err - bound)[inside].max().item()}"


def group_sq_errors(x, q, t, g):
    """Squared reconstruction error of each tile of t tokens x g channels, over its finite values, float64."""
    xf = x.float().cpu()
    err = (q.dequantize().cpu() - xf).double() ** 2
    err = torch.where(torch.isfinite(xf), err, torch.zeros_like(err))
    *lead, n, d = err.shape
    return err.reshape(*lead, n // t, t, d // g, g).sum(dim=(-3, -1))


@pytest.mark.parametrize("device", DEVICES)
@given(case=quant_cases())
def test_clip_never_increases_a_groups_error(device, case):
    """The search includes the min/max range, so no group can get worse (up to float64 summation order)."""
    case = {**case, "symmetric": False}
    x = make_input(case, device)
    args = quant_args(case)[:-1]
    tile = case["block"], case["group"]
    plain = group_sq_errors(x, torch_rkv.quantize(x, *args, clip=False), *tile)
    clipped = group_sq_errors(x, torch_rkv.quantize(x, *args, clip=True), *tile)
    assert bool((clipped <= plain * (1 + 1e-12)).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits, most", [(2, 0.75), (3, 0.9)])
def test_clip_beats_min_max_on_gaussian_channels(device, bits, most):
    """Per-channel blocks of 128 Gaussian tokens: min/max spans about 5.2 sigma, so at 2 bits the step is
    1.7 sigma (MSE ~ step^2/12 = 0.25 sigma^2), while the best uniform 4-level grid (Max, 1960) has MSE
    0.119 sigma^2: clipping must remove well over a quarter of the error (at 3 bits: 0.046 vs 0.037)."""
    x = torch.randn(8, 1024, 64, generator=torch.Generator().manual_seed(0)).to(device)
    plain = (torch_rkv.quantize(x, bits, 1, 128).dequantize() - x).pow(2).mean()
    clipped = (torch_rkv.quantize(x, bits, 1, 128, clip=True).dequantize() - x).pow(2).mean()
    assert clipped <= most * plain


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_error_shrinks_with_bits(device, bits):
    x = torch.randn(4, 64, 128, device=device)
    err = (torch_rkv.quantize(x, bits).dequantize() - x).pow(2).mean().sqrt().item()
    # uniform quantization: RMS error ~ step / sqrt(12), step = range / (2^b - 1); the range of 128
    # standard normals is about 5.5
    step = 5.5 / (2**bits - 1)
    assert err <= 1.5 * step / math.sqrt(12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("meta", FLOATS)
def test_constant_and_zero_groups_are_exact_or_within_step(device, symmetric, meta):
    x = torch.zeros(3, 8, 32, device=device)
    x[1] = 0.3  # not representable in fp16: scale becomes a tiny positive number, never NaN
    x[2] = -2.0  # representable: exact when asymmetric (zero = -2, scale = 0)
    q = torch_rkv.quantize(x, 4, 16, 1, symmetric, meta)
    y = q.dequantize()
    assert torch.isfinite(q.scale.float()).all() and torch.isfinite(y).all()
    assert torch.equal(y[0], x[0])
    if not symmetric:
        assert torch.equal(y[2], x[2])
    assert bool(((y - x).abs() <= half_step_bound(x, q)).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True])
def test_non_finite_values_never_poison_their_group(device, symmetric):
    x = torch.randn(4, 16, 32, device=device)
    bad = x.clone()
    bad[0, 3, 5] = float("nan")
    bad[1, 7, 0] = float("inf")
    bad[2, 0, 31] = float("-inf")
    bad[3] = float("nan")  # a whole block without a finite value
    for group, block in ((32, 1), (8, 1), (1, 16)):
        qb = torch_rkv.quantize(bad, 4, group, block, symmetric)
        # replacing each non-finite value by a finite neighbour of its group leaves min/max unchanged
        fixed = bad.clone()
        fixed[0, 3, 5] = fixed[0, 3, 4] if block == 1 else fixed[0, 2, 5]
        fixed[1, 7, 0] = fixed[1, 7, 1] if block == 1 else fixed[1, 6, 0]
        fixed[2, 0, 31] = fixed[2, 0, 30] if block == 1 else fixed[2, 1, 31]
        fixed[3] = 0.0
        qf = torch_rkv.quantize(fixed, 4, group, block, symmetric)
        assert torch.equal(qb.scale[:3], qf.scale[:3])
        y = qb.dequantize()
        assert torch.isfinite(y).all() and torch.isfinite(qb.scale.float()).all()
        mask = torch.isfinite(bad)
        assert torch.equal(y[mask], qf.dequantize()[mask])  # every finite value is untouched
        assert torch.equal(qb.scale[3], torch.zeros_like(qb.scale[3]))  # empty group: scale 0
        codes = torch_rkv.unpack(qb.packed, 4)
        assert codes[1, 7, 0] == 15  # +inf saturates to the top code
        assert codes[2, 0, 31] == (1 if symmetric else 0)  # -inf to the bottom one


@pytest.mark.parametrize("device", DEVICES)
def test_values_beyond_fp16_range_saturate(device):
    x = torch.randn(3, 4, 16, device=device)
    x[0, 1, 3] = -1e6  # below the lowest fp16 zero: saturates to -65504
    x[1, 2, 5] = 1e9  # needs a scale above 65504: the scale saturates, so does the value
    q = torch_rkv.quantize(x, 4, 16, 1, False, torch.float16)
    y = q.dequantize()
    assert torch.isfinite(y).all() and torch.isfinite(q.scale.float()).all()
    assert y[0, 1, 3] == -65504.0
    assert y[1, 2, 5] == float(q.zero[1, 2, 0]) + 15 * 65504.0
    others = torch.ones_like(x, dtype=torch.bool)
    others[0, 1], others[1, 2] = False, False
    bound = half_step_bound(x, q)
    assert bool(((y - x).abs() <= bound)[others].all())


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs(device):
    for shape in [(0, 16), (2, 0, 16), (0, 3, 8, 16)]:
        x = torch.randn(shape, device=device)
        q = torch_rkv.quantize(x, 4, 8, 1)
        assert q.packed.shape == (*shape[:-1], 8) and q.scale.shape == (*shape[:-1], 2)
        assert q.dequantize().shape == shape


def test_metadata_rounding_is_outward():
    lo = torch.tensor([0.1, -0.1, 1e-9, -70000.0, 3.0], dtype=torch.float64)
    for dtype in FLOATS:
        down = ref.round_meta(lo, dtype, up=False).double()
        up = ref.round_meta(lo, dtype, up=True).double()
        mx = torch.finfo(dtype).max
        inside = lo.abs() <= mx
        assert (down[inside] <= lo[inside]).all() and (up[inside] >= lo[inside]).all()
        assert torch.equal(down.to(dtype).double(), down) and torch.equal(up.to(dtype).double(), up)
        assert (down >= -mx).all() and (up <= mx).all()


BAD_CALLS = [
    (lambda x: torch.ops.rkv.quantize(x, 5, 16, 1, False, torch.float16), ValueError, "bits must be 2, 3, 4 or 8"),
    (lambda x: torch.ops.rkv.quantize(x, 4, 12, 1, False, torch.float16), ValueError, "group_size (12)"),
    (lambda x: torch.ops.rkv.quantize(x, 4, 0, 1, False, torch.float16), ValueError, "group_size (0)"),
    (lambda x: torch.ops.rkv.quantize(x, 4, 16, 3, False, torch.float16), ValueError, "block_tokens (3)"),
    (lambda x: torch.ops.rkv.quantize(x.long(), 4, 16, 1, False, torch.float16), TypeError, "x must be float32"),
    (lambda x: torch.ops.rkv.quantize(x, 4, 16, 1, False, torch.float64), TypeError, "meta_dtype"),
    (lambda x: torch.ops.rkv.quantize(x[0, 0, 0], 4, 16, 1, False, torch.float16), ValueError, "at least 2 dims"),
    (lambda x: torch.ops.rkv.quantize(x[..., :5], 3, 5, 1, False, torch.float16), ValueError, "multiple of 8"),
    (lambda x: torch.ops.rkv.quantize(x, 2, 1, 8, True, torch.float16, True), ValueError, "clip searches asymmetric"),
    (lambda x: torch.ops.rkv.quantize(x, 4, 16, 1, False, torch.float16, False, 0, _lv(x, 8)), ValueError,
     "levels must have shape (16,)"),
    (lambda x: torch.ops.rkv.quantize(x, 2, 16, 1, False, torch.float16, False, 0, _lv(x, 4).half()), TypeError,
     "levels must be float32"),
    (lambda x: torch.ops.rkv.quantize(x, 2, 16, 1, True, torch.float16, False, 0, _lv(x, 4)), ValueError,
     "levels (non-uniform levels) needs asymmetric codes"),
    (lambda x: torch.ops.rkv.quantize(x, 8, 16, 1, False, torch.float16, False, 0, _lv(x, 256)), ValueError,
     "non-uniform levels are for 2, 3 or 4 bits"),
]


def _lv(x, n):
    return torch.arange(n, dtype=torch.float32, device=x.device)


def dequant_bad_calls(x):
    p, s, z = torch.ops.rkv.quantize(x, 4, 16, 1, False, torch.float16)
    return [
        (lambda: torch.ops.rkv.dequantize(p, s, z[..., :1], 4, torch.float32), ValueError, "zero must have scale's shape"),
        (lambda: torch.ops.rkv.dequantize(p, s, z.float(), 4, torch.float32), TypeError, "zero must have scale's dtype"),
        (lambda: torch.ops.rkv.dequantize(p, s[..., :3], z, 4, torch.float32), ValueError, "scale's last dim (3 groups)"),
        (lambda: torch.ops.rkv.dequantize(p, s[:, :, :3], z, 4, torch.float32), ValueError, "token-block dim (3)"),
        (lambda: torch.ops.rkv.dequantize(p, s[0], z, 4, torch.float32), ValueError, "scale must have as many dims"),
        (lambda: torch.ops.rkv.dequantize(p.float(), s, z, 4, torch.float32), TypeError, "packed must be uint8"),
        (lambda: torch.ops.rkv.dequantize(p, s, z, 7, torch.float32), ValueError, "bits must be"),
        (lambda: torch.ops.rkv.dequantize(p, s, z, 4, torch.int8), TypeError, "out_dtype"),
        (lambda: torch.ops.rkv.dequantize(p, s, z, 4, torch.float32, _lv(x, 4)), ValueError, "levels must have shape"),
        (lambda: torch.ops.rkv.dequantize(p, s, None, 4, torch.float32, _lv(x, 16)), ValueError,
         "needs asymmetric codes"),
    ]


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("i", range(len(BAD_CALLS)))
def test_quantize_bad_input_names_the_argument(device, i):
    call, exc, msg = BAD_CALLS[i]
    x = torch.randn(2, 3, 8, 64, device=device)
    with pytest.raises(exc, match=f"rkv.quantize: .*{_re(msg)}"):
        call(x)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_dequantize_bad_input_names_the_argument(device):
    x = torch.randn(2, 3, 8, 64, device=device)
    for call, exc, msg in dequant_bad_calls(x):
        with pytest.raises(exc, match=f"rkv.dequantize: .*{_re(msg)}"):
            call()


def _re(s):
    import re

    return re.escape(s)


@pytest.mark.parametrize("bad", [[0.0, 2.0, 1.0, 3.0], [0.0, 1.0, 1.0, 3.0], [-0.5, 1.0, 2.0, 3.0],
                                 [0.0, 1.0, 2.0, 3.5], [0.0, 1.0, 2.0, math.nan]])
def test_levels_that_are_not_ascending_code_values_are_refused(bad):
    """On CPU the values are checked too (on CUDA they would cost a sync per call): ascending, within
    [0, 2^bits - 1], finite; the reference says the same."""
    x = torch.randn(4, 16)
    lv = torch.tensor(bad)
    with pytest.raises(ValueError, match="rkv.quantize: levels must be strictly ascending code values"):
        torch_rkv.quantize(x, 2, levels=lv)
    with pytest.raises(ValueError, match="rkv.quantize: levels must be strictly ascending code values"):
        ref.quantize(x, 2, 16, levels=lv)
    q = torch_rkv.quantize(x, 2)
    with pytest.raises(ValueError, match="rkv.dequantize: levels must be strictly ascending"):
        torch.ops.rkv.dequantize(q.packed, q.scale, q.zero, 2, torch.float32, lv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_uniform_grid_as_levels_gives_the_uniform_codes(device, bits):
    """levels = 0, 1, ..., 2^bits - 1 is the uniform grid: the same codes and values as no levels (up to
    exact ties at a midpoint, which rint sends to even and the levels to the lower: none in random data)."""
    x = torch.randn(3, 256, 64, generator=torch.Generator().manual_seed(bits)).to(device)
    grid = torch.arange(1 << bits, dtype=torch.float32, device=device)
    for group, tokens, clip in ((1, 128, False), (64, 1, False), (1, 128, True)):
        plain = torch_rkv.quantize(x, bits, group, tokens, clip=clip)
        lut = torch_rkv.quantize(x, bits, group, tokens, clip=clip, levels=grid)
        assert torch.equal(plain.packed, lut.packed) and torch.equal(plain.scale, lut.scale)
        assert torch.equal(plain.dequantize(), lut.dequantize())


@pytest.mark.parametrize("device", DEVICES)
@given(case=quant_cases())
def test_levels_error_is_bounded_by_the_widest_cell(device, case):
    """With levels l_0 < ... < l_n-1 inside a group's grid, a value decodes within scale times the largest
    of l_0 (below the first level), n-1 - l_n-1 (above the last) and half the widest gap, plus rounding."""
    case = {**case, "clip": False, "symmetric": False, "bits": min(case["bits"], 4), "levels": True}
    x = make_input(case, device)
    lv = case_levels(case)
    q = torch_rkv.quantize(x, *quant_args(case), levels=lv.to(device))
    s = ref.expand_meta(q.scale.cpu(), q.block_tokens, q.group_size)
    z = ref.expand_meta(q.zero.cpu(), q.block_tokens, q.group_size)
    cell = max(float(lv[0]), float((1 << case["bits"]) - 1 - lv[-1]), float((lv[1:] - lv[:-1]).max()) / 2)
    xf = x.float().cpu()
    err = (q.dequantize().cpu() - xf).abs()
    bound = s * cell + 4 * EPS32 * (xf.abs() + z.abs() + s * (2 ** case["bits"]))
    inside = in_meta_range(x, case["meta"])
    assert bool((err <= bound)[inside].all()), f"max excess {(err - bound)[inside].max().item()}"


@pytest.mark.parametrize("bits, most", [(2, 0.6), (3, 0.85)])
def test_lloyd_levels_fit_gaussian_channels_better_than_the_grid(bits, most):
    """codebook.lloyd on the code-unit positions of Gaussian per-channel blocks: the fitted levels, served
    through rkv.quantize, must cut the squared error well below the uniform grid's (Max's 4-level
    Gaussian quantizer has 0.118 sigma^2 against the grid's ~0.25 at 2 bits)."""
    from torch_rkv.codebook import lloyd

    x = torch.randn(8, 1024, 64, generator=torch.Generator().manual_seed(0))
    grid = torch_rkv.quantize(x, bits, 1, 128)
    s = ref.expand_meta(grid.scale, 128, 1)
    u = (x - ref.expand_meta(grid.zero, 128, 1)) / s
    lv = lloyd(u, s * s, bits, pin_ends=False)
    fitted = torch_rkv.quantize(x, bits, 1, 128, levels=lv)
    plain = (grid.dequantize() - x).pow(2).mean()
    assert (fitted.dequantize() - x).pow(2).mean() < most * plain
    pinned = lloyd(u, s * s, bits, pin_ends=True)
    assert pinned[0] == 0 and pinned[-1] == (1 << bits) - 1
    assert (torch_rkv.quantize(x, bits, 1, 128, levels=pinned).dequantize() - x).pow(2).mean() < plain
