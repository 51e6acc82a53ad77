"""Families with sliding windows, attention-logit soft-capping and a RoPE table per layer type (Mistral v0.1,
Qwen2's and dots.llm1's windowed layers, Gemma 2 / 3 / 4, GPT-OSS's learned sinks, Cohere 2 and EXAONE 4's NoPE
global layers, OLMo 3, ...): how inspect reads them layer by layer, generation at 8 bits over prompts longer than
the window, the report's simulation, and each layer's table and shape in the cache."""


import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402
from familybuild import (  # noqa: E402
    KV_SHARED,
    SENSITIVITY,
    WINDOWED,
    assert_generates_as_transformers_cache,
    assert_rotary_round_trip,
    assert_simulation_is_stock,
    build,
    prompt,
    windowed,
)
from test_transformers import TINY_SENSITIVITY  # noqa: E402

import torch_rkv  # noqa: E402
from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.eval.simulate import Simulation, install  # noqa: E402
from torch_rkv.integrations import models  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402

WINDOWS = {"mistral_v0.1": (16, 16), "qwen2_swa": (0, 16), "gemma2": (16, 0), "gemma3": (16, 0), "cohere2": (16, 0),
           "exaone4": (16, 0), "exaone_moe": (16, 0), "dots1": (0, 16), "gpt_oss": (16, 0), "olmo3": (16, 0),
           "beam": (16, 0), "ergo": (16, 0), "flint": (16, 0), "cohere2_moe": (16, 0), "gemma4": (16, 0),
           "phimoe": (16, 16), "gemma3n": (16, 0, 16, 0), "gemma4_shared": (16, 0, 16, 0)}
# (the report's simulations refuse learned sinks, and one table for layers of two head_dims)
SIMULATED = [n for n in WINDOWED if n not in ("gpt_oss", "flint", "gemma4", "gemma4_shared")]
TYPED = ("sliding_attention", "full_attention")
ROPE_TYPES = {"gemma3": TYPED, "olmo3": TYPED, "gemma4": TYPED, "cohere2": (None, models.NO_ROPE),
              "exaone4": (None, models.NO_ROPE), "exaone_moe": (None, models.NO_ROPE),
              "cohere2_moe": (None, models.NO_ROPE), "flint": (None, models.NO_ROPE),
              "beam": ("sliding_attention", models.NO_ROPE),
              "ergo": ("sliding_attention", models.NO_ROPE),
              "gemma3n": TYPED * 2, "gemma4_shared": TYPED * 2}  # (the others: one table, (None, None))


@pytest.mark.parametrize("name", list(WINDOWED))
def test_windowed_families_are_inspected_layer_by_layer(name):
    model = windowed(name)
    att = models.inspect(model)
    assert att.windows == WINDOWS[name]
    assert att.softcap == (5.0 if name == "gemma2" else 0.0)
    assert att.learned_sinks == (name in ("gpt_oss", "flint"))
    assert att.rope_types == ROPE_TYPES.get(name, (None, None))
    assert [att.source(i) for i in range(att.layers)] == ([0, 1, 0, 1] if name in KV_SHARED else list(range(2)))
    if name == "gemma3":  # two tables that differ (local base 1e4, global 1e6): one table is refused by name
        local, glob = (models.rope_tables(model, 64, rope_type=t) for t in ("sliding_attention", "full_attention"))
        assert not torch.allclose(local[0], glob[0])
        with pytest.raises(models.UnsupportedModelFeature, match="a table per layer type"):
            models.rope_tables(model, 64)


@pytest.mark.parametrize("name", list(WINDOWED))
@pytest.mark.parametrize("scheme", [S.recommended(8).replace(k_block_tokens=16, recent=16), S.per_token(8)], ids=lambda s: s.name)
def test_windowed_rkv_cache_at_8_bits_generates_as_transformers_cache(name, scheme):
    """Prompts of 60 tokens over windows of 16: the sliding layers' rings wrap, the soft-capped prefill
    runs the fused kernel, by the portable criterion (each layer's table: the round-trip test)."""
    cache = assert_generates_as_transformers_cache(windowed(name), scheme, SENSITIVITY.get(name, TINY_SENSITIVITY))
    sliding = [c for c in cache.caches if c.sliding_window]
    assert sliding and all(c.layout.packed_capacity < 128 for c in sliding)


def test_sliding_layers_hold_their_window_whatever_the_capacity():
    """Gemma 2's sliding layer keeps ring_rows(16, block) rows at any capacity; its global layer grows."""
    model = windowed("gemma2")
    small, large = (RKVCache(model, S.recommended(4).replace(k_block_tokens=16), capacity=c) for c in (128, 1024))
    ring = [c.nbytes() for c in small.caches if c.sliding_window] + [c.nbytes() for c in large.caches if c.sliding_window]
    glob = [c.nbytes() for c in small.caches if not c.sliding_window] + [
        c.nbytes() for c in large.caches if not c.sliding_window]
    assert len(ring) == 2 and ring[0] == ring[1] and glob[1] > glob[0]


@pytest.mark.parametrize("name", SIMULATED)
def test_windowed_simulation_without_quantization_equals_the_stock_forward(name):
    """The report's simulation with nothing quantized: the stock logits, windows and soft-capping included."""
    assert_simulation_is_stock(windowed(name), prompt(40),
                               Simulation(S.per_token(8), quantize_keys=False, quantize_values=False))


def test_the_simulation_honours_a_sliding_window_mask():
    """A sliding-window model through the simulation sees its window: the stock logits, where ignoring the
    mask would not give them."""
    model = build("MistralConfig", "MistralForCausalLM", num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    ids = prompt(40)
    with torch.no_grad():
        want = model(ids).logits
        full = build("MistralConfig", "MistralForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                     sliding_window=None)(ids).logits
        install(model, Simulation(S.per_token(8), quantize_keys=False, quantize_values=False))
        got = model(ids).logits
    assert not torch.allclose(full, want, atol=1e-3)  # the window matters at 40 tokens
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


def test_gpt_oss_rotary_table_holds_each_frequency_once():
    """GPT-OSS's rotary module returns (cos, sin) of head_dim / 2 channels, one per rotate-half pair: read
    as the pairs' table, it rotates layer 0's pre-RoPE keys to the model's own (a window longer than the
    prompt: layer 0 slides, and its cache would keep the newest keys only)."""
    config_cls, model_cls, kw = WINDOWED["gpt_oss"]
    assert_rotary_round_trip(build(config_cls, model_cls, **{**kw, "sliding_window": 64}), (32, False))


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_the_rkv_attention_without_a_cache_is_the_models_own(name):
    """A forward without RKVCache on a model whose attention is "rkv": soft-capped scores and learned
    sinks, which SDPA cannot apply, computed as the family's eager attention; dropping the sinks (the
    error the check can catch) changes the logits."""
    from torch_rkv.integrations import transformers as integration

    model = windowed(name)
    ids = prompt(40)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids).logits
        integration.enable(model)
        got = model(ids).logits
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
        if name == "gpt_oss":
            for m in models.inspect(model).modules:
                m.sinks.data.fill_(-float("inf"))  # a softmax without them
            assert not torch.allclose(model(ids).logits, want, atol=1e-3)


def test_the_simulation_refuses_learned_sinks_by_name():
    """SDPA, under the report's simulations, cannot add learned sinks: an error that names them, not
    GPT-OSS computed without its sinks."""
    with pytest.raises(models.UnsupportedModelFeature, match="learned attention sinks"):
        install(windowed("gpt_oss"), Simulation(S.per_token(8), quantize_keys=False, quantize_values=False))


def test_the_simulation_quantizes_each_gemma3_layers_pre_rope_keys(monkeypatch):
    """Gemma 3's local and global layers rotate by different tables: what the report's simulation hands its
    quantizer for each layer's keys is that layer's pre-RoPE keys (its k_norm's output), which one table
    for both layers would not give."""
    from torch_rkv.eval.sensitivity import simulations_for

    model = windowed("gemma3")
    att = models.inspect(model)
    ids = prompt(48)
    pre = {}
    for i, m in enumerate(att.modules):  # the normed keys, before RoPE, (B, Hkv, n, D)
        m.k_norm.register_forward_hook(lambda mod, args, out, i=i: pre.__setitem__(i, out.float()))
    seen = []
    round_trip = Simulation.round_trip
    monkeypatch.setattr(Simulation, "round_trip", lambda self, x, side, s, layer=None, **kw: (
        seen.append(x.clone()) if side == "k" else None) or round_trip(self, x, side, s, layer, **kw))
    simulation = simulations_for(model, 64)  # the report's and the calibration's simulations
    with torch.no_grad():
        install(model, simulation(S.recommended(8).replace(k_block_tokens=16, sinks=0), view="all"))
        model(ids)
        install(model, None)
    assert len(seen) == 2
    for i in (0, 1):
        assert torch.allclose(seen[i], pre[i], atol=1e-5, rtol=1e-5), (i, (seen[i] - pre[i]).abs().max())


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_gemmas_cache_round_trips_each_layers_keys_with_its_table(name):
    """RKVCache on Gemma 3 and 4: each kind of layer's cache un-rotates the model's post-RoPE keys to its
    pre-RoPE ones (k_norm's output) with its own table (Gemma 4's global one of its own head_dim, partial),
    and rotates them back, to float rounding."""
    model = windowed(name)
    att = models.inspect(model)
    ids = prompt(40)
    pre = {}
    for i, m in enumerate(att.modules):  # (Gemma 4 norms (B, n, H, D) before its transpose)
        m.k_norm.register_forward_hook(lambda mod, args, out, i=i: pre.__setitem__(
            i, (out.transpose(1, 2) if name == "gemma4" else out).float()))
    with torch.no_grad():
        full = T.DynamicCache()  # (without the config: every layer keeps every key)
        post = [layer.keys.float() for layer in model(ids, cache=full, use_cache=True).past_key_values.layers]
    cache = RKVCache(model, S.recommended(8).replace(k_block_tokens=16), capacity=64)
    pos = torch.arange(40)
    for i in range(att.layers):
        q = cache.layers[i].cache
        stored, _ = q.to_storage(cache.layers[i].index, post[i], post[i])
        assert torch.allclose(stored.float(), pre[i], atol=1e-5, rtol=1e-5), i
        back = torch_rkv.rope(pre[i], q.rope_cos, q.rope_sin, pos)
        assert torch.allclose(back, post[i], atol=1e-5, rtol=1e-5), i
    a, b = (cache.layers[i].cache for i in (0, 1))
    assert a is not b and (a.rope_cos.shape != b.rope_cos.shape or not torch.allclose(a.rope_cos, b.rope_cos))


@pytest.mark.parametrize("name", ["cohere2", "exaone4"])
def test_a_window_without_sliding_layers_masks_and_rotates_as_transformers_does(name):
    """Cohere 2 and EXAONE 4 with a window in the config but no sliding layer type: transformers masks no
    layer to the window (its masks follow the types), and rotates none (their global layers are NoPE
    wherever the config has a window). So every layer attends to the whole cache, keys as they are."""
    config_cls, model_cls, kw = WINDOWED[name]
    model = build(config_cls, model_cls, **{**kw, "layer_types": ["full_attention"] * 2})
    att = models.inspect(model)
    assert att.windows == (0, 0) and att.rope_types == (models.NO_ROPE, models.NO_ROPE)
    cache = assert_generates_as_transformers_cache(model, S.recommended(8).replace(k_block_tokens=16))
    assert not any(c.sliding_window for c in cache.caches)


def test_gemma4s_layers_keep_their_own_shapes_and_tables():
    """Gemma 4: the sliding layer's cache holds 2 KV heads of 32 channels, the global layer's 1 of 64,
    each with its own table (the global one partial: pairs past a quarter of the head rotate by 0); the
    report's one-shape paths refuse the model by name."""
    model = windowed("gemma4")
    att = models.inspect(model)
    assert att.layer_kv_heads == (2, 1) and att.layer_head_dims == (32, 64)
    cache = RKVCache(model, S.recommended(8).replace(k_block_tokens=16), capacity=64)
    local, glob = (cache.layers[i].cache for i in (0, 1))
    assert (local.layout.kv_heads, local.layout.head_dim, glob.layout.kv_heads, glob.layout.head_dim) == (2, 32, 1, 64)
    assert local.rope_cos.shape[-1] == 16 and glob.rope_cos.shape[-1] == 32
    assert torch.equal(glob.rope_cos[:, 8:], torch.ones_like(glob.rope_cos[:, 8:]))  # unrotated pairs
    assert not torch.equal(glob.rope_cos[:, :8], torch.ones_like(glob.rope_cos[:, :8]))
    with pytest.raises(models.UnsupportedModelFeature, match="one head_dim for a model whose layers differ"):
        att.head_dim
