"""Dense-and-sparse outliers: the greedy selection (reference.select_outliers) takes the planted outliers,
never a sink, at most its count; the cache kernels store them (their entries equal the reference's,
byte for byte, in tests/test_cache.py and test_attention.py) and read them back within fp16 of the
values; the dense part gets a finer grid; the bytes are counted; the simulation reads what the cache
holds; vLLM's pages hold them too."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import outliers
from torch_rkv import reference as ref
from torch_rkv import scheme as S
from torch_rkv.cache import QuantizedKVCache, layer_outliers
from torch_rkv.eval.simulate import Simulation
from torch_rkv.integrations.vllm_pool import content_bytes
from torch_rkv.layout import CacheLayout, PageLayout
from torch_rkv.ops.structs import CacheFormat, split_sides
from torch_rkv.paged import PagedQuantizedKVCache

from conftest import device_params


def planted(seed=0, n=256, d=64):
    x = torch.randn(1, 2, n, d, generator=torch.Generator().manual_seed(seed))
    spots = [(0, 5, 3), (0, 130, 60), (1, 77, 10), (1, 200, 0)]
    for h, t, c in spots:
        x[0, h, t, c] = 40.0
    return x, spots


def test_the_selection_takes_the_planted_outliers_within_its_count():
    x, spots = planted()
    k = outliers.outlier_count(0.01, 128, 64)
    mask = outliers.select(x, 0.01, 128, 1, 128)  # per-channel groups of 128 tokens
    assert k == 82
    per_block = mask.reshape(1, 2, 2, -1).sum(-1)
    assert (per_block <= k).all() and (per_block > 0).all()
    for h, t, c in spots:
        assert mask[0, h, t, c]


def test_the_greedy_order_is_largest_gain_first():
    """One group with a far spike, one with a near one: a count of 1 takes the far one; equal spikes in
    two groups go to the lower group."""
    x = torch.zeros(1, 4, 2)
    x[0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 10.0])  # group 0 (channel 0): a spike of 8 over the rest
    x[0, :, 1] = torch.tensor([0.0, 1.0, 2.0, 5.0])   # group 1: a spike of 3
    m = ref.select_outliers(x, 1, 4, 1)
    assert m.nonzero().tolist() == [[0, 3, 0]]
    x[0, :, 1] = x[0, :, 0]
    assert ref.select_outliers(x, 1, 4, 1).nonzero().tolist() == [[0, 3, 0]]
    # a group with one candidate left is never emptied: gain 0
    assert not ref.select_outliers(torch.tensor([[[7.0]]]), 3, 1, 1).any()


def greedy(x, count, tile_rows, group, sink_rows):
    """The selection's definition, one value at a time in numpy float32: per group its candidates'
    largest and smallest (the lowest position of equals) and the runners-up; take the best gain."""
    h, n, d = x.shape
    mask = np.zeros((h, n, d), dtype=bool)
    f32 = np.float32
    for i in range(h):
        groups = [[(t, c) for t in range(t0, t0 + tile_rows) for c in range(c0, c0 + group)]
                  for t0 in range(0, n, tile_rows) for c0 in range(0, d, group)]
        for _ in range(count):
            best, pick = f32(0), None
            for members in groups:
                alive = [(t, c) for t, c in members
                         if t >= sink_rows and np.isfinite(x[i, t, c]) and not mask[i, t, c]]
                if len(alive) < 2:
                    continue
                vals = [f32(x[i, t, c]) for t, c in alive]
                hi, lo = max(vals), min(vals)
                top = min(k for k, v in enumerate(vals) if v == hi)
                bottom = min(k for k, v in enumerate(vals) if v == lo)
                hi2 = max(v for k, v in enumerate(vals) if k != top)
                lo2 = min(v for k, v in enumerate(vals) if k != bottom)
                with np.errstate(invalid="ignore", over="ignore"):  # float32 as the kernels compute it
                    r = hi - lo
                    for at, r2 in ((top, hi2 - lo), (bottom, hi - lo2)):
                        gain = (r - r2) * (r + r2)
                        if gain > best:
                            best, pick = gain, alive[at]
            if pick is None:
                break
            mask[i, pick[0], pick[1]] = True
    return torch.from_numpy(mask)


@given(st.data())
def test_the_selection_is_the_step_by_step_greedy(data):
    """reference.select_outliers (each group sorted once, then read at its two ends) takes what taking
    one best value at a time takes, on inputs full of ties, infinities, NaN and signed zeros."""
    tile_rows, group = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 2, 3]))
    n = tile_rows * data.draw(st.integers(1, 3))
    d = group * data.draw(st.integers(1, 3))
    h = data.draw(st.integers(1, 2))
    pool = st.sampled_from([-2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, float("inf"), -float("inf"), float("nan"),
                            0.1, 1.7, 1.5e19, -2e19, 3e38, -3e38])
    x = torch.tensor(data.draw(st.lists(pool, min_size=h * n * d, max_size=h * n * d))).reshape(h, n, d)
    count = data.draw(st.integers(0, n * d))
    sinks = data.draw(st.integers(0, n))
    assert torch.equal(ref.select_outliers(x, count, tile_rows, group, sinks),
                       greedy(x.numpy(), count, tile_rows, group, sinks))


@pytest.mark.parametrize("column", [[1.0, 2.0, 2.0, 3.0], [2.0, 3.0, 3.0, 1.0], [5.0, 5.0, 1.0, 5.0],
                                    [0.0, -0.0, 0.0, 1.0], [float("inf"), 1.0, 2.0, float("nan")], [4.0, 4.0, 4.0, 4.0]])
def test_the_selection_on_pinned_ties(column):
    """Equal values at a group's ends (where a sorted-ends reading could take a different copy): one
    per-channel group of 4 tokens, and the same column again as a second group, every count."""
    x = torch.tensor(column).reshape(1, 4, 1).repeat(1, 1, 2)
    for count in range(6):
        assert torch.equal(ref.select_outliers(x, count, 4, 1), greedy(x.numpy(), count, 4, 1, 0)), count


def test_sinks_are_never_chosen():
    x, _ = planted()
    x[0, :, 1, :] = 100.0  # sink row 1: the most outlying of all
    mask = outliers.select(x, 0.01, 128, 64, 1, skip_rows=4)  # per-token groups
    assert not mask[:, :, :4].any() and mask[:, :, 4:].any()


def test_the_dense_part_gets_a_finer_grid():
    """Per-channel 2-bit keys with one planted spike per channel: keeping the spikes aside shrinks every
    other value's error, by far more than the spike costs in bits."""
    x = torch.randn(1, 1, 128, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0, 17] += 30.0  # one token spikes in every channel
    base = S.Scheme(name="k2", k_bits=2, v_bits=2, k_group_size=1, k_block_tokens=128)
    plain = Simulation(base, view="all").round_trip(x, "k", base)
    sparse_scheme = base.replace(outliers=64 / (128 * 64))
    sparse = Simulation(sparse_scheme, view="all").round_trip(x, "k", sparse_scheme)
    rest = torch.ones(128, dtype=torch.bool)
    rest[17] = False
    err = lambda y: (y - x)[0, 0, rest].pow(2).mean().item()
    assert err(sparse) < err(plain) / 20
    assert (sparse[0, 0, 17] - x[0, 0, 17]).abs().max() <= 2e-2  # the residual's fp16 rounding
    assert sparse_scheme.effective_bits(64) == base.effective_bits(64) + 64 * 32 / (128 * 64)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_cache_reads_planted_outliers_back_and_the_simulation_agrees(device):
    """Through the kernels: planted spikes come back within their fp16 residual's rounding, every other
    quantized value within half its dense step, and the cache holds exactly what the simulation (the
    reference selection and quantizer) computes."""
    s = S.recommended(2).replace(outliers=0.01)
    h, d, n = 2, 64, 384
    x, spots = planted(n=n, d=d)
    v = torch.randn(1, h, n, d, generator=torch.Generator().manual_seed(2))
    cos, sin = torch_rkv.rope_tables(d, n + 8, theta=1e4)
    keys = torch_rkv.rope(x, cos, sin, torch.arange(n))  # post-RoPE: the cache stores them pre-RoPE again
    cache = QuantizedKVCache(s, 1, 1, h, d, n, torch.float32, device=device, rope=(cos, sin))
    cache.append(0, keys.to(device), v.to(device))
    kd, vd = (t.cpu() for t in cache.dequantized(0))
    q = ref.quantized_count(n, s.recent, s.block)
    stored = torch_rkv.rope(kd, cos, sin, torch.arange(n), inverse=True)  # the pre-RoPE space they were kept in
    for hh, t, c in spots:
        assert s.sinks <= t < q
        assert abs(stored[0, hh, t, c] - 40.0) < 0.05, (hh, t, c)
    sim = Simulation(s, rope_cos=cos, rope_sin=sin)
    want_k, want_v = sim.fake_quantize(keys, "k", None), sim.fake_quantize(v, "v", None)
    assert (kd[:, :, s.sinks : q] - want_k[:, :, s.sinks : q]).abs().max() <= 1e-4
    assert (vd[:, :, s.sinks : q] - want_v[:, :, s.sinks : q]).abs().max() <= 1e-5
    plain = QuantizedKVCache(S.recommended(2), 1, 1, h, d, n, torch.float32, rope=(cos, sin))
    plain.append(0, keys, v)
    pk, pv = plain.dequantized(0)
    err = lambda a, b: (a - b)[:, :, s.sinks : q].pow(2).mean().item()
    assert err(kd, keys) < err(pk, keys) and err(vd, v) < err(pv, v)


def test_the_simulation_chooses_as_the_append_with_sinks_past_the_first_block():
    """Sinks spanning two blocks (12 sinks, blocks of 8): each block's sink rows are left out in the
    simulation as in the kernels' append, so the cache holds what the simulation computes."""
    s = S.recommended(2).replace(k_block_tokens=8, recent=8, sinks=12, outliers=0.05)
    h, d, n = 2, 32, 64
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)
    cos, sin = torch_rkv.rope_tables(d, n + 8, theta=1e4)
    cache = QuantizedKVCache(s, 1, 1, h, d, n, torch.float32, rope=(cos, sin))
    cache.append(0, k, v)
    kd, vd = cache.dequantized(0)
    sim = Simulation(s, rope_cos=cos, rope_sin=sin)
    q = ref.quantized_count(n, s.recent, s.block)
    assert (kd[:, :, s.sinks : q] - sim.fake_quantize(k, "k", None)[:, :, s.sinks : q]).abs().max() <= 1e-4
    assert (vd[:, :, s.sinks : q] - sim.fake_quantize(v, "v", None)[:, :, s.sinks : q]).abs().max() <= 1e-5


def test_bytes_are_counted_by_the_layouts_and_the_vllm_pages():
    s, base = S.recommended(2).replace(outliers=0.01), S.recommended(2)
    lay, plain = CacheLayout(s, 1, 3, 64, 1024), CacheLayout(base, 1, 3, 64, 1024)
    k = outliers.outlier_count(0.01, s.block, 64)
    assert lay.nbytes() - plain.nbytes() == 2 * 3 * (1024 // s.block) * k * 4
    extra = PageLayout(s, 3, 64, 128).payload_bytes - PageLayout(base, 3, 64, 128).payload_bytes
    assert extra == 2 * 3 * k * 4  # one block per page: a row of K entries per side and head
    assert content_bytes(s, 3, 64, torch.float16) * 128 >= PageLayout(s, 3, 64, 128).page_bytes
    s.check_served()  # the caches and the vLLM plugin store them
    with pytest.raises(ValueError, match="outliers"):
        S.recommended(2).replace(outliers=0.5)
    assert "1.0% outliers in fp16" in s.describe(64)


@pytest.mark.parametrize("mode", ["kernel", "fake"])
def test_buffers_not_contiguous_within_a_page_are_refused_when_traced_too(mode):
    """The kernels address a page's rows by offsets; the fake kernels refuse what the C++ checks refuse, with
    the same message, so a traced call fails as eager mode would."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    s = S.recommended(2).replace(outliers=0.01)
    bufs = CacheLayout(s, 1, 2, 64, 256).allocate()
    names = ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero", "k_window", "v_window", "k_sink", "v_sink")
    k = torch.randn(1, 2, 4, 64).half()
    fmt = CacheFormat(2, 2, s.block, s.recent)

    def strided(t):  # the same shape, heads innermost: not contiguous within a page
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def call(**swap):
        b = {**bufs, **swap}

        def append():
            sides = split_sides([b[n] for n in names], outliers=(b["k_outliers"], b["v_outliers"]))
            torch_rkv.ops.cache.cache_append(*sides, torch.tensor([0]), k, k, fmt)

        if mode == "fake":
            with FakeTensorMode(allow_non_fake_inputs=True):
                return append()
        return append()

    call()  # the layout's own buffers pass
    with pytest.raises(ValueError, match="rkv.cache_append: v_outliers must be contiguous within each page"):
        call(v_outliers=strided(bufs["v_outliers"]))
    with pytest.raises(ValueError, match="rkv.cache_append: k_packed and k_scale must be contiguous within each page"):
        call(k_packed=strided(bufs["k_packed"]))
    with pytest.raises(ValueError, match="rkv.cache_append: v_zero must be laid out as v_scale"):
        call(v_zero=strided(bufs["v_zero"]))


def test_bad_outlier_buffers_name_the_argument():
    s = S.recommended(2).replace(outliers=0.01)
    lay = CacheLayout(s, 1, 2, 64, 256)
    bufs = lay.allocate()
    args = [bufs.get(n) for n in ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero", "k_window",
                                  "v_window", "k_sink", "v_sink")]
    k = torch.randn(1, 2, 4, 64).half()

    def call(k_outliers=None, v_outliers=None):
        torch_rkv.ops.cache.cache_append(*split_sides(args, outliers=(k_outliers, v_outliers)), torch.tensor([0]), k,
                                         k, CacheFormat(2, 2, s.block, s.recent))

    with pytest.raises(TypeError, match="rkv.cache_append: k_outliers must be int32"):
        call(k_outliers=bufs["k_outliers"].float())
    with pytest.raises(ValueError, match=r"rkv.cache_append: v_outliers must have shape \(1, 2, 2, outliers"):
        call(v_outliers=bufs["v_outliers"][:, :, :1])
    big = S.recommended(2).replace(k_block_tokens=1024)
    with pytest.raises(ValueError, match="block x head_dim must be <= 65535"):  # the scheme refuses it first
        CacheLayout(big.replace(outliers=0.01), 1, 1, 128, 1024)
    b = CacheLayout(big, 1, 1, 128, 1024).allocate()  # and the op, for an outlier buffer made by hand
    with pytest.raises(ValueError, match="block x head_dim must be <= 65535"):
        sides = split_sides([b.get(n) for n in ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero",
                                                "k_window", "v_window", "k_sink", "v_sink")],
                            outliers=(torch.zeros(1, 1, 1, 8, dtype=torch.int32), None))
        torch_rkv.ops.cache.cache_append(*sides, torch.tensor([0]), torch.randn(1, 1, 4, 128).half(),
                                         torch.randn(1, 1, 4, 128).half(), CacheFormat(2, 2, 1024, big.recent))


def test_outlier_positions_bound_block_times_head_dim_when_the_scheme_is_checked():
    """Outlier positions are 16 bits (include/rkv/outliers.h): a block of 128 tokens at head_dim 512 (Gemma 4's
    global layers) has 65536 of them. The scheme refuses it by name before any cache is built; 256 fits."""
    s = S.by_name("rkv-sparse-3")
    assert s.outliers and s.block == 128
    s.check_head_dim(256)
    with pytest.raises(ValueError, match="block x head_dim must be <= 65535"):
        s.check_head_dim(512)
    S.recommended(3).check_head_dim(512)  # (no outliers: no such bound)


@pytest.mark.parametrize("device", device_params("paged_decode_attention"))
def test_attention_adds_each_blocks_outliers_where_the_reference_does(device):
    """Decode and prefill over pages whose blocks hold planted outliers, against reference.py's attention
    over the same buffers: an outlier's residual added at another row or channel (or not at all) moves
    the spiked keys' scores far beyond the float tolerance."""
    s = S.recommended_sparse(2, 0.02).replace(k_block_tokens=16, recent=8)
    h, hq, d = 2, 8, 64
    cos, sin = torch_rkv.rope_tables(d, 256, theta=1e4)
    cache = PagedQuantizedKVCache(s, 1, h, d, 16, 2, page_size=32, dtype=torch.float32, rope=(cos, sin),
                                  max_pages_per_seq=4, device=device)
    gen = torch.Generator().manual_seed(3)
    seqs = [cache.add(), cache.add()]
    counts = [70, 41]
    k = torch.randn(sum(counts), h, d, generator=gen)
    k[::7, :, 5] += 30.0  # spikes in several rows of every block: the selection takes them
    v = torch.randn(sum(counts), h, d, generator=gen)
    v[3::11, 1, 9] -= 25.0
    batch = cache.schedule(seqs, counts)
    cache.append(0, batch, k.to(device), v.to(device))
    cache.commit(batch)
    ko, vo = (t.cpu() for t in layer_outliers(cache, 0))
    assert (ko != ref.OUTLIER_EMPTY).any() and (vo != ref.OUTLIER_EMPTY).any()
    tensors = [None if t is None else t.cpu() for t in cache.layer_tensors(0)]
    step = cache.schedule(seqs, [0, 0])
    q = torch.randn(2, hq, d, generator=gen)
    signs = [None if t is None else t.cpu() for t in (cache.k_signs, cache.v_signs)]  # (values: Hadamard-rotated)
    args = (step.block_tables.cpu(), step.side_slots.cpu(), step.lengths_after.cpu(), s.k_bits, s.v_bits, s.block,
            s.recent, cos, sin, False, *signs)
    want = ref.paged_decode_attention(q, *tensors, *args, k_outliers=ko, v_outliers=vo)
    got = cache.attend(0, step, q.to(device)).cpu()
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    chunk = cache.schedule(seqs, [5, 3])
    qc, kc, vc = (torch.randn(8, n, d, generator=gen) for n in (hq, h, h))
    ks, vs = (t.cpu() for t in cache.to_storage(chunk, kc.to(device), vc.to(device)))
    want = ref.paged_prefill_attention(qc, ks, vs, chunk.query_start_loc.cpu(), *tensors, chunk.block_tables.cpu(),
                                       chunk.side_slots.cpu(), chunk.lengths.cpu(), s.k_bits, s.v_bits, s.block,
                                       s.recent, cos, sin, False, *signs, k_outliers=ko, v_outliers=vo)
    got = cache.prefill(0, chunk, qc.to(device), kc.to(device), vc.to(device)).cpu()
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
