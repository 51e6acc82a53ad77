"""Refined key channels in the cache kernels (reference.refine_codes / refined_rows; torch_rkv.channels): an
append writes the reference's bytes, codes, metadata and refinement codes alike, bit for bit; attention reads
them as the reference does; a refined channel comes back within scale / 2^(extra + 1); paged_copy copies
them; a bad buffer is refused by name, on every implementation."""

from __future__ import annotations

import pytest
import torch
from cachebuild import refined_buffers as contiguous_cache
from conftest import device_params
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref


def clone(bufs: dict, device) -> dict:
    return {k: v.clone().to(device) for k, v in bufs.items()}


CACHE = ["k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero", "k_window", "v_window", "k_sink", "v_sink"]


@st.composite
def refine_cases(draw):
    dim = draw(st.sampled_from([16, 32]))
    k_bits = draw(st.sampled_from([2, 3, 4]))
    extra = draw(st.sampled_from([2, 3, 4]))
    m = draw(st.sampled_from([c for c in (2, 4, 8, 16) if c <= dim and c * extra % 8 == 0]))
    block = draw(st.sampled_from([4, 8]))
    recent = draw(st.sampled_from([0, 3, 8]))
    sinks = draw(st.sampled_from([0, 1, 5]))
    chunks = draw(st.lists(st.integers(1, 3 * block), min_size=1, max_size=3))
    return dict(dim=dim, k_bits=k_bits, extra=extra, m=m, block=block, recent=recent, sinks=sinks, chunks=chunks,
                clip=draw(st.booleans()),
                meta=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])),
                seed=draw(st.integers(0, 2**16)))


def fill(case, device, specials: bool = False):
    """(kernel buffers, reference buffers, channels, keys appended) after the case's appends, both from the
    same random contents. specials: some keys NaN, +Inf and -Inf."""
    c = case
    gen = torch.Generator().manual_seed(c["seed"])
    cap = c["block"] * -(-sum(c["chunks"]) // c["block"]) + c["block"]
    bufs, channels = contiguous_cache(2, 2, cap, c["dim"], c["k_bits"], 4, c["block"], c["recent"], c["sinks"],
                                      c["m"], c["extra"], c["meta"], gen)
    got, want = clone(bufs, device), clone(bufs, "cpu")
    n, keys = 0, []
    for m in c["chunks"]:
        k_new = torch.randn(2, 2, m, c["dim"], generator=gen) * torch.linspace(0.2, 4.0, c["dim"])
        if specials:
            flat = k_new.view(-1)
            flat[::7], flat[3::11], flat[5::13] = float("nan"), float("inf"), float("-inf")
        v_new = torch.randn(2, 2, m, c["dim"], generator=gen)
        lengths = torch.full((2,), n, dtype=torch.int64)
        common = dict(k_bits=c["k_bits"], v_bits=4, block=c["block"], recent=c["recent"], k_clip=c["clip"],
                      v_clip=c["clip"])
        torch.ops.rkv.cache_append(**{k: got[k] for k in CACHE}, lengths=lengths.to(device), k_new=k_new.to(device),
                                   v_new=v_new.to(device), **common, k_refine=got["k_refine"],
                                   k_channels=channels.to(device))
        ref.cache_append(*[want[k] for k in CACHE], lengths, k_new, v_new, **common, k_refine=want["k_refine"],
                         k_channels=channels)
        n += m
        keys.append(k_new)
    return got, want, channels, torch.cat(keys, dim=2), n


def assert_same_bytes(got: dict, want: dict) -> None:
    """Every buffer byte for byte (NaN and float8 alike), the rows written and those left as they were."""
    for name in CACHE + ["k_refine"]:
        assert torch.equal(got[name].cpu().contiguous().view(torch.uint8), want[name].contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("device", device_params("cache_append"))
@given(case=refine_cases())
def test_the_append_writes_the_references_bytes(device, case):
    got, want, _, _, _ = fill(case, device)
    assert_same_bytes(got, want)


@pytest.mark.parametrize("device", device_params("cache_append"))
@pytest.mark.parametrize("bits, extra", [(2, 2), (3, 3), (4, 4)])
def test_nan_and_inf_keys_are_refined_as_the_reference_refines_them(device, bits, extra):
    """NaN encodes as 0 and +-Inf saturate, refinement codes too (they set no range): the same bytes."""
    case = dict(dim=32, k_bits=bits, extra=extra, m=8, block=8, recent=3, sinks=1, chunks=[20, 9], clip=True,
                meta=torch.float16, seed=11)
    got, want, _, _, _ = fill(case, device, specials=True)
    assert_same_bytes(got, want)


@pytest.mark.parametrize("device", device_params("decode_attention"))
@given(case=refine_cases(), rope=st.booleans())
def test_decode_reads_refined_channels_as_the_reference(device, case, rope):
    got, want, channels, _, n = fill(case, device)
    d = case["dim"]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(2, 4, d, generator=gen)
    cos, sin = torch_rkv.rope_tables(d, n + 4, theta=1e4) if rope else (None, None)
    lengths = torch.full((2,), n, dtype=torch.int64)
    args = dict(k_bits=case["k_bits"], v_bits=4, block=case["block"], recent=case["recent"], rope_cos=cos,
                rope_sin=sin, rope_interleaved=False, k_signs=None, v_signs=None)
    out = torch.ops.rkv.decode_attention(
        q.to(device), **{k: got[k] for k in CACHE}, lengths=lengths.to(device),
        **{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}, scale=d ** -0.5,
        split_tokens=0, k_refine=got["k_refine"], k_channels=channels.to(device)).cpu()
    expect = ref.decode_attention(q, *[want[k] for k in CACHE], lengths, **args, k_refine=want["k_refine"],
                                  k_channels=channels)
    plain = ref.decode_attention(q, *[want[k] for k in CACHE], lengths, **args)
    tol = 1e-4 * expect.abs().max().item() + 1e-6
    assert (out - expect).abs().max().item() <= tol
    if ref.quantized_count(n, case["recent"], case["block"]) > case["sinks"]:
        assert (out - plain).abs().max().item() > tol  # the refinement is read, not left out


@pytest.mark.parametrize("device", device_params("paged_prefill_attention"))
@given(case=refine_cases())
def test_prefill_reads_refined_channels_as_the_reference(device, case):
    """A chunk of new tokens per sequence over the contiguous buffers (page b / slot b of the paged op)."""
    got, want, channels, _, n = fill(case, device)
    d = case["dim"]
    gen = torch.Generator().manual_seed(case["seed"] + 2)
    qsl = torch.tensor([0, 3, 5])
    q, k_new, v_new = (torch.randn(5, h, d, generator=gen) for h in (4, 2, 2))
    cos, sin = torch_rkv.rope_tables(d, n + 8, theta=1e4)
    lengths = torch.full((2,), n, dtype=torch.int64)
    args = dict(block_tables=None, side_slots=None, k_bits=case["k_bits"], v_bits=4, block=case["block"],
                recent=case["recent"], rope_cos=cos, rope_sin=sin, rope_interleaved=False, k_signs=None, v_signs=None)
    names = dict(zip(CACHE, ["k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_window", "v_window",
                             "k_sink", "v_sink"]))
    dev = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    out = torch.ops.rkv.paged_prefill_attention(
        dev(q), dev(k_new), dev(v_new), dev(qsl), 3, **{names[k]: got[k] for k in CACHE}, lengths=dev(lengths),
        **{k: dev(v) for k, v in args.items()}, scale=d ** -0.5, split_tokens=0, k_refine=got["k_refine"],
        k_channels=dev(channels)).cpu()
    expect = ref.paged_prefill_attention(q, k_new, v_new, qsl, *[want[k] for k in CACHE], lengths=lengths, **args,
                                         k_refine=want["k_refine"], k_channels=channels)
    assert (out - expect).abs().max().item() <= 1e-4 * expect.abs().max().item() + 1e-6


def test_a_refined_channel_is_within_its_finer_step():
    """Through the CPU kernels: every quantized key of a refined channel read back (decode_attention with a
    one-hot query per channel would be indirect; the reference's read of the kernel's bytes is the
    spec of the read, so the bound is checked on it) within scale / 2^(extra + 1) of the value; a plain
    channel only within scale / 2."""
    case = dict(dim=32, k_bits=2, extra=2, m=8, block=8, recent=0, sinks=0, chunks=[64], clip=True,
                meta=torch.float32, seed=5)
    got, _, channels, keys, n = fill(case, "cpu")
    rows = torch.arange(n)
    for b in range(2):
        back = ref.read_rows(got["k_packed"][b : b + 1], got["k_scale"][b : b + 1], got["k_zero"][b : b + 1], 2,
                             torch.zeros(n, dtype=torch.long), rows, refine=(got["k_refine"][b : b + 1], channels))
        scale = got["k_scale"][b].repeat_interleave(8, dim=1)[:, :n]  # (H, n, D)
        err = (back - keys[b]).abs()
        refined = torch.zeros(2, 1, 32, dtype=torch.bool).scatter_(-1, channels.long()[:, None], True).expand_as(err)
        assert (err[refined] <= scale[refined] / 8 * (1 + 1e-5)).all()
        assert err[refined].max() > scale[refined].max() / 64  # not exact: the bound is met, not dodged
        assert (err[~refined] > scale[~refined] / 8).any()  # plain channels get the coarse step


@pytest.mark.parametrize("device", device_params("paged_copy"))
def test_paged_copy_copies_the_refinement_codes(device):
    gen = torch.Generator().manual_seed(1)
    bufs, _ = contiguous_cache(4, 2, 8, 16, 2, 4, 4, 0, 1, 4, 2, torch.float16, gen)
    names = ["k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_window", "v_window", "k_sink", "v_sink"]
    t = {n2: bufs[n1].to(device) for n1, n2 in zip(CACHE, names)}
    refine = bufs["k_refine"].to(device)
    before = refine.cpu().clone()
    ids = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    torch.ops.rkv.paged_copy(**t, page_fill=None, src_pages=ids(0, 2), dst_pages=ids(3, 1), src_slots=ids(0),
                             dst_slots=ids(1), k_refine=refine)
    want = before.clone()
    want[[3, 1]] = before[[0, 2]]
    assert torch.equal(refine.cpu(), want)


def _bad_calls(bufs, channels):
    """(keywords to swap into a cache_append call, the message it must raise)."""
    r, c = bufs["k_refine"], channels
    return [
        (dict(k_channels=None), "k_refine and k_channels come together"),
        (dict(k_channels=c.long()), "k_channels must be int32"),
        (dict(k_refine=r.view(torch.int8)), "k_refine must be uint8"),
        (dict(k_channels=c[:1]), "k_channels must have shape"),
        (dict(k_refine=torch.cat([r, r, r], dim=-1)), "k_refine must have shape"),  # 6 bits a channel
        (dict(k_refine=r[:, :, :-1]), "k_refine must have shape"),
        (dict(k_refine=r.transpose(1, 2).contiguous().transpose(1, 2)), "k_refine must be contiguous within each page"),
        (dict(k_zero=None, k_clip=False), "k_refine refines per-channel key codes"),
        (dict(k_channels=torch.cat([c[:, :1], c[:, :1], c[:, 2:]], dim=1)), r"k_channels\[0\] must name distinct"),
        (dict(k_channels=torch.full_like(c, 99)), r"k_channels\[0\] must name distinct"),
    ]


@pytest.mark.parametrize("device", device_params("cache_append"))
@pytest.mark.parametrize("mode", ["kernel", "fake"])
def test_bad_refinement_buffers_name_the_argument(device, mode):
    gen = torch.Generator().manual_seed(2)
    bufs, channels = contiguous_cache(1, 2, 8, 16, 2, 4, 4, 0, 1, 4, 2, torch.float16, gen)
    k_new = torch.randn(1, 2, 8, 16, generator=gen)
    for swap, message in _bad_calls(bufs, channels):
        if mode == "fake" and "distinct" in message:
            continue  # data: the kernels check the channels' values
        call = dict(**{k: bufs[k] for k in CACHE}, lengths=torch.zeros(1, dtype=torch.int64), k_new=k_new,
                    v_new=k_new.clone(), k_bits=2, v_bits=4, block=4, recent=0, k_clip=True, k_refine=bufs["k_refine"],
                    k_channels=channels)
        call.update(swap)
        before = {k: v.clone() for k, v in bufs.items()}
        with pytest.raises((ValueError, TypeError), match=message):
            if mode == "fake":
                from torch._subclasses.fake_tensor import FakeTensorMode
                with FakeTensorMode(allow_non_fake_inputs=True):
                    torch.ops.rkv.cache_append(**call)
            else:
                torch.ops.rkv.cache_append(**call)
        assert all(torch.equal(bufs[k], before[k]) for k in bufs), swap  # a refused call writes nothing


@pytest.mark.parametrize("channels, ok", [([[0, 3], [5, 1]], True), ([[2, 2], [0, 1]], False), ([[0, 16], [1, 2]], False),
                                          ([[-1, 3], [1, 2]], False)])
def test_on_a_gpu_the_channels_are_a_device_assert(monkeypatch, channels, ok):
    """The Triton launchers' check of k_channels' values on CUDA tensors (no host read: torch._assert_async),
    run here by taking CPU tensors for device ones."""
    from torch_rkv.gpu import checks

    monkeypatch.setattr(checks, "on_host", lambda t: False)
    ch = torch.tensor(channels, dtype=torch.int32)
    if ok:
        checks.refine_channels("decode_attention", ch, 16)
    else:
        with pytest.raises(RuntimeError, match=r"rkv.decode_attention: k_channels must name distinct channels in \[0, "
                                               r"head_dim=16\)"):
            checks.refine_channels("decode_attention", ch, 16)
