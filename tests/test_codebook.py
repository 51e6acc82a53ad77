"""Non-uniform levels (torch_rkv.codebook) and the TurboQuant-style preset: the Lloyd-Max levels of a
Gaussian as published, the round trip's distortion and norm, and the caches' refusal."""

import math

import pytest
import torch

from torch_rkv import scheme as S
from torch_rkv.cache import QuantizedKVCache
from torch_rkv.codebook import FP8_MAX, fp8_round_trip, gaussian_levels, gaussian_round_trip
from torch_rkv.eval.simulate import Simulation
from torch_rkv.paged import PagedQuantizedKVCache

# Max (1960), "Quantizing for minimum distortion", table I: the positive levels and the mean squared
# error of the N(0, 1) quantizer with 2^bits levels
MAX_1960 = {1: ((0.7979,), 0.3634), 2: ((0.4528, 1.510), 0.1175), 3: ((0.2451, 0.7560, 1.344, 2.152), 0.03454),
            4: ((0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733), 0.009497)}


@pytest.mark.parametrize("bits", sorted(MAX_1960))
def test_the_levels_are_max_1960s(bits):
    levels = gaussian_levels(bits)
    want, _ = MAX_1960[bits]
    assert torch.allclose(levels[len(levels) // 2:], torch.tensor(want), atol=1.5e-3)
    assert torch.allclose(levels, -levels.flip(0), atol=1e-6)  # symmetric


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rotated_rows_lose_what_the_gaussian_quantizer_loses(bits):
    """Rows whose coordinates are Gaussian (as a Hadamard rotation makes them): the relative squared error
    is the codebook's distortion (Max's MSE), the norm survives in fp16, and the direction is coded."""
    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(bits)) * 3.0
    back = gaussian_round_trip(x, bits)
    assert torch.allclose(back.norm(dim=-1), x.norm(dim=-1), rtol=1e-3)  # norm correction, fp16 norm
    rel = ((back - x) ** 2).sum() / (x**2).sum()
    _, mse = MAX_1960[bits]
    assert 0.8 * mse < rel < 1.25 * mse, rel
    coarser = gaussian_round_trip(x, bits - 1)
    assert ((coarser - x) ** 2).sum() > ((back - x) ** 2).sum()


def test_the_turboquant_preset_and_its_bits():
    s = S.by_name("turboquant-3")
    assert (s.levels, s.k_hadamard, s.v_hadamard, s.sinks, s.recent) == ("gaussian", True, True, 0, 0)
    assert math.isclose(s.effective_bits(128), 3 + 16 / 128)  # one fp16 norm per row
    assert "Lloyd-Max" in s.describe(128)
    with pytest.raises(ValueError, match="levels='gaussian'"):
        S.quarot(4).replace(levels="gaussian", v_hadamard=False)


@pytest.mark.parametrize("s", [S.turboquant(4), S.vllm_fp8()], ids=lambda s: s.name)
def test_the_caches_refuse_simulated_levels(s):
    for make in (lambda: QuantizedKVCache(s, 1, 1, 2, 64, 32),
                 lambda: PagedQuantizedKVCache(s, 1, 2, 64, 4, 1)):
        with pytest.raises(NotImplementedError, match="simulated only"):
            make()


def test_fp8_keeps_four_significant_bits_and_saturates():
    """vLLM's fp8 cache (e4m3, scale 1): every value in e4m3's normal range within half a step (1/16 of
    its power of two) of itself, the grid's own values exactly, and values past 448 saturated."""
    x = torch.randn(4096) * torch.logspace(-1.5, 2, 4096)
    back = fp8_round_trip(x)
    normal = x.abs() >= 2.0 ** -6
    step = 2.0 ** (torch.floor(torch.log2(x.abs())) - 3)
    assert ((back - x).abs() <= step / 2 + 1e-12)[normal].all()
    assert torch.equal(fp8_round_trip(back), back)  # the grid's values come back exactly
    assert torch.equal(fp8_round_trip(torch.tensor([1000.0, -1e6])), torch.tensor([FP8_MAX, -FP8_MAX]))
    assert torch.equal(fp8_round_trip(x * 4, scale=4.0), fp8_round_trip(x) * 4)


def test_the_vllm_fp8_scheme_quantizes_post_rope_keys_and_values_alike():
    """vllm-fp8: 8 bits an element with no metadata, nothing in full precision; the simulation's store
    and load round-trips every cached key and value through the fp8 grid, and its attention reads the
    queries through it too (vLLM's FlashAttention with an fp8 cache)."""
    s = S.by_name("vllm-fp8")
    assert s.effective_bits(64) == 8.0 and (s.sinks, s.recent, s.pre_rope) == (0, 0, False)
    assert "fp8 e4m3" in s.describe(64) and "meta" not in s.describe(64)
    x = torch.randn(1, 2, 40, 64) * 5
    for side in ("k", "v"):
        assert torch.equal(Simulation(s).fake_quantize(x, side), fp8_round_trip(x))
    q, k, v = torch.randn(1, 4, 40, 64) * 3, torch.randn(1, 2, 40, 64) * 3, torch.randn(1, 2, 40, 64)
    got = Simulation(s).attention(q, k, v, 0.125).transpose(1, 2)
    want = torch.nn.functional.scaled_dot_product_attention(*map(fp8_round_trip, (q, k, v)), is_causal=True,
                                                            scale=0.125, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    exact_q = torch.nn.functional.scaled_dot_product_attention(q, *map(fp8_round_trip, (k, v)), is_causal=True,
                                                               scale=0.125, enable_gqa=True)
    assert not torch.allclose(got, exact_q, atol=1e-4)  # (the queries' rounding shows)
    with pytest.raises(ValueError, match="levels='fp8'"):
        s.replace(pre_rope=True)
