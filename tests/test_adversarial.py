"""Adversarial inputs for every op: special values, edges, odd views, canaries, rejected calls, and
determinism across runs and thread counts. Each case ends in a documented result or a named error."""

import math
import re

import pytest
import torch
from cachebuild import BUFFERS, buffers_args, sides
from conftest import noncontiguous
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref
from torch_rkv.layout import CacheLayout
from torch_rkv.scheme import Scheme

SPECIALS = [math.nan, math.inf, -math.inf, 1e30, -3e38, 1e-40, -1e-45, 0.0, 65504.0, 70000.0]


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """x's values in a contiguous view whose storage starts one element into a larger buffer."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype)
    view = buf[1:].view(x.shape)
    view.copy_(x)
    return view


@st.composite
def special_tensors(draw):
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    group, block = draw(st.sampled_from([(16, 1), (4, 1), (1, 4), (8, 2)]))
    n = block * draw(st.integers(0, 4))
    x = torch.randn(draw(st.integers(1, 2)), n, 16, generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    specials = []
    if x.numel():
        for _ in range(draw(st.integers(1, 4))):
            idx = tuple(draw(st.integers(0, s - 1)) for s in x.shape)
            val = draw(st.sampled_from(SPECIALS))
            x[idx] = val
            specials.append(idx)
    if draw(st.booleans()):
        x[..., :group] = draw(st.sampled_from([0.0, 1.5, -7.0]))  # all-equal groups
    symmetric = draw(st.booleans())
    layout = draw(st.sampled_from(["contiguous", "noncontiguous", "misaligned"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return dict(x=x.to(dtype), bits=bits, group=group, block=block, specials=specials, layout=layout,
                symmetric=symmetric, clip=not symmetric and draw(st.booleans()),
                meta=draw(st.sampled_from([torch.float16, torch.float32])))


def groups_touched(case) -> torch.Tensor:
    """(lead, N/T, D/G) bool: the groups holding a non-finite or out-of-range input."""
    x = case["x"].float()
    bad = ~torch.isfinite(x) | (x.abs() > 6e4)
    lead, n, d = x.shape
    t, g = case["block"], case["group"]
    return bad.reshape(lead, n // t, t, d // g, g).any(dim=(2, 4))


@given(case=special_tensors())
def test_quantize_special_values_stay_in_their_group(case):
    x = case["x"]
    x_in = {"contiguous": x, "noncontiguous": noncontiguous(x), "misaligned": misaligned(x)}[case["layout"]]
    args = (case["bits"], case["group"], case["block"], case["symmetric"], case["meta"], case["clip"])
    q = torch_rkv.quantize(x_in, *args)
    packed, scale, zero = ref.quantize(x, *args)
    assert torch.equal(q.packed, packed) and torch.equal(q.scale, scale)  # the spec holds for any input
    y = q.dequantize()
    assert torch.isfinite(y).all() and torch.isfinite(q.scale.float()).all()  # documented: never NaN/Inf
    # every group without a special value is quantized exactly as in a clean tensor
    clean = torch.where(torch.isfinite(x.float()) & (x.float().abs() <= 6e4), x.float(), 0.0).to(x.dtype)
    qc = torch_rkv.quantize(clean, *args)
    touched = groups_touched(case)
    assert torch.equal(q.scale[~touched], qc.scale[~touched])
    codes, codes_clean = torch_rkv.unpack(q.packed, case["bits"]), torch_rkv.unpack(qc.packed, case["bits"])
    mask = ~touched.repeat_interleave(case["block"], 1).repeat_interleave(case["group"], 2)
    assert torch.equal(codes[mask], codes_clean[mask])


@given(case=special_tensors())
def test_rope_and_hadamard_propagate_specials_only_within_their_row(case):
    x = case["x"].float()
    if x.numel() == 0:
        return
    cos, sin = torch_rkv.rope_tables(16, 64)
    pos = torch.arange(x.shape[1])
    bad_rows = ~torch.isfinite(x).all(-1)
    clean_rows = ~bad_rows & (x.abs().amax(-1) < 1e29)
    for y in (torch_rkv.rope(x, cos, sin, pos), torch_rkv.hadamard(x, torch_rkv.hadamard_signs(16))):
        assert torch.isfinite(y[clean_rows]).all()  # a special value never leaks into another row
        assert (~torch.isfinite(y[bad_rows])).any(-1).all()  # and NaN/Inf are not silently dropped
    # the table edge: position P-1 is fine, P is a named error
    torch_rkv.rope(x[:, :1], cos, sin, torch.tensor([63]))
    with pytest.raises(ValueError, match="positions contains 64, outside the cos/sin table of 64"):
        torch_rkv.rope(x[:, :1], cos, sin, torch.tensor([64]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN when the bits are equal)."""
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(ints), b.view(ints))
    return torch.equal(a, b)


def canaried(layout: CacheLayout, pad: int = 7):
    """The layout's buffers as contiguous views into larger buffers filled with a canary pattern."""
    bufs, whole = {}, {}
    for name, (shape, dt) in layout.shapes().items():
        n = math.prod(shape)
        big = torch.full((n + 2 * pad,), 0xA5 if dt == torch.uint8 else -1234.5, dtype=dt)
        whole[name] = big
        bufs[name] = big[pad : pad + n].view(shape)  # contiguous, storage offset 7 (misaligned)
        bufs[name].zero_()
    return bufs, whole, pad


@st.composite
def append_sequences(draw):
    block = draw(st.sampled_from([1, 4]))
    scheme = Scheme(k_bits=draw(st.sampled_from([2, 3, 4])), v_bits=draw(st.sampled_from([2, 8])),
                    k_group_size=1 if block > 1 else None, k_block_tokens=block,
                    sinks=draw(st.sampled_from([0, 2])), recent=draw(st.sampled_from([0, 3])))
    capacity = draw(st.integers(0, 20))
    layout = CacheLayout(scheme, 2, 1, 16, capacity, torch.float32)
    chunks = draw(st.lists(st.integers(0, layout.max_tokens + 1), min_size=1, max_size=5))
    return scheme, layout, chunks, draw(st.integers(0, 999))


@given(case=append_sequences())
def test_appends_touch_nothing_outside_the_buffers_and_rejected_calls_change_nothing(case):
    scheme, layout, chunks, seed = case
    bufs, whole, pad = canaried(layout)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.zeros(2, dtype=torch.int64)
    for m in chunks:
        k = torch.randn(2, 1, m, 16, generator=gen)
        if m:
            k[0, 0, 0, 0] = math.nan  # specials in new tokens never reach other tokens' groups
        before = {n: t.clone() for n, t in whole.items()}
        if int(lengths[0]) + m > layout.max_tokens:
            with pytest.raises(ValueError, match=re.escape(f"exceeds its capacity of {layout.max_tokens} tokens")):
                torch_rkv.ops.cache.cache_append(*sides(bufs), lengths, k, k.clone(), scheme.format)
            assert all(same_bits(whole[n], before[n]) for n in whole)  # rejected: unchanged
            continue
        torch_rkv.ops.cache.cache_append(*sides(bufs), lengths, k, k.clone(), scheme.format)
        lengths += m
        for n, big in whole.items():
            assert same_bits(big[:pad], before[n][:pad]) and same_bits(big[-pad:], before[n][-pad:]), n
    for n, t in bufs.items():
        if t.dtype != torch.uint8 and n.endswith(("scale", "zero")):
            assert torch.isfinite(t).all()  # metadata never NaN, whatever the tokens held


def attention_case(n_window: int = 6):
    scheme = Scheme(k_bits=4, v_bits=4, k_group_size=1, k_block_tokens=4, recent=3)
    layout = CacheLayout(scheme, 3, 2, 32, 24, torch.float32)
    bufs = layout.allocate()
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, layout.max_tokens, 32, generator=gen)
    ref.cache_append(*buffers_args(bufs), torch.zeros(3, dtype=torch.int64), k, k.clone(), 4, 4, scheme.block,
                     scheme.recent)
    return scheme, layout, bufs


def test_attention_length_edges_and_nan_in_one_sequence():
    scheme, layout, bufs = attention_case()
    q = torch.randn(3, 4, 32)
    edges = [0, 1, scheme.block, layout.max_tokens]
    for n in edges:
        lengths = torch.tensor([n, n, 1])
        out = torch_rkv.decode_attention(q, *sides(bufs), lengths, scheme.format)
        want = ref.decode_attention(q, *buffers_args(bufs), lengths, 4, 4, scheme.block, scheme.recent)
        assert torch.allclose(out, want, atol=1e-5)
        if n == 0:
            assert torch.equal(out[0], torch.zeros_like(out[0]))
    with pytest.raises(ValueError, match=rf"lengths\[1\] = {layout.max_tokens + 1} is outside"):
        torch_rkv.decode_attention(q, *sides(bufs), torch.tensor([1, layout.max_tokens + 1, 1]), scheme.format)
    # NaN in a full-precision window token: documented to reach that sequence's output only
    n = layout.max_tokens
    bufs["v_window"][1, 0, (n - 1) % layout.window, 5] = math.nan
    bufs["k_window"][2, 1, (n - 2) % layout.window, 7] = math.nan  # a NaN key: NaN scores, NaN sum
    out = torch_rkv.decode_attention(q, *sides(bufs), torch.tensor([n, n, n]), scheme.format)
    assert torch.isnan(out[1, :2]).any() and torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1, 2:]).all()  # the other KV head's query heads are untouched
    assert torch.isnan(out[2, 2:]).all() and torch.isfinite(out[2, :2]).all()


def test_mixed_devices_are_named():
    scheme, layout, bufs = attention_case()
    meta_bufs = dict(bufs)
    meta_bufs["v_sink"] = bufs["v_sink"].to("meta")
    with pytest.raises(ValueError, match="v_sink is on meta but the input is on cpu"):
        torch.ops.rkv.decode_attention(torch.randn(3, 4, 32), *buffers_args(meta_bufs), torch.tensor([1, 1, 1]),
                                       4, 4, scheme.block, scheme.recent, None, None, False, None, None, 0.1, 0)
    with pytest.raises(ValueError, match="sink_logits is on meta but the input is on cpu"):
        torch.ops.rkv.decode_attention(torch.randn(3, 4, 32), *buffers_args(bufs), torch.tensor([1, 1, 1]), 4, 4,
                                       scheme.block, scheme.recent, None, None, False, None, None, 0.1, 0,
                                       sink_logits=torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="signs is on meta but the input is on cpu"):
        torch.ops.rkv.hadamard(torch.randn(2, 32), torch.ones(32, device="meta"), False)


def run_all_ops():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, 128, generator=gen)
    q = torch_rkv.quantize(x, 3, 1, 32)
    scheme, layout, bufs = attention_case()
    before = {n: t.clone() for n, t in bufs.items()}
    kn = torch.randn(3, 2, 5, 32, generator=gen)
    torch_rkv.ops.cache.cache_append(*sides(bufs), torch.tensor([3, 8, 0]), kn, kn.clone(), scheme.format)
    att = torch_rkv.decode_attention(torch.randn(3, 4, 32, generator=gen), *sides(bufs), torch.tensor([8, 13, 5]),
                                     scheme.format, split_tokens=3)
    for n in before:
        bufs[n] = bufs[n].clone()
    return [q.packed, q.scale, q.zero, q.dequantize(), att] + [bufs[n] for n in BUFFERS if n in bufs]


def test_outputs_are_bit_identical_across_runs_and_thread_counts():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_all_ops()
        torch.set_num_threads(max(2, threads))
        many, again = run_all_ops(), run_all_ops()
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(one, many, again):
        assert torch.equal(a, b) and torch.equal(b, c)
