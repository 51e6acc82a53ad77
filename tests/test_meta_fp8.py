"""Float8 e4m3 metadata (rkv-lean's values): quantize, the cache append and decode through the C++ CPU
kernels and the Triton kernels (interpreted) against the reference, bit for bit where the reference is,
on groups whose scales fall on every part of e4m3's grid: subnormal, normal, and saturated at 448."""

import pytest
import torch

import torch_rkv
from torch_rkv import reference as ref
from torch_rkv.cache import QuantizedKVCache
from torch_rkv.gpu import registry
from torch_rkv.scheme import Scheme

E4M3 = torch.float8_e4m3fn
# per-token magnitudes from 1e-4 (scales below e4m3's smallest normal, 2^-6) to 300 (zeros near -448,
# scales of tens; a group past 448 saturates)
MAGNITUDES = torch.tensor([1e-4, 3e-3, 0.02, 0.5, 1.0, 7.0, 60.0, 300.0])


def tokens(gen, batch, heads, n, dim):
    x = torch.randn(batch, heads, n, dim, generator=gen)
    return x * MAGNITUDES[torch.randint(0, len(MAGNITUDES), (batch, heads, n, 1), generator=gen)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_on_every_part_of_the_grid(bits, symmetric):
    """rkv.quantize / dequantize with e4m3 metadata: the CPU kernel and the Triton kernel each equal the
    reference bit for bit, per-token and per-channel groups, values past 448 included."""
    gen = torch.Generator().manual_seed(bits)
    x = tokens(gen, 1, 3, 32, 64)[0]
    x[0, 3, 5] = 1000.0  # beyond e4m3's range: the group's scale grows
    x[1, 7] = -600.0 - torch.rand(64, generator=gen) * 400  # a whole token beyond it: its zero saturates at -448
    for group, block in ((64, 1), (1, 8), (16, 2)):
        want = ref.quantize(x, bits, group, block, symmetric, E4M3)
        for impl in ("cpu", "triton"):
            ctx = registry.on_cpu() if impl == "triton" else torch.no_grad()
            with ctx:
                q = torch_rkv.quantize(x, bits, group, block, symmetric, E4M3)
                back = torch_rkv.dequantize(q)
            got = (q.packed, q.scale, torch.empty(0, dtype=E4M3) if q.zero is None else q.zero)
            for name, a, b in zip(("packed", "scale", "zero"), got, want):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (impl, group, block, name)
            zero = None if symmetric else want[2]
            assert torch.equal(back, ref.dequantize(want[0], want[1], zero, bits)), (impl, group, block)


def lean(bits: int) -> Scheme:
    """rkv-lean's layout at test sizes: blocks of 8 tokens, 2 sinks, 4 recent."""
    return Scheme(k_bits=bits, v_bits=bits, k_group_size=1, k_block_tokens=8, k_clip=bits == 2, v_hadamard=True,
                  sinks=2, recent=4, v_meta_dtype=E4M3)


@pytest.mark.parametrize("bits", [2, 4])
def test_cache_append_and_decode_as_the_reference(bits):
    """A contiguous cache of rkv-lean's layout filled by appends of several sizes: every buffer of the C++
    and the Triton append equal (bit for bit), the dequantized cache equals reference.dequantize of its
    and both decodes agree with attention over the cache as QuantizedKVCache.dequantized reads it."""
    s = lean(bits)
    gen = torch.Generator().manual_seed(bits)
    caches = {impl: QuantizedKVCache(s, 1, 2, 2, 64, 64, dtype=torch.float32) for impl in ("cpu", "triton")}
    steps = [(m, tokens(gen, 2, 2, m, 64), tokens(gen, 2, 2, m, 64)) for m in (5, 1, 11, 8, 3)]
    q = torch.randn(2, 4, 64, generator=gen)
    out = {}
    for impl, cache in caches.items():
        ctx = registry.on_cpu() if impl == "triton" else torch.no_grad()
        with ctx:
            for _, k, v in steps:
                cache.append(0, k, v)
            out[impl] = cache.attend(0, q)
    assert caches["cpu"].v_scale.dtype == E4M3 and caches["cpu"].k_scale.dtype == torch.float16
    for name, buf in caches["cpu"].named_buffers():
        assert torch.equal(buf.view(torch.uint8), getattr(caches["triton"], name).view(torch.uint8)), name
    k, v = caches["cpu"].dequantized(0)
    logits = torch.einsum("bhd,bhtd->bht", q / 8.0, k.repeat_interleave(2, dim=1))
    want = torch.einsum("bht,bhtd->bhd", logits.softmax(-1), v.repeat_interleave(2, dim=1))
    for impl in out:
        assert torch.allclose(out[impl], want, rtol=1e-4, atol=1e-4 * float(v.abs().max())), impl
