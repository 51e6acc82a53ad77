"""The paged quantized KV cache: rkv::paged_append / paged_decode_attention / paged_prefill_attention /
paged_copy against the reference, paged == contiguous, chunk invariance, a stateful pool of sequences
with canaries, compile, bytes and errors."""

import math
import re

import pytest
import torch
from cachebuild import attention_fp32, float_tolerance, levels_of, meta_dtypes, random_levels
from conftest import device_params
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pagedbuild import Pool, fill, random_tables

import torch_rkv
from torch_rkv import reference as ref
from torch_rkv import scheme as presets
from torch_rkv.cache import QuantizedKVCache
from torch_rkv.layout import PageLayout
from torch_rkv.ops import paged as ops
from torch_rkv.ops.structs import AttentionOptions, CacheFormat, split_sides
from torch_rkv.paged import PagedQuantizedKVCache
from torch_rkv.scheme import Scheme

DEVICES = device_params("paged_append")


@st.composite
def schemes(draw, d=32):
    block = draw(st.sampled_from([1, 4, 8]))
    k_kind = draw(st.sampled_from(["token", "channel", "grouped"]))
    k_group, k_tokens = {"token": (None, 1), "channel": (1, block), "grouped": (16, 1)}[k_kind]
    key_space = draw(st.sampled_from(["post", "pre", "hadamard"]))
    s = Scheme(
        k_bits=draw(st.sampled_from([2, 3, 4, 8])), v_bits=draw(st.sampled_from([2, 3, 4, 8])),
        k_group_size=k_group, k_block_tokens=k_tokens, v_group_size=draw(st.sampled_from([None, 16])),
        v_block_tokens=1 if k_kind != "token" else draw(st.sampled_from([1, block])),
        k_symmetric=draw(st.booleans()), v_symmetric=draw(st.booleans()),
        pre_rope=key_space == "pre", k_hadamard=key_space == "hadamard", v_hadamard=draw(st.booleans()),
        sinks=draw(st.sampled_from([0, 2, 5])), recent=draw(st.sampled_from([0, 3, 8])),
        **meta_dtypes(draw),
    )
    return s.replace(k_clip=not s.k_symmetric and draw(st.booleans()),
                     v_clip=not s.v_symmetric and draw(st.booleans()))


def rows_of(x: torch.Tensor, counts, starts):
    """(B, H, n, D) -> the (T, H, D) rows of tokens [starts[b], starts[b] + counts[b]) of each sequence."""
    return torch.cat([x[b, :, s : s + m].transpose(0, 1) for b, (s, m) in enumerate(zip(starts, counts))])


@pytest.mark.parametrize("device", DEVICES)
@given(s=schemes(), data=st.data())
def test_paged_append_matches_reference_and_writes_nothing_else(device, s, data):
    """Ragged appends over random block tables into a canary-filled pool: every byte of the pool, the
    side slots and page_fill equals reference.paged_append's, step after step."""
    page = data.draw(st.sampled_from([16, 32]))
    batch, heads, d = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2)), 32
    steps = data.draw(st.lists(st.lists(st.integers(0, 13), min_size=batch, max_size=batch), min_size=1, max_size=5))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16]))
    layout = PageLayout(s, heads, d, page, dtype)
    kl, vl = levels_of(s, seed, data.draw(st.booleans(), label="levels"))
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    totals = [sum(step[b] for step in steps) for b in range(batch)]
    width = max(1, max(-(-n // page) for n in totals))
    pages = batch * width + 2
    want = Pool(layout, pages, batch + 1, gen)
    got = want.clone(device)
    tables = random_tables(gen, pages, totals, page, width)
    slots = torch.randperm(batch + 1, generator=gen)[:batch].to(torch.int32)
    lengths = torch.zeros(batch, dtype=torch.int64)
    for counts in steps:
        k = torch.randn(sum(counts), heads, d, generator=gen).to(dtype)
        v = torch.randn(sum(counts), heads, d, generator=gen).to(dtype)
        qsl = torch.tensor([0] + counts).cumsum(0)
        ref.paged_append(*want.tensors(), want.fill, tables, slots, lengths, qsl, k, v, s.k_bits, s.v_bits, s.block,
                         s.recent, s.k_clip, s.v_clip, k_levels=kl, v_levels=vl)
        ops.paged_append(*got.sides(levels=(on(kl), on(vl))), on(k), on(v), s.format, lengths=on(lengths),
                         query_start_loc=on(qsl), block_tables=on(tables), side_slots=on(slots), page_fill=got.fill)
        lengths += torch.tensor(counts)
        assert got.equal(want)


def attention_inputs(s: Scheme, data, device, prefill: bool, one_new: bool = False):
    """A filled pool, its tables, the raw keys/values (post-RoPE originals) and the op's rope / signs.
    one_new: one new token a sequence (a decode step), with room for it in the tables."""
    # a long chunk (prefill): 100 tokens of a GQA group of 3 or 4 span several of the CPU kernel's work
    # items (prefill_rows(d) / group tokens each)
    long = prefill and not one_new and data.draw(st.booleans())
    d = data.draw(st.sampled_from([64, 96] if long else [32, 64, 96]))
    page = data.draw(st.sampled_from([16, 32]))
    kv_heads, ratio = data.draw(st.integers(1, 2)), data.draw(st.sampled_from([3, 4] if long else [1, 3, 4]))
    batch = data.draw(st.integers(1, 3))
    edges = [0, 1, s.sinks, s.recent + s.block - 1, s.recent + s.block, page, page + 1, 70]
    lengths = [data.draw(st.sampled_from(edges)) for _ in range(batch)]
    counts = [data.draw(st.integers(0, 9)) for _ in range(batch)] if prefill else [0] * batch
    if one_new:
        counts = [1] * batch
    if long:
        counts[0] = 100
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    fp = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    layout = PageLayout(s, kv_heads, d, page, fp)
    n_max = max(n + m for n, m in zip(lengths, counts)) + 1
    keys = torch.randn(batch, kv_heads, n_max, d, generator=gen)
    keys[..., 3] += 4.0  # an outlier channel, as in real keys
    values = torch.randn(batch, kv_heads, n_max, d, generator=gen)
    rot = data.draw(st.sampled_from([d, d // 2]))
    interleaved = data.draw(st.booleans())
    cos, sin = torch_rkv.rope_tables(d, n_max + 2, theta=1e4, rot_dim=rot)
    k_signs = torch_rkv.hadamard_signs(d, 1) if s.k_hadamard else None
    v_signs = torch_rkv.hadamard_signs(d, 2) if s.v_hadamard else None
    ks = keys
    if s.pre_rope:
        ks = torch_rkv.rope(keys, cos, sin, torch.arange(n_max), interleaved, inverse=True)
    elif k_signs is not None:
        ks = torch_rkv.hadamard(keys, k_signs)
    vs = torch_rkv.hadamard(values, v_signs) if v_signs is not None else values
    width = max(1, max(-(-(n + m) // page) for n, m in zip(lengths, counts)))
    pages = batch * width + 1
    pool = Pool(layout, pages, batch, gen, zeros=True)
    tables = random_tables(gen, pages, [n + m for n, m in zip(lengths, counts)], page, width)
    slots = torch.randperm(batch, generator=gen).to(torch.int32)
    levels = levels_of(s, seed, data.draw(st.booleans(), label="levels"))
    fill(pool, s, tables, slots, ks, vs, lengths, chunk=data.draw(st.sampled_from([0, 5])), levels=levels)
    q_dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    rope = (cos, sin) if s.pre_rope else (None, None)
    return dict(pool=pool, tables=tables, slots=slots, lengths=lengths, counts=counts, keys=keys, values=values,
                ks=ks, vs=vs, rope=rope, interleaved=interleaved, k_signs=k_signs, v_signs=v_signs, q_dtype=q_dtype,
                heads=kv_heads * ratio, d=d, gen=gen, split=data.draw(st.sampled_from([0, 7, 32])), levels=levels)


def cpu(t):
    return None if t is None else t.cpu()


def window_and_cap(data):
    """A sliding window (over pages it only masks: the engine keeps the pages) and soft-capping, or none."""
    return (data.draw(st.sampled_from([0, 0, 1, 6, 50]), label="sliding_window"),
            data.draw(st.sampled_from([0.0, 0.0, 2.0]), label="softcap"))


def draw_sink_logits(data, heads: int):
    """Learned attention sinks (GPT-OSS), one logit per query head, or None."""
    spread = data.draw(st.sampled_from([None, None, 0.0, 3.0]), label="sink_logits")
    return None if spread is None else torch.randn(heads, generator=torch.Generator().manual_seed(heads)) * spread


@pytest.mark.parametrize("device", device_params("paged_decode_attention"))
@given(s=schemes(), data=st.data())
def test_paged_decode_matches_reference(device, s, data):
    c = attention_inputs(s, data, device, prefill=False)
    b = len(c["lengths"])
    q = torch.randn(b, c["heads"], c["d"], generator=c["gen"]).to(c["q_dtype"])
    pool = c["pool"].clone(device)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    tables, slots, n = c["tables"], c["slots"], torch.tensor(c["lengths"])
    args = (tables, slots, n, s.k_bits, s.v_bits, s.block, s.recent)
    window, cap = window_and_cap(data)
    sink_logits = draw_sink_logits(data, c["heads"])
    kl, vl = c["levels"]
    want = ref.paged_decode_attention(q, *c["pool"].tensors(), *args, *c["rope"], c["interleaved"], c["k_signs"],
                                      c["v_signs"], sliding_window=window, softcap=cap, k_levels=kl, v_levels=vl,
                                      sink_logits=sink_logits)
    opts = AttentionOptions(on(c["rope"][0]), on(c["rope"][1]), c["interleaved"], on(c["k_signs"]), on(c["v_signs"]),
                            sliding_window=window, softcap=cap, sink_logits=on(sink_logits))
    got = ops.paged_decode_attention(on(q), *pool.sides(levels=(on(kl), on(vl))), s.format, opts, lengths=on(n),
                                     block_tables=on(tables), side_slots=on(slots), split_tokens=c["split"])
    assert got.shape == q.shape and got.dtype == q.dtype
    tol = float_tolerance(q, c["keys"], c["values"], q.dtype)
    assert (got.cpu().float() - want.float()).abs().max().item() <= tol


@pytest.mark.parametrize("device", device_params("paged_prefill_attention"))
@given(s=schemes(), data=st.data())
def test_paged_prefill_matches_reference(device, s, data):
    """A chunk per sequence over its quantized prefix: the kernel equals the reference to float
    tolerance; padding rows past query_start_loc[B] are zeros."""
    c = attention_inputs(s, data, device, prefill=True)
    counts, lengths = c["counts"], c["lengths"]
    t = sum(counts) + 2  # two padding rows
    q = torch.randn(t, c["heads"], c["d"], generator=c["gen"]).to(c["q_dtype"])
    kn = torch.cat([rows_of(c["ks"], counts, lengths), torch.zeros(2, *c["ks"].shape[1:2], c["d"])])
    vn = torch.cat([rows_of(c["vs"], counts, lengths), torch.zeros(2, *c["vs"].shape[1:2], c["d"])])
    fp = c["pool"].layout.dtype
    kn, vn = kn.to(fp), vn.to(fp)
    qsl = torch.tensor([0] + counts).cumsum(0)
    pool = c["pool"].clone(device)
    on = lambda x: None if x is None else x.to(device)  # noqa: E731
    tables, slots, n = c["tables"], c["slots"], torch.tensor(lengths)
    args = (tables, slots, n, s.k_bits, s.v_bits, s.block, s.recent)
    window, cap = window_and_cap(data)
    sink_logits = draw_sink_logits(data, c["heads"])
    kl, vl = c["levels"]
    want = ref.paged_prefill_attention(q, kn, vn, qsl, *c["pool"].tensors(), *args, *c["rope"], c["interleaved"],
                                       c["k_signs"], c["v_signs"], sliding_window=window, softcap=cap, k_levels=kl,
                                       v_levels=vl, sink_logits=sink_logits)
    opts = AttentionOptions(on(c["rope"][0]), on(c["rope"][1]), c["interleaved"], on(c["k_signs"]), on(c["v_signs"]),
                            sliding_window=window, softcap=cap, sink_logits=on(sink_logits))
    got = ops.paged_prefill_attention(on(q), on(kn), on(vn), *pool.sides(levels=(on(kl), on(vl))), s.format, opts,
                                      query_start_loc=on(qsl), max_query_len=max(counts), lengths=on(n),
                                      block_tables=on(tables), side_slots=on(slots), split_tokens=c["split"])
    tol = float_tolerance(q, c["keys"], c["values"], q.dtype)
    assert (got.cpu().float() - want.float()).abs().max().item() <= tol
    assert torch.equal(got[-2:].cpu(), torch.zeros_like(got[-2:].cpu()))


@pytest.mark.parametrize("device", device_params("paged_decode_attention"))
@given(s=schemes(), data=st.data())
def test_a_decode_step_reads_the_same_through_either_kernel(device, s, data):
    """One new token a sequence (the vLLM plugin's decode step): appended first and read back from the
    window by the decode kernel, it gives what the prefill kernel gives over the cache before it, to float
    tolerance, when no block leaves the recent window (append_keeps_reads: every older token is read
    where it was), sliding window and soft cap included."""
    s = s.replace(recent=max(1, s.recent))  # (with recent 0 and block 1 every token leaves the window at once)
    c = attention_inputs(s, data, device, prefill=True, one_new=True)
    lengths = c["lengths"]
    assume(all(ref.append_keeps_reads(n, s.recent, s.block) for n in lengths))
    window, cap = window_and_cap(data)
    b = len(lengths)
    q = torch.randn(b, c["heads"], c["d"], generator=c["gen"]).to(c["q_dtype"])
    fp = c["pool"].layout.dtype
    kn, vn = rows_of(c["ks"], c["counts"], lengths).to(fp), rows_of(c["vs"], c["counts"], lengths).to(fp)
    on = lambda x: None if x is None else x.to(device)
    qsl, n = on(torch.arange(b + 1)), on(torch.tensor(lengths))
    kl, vl = c["levels"]
    levels = (on(kl), on(vl))
    common = {"block_tables": on(c["tables"]), "side_slots": on(c["slots"])}
    opts = AttentionOptions(on(c["rope"][0]), on(c["rope"][1]), c["interleaved"], on(c["k_signs"]), on(c["v_signs"]),
                            sliding_window=window, softcap=cap, sink_logits=on(draw_sink_logits(data, c["heads"])))
    prefilled = ops.paged_prefill_attention(on(q), on(kn), on(vn), *c["pool"].clone(device).sides(levels), s.format,
                                            opts, query_start_loc=qsl, max_query_len=1, lengths=n, **common,
                                            split_tokens=c["split"])
    pool = c["pool"].clone(device)
    ops.paged_append(*pool.sides(levels), on(kn), on(vn), s.format, lengths=n, query_start_loc=qsl, **common)
    decoded = ops.paged_decode_attention(on(q), *pool.sides(levels), s.format, opts, lengths=n + 1, **common,
                                         split_tokens=c["split"])
    tol = float_tolerance(q, c["keys"], c["values"], q.dtype)
    assert (decoded.cpu().float() - prefilled.cpu().float()).abs().max().item() <= tol


# ------------------------------------------------------------------------------------------------
# The cache: paged == contiguous, chunk invariance, forks
# ------------------------------------------------------------------------------------------------

def calibrated_preset(bits: int = 2, layers: int = 2):
    """rkv-<bits> with a random per-layer codebook file (each layer and side its own levels)."""
    import tempfile
    from pathlib import Path

    from torch_rkv.codebook import Codebook

    book = Codebook([{side: {str(bits): random_levels(bits, 10 * i + j).tolist()} for j, side in enumerate("kv")}
                     for i in range(layers)])
    path = Path(tempfile.mkdtemp()) / "levels.json"
    book.save(path)
    return presets.recommended(bits).replace(name=f"rkv-nu-{bits}", k_block_tokens=32, recent=16, levels="calibrated",
                                             codebook=str(path))


PRESETS = [presets.per_token(4), presets.kivi(2, block=16, recent=8), presets.quarot(3),
           presets.recommended(4).replace(k_block_tokens=16, recent=8),
           presets.recommended(2).replace(k_block_tokens=32, recent=16), calibrated_preset(),
           presets.recommended(2).replace(name="rkv-sparse-2", k_block_tokens=32, recent=16, outliers=0.02)]
H, D = 2, 32


def tables_for(rope_tokens=1024):
    return torch_rkv.rope_tables(D, rope_tokens, theta=1e4)


def paged_cache(scheme, device="cpu", pages=64, seqs=4, page_size=None, max_pages=24):
    return PagedQuantizedKVCache(scheme, 2, H, D, pages, seqs, page_size=page_size, dtype=torch.float32,
                                 device=device, rope=tables_for(), max_pages_per_seq=max_pages)


def page_state(cache) -> torch.Tensor:
    """Every page of every layer in the one-buffer byte layout: (layers, pages, page_bytes)."""
    return torch.stack([torch.stack([cache.page_bytes(layer, p) for p in range(cache.num_pages)])
                        for layer in range(cache.num_layers)])


def set_pages(cache, state: torch.Tensor) -> None:
    """Write (layers, pages, page_bytes) bytes into the cache's region tensors (canaries)."""
    for layer in range(cache.num_layers):
        views = cache.layout.views(state[layer].clone())
        for name in cache.regions:
            getattr(cache, name)[layer].copy_(views[name])


def token_rows(x, counts):
    """(B, H, m, D) equal-count tokens -> (B*m, H, D) varlen rows."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", PRESETS, ids=lambda s: s.name)
def test_paged_equals_contiguous(device, scheme):
    """The same tokens through QuantizedKVCache and PagedQuantizedKVCache: every quantized row's codes and
    metadata and every full-precision row bit for bit, decode outputs to float tolerance."""
    gen = torch.Generator().manual_seed(0)
    contiguous = QuantizedKVCache(scheme, 2, 2, H, D, 400, dtype=torch.float32, device=device, rope=tables_for())
    paged = paged_cache(scheme, device)
    seqs = [paged.add(), paged.add()]
    for m in (13, 1, 1, 40, 3, 70, 1):
        k = torch.randn(2, H, m, D, generator=gen).to(device)
        v = torch.randn(2, H, m, D, generator=gen).to(device)
        contiguous.append(1, k, v)
        batch = paged.schedule(seqs, [m, m])
        paged.append(1, batch, token_rows(k, m), token_rows(v, m))
        paged.commit(batch)
        q = torch.randn(2, 6, D, generator=gen).to(device)
        got = paged.attend(1, paged.schedule(seqs, [0, 0]), q)
        want = contiguous.attend(1, q)
        kd, vd = contiguous.dequantized(1)
        assert (got - want).abs().max().item() <= float_tolerance(q, kd, vd, torch.float32)
    n, p = paged.length(seqs[0]), paged.page_size
    q_end = ref.quantized_count(n, scheme.recent, scheme.block)
    c = dict(zip(("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero"), contiguous.layer_buffers(1)))
    pt = dict(zip(("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero"), paged.layer_tensors(1)))
    for b, seq in enumerate(seqs):
        pages = paged.pages_of(seq)
        for t in range(q_end):
            for name in ("k_packed", "v_packed"):
                assert torch.equal(c[name][b, :, t], pt[name][pages[t // p], :, t % p]), (name, t)
            for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
                if c[name] is None:
                    continue
                per = contiguous.layout.packed_capacity // c[name].shape[2]  # tokens per metadata row
                assert torch.equal(c[name][b, :, t // per], pt[name][pages[t // p], :, (t % p) // per]), (name, t)
        slot = int(paged.schedule([seq], [0]).side_slots[0])
        for name in ("k_window", "v_window", "k_sink", "v_sink"):
            assert torch.equal(getattr(contiguous, name)[1, b], getattr(paged, name)[1, slot]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [5, 70])
def test_paged_sliding_window_attends_as_the_contiguous_ring(device, window):
    """Pages with a sliding window and soft-capping against QuantizedKVCache's ring with the same: decode
    and chunk outputs to float tolerance (only the tiles' page boundaries differ)."""
    scheme = presets.recommended(4).replace(k_block_tokens=16, recent=8)
    gen = torch.Generator().manual_seed(window)
    ring = QuantizedKVCache(scheme, 2, 2, H, D, 400, dtype=torch.float32, device=device, rope=tables_for(),
                            sliding_window=window, softcap=3.0)
    paged = PagedQuantizedKVCache(scheme, 2, H, D, 64, 4, dtype=torch.float32, device=device, rope=tables_for(),
                                  max_pages_per_seq=24, sliding_window=window, softcap=3.0)
    seqs = [paged.add(), paged.add()]
    assert ring.layout.packed_capacity < 400
    for m in (13, 1, 40, 1, 70, 1):
        k = torch.randn(2, H, m, D, generator=gen).to(device)
        v = torch.randn(2, H, m, D, generator=gen).to(device)
        q = torch.randn(2, 6, m, D, generator=gen).to(device)
        batch = paged.schedule(seqs, [m, m])
        if m == 1:
            ring.append(1, k, v)
            paged.append(1, batch, token_rows(k, m), token_rows(v, m))
            got, want = paged.attend(1, batch, q[:, :, 0]), ring.attend(1, q[:, :, 0])
        else:
            got = paged.prefill(1, batch, token_rows(q, m), token_rows(k, m), token_rows(v, m))
            want = token_rows(ring.prefill(1, q, k, v), m)
        paged.commit(batch)
        assert (got - want).abs().max().item() <= float_tolerance(q, k, v, torch.float32)


@pytest.mark.parametrize("scheme", PRESETS, ids=lambda s: s.name)
def test_chunked_prefill_leaves_the_same_cache(scheme):
    """Prefilling in chunks of 1, 7, 64 or all at once gives the same pages, side rows and page counts,
    and the same decode output afterwards."""
    gen = torch.Generator().manual_seed(1)
    n = 150
    k = torch.randn(1, H, n, D, generator=gen)
    v = torch.randn(1, H, n, D, generator=gen)
    q = torch.randn(1, 4, D, generator=gen)
    results = []
    for chunk in (1, 7, 64, n):
        cache = paged_cache(scheme)
        seq = cache.add()
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            batch = cache.schedule([seq], [m])
            for layer in range(2):
                qc = torch.randn(m, 4, D, generator=gen)
                cache.prefill(layer, batch, qc, token_rows(k[:, :, start : start + m], m),
                              token_rows(v[:, :, start : start + m], m))
            cache.commit(batch)
        results.append((cache, cache.attend(0, cache.schedule([seq], [0]), q)))
    first, out = results[0]
    # the window rows attention reads: tokens [max(S, Q(n)), n) (the other ring slots hold stale tokens,
    # which chunking changes and nothing reads)
    live = [t % first.layout.side_shapes(1)["k_window"][0][2]
            for t in range(max(scheme.sinks, ref.quantized_count(n, scheme.recent, scheme.block)), n)]
    for cache, o in results[1:]:
        assert torch.equal(page_state(cache), page_state(first)) and torch.equal(cache.page_fill, first.page_fill)
        for name in ("k_sink", "v_sink"):
            assert torch.equal(getattr(cache, name), getattr(first, name))
        for name in ("k_window", "v_window"):
            assert torch.equal(getattr(cache, name)[:, :, :, live], getattr(first, name)[:, :, :, live])
        assert torch.equal(o, out)


@pytest.mark.parametrize("device", DEVICES)
def test_fork_shares_full_pages_and_copies_the_open_one(device):
    scheme = presets.recommended(4).replace(k_block_tokens=16, recent=8)
    gen = torch.Generator().manual_seed(2)
    cache = paged_cache(scheme, device)
    parent = cache.add()
    prompt = 37  # two full pages of 16 and an open one
    k, v = torch.randn(prompt + 20, H, D, generator=gen).to(device), torch.randn(prompt + 20, H, D, generator=gen).to(device)
    batch = cache.schedule([parent], [prompt])
    for layer in range(2):
        cache.append(layer, batch, k[:prompt], v[:prompt])
    cache.commit(batch)
    child = cache.fork(parent)
    pp, cp = cache.pages_of(parent), cache.pages_of(child)
    assert pp[:2] == cp[:2] and pp[2] != cp[2]  # full pages by reference, the open one copied
    assert [cache.refcount(p) for p in pp] == [2, 2, 1]
    # both grow with different tokens; each equals a sequence built from scratch with its tokens
    other = torch.randn(20, H, D, generator=gen).to(device)
    batch = cache.schedule([parent, child], [20, 20])
    for layer in range(2):
        cache.append(layer, batch, torch.cat([k[prompt:], other]), torch.cat([v[prompt:], other]))
    cache.commit(batch)
    fresh = cache.add()
    batch = cache.schedule([fresh], [prompt + 20])
    for layer in range(2):
        cache.append(layer, batch, torch.cat([k[:prompt], other]), torch.cat([v[:prompt], other]))
    cache.commit(batch)
    q = torch.randn(3, 4, D, generator=gen).to(device)
    out = cache.attend(1, cache.schedule([parent, child, fresh], [0, 0, 0]), q)
    assert torch.equal(out[1], cache.attend(1, cache.schedule([fresh], [0]), q[1:2])[0])
    assert not torch.equal(out[0], out[1])
    cache.remove(parent)
    assert [cache.refcount(p) for p in pp] == [1, 1, 0]  # the shared pages live on in the child
    cache.remove(child)
    cache.remove(fresh)
    assert cache.free_pages() == cache.num_pages


def test_per_layer_schemes_store_and_read_as_each_schemes_own_cache():
    """A per-layer allocation in one pool (each layer its own key and value bits, 2-bit keys clipped):
    chunked prefill, decode steps and a fork give, layer by layer, the outputs and page bytes of a
    one-layer cache of that layer's scheme, bit for bit; the bytes are the sum of theirs."""
    base = presets.recommended(2).replace(k_block_tokens=16, recent=8)
    schemes = [base.replace(name=f"k{k}v{v}", k_bits=k, v_bits=v, k_clip=k == 2) for k, v in ((4, 4), (3, 2), (2, 2))]
    gen = torch.Generator().manual_seed(3)

    def make(ss):
        return PagedQuantizedKVCache(ss, len(ss), H, D, 32, 4, dtype=torch.float32, rope=tables_for(),
                                     max_pages_per_seq=12)

    mixed, singles = make(schemes), [make([s]) for s in schemes]
    assert len({lay.page_bytes for lay in mixed.layouts}) == 3
    assert mixed.nbytes() == sum(c.nbytes() for c in singles)
    seqs = [[c.add(), c.add()] for c in (mixed, *singles)]
    for step, counts in enumerate(((13, 40), (1, 1), (30, 5), (1, 1), "fork", (1, 1))):
        if counts == "fork":  # the second sequence's fork joins: its open page and side rows copied
            seqs = [ids + [c.fork(ids[1])] for c, ids in zip((mixed, *singles), seqs)]
            continue
        counts = list(counts) + [1] * (len(seqs[0]) - len(counts))
        batches = [c.schedule(ids, counts) for c, ids in zip((mixed, *singles), seqs)]
        for layer, single in enumerate(singles):
            t = sum(counts)
            q, k, v = (torch.randn(t, n, D, generator=gen) for n in (2 * H, H, H))
            if max(counts) > 1:
                got = mixed.prefill(layer, batches[0], q, k, v)
                want = single.prefill(0, batches[layer + 1], q, k, v)
            else:
                mixed.append(layer, batches[0], k, v)
                single.append(0, batches[layer + 1], k, v)
                got, want = mixed.attend(layer, batches[0], q), single.attend(0, batches[layer + 1], q)
            assert torch.equal(got, want), (step, layer)
        for c, b in zip((mixed, *singles), batches):
            c.commit(b)
    for layer, single in enumerate(singles):
        for page in mixed.pages_of(seqs[0][2]) + mixed.pages_of(seqs[0][0]):
            assert torch.equal(mixed.page_bytes(layer, page), single.page_bytes(0, page))
    assert "K/V bits by layer 44 32 22" in repr(mixed)


def test_per_layer_schemes_may_differ_only_in_their_bits():
    base = presets.recommended(2).replace(k_block_tokens=16, recent=8)
    with pytest.raises(ValueError, match="layer 1's scheme .* in recent; .* differ only in k_bits, v_bits"):
        PagedQuantizedKVCache([base, base.replace(k_bits=3, recent=16)], 2, H, D, 8, 2, rope=tables_for())
    with pytest.raises(ValueError, match="3 schemes for num_layers=2"):
        PagedQuantizedKVCache([base] * 3, 2, H, D, 8, 2, rope=tables_for())
    cal = calibrated_preset(bits=2)
    with pytest.raises(NotImplementedError, match="calibrated levels"):
        PagedQuantizedKVCache([cal, cal.replace(v_bits=3)], 2, H, D, 8, 2, rope=tables_for())


# ------------------------------------------------------------------------------------------------
# A pool under random admissions, appends, forks and evictions
# ------------------------------------------------------------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Sequences join, grow by ragged chunks, fork and leave over a small canary-filled pool. Every step
    writes only the open pages of the sequences it grows (free pages keep their canary bytes, full and
    other sequences' pages stay as they were), every page is referenced exactly as often as the tables
    say (no leak), and every live sequence's decode attention equals the reference over its own tokens."""

    @initialize(scheme=st.sampled_from(PRESETS[:4]), seed=st.integers(0, 2**16))
    def setup(self, scheme, seed):
        self.scheme = scheme
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = paged_cache(scheme, pages=12, seqs=4, page_size=16, max_pages=6)
        lay = self.cache.layout
        set_pages(self.cache, torch.randint(0, 256, (2, 12, lay.page_bytes), generator=self.gen, dtype=torch.uint8))
        self.tokens = {}  # seq -> (keys, values) (n, H, D) post-RoPE, as appended

    def writes_only(self, before: torch.Tensor, writable: set) -> None:
        after = page_state(self.cache)
        for p in range(self.cache.num_pages):
            if p not in writable:
                assert torch.equal(before[:, p], after[:, p]), f"page {p} was written"

    @precondition(lambda self: len(self.cache.sequences()) < 4)
    @rule()
    def admit(self):
        seq = self.cache.add()
        self.tokens[seq] = (torch.zeros(0, H, D), torch.zeros(0, H, D))

    @precondition(lambda self: self.cache.sequences())
    @rule(data=st.data())
    def append(self, data):
        seqs = self.cache.sequences()
        chosen = data.draw(st.lists(st.sampled_from(seqs), min_size=1, max_size=len(seqs), unique=True))
        counts = [data.draw(st.integers(0, 20)) for _ in chosen]
        need = sum(max(0, -(-(self.cache.length(s) + m) // 16) - len(self.cache.pages_of(s)))
                   for s, m in zip(chosen, counts))
        if need > self.cache.free_pages() or any(self.cache.length(s) + m > self.cache.max_tokens
                                                 for s, m in zip(chosen, counts)):
            with pytest.raises((RuntimeError, ValueError)):
                self.cache.schedule(chosen, counts)
            return
        before = page_state(self.cache)
        batch = self.cache.schedule(chosen, counts)
        writable = {p for s, m in zip(chosen, counts) if m for p in self.cache.pages_of(s)[self.cache.length(s) // 16:]}
        k = torch.randn(sum(counts), H, D, generator=self.gen)
        v = torch.randn(sum(counts), H, D, generator=self.gen)
        for layer in range(2):
            self.cache.append(layer, batch, k, v)
        self.cache.commit(batch)
        self.writes_only(before, writable)
        start = 0
        for s, m in zip(chosen, counts):
            ok, ov = self.tokens[s]
            self.tokens[s] = (torch.cat([ok, k[start : start + m]]), torch.cat([ov, v[start : start + m]]))
            start += m

    @precondition(lambda self: self.cache.sequences() and len(self.cache.sequences()) < 4)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(self.cache.sequences()))
        if self.cache.length(seq) % 16 and self.cache.free_pages() == 0:
            with pytest.raises(RuntimeError, match="no free page for the fork's open page"):
                self.cache.fork(seq)
            return
        before = page_state(self.cache)
        child = self.cache.fork(seq)
        shared = self.cache.length(seq) // 16
        assert self.cache.pages_of(child)[:shared] == self.cache.pages_of(seq)[:shared]
        self.writes_only(before, set(self.cache.pages_of(child)[shared:]))
        self.tokens[child] = self.tokens[seq]

    @precondition(lambda self: self.cache.sequences())
    @rule(data=st.data())
    def evict(self, data):
        seq = data.draw(st.sampled_from(self.cache.sequences()))
        before = page_state(self.cache)
        self.cache.remove(seq)
        del self.tokens[seq]
        self.writes_only(before, set())

    @invariant()
    def pages_are_counted(self):
        if not hasattr(self, "cache"):
            return
        used = [p for s in self.cache.sequences() for p in self.cache.pages_of(s)]
        assert self.cache.free_pages() == self.cache.num_pages - len(set(used))
        refs = [0] * self.cache.num_pages
        for p in used:
            refs[p] += 1
        assert refs == [self.cache.refcount(p) for p in range(self.cache.num_pages)]

    @invariant()
    def attention_matches_the_reference(self):
        if not hasattr(self, "cache") or not self.cache.sequences():
            return
        seqs = self.cache.sequences()
        q = torch.randn(len(seqs), 4, D, generator=self.gen)
        batch = self.cache.schedule(seqs, [0] * len(seqs))
        got = self.cache.attend(1, batch, q)
        want = ref.paged_decode_attention(q, *self.cache.layer_tensors(1), batch.block_tables, batch.side_slots,
                                          batch.lengths, self.scheme.k_bits, self.scheme.v_bits, self.scheme.block,
                                          self.scheme.recent, self.cache.rope_cos, self.cache.rope_sin, False,
                                          self.cache.k_signs, self.cache.v_signs)
        keys = torch.cat([self.tokens[s][0] for s in seqs])
        values = torch.cat([self.tokens[s][1] for s in seqs])
        assert (got - want).abs().max().item() <= float_tolerance(q, keys, values, torch.float32)
        # and each sequence's attention is its own: near plain attention over its own tokens
        for i, s in enumerate(seqs):
            k, v = self.tokens[s]
            if len(k) == 0:
                assert torch.equal(got[i], torch.zeros_like(got[i]))
                continue
            plain = attention_fp32(q[i : i + 1], k.transpose(0, 1)[None], v.transpose(0, 1)[None], [len(k)])
            assert (got[i] - plain[0]).abs().max().item() < 1.0  # 2-4 bit steps on unit normals: far below 1


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=8, stateful_step_count=12, deadline=None)


# ------------------------------------------------------------------------------------------------
# Compile, bytes, errors
# ------------------------------------------------------------------------------------------------


class PagedStep(torch.nn.Module):
    """One decode step of one attention layer over a PagedQuantizedKVCache: project, rotate, append, attend."""

    def __init__(self, cache, heads=4, d_model=64):
        super().__init__()
        self.cache, self.heads = cache, heads
        self.qkv = torch.nn.Linear(d_model, (heads + 2 * H) * D, bias=False)
        cos, sin = tables_for()
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, block_tables, side_slots, lengths, positions, query_start_loc):
        from torch_rkv.paged import PagedBatch

        b = x.shape[0]
        qkv = self.qkv(x).view(b, self.heads + 2 * H, D)
        q, k, v = qkv[:, : self.heads], qkv[:, self.heads : self.heads + H], qkv[:, self.heads + H :]
        q = torch_rkv.rope(q, self.cos, self.sin, positions[:, None])
        k = torch_rkv.rope(k, self.cos, self.sin, positions[:, None])
        batch = PagedBatch([], [], block_tables, side_slots, lengths, query_start_loc, positions, 1)
        self.cache.append(0, batch, k, v)
        return self.cache.attend(0, batch, q)


def test_compiled_paged_decode_does_not_recompile_as_lengths_grow_or_the_batch_changes():
    torch._dynamo.reset()
    torch.manual_seed(0)
    scheme = presets.recommended(4).replace(k_block_tokens=16, recent=8)
    eager_cache, compiled_cache = paged_cache(scheme), paged_cache(scheme)
    eager = PagedStep(eager_cache)
    block = PagedStep(compiled_cache)
    block.load_state_dict(eager.state_dict())
    step = torch.compile(block, fullgraph=True, dynamic=True)
    from torch._dynamo.utils import counters

    seqs = [[c.add() for _ in range(3)] for c in (eager_cache, compiled_cache)]
    frames = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for i in range(30):  # crosses page and block boundaries; the batch shrinks and grows
            live = 3 if i % 3 else 2
            x = torch.randn(live, 64)
            outs = []
            for cache, module, ids in ((eager_cache, eager, seqs[0]), (compiled_cache, step, seqs[1])):
                batch = cache.schedule(ids[:live], [1] * live)
                outs.append(module(x, batch.block_tables, batch.side_slots, batch.lengths, batch.positions,
                                   batch.query_start_loc))
                cache.commit(batch)
            assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5), i
    assert counters["stats"]["unique_graphs"] - frames == 1
    assert torch.equal(page_state(eager_cache), page_state(compiled_cache))


def test_bytes_are_counted_by_hand():
    """rkv-4 with kv_heads 2, head_dim 64, pages of 128 tokens, fp16 side rows, worked out by hand from
    docs/format.md: codes 2 heads x 128 rows x 32 bytes = 8192 per side; key metadata 2 heads x 1 block
    x 64 channels x 2 B = 256 each for scale and zero; value metadata 2 heads x 128 rows x 1 group x 2 B =
    512 each. Regions at 16-byte boundaries: 8192 + 8192 + 256 + 256 + 512 + 512 = 17920 bytes a page.
    A side slot: sinks 4 + window 64 + 127 rows, x 2 heads x 64 x 2 B, keys and values: 99840."""
    layout = PageLayout(presets.recommended(4), 2, 64, 128, torch.float16)
    assert layout.page_bytes == 17920 and layout.payload_bytes == 17920
    assert layout.slot_bytes == (4 + 64 + 127) * 2 * 64 * 2 * 2 == 99840
    assert layout.sequence_bytes(1000) == 8 * 17920 + 99840
    cache = PagedQuantizedKVCache(presets.recommended(4), 3, 2, 64, 10, 2, dtype=torch.float16,
                                  rope=torch_rkv.rope_tables(64, 1280))
    allocated = sum(t.numel() * t.element_size() for n, t in cache.named_buffers()
                    if n in (*cache.regions, "k_window", "v_window", "k_sink", "v_sink", "page_fill"))
    assert cache.nbytes() == allocated == 3 * (10 * 17920 + 2 * 99840 + 10 * 4)
    # 3-bit, symmetric values, fp32 metadata, 24-code-byte rows: regions pad to 16 bytes
    odd = PageLayout(Scheme(k_bits=3, v_bits=3, v_symmetric=True, meta_dtype=torch.float32), 1, 64, 16)
    # codes 16 x 24 = 384 each; key scale + zero 16 x 4 = 64 each; value scale 64
    assert odd.offsets == {"k_codes": 0, "v_codes": 384, "k_scale": 768, "k_zero": 832, "v_scale": 896}
    assert odd.page_bytes == 960


def error_setup(device="cpu"):
    scheme = presets.kivi(4, block=16, recent=4)
    layout = PageLayout(scheme, 1, 32, 16, torch.float32)
    pool = Pool(layout, 4, 2, torch.Generator().manual_seed(0), zeros=True).clone(device)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=device)
    return scheme, pool, tables, slots


def append_call(scheme, pool, tables, slots, lengths, counts, fill=True, slot_mapping=None, device="cpu"):
    qsl = torch.tensor([0] + counts, device=device).cumsum(0)
    k = torch.randn(sum(counts), 1, 32, device=device)
    fmt = CacheFormat(scheme.k_bits, scheme.v_bits, scheme.block, scheme.recent)
    ops.paged_append(*pool.sides(), k, k.clone(), fmt, lengths=torch.tensor(lengths, device=device),
                     query_start_loc=qsl, block_tables=tables, side_slots=slots,
                     page_fill=pool.fill if fill else None, slot_mapping=slot_mapping)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_bad_input_names_the_argument(device):
    dev = "cpu" if device == "meta" else device
    s, pool, tables, slots = error_setup(dev)
    static = [
        (lambda: append_call(s, pool, tables[:1], slots, [0, 0], [1, 1], device=dev), ValueError,
         "rkv.paged_append: block_tables must have shape (2, max_pages,) with one row per sequence"),
        (lambda: append_call(s, pool, tables.long(), slots, [0, 0], [1, 1], device=dev), TypeError,
         "rkv.paged_append: block_tables must be int32"),
        (lambda: append_call(s, pool, tables, slots, [0], [1, 1], device=dev), ValueError,
         "rkv.paged_append: query_start_loc must have shape (2,)"),
    ]
    data = [
        (lambda: append_call(s, pool, torch.tensor([[0, 7], [2, 3]], dtype=torch.int32, device=dev), slots, [15, 0],
                             [2, 1], device=dev), ValueError,
         "rkv.paged_append: block_tables[0][1] = 7 is outside the pool of 4 pages"),
        (lambda: append_call(s, pool, tables, slots, [30, 0], [3, 1], device=dev), ValueError,
         "rkv.paged_append: appending 3 tokens to sequence 0 of 30 tokens exceeds its capacity of 32 tokens "
         "(2 pages of 16)"),
        (lambda: append_call(s, pool, tables, torch.tensor([0, 5], dtype=torch.int32, device=dev), [0, 0], [1, 1],
                             device=dev), ValueError, "rkv.paged_append: side_slots[1] = 5 is outside the 2 side slots"),
        (lambda: append_call(s, pool, torch.tensor([[0, 1], [0, 3]], dtype=torch.int32, device=dev), slots, [0, 0],
                             [1, 1], device=dev), ValueError,
         "rkv.paged_append: page 0 receives new tokens of sequences 0 and 1"),
        (lambda: append_call(s, pool, tables, slots, [0, 0], [1, 1], slot_mapping=torch.tensor([0, 5], device=dev),
                             device=dev), ValueError,
         "rkv.paged_append: slot_mapping[1] = 5 but the block table puts that token at slot 32"),
    ]
    if device == "meta":

        static = [(lambda f=f: _fake(f), e, m) for f, e, m in static]
        data = []
    if device == "cuda":
        data = []  # a device-side assert would poison the CUDA context; the CPU checks these
    for call, exc, msg in static + data:
        with pytest.raises(exc, match=re.escape(msg)):
            call()


def _fake(fn):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return fn()


def test_a_write_into_a_full_page_is_refused_and_changes_nothing():
    s, pool, tables, slots = error_setup()
    append_call(s, pool, tables, slots, [0, 0], [16, 3])  # page 0 is full (quantized) now
    assert pool.fill.tolist() == [16, 0, 0, 0]
    before = pool.clone()
    shared = torch.tensor([[2, 3], [0, 1]], dtype=torch.int32)  # sequence 1 now addresses full page 0
    with pytest.raises(ValueError, match=re.escape("rkv.paged_append: sequence 1 writes row 3 of page 0, which "
                                                   "already holds 16 quantized rows (a full page is immutable)")):
        append_call(s, pool, shared, slots, [3, 3], [1, 1])
    assert pool.equal(before)
    # without the page counts there is no guard: the engine's own bookkeeping then decides
    append_call(s, pool, shared, slots, [3, 3], [1, 1], fill=False)


def test_decode_and_prefill_errors_name_the_argument():
    s, pool, tables, slots = error_setup()
    append_call(s, pool, tables, slots, [0, 0], [5, 5])
    q = torch.randn(2, 2, 32)
    k, v = pool.sides()
    with pytest.raises(ValueError, match=re.escape("rkv.paged_decode_attention: lengths[1] = 40 is outside [0, 32] "
                                                   "(2 pages of 16 tokens)")):
        ops.paged_decode_attention(q, k, v, s.format, lengths=torch.tensor([5, 40]), block_tables=tables,
                                   side_slots=slots)
    with pytest.raises(ValueError, match=re.escape("rkv.paged_decode_attention: lengths must have shape (2,)")):
        ops.paged_decode_attention(q, k, v, s.format, lengths=torch.tensor([5]), block_tables=tables, side_slots=slots)
    with pytest.raises(ValueError, match=re.escape("rkv.paged_decode_attention: block_tables[0][0] = -1 is outside")):
        ops.paged_decode_attention(q, k, v, s.format, lengths=torch.tensor([5, 5]),
                                   block_tables=torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32), side_slots=slots)
    kn = torch.randn(3, 1, 32)
    with pytest.raises(ValueError, match=re.escape("more than max_query_len (1)")):
        ops.paged_prefill_attention(torch.randn(3, 2, 32), kn, kn, k, v, s.format,
                                    query_start_loc=torch.tensor([0, 1, 3]), max_query_len=1, lengths=torch.tensor([5, 5]), block_tables=tables,
                                    side_slots=slots)
    with pytest.raises(ValueError, match=re.escape("rkv.paged_prefill_attention: k_new must have shape (3, 1, 32)")):
        ops.paged_prefill_attention(torch.randn(3, 2, 32), kn[:2], kn[:2], k, v, s.format,
                                    query_start_loc=torch.tensor([0, 1, 3]), max_query_len=2,
                                    lengths=torch.tensor([5, 5]), block_tables=tables, side_slots=slots)


def test_paged_copy_copies_pages_and_slots_and_names_bad_ids():
    s, pool, tables, slots = error_setup()
    append_call(s, pool, tables, slots, [0, 0], [20, 7])
    want = pool.clone()
    ref.paged_copy(*want.tensors(), want.fill, torch.tensor([1]), torch.tensor([3]), torch.tensor([0]),
                   torch.tensor([1]))
    ops.paged_copy(*pool.sides(), src_pages=torch.tensor([1]), dst_pages=torch.tensor([3]),
                   src_slots=torch.tensor([0]), dst_slots=torch.tensor([1]), page_fill=pool.fill)
    assert pool.equal(want) and torch.equal(pool.raw[3], pool.raw[1])
    with pytest.raises(ValueError, match=re.escape("rkv.paged_copy: src_pages[0] = 4 or dst_pages[0] = 0 is outside "
                                                   "the 4 pages")):
        ops.paged_copy(*pool.sides(), src_pages=torch.tensor([4]), dst_pages=torch.tensor([0]),
                       src_slots=torch.tensor([0]), dst_slots=torch.tensor([1]), page_fill=pool.fill)
    with pytest.raises(ValueError, match=re.escape("rkv.paged_copy: dst_slots names side slots 1 twice")):
        ops.paged_copy(*pool.sides(), src_pages=torch.tensor([1]), dst_pages=torch.tensor([3]),
                       src_slots=torch.tensor([0, 0]), dst_slots=torch.tensor([1, 1]), page_fill=pool.fill)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_paged_copy_names_bad_buffers(device):
    """Shapes and dtypes of what paged_copy copies, named alike by the kernel and the fake kernel."""
    dev = "cpu" if device == "meta" else device
    _, pool, _, _ = error_setup(dev)
    t = pool.tensors()
    outl = torch.zeros(4, 1, 1, 3, dtype=torch.int32, device=dev)  # pages, heads, blocks per page, entries

    def call(tensors=t, src=(1,), dst=(3,), k_outliers=None, v_outliers=None):
        def copy():
            ids = [torch.tensor(v, device=dev) for v in (src, dst, (0,), (1,))]
            return ops.paged_copy(*split_sides(tensors, outliers=(k_outliers, v_outliers)), page_fill=pool.fill,
                                  **dict(zip(("src_pages", "dst_pages", "src_slots", "dst_slots"), ids)))

        return _fake(copy) if device == "meta" else copy()

    call(k_outliers=outl, v_outliers=outl.clone())
    cases = [
        ({"k_outliers": outl.float()}, TypeError, "rkv.paged_copy: k_outliers must be int32"),
        ({"v_outliers": outl[:3]}, ValueError,
         "rkv.paged_copy: v_outliers must have shape (pages=4, kv_heads, blocks, outliers), got [3, 1, 1, 3]"),
        ({"src": (1,), "dst": (2, 3)}, ValueError,
         "rkv.paged_copy: src_pages and dst_pages must have the same length, got 1 and 2"),
        ({"tensors": [t[0], t[1][:3], *t[2:]]}, ValueError, "rkv.paged_copy: k_scale must have shape (pages=4, "),
        ({"tensors": [*t[:9], t[9][:1]]}, ValueError, "rkv.paged_copy: v_sink must have shape (slots=2, "),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            call(**kw)


def test_the_cache_refuses_what_the_pool_cannot_hold():
    cache = paged_cache(presets.kivi(4, block=16, recent=4), pages=3, seqs=2, max_pages=2)
    a = cache.add()
    cache.add()
    with pytest.raises(RuntimeError, match="all 2 sequence slots are in use"):
        cache.add()
    with pytest.raises(ValueError, match=re.escape("sequence 0 of 0 tokens cannot take 40 more (at most 32 tokens")):
        cache.schedule([a], [40])
    cache.schedule([a], [32])
    with pytest.raises(RuntimeError, match="2 new pages needed, 1 free"):
        cache.schedule([1], [17])
    with pytest.raises(KeyError, match="no sequence 7"):
        cache.remove(7)
    assert math.isfinite(cache.nbytes())
