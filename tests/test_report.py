"""The evaluation pieces: the simulation protocol's cache view, the decode protocol against it on a tiny
random Llama, the localization document, and (real model, CI-sized) the 4-bit reference reproduction."""

import math
import re

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from torch_rkv import reference as ref  # noqa: E402
from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.eval import data, localization, perplexity  # noqa: E402
from torch_rkv.eval.report import REFERENCE, TOLERANCE, effective_bits_at, reference_scheme  # noqa: E402
from torch_rkv.eval.simulate import Simulation  # noqa: E402
from torch_rkv.integrations.models import rope_tables as model_rope_tables  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=160, hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("scheme", [S.recommended(4).replace(k_block_tokens=16, recent=8), S.kivi(2, block=8, recent=8),
                                    S.per_token(3), S.quarot(4)], ids=lambda s: s.name)
def test_cache_view_pairs_follow_the_cache_layout(scheme):
    sim = Simulation(scheme, *model_rope_tables(tiny_llama(), 64))
    n = 60
    pairs = sim.quantized_pairs(torch.arange(n), n, scheme)
    for i in range(n):
        q = ref.quantized_count(i + 1, scheme.recent, scheme.block)
        want = [scheme.sinks <= t < q for t in range(n)]
        assert pairs[i].tolist() == want


@pytest.mark.parametrize("scheme", [S.recommended(4).replace(k_block_tokens=16, recent=8), S.recommended(8).replace(
    k_block_tokens=16), S.recommended(2).replace(k_block_tokens=16, recent=8), S.kivi(4, block=8, recent=8),
    S.quarot(4), S.per_token(2)], ids=lambda s: s.name)
def test_decode_protocol_equals_the_simulation(scheme):
    """Token by token through RKVCache and the fused kernel gives the simulated perplexity: the served path
    is the measured one (float tolerance; the tiny model does not amplify rounding much)."""
    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 96), generator=torch.Generator().manual_seed(5))
    cos, sin = model_rope_tables(model, 128)
    simulated = perplexity.simulated(model, ids, Simulation(scheme, cos, sin))
    decoded = perplexity.decoded(model, ids, lambda n: RKVCache(model, scheme, capacity=n))
    full = perplexity.simulated(model, ids, None)
    assert abs(decoded / simulated - 1) < 1e-4, (simulated, decoded, full)


@pytest.mark.parametrize("scheme", [S.recommended(3).replace(k_block_tokens=16, recent=8),
                                    S.recommended_sparse(2).replace(k_block_tokens=16, v_block_tokens=16, recent=8),
                                    S.kivi(2, block=8, recent=8), S.kivi(2, block=8, recent=8).replace(sinks=70),
                                    S.turboquant(4)], ids=lambda s: f"{s.name}-sinks{s.sinks}")
def test_reused_blocks_are_what_quantizing_every_block_gives(scheme, monkeypatch):
    """Simulation(reuse_blocks=True) (localization: many questions on one cached document) quantizes only
    the blocks its last call on that layer and side did not hold, and gives what a fresh Simulation gives;
    a changed or shorter prefix reuses nothing. Exact: the same per-token and per-block arithmetic either way."""
    cos, sin = model_rope_tables(tiny_llama(), 256)
    x = torch.randn(1, 2, 200, 32, generator=torch.Generator().manual_seed(3)) * 3
    changed = x.clone()
    changed[0, 1, 20, 3] += 1.0  # in the second block, past the sinks
    sim = Simulation(scheme, cos, sin, reuse_blocks=True)
    quantized = []
    round_trip = sim.round_trip
    monkeypatch.setattr(sim, "round_trip",
                        lambda part, *a, **k: quantized.append(part.shape[2]) or round_trip(part, *a, **k))
    count = lambda n: ref.quantized_count(n, scheme.recent, scheme.block)  # noqa: E731
    for layer, side in ((0, "k"), (1, "v")):
        for y in (x[:, :, :40], x[:, :, :100], x[:, :, :130], x, changed, changed[:, :, :60]):
            quantized.clear()
            got = sim.fake_quantize(y, side, layer)
            want = Simulation(scheme, cos, sin).fake_quantize(y, side, layer)
            assert torch.equal(got, want), (side, y.shape[2])
            if y is x:  # after 130 tokens: only the blocks that 200 adds
                assert quantized == [count(200) - count(130)], quantized
            if y is changed:  # the blocks before token 20's are kept
                kept = scheme.block * (20 // scheme.block)
                assert quantized == [count(200) - kept], quantized
    # each (layer, side) keeps its own blocks: the same tokens in a layer with another scheme
    other = S.recommended(4).replace(k_block_tokens=16, recent=8)
    per_layer = Simulation(scheme, cos, sin, layer_schemes={2: other}, reuse_blocks=True)
    for layer in (0, 2, 0, 2):
        want = Simulation(scheme, cos, sin, layer_schemes={2: other}).fake_quantize(x, "k", layer)
        assert torch.equal(per_layer.fake_quantize(x, "k", layer), want), layer
    with pytest.raises(ValueError, match="reuse_blocks needs view 'cache'"):
        Simulation(scheme, cos, sin, view="all", reuse_blocks=True)


def test_a_per_layer_cache_decodes_what_the_per_layer_simulation_measures():
    """RKVCache with one scheme per layer (an allocation; the layers here even differ in layout and window):
    token by token through the fused kernel, each layer with its own bits, gives the simulation's
    perplexity with the same layer_schemes; giving every layer the first layer's scheme does not."""
    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 96), generator=torch.Generator().manual_seed(5))
    cos, sin = model_rope_tables(model, 128)
    schemes = [S.recommended(4).replace(k_block_tokens=16, recent=8), S.per_token(2),
               S.recommended(3).replace(k_block_tokens=16, recent=16, v_bits=2, sinks=2)]
    per_layer = Simulation(schemes[0], cos, sin, layer_schemes=dict(enumerate(schemes)))
    simulated = perplexity.simulated(model, ids, per_layer)
    cache = RKVCache(model, schemes, capacity=96)
    assert cache.schemes == schemes and len(cache.caches) == 3
    with pytest.raises(ValueError, match="different schemes"):
        cache.scheme
    decoded = perplexity.decoded(model, ids, lambda n: RKVCache(model, schemes, capacity=n))
    assert abs(decoded / simulated - 1) < 1e-4, (simulated, decoded)
    uniform = perplexity.simulated(model, ids, Simulation(schemes[0], cos, sin))
    assert abs(uniform / simulated - 1) > 5e-4  # (a tiny random model moves little)
    with pytest.raises(ValueError, match="2 schemes for a model of 3 layers"):
        RKVCache(model, schemes[:2], capacity=96)


def test_calibrated_levels_decode_what_the_simulation_measures(tmp_path):
    """A codebook fitted on a tiny model (torch_rkv.eval.levels): per layer and side, strictly ascending
    code values within range; RKVCache token by token (the kernels looking codes up in each layer's own
    levels) gives the simulation's perplexity with the same scheme, and the levels change it (the uniform
    grid measures differently, and so does one layer's levels given to every layer)."""
    from torch_rkv.codebook import Codebook, load
    from torch_rkv.eval import levels

    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 320), generator=torch.Generator().manual_seed(8))
    book = levels.calibrate(model, ids, widths=(2, 3), pin_ends=False, weighting="mse")
    assert len(book.layers) == 3
    for layer in book.layers:
        for side in ("k", "v"):
            for bits, lv in layer[side].items():
                assert len(lv) == 1 << int(bits) and all(b > a for a, b in zip(lv, lv[1:]))
    path = tmp_path / "levels.json"
    book.save(path)
    assert Codebook.from_json(path.read_text()).layers == book.layers
    scheme = levels.calibrated(2, path).replace(k_block_tokens=16, recent=16)
    cos, sin = model_rope_tables(model, 128)
    short = ids[:, :96]
    simulated = perplexity.simulated(model, short, Simulation(scheme, cos, sin))
    decoded = perplexity.decoded(model, short, lambda n: RKVCache(model, scheme, capacity=n))
    assert abs(decoded / simulated - 1) < 1e-4, (simulated, decoded)
    uniform = perplexity.simulated(model, short, Simulation(scheme.replace(levels="uniform", codebook=None), cos, sin))
    assert abs(uniform / simulated - 1) > 5e-4
    same = Codebook([book.layers[0]] * 3)
    same.save(tmp_path / "same.json")
    copied = perplexity.decoded(model, short, lambda n: RKVCache(
        model, scheme.replace(codebook=str(tmp_path / "same.json")), capacity=n))
    assert abs(copied / simulated - 1) > 5e-4  # each layer reads its own levels
    with pytest.raises(ValueError, match="layer 0 side k has no 4-bit levels"):
        load(str(path)).levels(0, "k", 4)
    with pytest.raises(ValueError, match="give both, or neither"):
        scheme.replace(codebook=None)


def test_attention_weights_follow_the_queries_and_the_probabilities():
    """Key channels weigh the queries' energy, shared by each rotated pair (RoPE moves energy within a
    pair, never across); a channel no query uses weighs 0; value tokens weigh their squared attention."""
    from torch_rkv.eval.levels import attention_weights

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=gen)
    q[..., 5] = 0.0
    q[..., 1] = 0.0  # channel 1's pair partner (rotate-half over 6 channels: 1 <-> 4) keeps energy
    k = torch.randn(1, 2, 6, 8, generator=gen)
    kw, vw = attention_weights(q, k, 0.5, 0.0, half=3, interleaved=False)
    assert kw.shape == vw.shape == (1, 2, 6, 8)
    for c, partner in ((0, 3), (1, 4), (2, 5)):
        assert torch.allclose(kw[..., c], kw[..., partner])
    assert bool((kw[..., 1] > 0).all())  # its partner's energy
    assert bool((kw[..., 6:] > 0).all())  # not rotated: its own energy
    kw, _ = attention_weights(q, k, 0.5, 0.0, half=0, interleaved=False)
    assert bool((kw[..., 5] == 0).all()) and bool((kw[..., 1] == 0).all())
    # the first token is seen by every query, the last only by itself: it gets the least attention
    assert bool((vw[..., 0, 0] > vw[..., -1, 0]).all())


def test_sensitivity_on_a_tiny_model():
    """One KL and one perplexity change per (layer, side) and base; the KL is never negative, and a layer
    whose keys are stored at 8 bits in every run costs nothing to "drop" (its runs are the base's)."""
    from torch_rkv.eval.sensitivity import measure, simulations_for

    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 320), generator=torch.Generator().manual_seed(7))  # a block of 128 quantized
    make = simulations_for(model, 320)
    calls = []
    prof = measure(model, ids, (2, 3, 4), make, 3, progress=lambda *a: calls.append(a))
    assert sorted(prof.drops) == [3, 4] and all(len(prof.drops[b]) == 3 for b in (3, 4))
    assert all(x >= -1e-6 for b in (3, 4) for pair in prof.drops[b] for x in pair)  # (float rounding)
    assert any(x > 1e-6 for pair in prof.drops[3] for x in pair)
    assert calls[-1] == (4, 3, 3) and len(calls) == 6

    def frozen(scheme, layer_schemes=None, **kw):  # layer 1's keys never change width
        layer_schemes = {**(layer_schemes or {})}
        layer_schemes[1] = layer_schemes.get(1, scheme).replace(k_bits=8, k_clip=False)
        return make(scheme, layer_schemes=layer_schemes, **kw)

    again = measure(model, ids, (2, 3), frozen, 3)
    assert again.drops[3][1][0] == 0.0 and again.drops[3][1][1] > 0


def test_moves_are_measured_at_the_allocation_on_a_tiny_model():
    """measure_moves: the allocation's own KL from full precision, and for every side each width one
    level away, the change in that KL when only that side moves (a layer frozen at 8 bits never moves)."""
    from torch_rkv.allocate import Allocation, layer_scheme
    from torch_rkv.eval.sensitivity import measure_moves, simulations_for

    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 320), generator=torch.Generator().manual_seed(7))
    make = simulations_for(model, 320)
    alloc = Allocation(((2, 3), (3, 4), (4, 2)), (2, 3, 4), 0.0)
    calls = []
    cost, moves = measure_moves(model, ids, alloc, make, progress=lambda *a: calls.append(a))
    assert sorted(moves) == sorted([(0, "k", 3), (0, "v", 2), (0, "v", 4), (1, "k", 2), (1, "k", 4), (1, "v", 3),
                                    (2, "k", 3), (2, "v", 3)])
    assert calls[-1] == (8, 8)
    reference = perplexity.simulated_logprobs(model, ids, None)

    def kl(bits):
        schemes = [layer_scheme(k, v, (2, 3, 4)) for k, v in bits]
        out = perplexity.simulated_logprobs(model, ids, make(schemes[0], layer_schemes=dict(enumerate(schemes))))
        return perplexity.kl_divergence(reference, out)

    assert cost > 0 and math.isclose(cost, kl(alloc.bits), rel_tol=1e-6)
    assert math.isclose(moves[(2, "v", 3)], kl(((2, 3), (3, 4), (4, 3))) - cost, rel_tol=1e-4, abs_tol=1e-9)
    assert moves[(0, "k", 3)] != 0 and moves[(2, "v", 3)] < 0  # a third value bit in layer 2 helps here


def test_simulation_at_8_bits_is_close_to_full_precision_and_all_view_quantizes_everything():
    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 128), generator=torch.Generator().manual_seed(6))
    cos, sin = model_rope_tables(model, 128)
    full = perplexity.simulated(model, ids, None)
    eight = perplexity.simulated(model, ids, Simulation(S.per_token(8), cos, sin, view="all"))
    two = perplexity.simulated(model, ids, Simulation(S.per_token(2), cos, sin, view="all"))
    assert abs(eight / full - 1) < 2e-3 < abs(two / full - 1)
    sim = Simulation(S.kivi(4, block=32, recent=8), cos, sin, view="all")
    assert bool(sim.quantized_pairs(torch.arange(128), 128, sim.scheme).all())


def test_effective_bits_count_full_precision_tokens():
    s = S.recommended(4)
    assert effective_bits_at(s, 64, 10**9) == pytest.approx(s.effective_bits(64), rel=1e-6)
    assert effective_bits_at(s, 64, 100) == 16.0  # everything still in the window


def test_bits_at_the_window_split_into_what_they_are_spent_on():
    """rkv-2 at 8192 tokens (head_dim 64): 2-bit codes and 0.375 bits of fp16 metadata (a scale and zero per
    key channel per 128 tokens, per value row of 64) over the quantized tokens; the 4 sinks, 128 recent
    tokens and the open block at 16 bits; outliers only where the scheme keeps them."""
    from torch_rkv.eval.report import bits_parts_at

    s = S.recommended(2)
    fp = 4 + 128  # the last query of 8192 tokens: the sinks and recent window (8064 tokens, whole blocks, before)
    parts = bits_parts_at(s, 64, 8192)
    share = (8192 - fp) / 8192
    assert parts == pytest.approx({"codes": 2 * share, "metadata": 0.375 * share, "outliers": 0.0,
                                   "full_precision": fp * 16 / 8192})
    assert sum(parts.values()) == pytest.approx(effective_bits_at(s, 64, 8192))
    sparse = S.recommended_sparse(2)
    parts = bits_parts_at(sparse, 64, 8192)
    assert parts["outliers"] > 0 and sum(parts.values()) == pytest.approx(effective_bits_at(sparse, 64, 8192))


def test_localization_document_places_every_needle():
    class Tok:  # characters as tokens: enough to check placement without a real tokenizer
        def __call__(self, text, return_tensors=None, add_special_tokens=True):
            class Out:
                input_ids = torch.tensor([[ord(c) % 256 for c in text]])

            return Out()

        def decode(self, ids):
            return "".join(chr(int(i)) for i in ids)

    hay = "alice was beginning to get very tired of sitting by her sister " * 100
    doc = localization.build_document(Tok(), hay, 2000, needles=5, seed=1)
    text = Tok().decode(doc.ids[0])
    assert len(doc.needles) == 5 and len({n.article for n in doc.needles}) == 5
    for n in doc.needles:
        assert f"The penalty rate under Article {n.article} is {n.rate} percent." in text
    assert [n.depth for n in doc.needles] == sorted(n.depth for n in doc.needles)
    assert abs(doc.ids.shape[1] - 2000) < 300


def test_document_start_follows_the_tokenizer():
    class Tok:
        bos_token, eos_token = None, "</s>"

    assert data.bos_text(Tok()) == "</s>"  # no BOS: the end-of-text token separates documents
    Tok.eos_token = None
    assert data.bos_text(Tok()) == ""

    class Adds(Tok):  # a tokenizer that prepends its BOS itself (Llama): no second one
        bos_token, bos_token_id = "<s>", 1

        def __call__(self, text):
            class Out:
                input_ids = [1, 5]

            return Out()

    assert data.bos_text(Adds()) == ""


@pytest.mark.slow
def test_smollm2_documents_start_with_endoftext():
    """SmolLM2-Instruct's tokenizer names <|im_start|> its BOS; its pretraining documents start after
    <|endoftext|> (id 0), which the reference perplexities condition on."""
    from transformers import AutoTokenizer

    try:
        d, f = data.model_gguf(fetch=False)
    except data.MissingMaterial as e:
        pytest.skip(f"evaluation material unavailable: {e}")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)  # the tokenizer only: a few seconds
    assert tok.bos_token == "<|im_start|>" and data.bos_text(tok) == "<|endoftext|>"
    assert tok(data.bos_text(tok) + "Alice was").input_ids[0] == 0


@pytest.mark.slow
def test_reproduces_the_4_bit_reference_rows(smollm2_alice):
    """Every 4-bit row of the reference fake-quant table within 2% (SmolLM2, alice29, 2048 tokens)."""
    model, tok, text = smollm2_alice
    ids = tok(data.bos_text(tok) + text, return_tensors="pt").input_ids[:, :2048]
    cos, sin = model_rope_tables(model, 2048)
    assert math.isclose(perplexity.simulated(model, ids, None), 19.874, rel_tol=1e-3)
    for row, refs in REFERENCE.items():
        scheme, keys = reference_scheme(row, 4)
        ppl = perplexity.simulated(model, ids, Simulation(scheme, cos, sin, view="all", quantize_keys=keys))
        assert abs(ppl / refs[4] - 1) <= TOLERANCE[4], (row, ppl, refs[4])


def test_wilson_interval():
    """The 95% Wilson interval: known values (Newcombe 1998's examples: 81/263 -> 0.2553-0.3662), and
    sound at the edges, where the normal approximation collapses to a point."""
    lo, hi = localization.wilson(81, 263)
    assert abs(lo - 0.2553) < 5e-4 and abs(hi - 0.3662) < 5e-4
    assert localization.wilson(0, 24)[0] == 0.0 and 0.1 < localization.wilson(0, 24)[1] < 0.16
    assert localization.wilson(24, 24)[1] == 1.0 and localization.wilson(24, 24)[0] > 0.85


def test_paired_gap_interval():
    """The localization gap: the mean paired difference with a 95% interval of 1.96 standard errors (known
    values), exact for a constant shift, and refused for needles that do not pair."""
    fp = [{"article": a, "logprob": -1.0} for a in range(4)]
    rows = [{"article": a, "logprob": -1.0 + d} for a, d in zip(range(4), (-1.0, -2.0, -3.0, -4.0))]
    mean, lo, hi = localization.paired_gap(rows, fp)
    half = 1.96 * (5 / 3) ** 0.5 / 2  # sd of (-1, -2, -3, -4) is sqrt(5/3), over sqrt(4)
    assert mean == -2.5 and abs(lo - (-2.5 - half)) < 1e-12 and abs(hi - (-2.5 + half)) < 1e-12
    shifted = [{**x, "logprob": x["logprob"] - 0.5} for x in fp]
    assert localization.paired_gap(shifted, fp) == (-0.5, -0.5, -0.5)
    with pytest.raises(ValueError, match="same needles"):
        localization.paired_gap(rows[::-1], fp)


def test_the_localization_table_keeps_its_columns_for_long_row_names():
    from torch_rkv.eval.report import format_localization
    from torch_rkv.eval.report.names import FULL

    results = [{"scheme": name, "length": n, "article": a, "exact": a % 2 == 0, "logprob": -1.0 - a / 10}
               for name in (FULL, "rkv-4", "rkv-lean-sparse-alloc-2.5") for n in (1024, 8192) for a in range(6)]
    lines = format_localization(results).split("\n")[1:]
    assert len(lines) == 4 and lines[-1].startswith("rkv-lean-sparse-alloc-2.5 ")
    assert len({len(line) for line in lines}) == 1  # every row's cells start where the header's lengths do


def test_relative_loss_samples_resample_runs_of_tokens():
    """The bootstrap of a relative perplexity loss: exact for a constant loss; with losses shared within
    runs of 128 tokens (neighbours correlate), the draws spread like the runs' means do (1 / sqrt(runs)
    in log space), not like independent tokens' (sqrt(128) narrower)."""
    ref_nll = torch.rand(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 5
    flat = perplexity.relative_loss_samples(ref_nll + 0.01, ref_nll)
    assert torch.allclose(flat, torch.full_like(flat, math.expm1(0.01)))
    runs = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.05
    draws = perplexity.relative_loss_samples(ref_nll + runs.repeat_interleave(128), ref_nll, samples=4000)
    spread = torch.log1p(draws).std().item() * math.sqrt(32)
    assert 0.8 * runs.std().item() < spread < 1.2 * runs.std().item(), (spread, runs.std().item())
    # a length that is not a multiple of the run: the last, shorter run counts by its tokens. 129 tokens,
    # a loss of 1 on the last only: draws of (full, full), (full, last) x2, (last, last) average to
    # 0, 1/129, 1: a mean of 1/4 + 1/258 (counting the last run as 128 tokens would give 1/128 + 1/512)
    short = ref_nll[:129]
    tail = torch.zeros(129, dtype=torch.float64)
    tail[-1] = 1.0
    draws = perplexity.relative_loss_samples(short + tail, short, samples=16000)
    assert abs(torch.log1p(draws).mean().item() - (0.25 + 1 / 258)) < 0.05 * 0.25
    with pytest.raises(ValueError, match="must be equal 1-D shapes"):
        perplexity.relative_loss_samples(ref_nll[:100], ref_nll)
    with pytest.raises(ValueError, match="fewer than 2 runs"):
        perplexity.relative_loss_samples(ref_nll[:128], ref_nll[:128])


def test_token_kl_is_from_the_reference():
    """KL(reference || quantized) per position: uniform over two tokens against (0.9, 0.1) is
    0.5 ln(0.5 / 0.9) + 0.5 ln(0.5 / 0.1) = 0.5108 (the other direction would be 0.3681); 0 where equal."""
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.2, 0.8]]))
    out = torch.log(torch.tensor([[0.9, 0.1], [0.2, 0.8]]))
    kl = perplexity.token_kl(ref, out)
    assert kl.dtype == torch.float64 and kl[0].item() == pytest.approx(0.5108, abs=1e-4) and abs(kl[1].item()) < 1e-7
    assert perplexity.kl_divergence(ref, out) == pytest.approx(kl.mean().item())
    g = torch.Generator().manual_seed(0)  # more positions than one chunk: every position computed once
    ref, out = (torch.randn(600, 10, generator=g).log_softmax(-1) for _ in range(2))
    assert torch.allclose(perplexity.token_kl(ref, out), (ref.exp() * (ref - out)).sum(-1).double(), atol=1e-6)


def test_ratio_interval_is_unbounded_where_the_second_loss_may_be_zero():
    first = torch.linspace(0.10, 0.20, 1001, dtype=torch.float64)
    assert perplexity.interval(first) == pytest.approx((0.1025, 0.1975))
    assert perplexity.ratio_interval(first, first - 0.11) is None  # the second's interval reaches 0
    lo, hi = perplexity.ratio_interval(first, torch.full_like(first, 0.5))
    assert lo == pytest.approx(0.205) and hi == pytest.approx(0.395)
    assert perplexity.ratio_interval(first, first) == pytest.approx((1.0, 1.0))  # draws paired, not crossed


def test_second_text_table_prints_intervals_and_judges_the_ratios():
    """The second text's checks: the ranking and the 1.5x bar on the measured losses, and how many ratios'
    intervals overlap [1/1.5, 1.5] and lie inside it; a ratio whose second loss may be 0 is printed as
    unbounded, not judged."""
    from torch_rkv.eval.report import FULL, format_second_text

    def row(name, rel, first, iv, first_iv, ratio):
        return {"scheme": name, "text": "asyoulik.txt", "ppl": 20 * (1 + rel), "relative": rel,
                "first_relative": first, "relative_interval": iv, "first_relative_interval": first_iv,
                "relative_ratio_interval": ratio}

    rows = [{"scheme": FULL, "text": "asyoulik.txt", "ppl": 20.0, "relative": 0.0, "first_relative": 0.0,
             "tokens": 4096},
            row("a", 0.10, 0.12, (0.08, 0.12), (0.10, 0.14), (0.90, 1.50)),
            row("b", 0.02, 0.05, (-0.01, 0.05), (0.03, 0.07), None),
            row("c", 0.30, 0.10, (0.25, 0.35), (0.08, 0.12), (0.25, 0.45))]
    table = format_second_text(rows).splitlines()
    assert "full precision 20.000; 4096 tokens a text" in table[1]
    a, b, c = (" ".join(line.split()) for line in table[3:6])
    assert a == "a +10.00% [+8.00%,+12.00%] +12.00% [+10.00%,+14.00%] 1.20 [0.90,1.50]"
    assert "2.50 [second text's interval reaches 0]" in b and "0.33 [0.25,0.45]" in c
    assert table[6] == ("same ranking: NO; every value within 1.5x of the first text's: NO; "
                        "ratio intervals overlapping [0.67, 1.5]: 1 of 2 (not: c), inside it: 1")
    assert len(table) == 7  # no KL measured, no KL table
    # the KL table: its own values, intervals and verdict (here the ranking holds and every ratio is bounded)
    for x, kl, first_kl in zip(rows[1:], (0.010, 0.004, 0.030), (0.012, 0.005, 0.021)):
        x.update(kl=kl, first_kl=first_kl, kl_interval=(kl * 0.8, kl * 1.2),
                 first_kl_interval=(first_kl * 0.8, first_kl * 1.2),
                 kl_ratio_interval=(first_kl / kl * 0.7, first_kl / kl * 1.3))
    table = format_second_text(rows).splitlines()
    assert " ".join(table[10].split()) == "a 0.0100 [0.0080,0.0120] 0.0120 [0.0096,0.0144] 1.20 [0.84,1.56]"
    assert table[13] == ("same ranking: yes; every value within 1.5x of the first text's: yes; "
                         "ratio intervals overlapping [0.67, 1.5]: 3 of 3, inside it: 0")
    same = format_second_text(rows[:2]).splitlines()[4]
    assert same == "same ranking: yes; every value within 1.5x of the first text's: yes; " \
                   "ratio intervals overlapping [0.67, 1.5]: 1 of 1, inside it: 1"
    # a gain on one text against a loss on the other fails the bar; nothing lost on either says nothing
    flipped = [rows[0], row("d", -0.001, 0.01, None, None, None), row("e", 0.0, 0.0, None, None, None)]
    assert "within 1.5x of the first text's: NO" in format_second_text(flipped)
    assert "within 1.5x of the first text's: yes" in format_second_text([rows[0], flipped[2]])


@pytest.mark.slow
def test_the_full_modes_rows_on_smollm2(smollm2_alice):
    """--full's long-context row and several localization documents per length (CI-sized: 1024 and 512
    tokens, 2 documents): full precision first, each scheme's bits counted at the window and its mean KL
    from full precision, 12 needles a length, and the table prints the exact rate's interval and the
    log-probability gap."""
    from torch_rkv.eval.report import Options, Report, format_tables

    model, tok, text = smollm2_alice
    opts = Options(tokens=512, long_tokens=1024, long_schemes=("rkv-4",), loc_lengths=(512,),
                   loc_schemes=("rkv-4",), loc_documents=2)
    report = Report(model, tok, text, opts, log=lambda s: None)
    report.results["full_precision_ppl"] = 0.0
    long = report.long_context()
    assert [x["scheme"] for x in long] == ["full precision", "rkv-4"] and long[0]["tokens"] == 1024
    assert 0 < long[1]["delta"] < 0.5 and long[1]["bits_at_window"] > S.by_name("rkv-4").effective_bits(64)
    assert sum(long[1]["bits_parts"].values()) == pytest.approx(long[1]["bits_at_window"])
    assert 0.5 < long[1]["top8_recall"] < 1 and long[0]["top8_recall"] == 1.0  # measured, not full precision's
    assert long[0]["kl"] == 0.0 and 0 < long[1]["kl"] < 0.1  # each position's KL from full precision, averaged
    loc = report.localization()
    assert len([x for x in loc if x["scheme"] == "rkv-4"]) == 12
    assert len({(x["depth"], x["article"]) for x in loc if x["scheme"] == "full precision"}) == 12  # distinct
    text = format_tables({**{k: [] for k in ("reproduction", "schemes", "decode_protocol")},
                          "full_precision_ppl": 0.0, "long_context": long, "localization": loc})
    assert "Long context (1024 tokens" in text and "[0." in text
    assert f"{long[1]['kl']:7.4f} {long[1]['top8_recall']:6.3f}" in text.split("Long context")[1].splitlines()[3]


@pytest.mark.slow
def test_the_reports_calibrated_levels_rows_on_smollm2(smollm2_alice):
    """--full's "rkv + calibrated levels" family: the model's codebook fitted on the calibration text
    (cached), rows named rkv-nu-<bits> that decode through it, and the name resolves everywhere."""
    from torch_rkv.eval.report import CALIBRATED_LEVELS, Options, Report

    model, tok, text = smollm2_alice
    opts = Options(tokens=512, bits=(2,), families=(CALIBRATED_LEVELS,), alloc_tokens=384)
    report = Report(model, tok, text, opts, log=lambda s: None)
    report.results["full_precision_ppl"] = report._simulated(report.ids, None)
    rows = report.schemes()
    assert [x["scheme"] for x in rows] == ["rkv-nu-2"] and "calibrated levels" in rows[0]["description"]
    assert 0 < rows[0]["delta"] < 5 and 0.5 < rows[0]["top8_recall"] <= 1
    schemes = report.layer_schemes("rkv-nu-3")
    assert len(schemes) == 30 and schemes[0].levels == "calibrated" and schemes[0].k_bits == 3
    assert schemes[0].side_levels(29, "v").shape == (8,)


@pytest.mark.slow
def test_an_allocation_with_sparse_outliers_is_served_as_simulated(smollm2_alice):
    """rkv-sparse-alloc-<bits>: the allocation's per-layer widths, each layer with rkv-sparse's outliers;
    RKVCache serves it token by token as the simulation predicts (serving it without the outliers is
    3e-3 off on these 300 tokens, 30x the tolerance)."""
    from torch_rkv.eval.report import Options, Report

    model, tok, text = smollm2_alice
    opts = Options(tokens=512, alloc_levels=(2, 3), alloc_tokens=384, decode_tokens=300,
                   decode_schemes=("rkv-sparse-alloc-2.5",))
    report = Report(model, tok, text, opts, log=lambda s: None)
    schemes, plain = report.layer_schemes("rkv-sparse-alloc-2.5"), report.layer_schemes("rkv-alloc-2.5")
    assert [(s.k_bits, s.v_bits) for s in schemes] == [(s.k_bits, s.v_bits) for s in plain]
    assert len({(s.k_bits, s.v_bits) for s in schemes}) > 1 and {s.outliers for s in schemes} == {S.SPARSE_FRACTION}
    (row,) = report.decode_protocol()
    assert row["quantized_tokens"] > 0 and abs(row["relative_difference"]) < 1e-4, row


def test_second_text_losses_pool_every_window():
    """A row's relative loss over several windows is the perplexity ratio over all their tokens (not one
    window's, nor a mean of per-window ratios), and its intervals draw from every window's tokens."""
    from torch_rkv.eval.report.losses import TokenLosses
    from torch_rkv.eval.report.names import FULL_PRECISION, SECOND, RowName, TextRow

    losses = TokenLosses()  # only the kept losses: no model
    g = torch.Generator().manual_seed(0)
    fp = [torch.rand(255, generator=g, dtype=torch.float64) + 2 for _ in range(3)]
    row = [fp[0] + 0.01, fp[1] + 0.05, fp[2] + 0.03]  # window losses of 1%, 5%, 3% (in log terms)
    r = RowName.parse("r")
    losses.nll = {TextRow(FULL_PRECISION): fp, TextRow(r): row, TextRow(FULL_PRECISION, SECOND): fp[:2],
                  TextRow(r, SECOND): [fp[0] + 0.02, fp[1] + 0.04]}
    assert losses.relative(TextRow(r)) == pytest.approx(math.exp(0.03) - 1, rel=1e-9)
    assert losses.relative(TextRow(r, SECOND)) == pytest.approx(math.exp(0.03) - 1, rel=1e-9)
    iv = losses.intervals(r)
    assert iv["first_relative_interval"][0] < math.exp(0.03) - 1 < iv["first_relative_interval"][1]
    # one window's loss would be outside the pooled interval: the draws see all three windows
    assert not iv["first_relative_interval"][0] <= math.exp(0.01) - 1 <= iv["first_relative_interval"][1]


def test_second_text_windows_must_fit_in_the_text():
    """Asking for more windows than a text holds is an error that names the option, not fewer windows."""
    from torch_rkv.eval.report import Options, Report

    report = Report.__new__(Report)
    report.opts = Options(tokens=256, second_windows=3)
    assert [w[0].tolist() for w in report.text_windows(torch.arange(800)[None], "t")] == \
        [list(range(256)), list(range(256, 512)), list(range(512, 768))]
    with pytest.raises(data.MissingMaterial, match="second_windows 4 x --tokens 256"):
        report.opts = Options(tokens=256, second_windows=4)
        report.text_windows(torch.arange(800)[None], "t")


class CharTokenizer:
    """Characters as tokens (a code below the tiny model's vocabulary each): a Report without a real tokenizer."""

    bos_token_id = bos_token = eos_token = None

    def __call__(self, text, return_tensors=None):
        class Out:
            input_ids = torch.tensor([[ord(c) % 160 for c in text]])

        return Out()


ETA_MODES = {  # the options of each mode, and the sections that run
    "quick": (lambda options: options.quick(), (
        "full precision", "reproduction", "schemes", "8 bits", "allocation", "localization", "decode protocol",
        "chunked prefill", "plots")),
    "default": (lambda options: options(), (
        "full precision", "reproduction", "schemes", "8 bits", "allocation", "localization", "decode protocol",
        "chunked prefill", "plots")),
    "full": (lambda options: options.full(), (
        "full precision", "reproduction", "schemes", "8 bits", "long context", "allocation", "second text",
        "localization", "decode protocol", "chunked prefill", "peers", "plots")),
    # a model that cannot take several tokens over its cache (Jamba's): no localization or chunked prefill
    "quick without chunks": (lambda options: options.quick().without_chunks(), (
        "full precision", "reproduction", "schemes", "8 bits", "allocation", "decode protocol", "plots")),
}


@pytest.mark.parametrize("mode", list(ETA_MODES))
def test_the_eta_is_the_cost_of_exactly_the_sections_that_run(mode, tmp_path, monkeypatch):
    """The progress total (the ETA's whole) is the sum of the costs of the sections run() executes, each
    counted once and none left out, plus measuring the sensitivity profile once (not stored here), for
    the --quick, default and --full options, and for options less some sections. The sections that run
    are the ones each mode asks for; the others leave an empty list in the results."""
    from torch_rkv.eval.report import SECTIONS, Options, Report

    monkeypatch.setenv("TORCH_RKV_CACHE", str(tmp_path))  # no stored profile: measuring it is planned
    second = tmp_path / "second.txt"
    second.write_text("the second text " * 1100)
    monkeypatch.setattr(data, "text_path", lambda name: second)
    make, expected = ETA_MODES[mode]
    opts = make(Options)
    report = Report(tiny_llama(), CharTokenizer(), "a first text " * 1400, opts, log=lambda line: None)
    ran = []
    for section in SECTIONS:  # each section's run, recorded instead of measured
        monkeypatch.setattr(section, "run", lambda report, section=section: ran.append(section) or [])
    results = report.run()
    assert tuple(s.timing for s in ran) == expected == tuple(opts.timings)
    assert all(s.cost(report) > 0 for s in ran)
    profile = report.profile_cost()
    assert profile > 0 and any(s.needs_profile(report) for s in ran)
    assert report.progress.total == pytest.approx(sum(s.cost(report) for s in ran) + profile, rel=1e-12)
    assert list(results) == [s.key for s in SECTIONS]
    assert all(results[s.key] == [] for s in SECTIONS if s not in ran)


def test_row_names_render_back_to_the_names_the_options_write():
    """Every scheme name of the --quick, default and --full options parses into a RowName that prints as
    the same string (the JSON's names); the kinds tell the profiled and per-layer rows apart."""
    from torch_rkv.eval.report import FULL, Options, RowName

    for opts in (Options.quick(), Options(), Options.full()):
        for name in opts.named_schemes():
            assert str(RowName.parse(name)) == name and f"{RowName.parse(name):>24s}" == f"{name:>24s}"
    sparse, split, nu = (RowName.parse(n) for n in ("rkv-sparse-alloc-2.5", "rkv-split-3", "rkv-nu-3"))
    assert (sparse.kind, sparse.bits, sparse.profiled) == ("sparse allocation", 2.5, True)
    assert split == RowName.split(3.0) and str(split) == "rkv-split-3" and split.profiled
    assert nu.per_layer and not nu.profiled and nu.bits == 3
    assert RowName.parse("rkv-alloc-2.5") == RowName.allocation(2.5) != RowName.parse("rkv-sparse-alloc-2.5")
    for name, kind in (("rkv-lean-alloc-2.7", "lean allocation"), ("rkv-edge-alloc-2.5", "edge allocation")):
        row = RowName.parse(name)
        assert (row.kind, str(row), row.profiled) == (kind, name, True)
    assert RowName.parse("rkv-lean-2").kind == "preset"
    kivi = RowName.parse("kivi-2")
    assert (kivi.kind, kivi.preset, kivi.per_layer) == ("preset", "kivi-2", False)
    assert str(RowName.parse(FULL)) == FULL and RowName.parse(FULL).kind == "full precision"


@pytest.mark.slow
def test_the_whole_report_runs_and_prints(smollm2_alice, tmp_path):
    """Every section of the report, plots included, in a CI-sized run (the main job must not break where
    no other test looks: its key-magnitude capture once fell behind the simulation's arguments)."""
    from torch_rkv.eval.report import Options, Report, format_tables

    model, tok, text = smollm2_alice
    opts = Options(tokens=256, bits=(4,), families=("rkv (recommended)",), noise=False, loc_lengths=(512,),
                   loc_schemes=("rkv-4",), decode_tokens=96, decode_schemes=("rkv-4",), chunk_sizes=(128,),
                   chunk_schemes=("rkv-4",), alloc_levels=(2, 3), alloc_targets=(2.5,), split_targets=(2.5,),
                   alloc_tokens=384, second_text="asyoulik.txt", second_windows=2, second_schemes=("rkv-4",), peers=False,
                   out_dir=str(tmp_path))
    lines = []
    results = Report(model, tok, text, opts, log=lines.append).run()
    assert set(results["plots"]) == {"ppl_vs_bits", "localization", "key_magnitudes"}
    assert all((tmp_path / f"{name}.png").exists() for name in results["plots"])
    table = format_tables(results)
    assert "Schemes as served" in table and "Per-layer allocation" in table and "same ranking" in table
    fp8, rkv8 = results["eight_bits"]  # vLLM's own fp8 cache beside rkv-8, every token quantized by fp8
    assert (fp8["scheme"], fp8["bits_per_element"], fp8["bits_at_window"], rkv8["scheme"]) == ("vllm-fp8", 8, 8, "rkv-8")
    assert fp8["delta"] > rkv8["delta"] and "At 8 bits: vLLM's own fp8 cache" in table
    alloc = results["allocation"][0]
    assert len(alloc["bits"]) == 30 and sum(k + v for k, v in alloc["bits"]) == 150  # 2.5 bits on average
    split = results["allocation"][1]
    assert split["scheme"] == "rkv-split-2.5" and {k + v for k, v in split["bits"]} == {5}  # 5 bits every layer
    assert [x["scheme"] for x in results["second_text"]] == ["full precision", "rkv-4", "rkv-alloc-2.5",
                                                             "rkv-split-2.5"]
    assert {x["tokens"] for x in results["second_text"]} == {512}  # two windows of 256 a text
    for x in results["second_text"][1:]:  # each with its intervals, around its own measured loss
        assert x["relative_interval"][0] <= x["relative"] <= x["relative_interval"][1], x
        assert x["first_relative_interval"][0] <= x["first_relative"] <= x["first_relative_interval"][1], x
        assert -1e-7 <= x["kl_interval"][0] <= x["kl"] <= x["kl_interval"][1], x  # KL from full precision
    # rkv-4 quantizes blocks of these 256 tokens (the 2-bit allocations keep all 256 in full precision: 0)
    assert results["second_text"][1]["kl"] > 0 and results["second_text"][1]["first_kl"] > 0
    assert "runs of 128 tokens" in table and ("ratio intervals overlapping" in table or "no ratio is bounded" in table)
    percents = [int(line[1:4]) for line in lines]  # "[ 37% 1:02 ETA 1:45] ..."
    assert percents == sorted(percents) and "ETA" in lines[-1]


def test_calibration_caches_tell_models_and_texts_of_one_name_apart(tmp_path, monkeypatch):
    """A sensitivity profile or codebook cached for one model is never read for another saved under the same
    name (a fine-tune, a changed RoPE scaling, another dtype): the key carries a fingerprint of the config and
    weights. An edited calibration file is another text."""
    from torch_rkv.allocate import Sensitivity
    from torch_rkv.eval import levels, sensitivity

    monkeypatch.setenv("TORCH_RKV_CACHE", str(tmp_path))
    base, tuned, scaled = tiny_llama(), tiny_llama(), tiny_llama()
    with torch.no_grad():
        tuned.model.layers[1].self_attn.q_proj.weight.mul_(1.01)  # (one tensor of a fine-tune)
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    keys = [sensitivity.model_key(m) for m in (base, tiny_llama(), tuned, scaled, tiny_llama().to(torch.bfloat16))]
    assert keys[0] == keys[1] and len(set(keys)) == 4 and keys[0].startswith("llama-3l-")
    text = tmp_path / "calibration.txt"
    text.write_text("one text")
    path = sensitivity.profile_path(base, str(text), 64, (2, 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(Sensitivity("", "", 64, (2, 3), 10.0).to_json())
    assert sensitivity.stored_profile(base, (2, 3), str(text), 64) is not None
    assert sensitivity.stored_profile(tuned, (2, 3), str(text), 64) is None
    assert levels.codebook_path(base, str(text), 64, False) != levels.codebook_path(tuned, str(text), 64, False)
    text.write_text("another text")
    assert sensitivity.stored_profile(base, (2, 3), str(text), 64) is None


def test_the_goal_rows_are_checked_against_their_goals():
    """scripts/long_context.py --goals: each goal's row is one the report resolves, and each line says met
    only when the row is within the goal's bits and delta (and recall, for the 2.6-bit goal)."""
    import importlib.util
    from pathlib import Path

    from torch_rkv.eval.report import RowName

    path = Path(__file__).resolve().parents[1] / "scripts" / "long_context.py"
    spec = importlib.util.spec_from_file_location("long_context", path)
    lc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lc)
    assert all(RowName.parse(name).profiled for _, name in lc.GOALS)
    (bits, delta, recall), name = lc.GOALS[0]
    # 2.5 bits: the KL baseline's nearest row at no fewer bits is rkv-2's (2.59 bits, 0.0762): at most 0.0381
    row = {"scheme": RowName.parse(name), "bits_at_window": 2.5, "delta": delta, "top8_recall": recall, "kl": 0.03}
    others = [{"scheme": RowName.parse(n), "bits_at_window": 9.0, "delta": 1.0, "top8_recall": 0.5, "kl": 0.1}
              for _, n in lc.GOALS[1:]]
    verdicts = lambda line: re.findall(r"(NOT met|met)", line)  # noqa: E731  (goal, then KL)
    lines = lc.goal_lines([row, *others])
    assert verdicts(lines[0]) == ["met", "met"] and all(verdicts(x)[0] == "NOT met" for x in lines[1:])
    assert verdicts(lc.goal_lines([{**row, "kl": 0.04}, *others])[0]) == ["met", "NOT met"]
    assert verdicts(lc.goal_lines([{**row, "top8_recall": recall - 0.01}, *others])[0]) == ["NOT met", "met"]
    assert verdicts(lc.goal_lines([{**row, "bits_at_window": bits + 0.01}, *others])[0])[0] == "NOT met"
