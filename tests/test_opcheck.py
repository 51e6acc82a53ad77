"""torch.library.opcheck on every rkv op (schema, fake kernel vs real kernel, aot dispatch), and
torch.compile(fullgraph=True) of functions chaining them."""

import pytest
import torch
from cachebuild import buffers_args, build
from conftest import DEVICES, RKV_OPS, noncontiguous

import torch_rkv
from torch_rkv import scheme as presets
from torch_rkv.layout import CacheLayout
from torch_rkv.scheme import Scheme


def samples(device):
    """(op, args) pairs: contiguous, non-contiguous and empty inputs for every op."""
    x = torch.randn(2, 3, 16, 64, device=device)
    xh = x.half()
    empty = torch.randn(0, 16, 64, device=device)
    out = []
    for bits, g, t, sym, meta in [(4, 64, 1, False, torch.float16), (3, 16, 1, True, torch.float32),
                                  (2, 1, 8, False, torch.bfloat16), (8, 32, 4, False, torch.float16)]:
        for inp in (x, noncontiguous(xh), empty):
            out.append((torch.ops.rkv.quantize.default, (inp, bits, g, t, sym, meta)))
        if not sym:
            out.append((torch.ops.rkv.quantize.default, (x, bits, g, t, sym, meta, True)))
        p, s, z = torch.ops.rkv.quantize(x, bits, g, t, sym, meta)
        out.append((torch.ops.rkv.dequantize.default, (p, s, None if sym else z, bits, torch.float32)))
        out.append((torch.ops.rkv.dequantize.default, (noncontiguous(p), s, None if sym else z, bits, torch.bfloat16)))
        if not sym and bits < 8:  # non-uniform levels
            lv = torch.linspace(0.25, 2**bits - 1.5, 2**bits, device=device)
            out.append((torch.ops.rkv.quantize.default, (x, bits, g, t, sym, meta, True, 0, lv)))
            out.append((torch.ops.rkv.dequantize.default, (p, s, z, bits, torch.float32, lv)))
        codes = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8, device=device)
        out.append((torch.ops.rkv.pack.default, (codes, bits)))
        out.append((torch.ops.rkv.pack.default, (noncontiguous(codes), bits)))
        out.append((torch.ops.rkv.unpack.default, (torch_rkv.pack(codes, bits), bits)))
        out.append((torch.ops.rkv.unpack.default, (torch.empty(0, 5, 8 * bits, dtype=torch.uint8, device=device), bits)))
    cos, sin = (t.to(device) for t in torch_rkv.rope_tables(64, 128, rot_dim=32))
    for inter in (False, True):
        out.append((torch.ops.rkv.rope.default, (x, cos, sin, torch.arange(16, device=device), inter, False)))
        out.append((torch.ops.rkv.rope.default, (noncontiguous(xh), cos, sin, torch.arange(16, device=device), inter, True)))
        out.append((torch.ops.rkv.rope.default, (empty, cos, sin, torch.arange(16, device=device), inter, False)))
    signs = torch_rkv.hadamard_signs(64, device=device)
    for inv in (False, True):
        out.append((torch.ops.rkv.hadamard.default, (x, signs, inv)))
        out.append((torch.ops.rkv.hadamard.default, (noncontiguous(xh), None, inv)))
        out.append((torch.ops.rkv.hadamard.default, (empty, None, inv)))
    return out + cache_samples(device)


def cache_samples(device):
    """cache_append into empty, partly filled and block-completing sequences (and with clipping), and
    decode_attention with post-RoPE, pre-RoPE and Hadamard keys."""
    out = []
    s = presets.recommended(4).replace(sinks=2, recent=4, k_block_tokens=8)
    bufs = CacheLayout(s, 2, 2, 64, 40, torch.float16).allocate(device)
    k = torch.randn(2, 2, 9, 64, device=device).half()
    lv = torch.linspace(0.5, 14.0, 16, device=device)
    for lengths, clip in (([0, 5], False), ([20, 31], False), ([3, 20], True)):
        out.append((torch.ops.rkv.cache_append.default, (*buffers_args(bufs), torch.tensor(lengths, device=device), k,
                                                         k.clone(), 4, 4, s.block, s.recent, clip, clip)))
    out.append((torch.ops.rkv.cache_append.default, (*buffers_args(bufs), torch.tensor([3, 20], device=device), k,
                                                     k.clone(), 4, 4, s.block, s.recent, True, False, 0, lv, lv)))
    for key_space in ("post", "pre", "hadamard"):
        s = Scheme(k_bits=4, v_bits=4, k_group_size=1, k_block_tokens=8, v_group_size=16, v_block_tokens=1,
                   pre_rope=key_space == "pre", k_hadamard=key_space == "hadamard", v_hadamard=key_space != "post",
                   sinks=1, recent=4)
        case = dict(d=64, kv_heads=2, q_heads=6, scheme=s, capacity=40, lengths=[40, 9], rot=64, interleaved=False,
                    q_dtype=torch.float16, fp_dtype=torch.float16, split=16, seed=1)
        _, bufs, q, _, _, rope, ks, vs = build(case, device)
        lengths = torch.tensor(case["lengths"], device=device)
        out.append((torch.ops.rkv.decode_attention.default,
                    (q, *buffers_args(bufs), lengths, 4, 4, s.block, s.recent, rope[0], rope[1], False, ks, vs, 0.125,
                     16)))
        out.append((torch.ops.rkv.decode_attention.default,
                    (q, *buffers_args(bufs), lengths, 4, 4, s.block, s.recent, rope[0], rope[1], False, ks, vs, 0.125,
                     16, 0, 0.0, lv, lv)))
    # a sliding-window ring (appended past its rows) and soft-capped scores
    s = Scheme(k_bits=4, v_bits=4, k_group_size=1, k_block_tokens=8, v_group_size=16, v_block_tokens=1, pre_rope=True,
               sinks=1, recent=4)
    case = dict(d=64, kv_heads=2, q_heads=6, scheme=s, capacity=40, lengths=[40, 9], rot=64, interleaved=False,
                q_dtype=torch.float16, fp_dtype=torch.float16, split=16, seed=1, window=12)
    _, bufs, q, _, _, rope, _, _ = build(case, device)
    assert bufs["k_packed"].shape[2] < 40  # a ring
    lengths = torch.tensor(case["lengths"], device=device)
    out.append((torch.ops.rkv.decode_attention.default,
                (q, *buffers_args(bufs), lengths, 4, 4, s.block, s.recent, rope[0], rope[1], False, None, None, 0.125,
                 0, 12, 5.0)))
    sink_logits = torch.linspace(-2.0, 3.0, 6, device=device)  # learned attention sinks, one per query head
    out.append((torch.ops.rkv.decode_attention.default,
                (q, *buffers_args(bufs), lengths, 4, 4, s.block, s.recent, rope[0], rope[1], False, None, None, 0.125,
                 16, 12, 0.0, None, None, None, None, sink_logits)))
    out.append((torch.ops.rkv.cache_append.default,
                (*buffers_args(bufs), lengths, k[:, :, :9], k[:, :, :9].clone(), 4, 4, s.block, s.recent, False, False,
                 12)))
    return out + outlier_samples(device) + paged_samples(device) + refine_samples(device)


def outlier_samples(device):
    """Every cache op with sparse-outlier buffers: contiguous appends and decode, and the paged ops over a
    PagedQuantizedKVCache's layer (region views, outliers included) after a prefill."""
    from torch_rkv.cache import layer_outliers
    from torch_rkv.paged import PagedQuantizedKVCache

    out = []
    s = presets.recommended(2).replace(sinks=2, recent=4, k_block_tokens=8, outliers=0.02)
    cos, sin = (t.to(device) for t in torch_rkv.rope_tables(64, 256))
    case = dict(d=64, kv_heads=2, q_heads=6, scheme=s, capacity=40, lengths=[40, 9], rot=64, interleaved=False,
                q_dtype=torch.float16, fp_dtype=torch.float16, split=16, seed=1)
    _, bufs, q, _, _, rope, _, vs = build(case, device)
    outl = (bufs["k_outliers"], bufs["v_outliers"])
    lengths = torch.tensor(case["lengths"], device=device)
    out.append((torch.ops.rkv.decode_attention.default,
                (q, *buffers_args(bufs), lengths, 2, 2, s.block, s.recent, *rope, False, None, vs, 0.125, 16, 0, 0.0,
                 None, None, *outl)))
    k = torch.randn(2, 2, 9, 64, device=device).half()
    out.append((torch.ops.rkv.cache_append.default,
                (*buffers_args(bufs), torch.tensor([3, 20], device=device), k, k.clone(), 2, 2, s.block, s.recent,
                 True, True, 0, None, None, *outl)))
    cache = PagedQuantizedKVCache(s, 1, 2, 64, 8, 2, dtype=torch.float16, device=device, rope=(cos, sin))
    seqs = [cache.add(), cache.add()]
    batch = cache.schedule(seqs, [20, 9])
    kr = torch.randn(29, 2, 64, device=device).half()
    cache.append(0, batch, kr, kr.clone())
    cache.commit(batch)
    t = cache.layer_tensors(0)
    po = layer_outliers(cache, 0)
    batch = cache.schedule(seqs, [1, 1])
    common = (batch.block_tables, batch.side_slots)
    out.append((torch.ops.rkv.paged_append.default,
                (*t, None, *common, batch.lengths, batch.query_start_loc, kr[:2], kr[:2].clone(), 2, 2, s.block,
                 s.recent, True, True, None, None, None, *po)))
    out.append((torch.ops.rkv.paged_decode_attention.default,
                (q[:2], *t, *common, batch.lengths, 2, 2, s.block, s.recent, cache.rope_cos, cache.rope_sin, False,
                 None, cache.v_signs, 0.125, 8, 0, 0.0, None, None, *po, q.new_ones(6, dtype=torch.bfloat16))))
    out.append((torch.ops.rkv.paged_prefill_attention.default,
                (q[:2], kr[:2], kr[:2].clone(), batch.query_start_loc, 1, *t, *common, batch.lengths, 2, 2, s.block,
                 s.recent, cache.rope_cos, cache.rope_sin, False, None, cache.v_signs, 0.125, 0, 0, 0.0, None, None,
                 *po, torch.linspace(-1.0, 2.0, 6, device=device))))
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    out.append((torch.ops.rkv.paged_copy.default,
                (*t, None, torch.tensor([1], device=device), torch.tensor([5], device=device), empty, empty, *po)))
    return out


def refine_samples(device):
    """Every cache op with refined key channels, over contiguous buffers (the paged ops' page b / slot b)."""
    from cachebuild import refined_buffers

    gen = torch.Generator().manual_seed(3)
    bufs, channels = refined_buffers(2, 2, 24, 32, 2, 4, 8, 4, 2, 8, 2, torch.float16, gen)
    b = [bufs[n].to(device) for n in ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero", "k_window",
                                       "v_window", "k_sink", "v_sink")]
    refine, channels = bufs["k_refine"].to(device), channels.to(device)
    k = torch.randn(2, 2, 9, 32, generator=gen).to(device)
    lengths = torch.tensor([0, 7], device=device)
    cos, sin = (t.to(device) for t in torch_rkv.rope_tables(32, 64))
    q = torch.randn(2, 4, 32, generator=gen).to(device)
    qsl = torch.tensor([0, 2, 5], device=device)
    kn = torch.randn(5, 2, 32, generator=gen).to(device)
    return [
        (torch.ops.rkv.cache_append.default,
         (*b, lengths, k, k.clone(), 2, 4, 8, 4, True, False, 0, None, None, None, None, refine, channels)),
        (torch.ops.rkv.decode_attention.default,
         (q, *b, lengths + 9, 2, 4, 8, 4, cos, sin, False, None, None, 0.2, 8, 0, 0.0, None, None, None, None, None,
          refine, channels)),
        (torch.ops.rkv.paged_append.default,
         (*b, None, None, None, lengths, qsl, kn, kn.clone(), 2, 4, 8, 4, True, False, None, None, None, None, None,
          refine, channels)),
        (torch.ops.rkv.paged_decode_attention.default,
         (q, *b, None, None, lengths + 9, 2, 4, 8, 4, cos, sin, False, None, None, 0.2, 0, 0, 0.0, None, None, None,
          None, None, refine, channels)),
        (torch.ops.rkv.paged_prefill_attention.default,
         (q[:1].expand(5, -1, -1).contiguous(), kn, kn.clone(), qsl, 3, *b, None, None, lengths + 9, 2, 4, 8, 4, cos, sin,
          False, None, None, 0.2, 0, 0, 0.0, None, None, None, None, None, refine, channels)),
        (torch.ops.rkv.paged_copy.default,
         (*b, None, torch.tensor([0], device=device), torch.tensor([1], device=device),
          torch.tensor([1], device=device), torch.tensor([0], device=device), None, None, refine)),
    ]


def paged_samples(device):
    """The paged ops over a pool whose regions are views into one page buffer (pages any stride apart):
    appends with and without page counts and slot_mapping, decode and prefill with pre-RoPE and Hadamard
    keys, and page copies."""
    from pagedbuild import Pool, random_tables

    from torch_rkv.layout import PageLayout

    out = []
    gen = torch.Generator().manual_seed(0)
    on = lambda t: t.to(device)  # noqa: E731
    lv = on(torch.linspace(0.5, 14.0, 16))
    for key_space in ("pre", "hadamard"):
        s = presets.recommended(4).replace(sinks=2, recent=4, k_block_tokens=8, pre_rope=key_space == "pre",
                                           k_hadamard=key_space == "hadamard")
        pool = Pool(PageLayout(s, 2, 64, 16, torch.float16), 8, 3, gen, zeros=True).clone(device)
        tables = on(random_tables(gen, 8, [20, 9], 16, 3))
        slots = on(torch.tensor([2, 0], dtype=torch.int32))
        k = on(torch.randn(14, 2, 64, generator=gen).half())
        for lengths, fill, slot_map in (([0, 0], True, False), ([5, 3], False, True)):
            qsl = on(torch.tensor([0, 9, 14]))
            mapping = None
            if slot_map:
                t = tables.cpu().long()
                mapping = on(torch.tensor([int(t[b, p // 16]) * 16 + p % 16 for b, (n, m) in
                                           enumerate(zip(lengths, (9, 5))) for p in range(n, n + m)]))
            out.append((torch.ops.rkv.paged_append.default,
                        (*pool.tensors(), pool.fill if fill else None, tables, slots, on(torch.tensor(lengths)), qsl, k,
                         k.clone(), 4, 4, s.block, s.recent, False, False, mapping, lv if slot_map else None, lv)))
        cos, sin = (on(t) for t in torch_rkv.rope_tables(64, 64))
        rope = (cos, sin) if key_space == "pre" else (None, None)
        signs = on(torch_rkv.hadamard_signs(64, 1)) if key_space == "hadamard" else None
        vs = on(torch_rkv.hadamard_signs(64, 2))
        lengths = on(torch.tensor([14, 3]))
        q = on(torch.randn(2, 6, 64, generator=gen).half())
        out.append((torch.ops.rkv.paged_decode_attention.default,
                    (q, *pool.tensors(), tables, slots, lengths, 4, 4, s.block, s.recent, *rope, False, signs, vs,
                     0.125, 8, 0, 0.0, lv, lv)))
        qp = on(torch.randn(7, 6, 64, generator=gen).half())
        out.append((torch.ops.rkv.paged_prefill_attention.default,
                    (qp, k[:7], k[:7].clone(), on(torch.tensor([0, 3, 6])), 3, *pool.tensors(), tables, slots, lengths,
                     4, 4, s.block, s.recent, *rope, False, signs, vs, 0.125, 0, 5, 3.0, None, lv)))
        out.append((torch.ops.rkv.paged_copy.default,
                    (*pool.tensors(), pool.fill, on(torch.tensor([1, 2])), on(torch.tensor([5, 6])),
                     on(torch.tensor([0])), on(torch.tensor([1])))))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RKV_OPS)
def test_opcheck(device, name):
    """Every registered op (the list comes from the schemas): an op without samples here fails."""
    cases = [(op, args) for op, args in samples(device) if op.name().endswith(f"::{name}")]
    assert cases, f"no opcheck samples for rkv::{name}"
    for op, args in cases:
        torch.library.opcheck(op, args)


def chain(x, cos, sin, pos, signs):
    """A pre-RoPE, Hadamard-rotated 4-bit round trip, as the cache and attention use the ops."""
    pre = torch_rkv.rope(x, cos, sin, pos, inverse=True)
    q = torch_rkv.quantize(torch_rkv.hadamard(pre, signs), 4, group_size=32)
    back = torch_rkv.hadamard(torch_rkv.dequantize(q, x.dtype), signs, inverse=True)
    codes = torch_rkv.unpack(q.packed, 4)
    return torch_rkv.rope(back, cos, sin, pos), torch_rkv.pack(codes, 4), q.scale


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    cos, sin = (t.to(device) for t in torch_rkv.rope_tables(64, 256))
    signs = torch_rkv.hadamard_signs(64, device=device)
    compiled = torch.compile(chain, fullgraph=True, dynamic=True)
    for n in (16, 24):  # two shapes, one dynamic graph
        x = torch.randn(2, 3, n, 64, device=device)
        pos = torch.arange(n, device=device)
        got, want = compiled(x, cos, sin, pos, signs), chain(x, cos, sin, pos, signs)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
