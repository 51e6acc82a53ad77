"""rkv::cache_append and QuantizedKVCache: reference equivalence, chunking invariance, canaries,
compile, errors, exact memory."""

import re

import pytest
import torch
from cachebuild import BUFFERS, attention_fp32, buffers_args, meta_dtypes, outliers_args, quantization_bound, sides
from conftest import device_params
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref
from torch_rkv import scheme as presets
from torch_rkv.cache import QuantizedKVCache
from torch_rkv.layout import CacheLayout
from torch_rkv.ops.structs import AttentionOptions, CacheFormat, split_sides
from torch_rkv.scheme import Scheme

DEVICES = device_params("cache_append")


@st.composite
def append_cases(draw):
    block = draw(st.sampled_from([1, 4, 8]))
    k_kind = draw(st.sampled_from(["token", "channel", "grouped"]))
    k_group, k_tokens = {"token": (None, 1), "channel": (1, block), "grouped": (16, 1)}[k_kind]
    scheme = Scheme(
        k_bits=draw(st.sampled_from([2, 3, 4, 8])), v_bits=draw(st.sampled_from([2, 3, 4, 8])),
        k_group_size=k_group, k_block_tokens=k_tokens, v_group_size=draw(st.sampled_from([None, 16])),
        v_block_tokens=1 if k_kind != "token" else draw(st.sampled_from([1, block])),
        k_symmetric=draw(st.booleans()), v_symmetric=draw(st.booleans()),
        sinks=draw(st.sampled_from([0, 2])), recent=draw(st.sampled_from([0, 3, 8])),
        **meta_dtypes(draw),
        outliers=draw(st.sampled_from([0.0, 0.0, 0.05])),  # sparse outliers: each block's entries too
    )
    scheme = scheme.replace(k_clip=not scheme.k_symmetric and draw(st.booleans()),
                            v_clip=not scheme.v_symmetric and draw(st.booleans()))
    chunks = draw(st.lists(st.integers(0, 13), min_size=1, max_size=6))
    return dict(scheme=scheme, chunks=chunks, dtype=draw(st.sampled_from([torch.float32, torch.float16])),
                batch=draw(st.integers(1, 2)), heads=draw(st.integers(1, 2)), dim=32,
                offsets=draw(st.lists(st.integers(0, 5), min_size=2, max_size=2)), seed=draw(st.integers(0, 2**16)),
                window=draw(st.sampled_from([0, 0, 1, 6, 13])))  # > 0: the packed rows are a ring


def random_tokens(case, n, gen):
    return torch.randn(case["batch"], case["heads"], n, case["dim"], generator=gen).to(case["dtype"])


@pytest.mark.parametrize("device", DEVICES)
@given(case=append_cases())
def test_append_matches_reference_and_writes_nothing_else(device, case):
    """Every buffer (canary-filled, so untouched bytes are visible) equals reference.cache_append's."""
    s, w = case["scheme"], case["window"]
    total = sum(case["chunks"]) + max(case["offsets"])
    layout = CacheLayout(s, case["batch"], case["heads"], case["dim"], total, case["dtype"], w)
    step = layout.packed_capacity - s.block + 1  # the most a ring takes per append
    chunks = [min(m, step) for m in case["chunks"]] if w else case["chunks"]
    gen = torch.Generator().manual_seed(case["seed"])
    bufs = {}
    for name, (shape, dt) in layout.shapes().items():  # canaries: random bytes everywhere
        bufs[name] = torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)
        if dt != torch.uint8:
            bufs[name] = torch.randn(shape, generator=gen).to(dt)
    want = {k: v.clone() for k, v in bufs.items()}
    got = {k: v.clone().to(device) for k, v in bufs.items()}
    lengths = torch.tensor(case["offsets"][: case["batch"]])  # sequences start at different lengths
    for m in chunks:
        k, v = random_tokens(case, m, gen), random_tokens(case, m, gen)
        ref.cache_append(*buffers_args(want), lengths, k, v, s.k_bits, s.v_bits, s.block, s.recent, s.k_clip, s.v_clip,
                         w, **outliers_args(want))
        torch_rkv.ops.cache.cache_append(*sides(got), lengths.to(device), k.to(device), v.to(device), s.format,
                                         sliding_window=w)
        lengths = lengths + m
    for name in want:
        assert torch.equal(got[name].cpu(), want[name]), name


def live_tokens(cache, layer):
    """(keys, values) of every cached token, read back through the layout (post-RoPE, original space)."""
    return cache.dequantized(layer)


SCHEMES = [presets.per_token(4), presets.kivi(2, recent=8), presets.kvquant(3, block=16), presets.quarot(4),
           presets.recommended(4), presets.recommended(2).replace(k_block_tokens=16, recent=8, v_clip=True),
           Scheme(name="tiny-sink", k_bits=8, v_bits=3, k_group_size=1, k_block_tokens=8, pre_rope=True, sinks=3,
                  recent=5, v_hadamard=True)]


def make_cache(scheme, capacity=100, layers=2, batch=2, device="cpu", dtype=torch.float32, window=0):
    cos, sin = torch_rkv.rope_tables(32, capacity + 1024, theta=1e4)
    return QuantizedKVCache(scheme, layers, batch, 2, 32, capacity, dtype=dtype, device=device, rope=(cos, sin),
                            sliding_window=window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("chunking", ["tokens", "chunks"])
def test_chunked_appends_equal_one_prefill(device, scheme, chunking):
    gen = torch.Generator().manual_seed(0)
    n = 75  # crosses several block boundaries and leaves a partial block in the window
    k = torch.randn(2, 2, n, 32, generator=gen).to(device)
    v = torch.randn(2, 2, n, 32, generator=gen).to(device)
    one, many = make_cache(scheme, device=device), make_cache(scheme, device=device)
    one.append(1, k, v)
    sizes = [1] * n if chunking == "tokens" else [7, 1, 16, 20, 31]
    start = 0
    for m in sizes:
        many.append(1, k[:, :, start : start + m], v[:, :, start : start + m])
        start += m
    assert torch.equal(one.lengths, many.lengths) and one.seq_length(1) == n
    ko, vo = live_tokens(one, 1)
    km, vm = live_tokens(many, 1)
    assert torch.equal(ko, km) and torch.equal(vo, vm)
    q = torch.randn(2, 4, 32, generator=gen).to(device)
    assert torch.equal(one.attend(1, q), many.attend(1, q))
    if scheme.k_clip or scheme.v_clip:
        return  # the half-step bound below is min/max quantization's; a clipped range saturates by design
    # and the cache holds these tokens: plain attention is within the bound of the stored steps
    plain = attention_fp32(q.cpu(), k.cpu(), v.cpu(), [n, n])
    bufs = {name: t.cpu() for name, t in zip(BUFFERS, one.layer_buffers(1)) if t is not None}
    bound = quantization_bound(q.cpu(), bufs, v.cpu(), v_rotated=scheme.v_hadamard)
    assert (one.attend(1, q).cpu() - plain).abs().max().item() <= bound


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_dequantized_cache_equals_stored_tokens_within_a_step(scheme):
    cache = make_cache(scheme.replace(k_bits=8, v_bits=8, k_clip=False, v_clip=False), capacity=60)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(2, 2, 60, 32, generator=gen)
    v = torch.randn(2, 2, 60, 32, generator=gen)
    cache.append(0, k, v)
    kd, vd = cache.dequantized(0)
    assert kd.shape == k.shape
    # 8 bits: each element within half a step (range of a group of normals / 255 / 2 < 0.02), plus the
    # float rounding of the RoPE / Hadamard round trip
    assert (kd - k).abs().max() < 0.03 and (vd - v).abs().max() < 0.03


@pytest.mark.parametrize("device", DEVICES)
def test_nbytes_is_exact(device):
    for scheme in SCHEMES:
        cache = make_cache(scheme, device=device)
        actual = sum(t.numel() * t.element_size() for name, t in cache.named_buffers()
                     if name.split(".")[-1] in BUFFERS)
        assert cache.nbytes() == actual


class TinyAttention(torch.nn.Module):
    """One attention layer's decode step against the quantized cache: project, rotate, append, attend."""

    def __init__(self, cache, layer, d_model=64, heads=4):
        super().__init__()
        self.cache, self.layer, self.heads = cache, layer, heads
        self.qkv = torch.nn.Linear(d_model, (heads + 2 * cache.layout.kv_heads) * 32, bias=False)
        cos, sin = torch_rkv.rope_tables(32, 1024, theta=1e4)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x):  # x (B, d_model): the new token
        b, hkv = x.shape[0], self.cache.layout.kv_heads
        qkv = self.qkv(x).view(b, self.heads + 2 * hkv, 32)
        q, k, v = qkv[:, : self.heads], qkv[:, self.heads : self.heads + hkv], qkv[:, self.heads + hkv :]
        pos = self.cache.lengths[self.layer]  # (B,) the new token's position
        q = torch_rkv.rope(q, self.cos, self.sin, pos[:, None])
        k = torch_rkv.rope(k, self.cos, self.sin, pos[:, None])
        self.cache.append(self.layer, k[:, :, None], v[:, :, None])
        return self.cache.attend(self.layer, q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", [presets.kivi(4, block=8, recent=4), presets.recommended(4).replace(k_block_tokens=8)],
                         ids=lambda s: s.name)
def test_compiled_decode_step_matches_eager_without_recompiling(device, scheme):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager_cache, compiled_cache = make_cache(scheme, device=device), make_cache(scheme, device=device)
    eager = TinyAttention(eager_cache, 1).to(device)
    compiled_block = TinyAttention(compiled_cache, 1).to(device)
    compiled_block.load_state_dict(eager.state_dict())
    step = torch.compile(compiled_block, fullgraph=True)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # an inference step: the ops have no autograd formula
        for i in range(20):  # crosses block boundaries of the per-channel keys
            x = torch.randn(2, 64, device=device)
            assert torch.allclose(step(x), eager(x), atol=1e-5, rtol=1e-5), i
    assert torch.equal(eager_cache.lengths, compiled_cache.lengths)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the sequence grew by 20 tokens: one graph
    # the lengths compiled steps wrote are the ones every eager method reads
    assert compiled_cache.seq_length(1) == eager_cache.seq_length(1) == 20 and compiled_cache.seq_length(0) == 0
    for got, want in zip(compiled_cache.dequantized(1), eager_cache.dequantized(1)):
        assert got.shape == want.shape == (2, 2, 20, 32) and torch.allclose(got, want, atol=1e-3)


def test_capacity_is_enforced_by_compiled_steps():
    """The capacity guard is a device-side check in the traced code: compiled steps stop at the capacity
    with the cache's error, with no host copy of the lengths to fall out of date."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cache = make_cache(presets.kivi(4, block=8, recent=4), capacity=22)  # rows round up to 3 blocks of 8
    assert cache.capacity == 24
    step = torch.compile(TinyAttention(cache, 0), fullgraph=True)
    with torch.no_grad():
        for _ in range(24):
            step(torch.randn(2, 64))
        assert cache.seq_length(0) == 24
        with pytest.raises(RuntimeError, match="appending 1 tokens to layer 0 exceeds the capacity of 24 tokens"):
            step(torch.randn(2, 64))
    assert cache.seq_length(0) == 24  # the refused step wrote nothing
    cache.reset()
    assert cache.seq_length(0) == 0


def test_bad_input_is_a_clear_error():
    cache = make_cache(presets.recommended(4), capacity=40)
    k = torch.randn(2, 2, 5, 32)
    with pytest.raises(IndexError, match="layer 2 is out of range for 2 layers"):
        cache.append(2, k, k)
    for bad in ((3, 2, 5, 32), (2, 4, 5, 32), (2, 2, 5, 64)):
        with pytest.raises(ValueError, match=re.escape("append: k must have shape (batch=2, kv_heads=2, tokens, head_dim=32)")):
            cache.append(0, torch.randn(bad), torch.randn(bad))
    # the op itself names the buffer that does not fit
    bufs = cache.layer_buffers(0)
    with pytest.raises(ValueError, match=re.escape("rkv.cache_append: k_packed must have shape (batch=3")):
        torch_rkv.ops.cache.cache_append(*split_sides(bufs), torch.zeros(3, dtype=torch.int64), torch.randn(3, 2, 1, 32),
                                         torch.randn(3, 2, 1, 32), CacheFormat(4, 4, 64, 64))
    with pytest.raises(RuntimeError, match=r"appending 500 tokens to layer 0 exceeds the capacity of \d+ tokens"):
        cache.append(0, torch.randn(2, 2, 500, 32), torch.randn(2, 2, 500, 32))
    with pytest.raises(ValueError, match=r"group_size 48 does not divide head_dim 32"):
        make_cache(presets.recommended(4).replace(v_group_size=48))
    with pytest.raises(ValueError, match="needs the model's rope tables"):
        QuantizedKVCache(presets.kvquant(4), 1, 1, 2, 32, 16)
    with pytest.raises(ValueError, match="pre_rope and k_hadamard cannot be combined"):
        Scheme(pre_rope=True, k_hadamard=True)
    with pytest.raises(ValueError, match="k_clip needs asymmetric quantization"):
        Scheme(k_symmetric=True, k_clip=True)
    sym = CacheLayout(presets.recommended(4).replace(v_symmetric=True), 1, 1, 32, 128, torch.float32).allocate()
    with pytest.raises(ValueError, match="rkv.cache_append: v_clip needs asymmetric values"):
        torch_rkv.ops.cache.cache_append(*sides(sym), torch.zeros(1, dtype=torch.int64), torch.randn(1, 1, 2, 32),
                                         torch.randn(1, 1, 2, 32), CacheFormat(4, 4, 128, 64, False, True))


def test_the_op_rejects_a_full_cache_and_changes_nothing():
    s = presets.kivi(4, block=4, recent=2)
    layout = CacheLayout(s, 1, 1, 32, 10, torch.float32)
    bufs = layout.allocate()
    before = {k: v.clone() for k, v in bufs.items()}
    k = torch.randn(1, 1, layout.max_tokens + 1, 32)
    fmt = CacheFormat(4, 4, s.block, s.recent)
    with pytest.raises(ValueError, match=re.escape(f"exceeds its capacity of {layout.max_tokens} tokens")):
        torch_rkv.ops.cache.cache_append(*sides(bufs), torch.zeros(1, dtype=torch.int64), k, k, fmt)
    assert all(torch.equal(bufs[n], before[n]) for n in bufs)
    with pytest.raises(TypeError, match="must have the cache's full-precision dtype"):
        torch_rkv.ops.cache.cache_append(*sides(bufs), torch.zeros(1, dtype=torch.int64), k[:, :, :2].half(),
                                         k[:, :, :2].half(), fmt)
    with pytest.raises(ValueError, match="k_window must be contiguous"):
        args = buffers_args(bufs)
        args[BUFFERS.index("k_window")] = torch.zeros(1, 1, 32, layout.window).transpose(-1, -2)
        torch_rkv.ops.cache.cache_append(*split_sides(args), torch.zeros(1, dtype=torch.int64), k[:, :, :2],
                                         k[:, :, :2], fmt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", [presets.recommended(4), presets.kivi(2, recent=8), presets.per_token(8)],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("window", [7, 40, 64])
def test_sliding_window_ring_attends_as_a_full_cache(device, scheme, window):
    """A sliding-window cache keeps only a ring of rows, yet its decode steps and chunks attend exactly as
    a cache that kept every token, masked to the same window (same kernel, same codes: bit-identical);
    and the window is the model's: the newest `window` tokens, the query included."""
    gen = torch.Generator().manual_seed(window)
    ring = make_cache(scheme, capacity=300, layers=1, batch=1, device=device, window=window)
    full = make_cache(scheme, capacity=300, layers=1, batch=1, device=device)
    assert ring.layout.packed_capacity < full.layout.packed_capacity
    steps = [90, 1, 1, 37, 1, 64, 1, 1]  # a prefill longer than the ring, decode steps, chunks
    for m in steps:
        k = torch.randn(1, 2, m, 32, generator=gen).to(device)
        v = torch.randn(1, 2, m, 32, generator=gen).to(device)
        q = torch.randn(1, 4, m, 32, generator=gen).to(device)
        if ring.seq_length() == 0:
            ring.append(0, k, v)
            full.append(0, k, v)
            continue
        if m == 1:
            ring.append(0, k, v)
            full.append(0, k, v)
            got = ring.attend(0, q[:, :, 0])
            want = torch_rkv.decode_attention(q[:, :, 0], *full.sides(0), full.lengths[0], scheme.format,
                                              full.rotations.options(sliding_window=window))
        else:
            got = ring.prefill(0, q, k, v)
            full.sliding_window = window  # its buffers hold every token: the window only masks
            want = full.prefill(0, q, k, v)
            full.sliding_window = 0
        assert torch.equal(got, want)
    # the window itself: with 8 bits the newest `window` tokens (exactly) are what the query attends
    if scheme.k_bits == 8:
        keys, values = full.dequantized(0)
        n = keys.shape[2]
        qq = torch.randn(1, 4, 32, generator=gen).to(device)
        plain = attention_fp32(qq.cpu(), keys[:, :, n - window :].cpu(), values[:, :, n - window :].cpu(), [window])
        wider = attention_fp32(qq.cpu(), keys[:, :, n - window - 1 :].cpu(), values[:, :, n - window - 1 :].cpu(),
                               [window + 1])
        got = ring.attend(0, qq).cpu()
        assert (got - plain).abs().max() < 1e-5 < (got - wider).abs().max()


def test_sliding_window_cache_holds_the_window_in_bytes_counted_by_hand():
    """rkv-4 (keys 4 bits per channel in blocks of 128, values 4 bits per token, fp16 scale and zero;
    4 sinks, 64 recent tokens, fp16 rows) at head_dim 128, 2 kv heads, window 1000: the ring holds
    round_up(1000, 128) = 1024 quantized rows, whatever the capacity."""
    s = presets.recommended(4)
    assert (s.k_bits, s.v_bits, s.block, s.sinks, s.recent, s.k_group_size, s.v_group_size) == (4, 4, 128, 4, 64, 1, None)
    h, d, rows = 2, 128, 1024
    codes = 2 * h * rows * d * 4 // 8  # keys and values, 4 bits
    k_meta = 2 * h * (rows // 128) * d * 2  # scale and zero per channel and block, fp16
    v_meta = 2 * h * rows * 2  # scale and zero per token, fp16
    side = 2 * h * (4 + 64 + 127) * d * 2  # sinks and the fp ring (recent + block - 1), keys and values, fp16
    want = codes + k_meta + v_meta + side
    for capacity in (2048, 131072):
        cache = QuantizedKVCache(s, 1, 1, h, d, capacity, dtype=torch.float16, rope=torch_rkv.rope_tables(d, capacity),
                                 sliding_window=1000)
        assert cache.nbytes() == want
    # quantized rows: the window plus less than a block; besides them only the sinks and the fp tail


def test_sliding_window_and_softcap_errors_name_the_argument():
    s = presets.recommended(4).replace(sinks=1, recent=4, k_block_tokens=8)
    ring = make_cache(s, capacity=64, layers=1, batch=1, window=20)  # a ring of 24 rows
    full = make_cache(s, capacity=64, layers=1, batch=1)
    b = ring.layer_buffers(0)
    q = torch.randn(1, 4, 32)
    call = lambda bufs, **kw: torch_rkv.decode_attention(  # noqa: E731
        q, *split_sides(bufs), ring.lengths[0], s.format, AttentionOptions(ring.rope_cos, ring.rope_sin, **kw))
    with pytest.raises(ValueError, match=re.escape("rkv.decode_attention: sliding_window must be >= 0")):
        call(b, sliding_window=-1)
    with pytest.raises(ValueError, match=re.escape("rkv.decode_attention: softcap must be finite and >= 0")):
        call(b, softcap=-1.0)
    with pytest.raises(ValueError, match=re.escape("rkv.decode_attention: a sliding window of 40 tokens needs a ring "
                                                   "of at least 40 packed rows (k_packed has 24)")):
        call(b, sliding_window=40)
    call(full.layer_buffers(0), sliding_window=40)  # rows for every token: a window only masks
    k = torch.randn(1, 2, 18, 32)
    with pytest.raises(ValueError, match=re.escape("rkv.cache_append: a ring of 24 packed rows (sliding_window=20) "
                                                   "takes at most 17 tokens per append (k_new has 18)")):
        torch_rkv.ops.cache.cache_append(*split_sides(b), ring.lengths[0], k, k,
                                         CacheFormat(s.k_bits, s.v_bits, s.block, s.recent), sliding_window=20)
    ring.append(0, k, k)  # the cache appends in pieces
    assert ring.seq_length(0) == 18
