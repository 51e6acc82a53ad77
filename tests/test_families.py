"""Model families beyond Llama (torch_rkv/integrations/models.py): per family, a tiny random model built
here from its transformers config with the family's structure (GQA, qkv bias, q/k norms, fused qkv,
partial rotary, GPT-J's interleaved pairs); no download."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402
from test_transformers import TINY_SENSITIVITY, assert_agrees  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import torch_rkv  # noqa: E402
from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.eval import perplexity  # noqa: E402
from torch_rkv.eval.agreement import cached_logprobs, greedy_agrees, logprob_bound, teacher_forced  # noqa: E402
from torch_rkv.eval.simulate import Simulation, install  # noqa: E402
from torch_rkv.integrations import models  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402
from torch_rkv.reference import quantized_count  # noqa: E402

VOCAB = 128
COMMON = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
          "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def build(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    cfg = getattr(T, config_cls)(**{**COMMON, **kw})
    return getattr(T, model_cls)(cfg).eval()


FAMILIES = {  # name: (config, model, family-specific arguments), with the rot_dim and pairing expected
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 1,
                                                         "sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_attention_heads": 4, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    # (GPT-J's config maps the common names onto n_embd, n_layer, n_head, n_positions)
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"num_attention_heads": 4, "rotary_dim": 16}),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", {"num_attention_heads": 4, "rotary_dim": 16}),  # GPT-J's
    # the MoE families: their dense family's attention beside expert MLPs
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                         "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                             "head_dim": 32, "moe_intermediate_size": 64,
                                                             "num_experts": 4, "num_experts_per_tok": 2}),
    # Command R: interleaved pairs from a cos/sin table (each frequency repeated), q/k LayerNorms
    "cohere": ("CohereConfig", "CohereForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "use_qk_norm": True}),
    # Granite: attention_multiplier in place of 1/sqrt(head_dim)
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                        "attention_multiplier": 0.05}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2}),  # q/k norms
    # SmolLM3: its second layer applies no RoPE (no_rope_layers)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                        "no_rope_layers": [1, 0]}),
}
ROTARY = {"qwen2": (32, False), "qwen3": (32, False), "mistral": (32, False), "phi3": (32, False),
          "gpt_neox": (8, False), "phi": (16, False), "stablelm": (8, False), "gptj": (16, True), "codegen": (16, True),
          "mixtral": (32, False), "qwen3_moe": (32, False), "cohere": (32, True), "granite": (32, False),
          "olmo2": (32, False), "smollm3": (32, False)}


def family(name):
    config_cls, model_cls, kw = FAMILIES[name]
    return build(config_cls, model_cls, **kw)


def prompt(n, batch=1, seed=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_rotary_table_and_pairing_are_the_models_own(name):
    """Layer 0's keys with every position at 0, un-rotated at position 0, are its pre-RoPE keys (the
    rotation at position 0 is the identity, up to a scaled table's attention scaling; nothing else in
    layer 0 depends on positions). Rotating them with the table and pairing models.inspect reports gives
    the model's own post-RoPE keys, and the inverse gives them back."""
    assert_rotary_round_trip(family(name), ROTARY[name])


def assert_rotary_round_trip(model, rotary, layer=0):
    att = models.inspect(model)
    cos, sin = models.rope_tables(model, 64)
    assert (2 * cos.shape[-1], att.interleaved) == rotary
    ids = prompt(40)
    with torch.no_grad():
        post = model(ids, use_cache=True).past_key_values.layers[layer].keys.float()
        at_zero = model(ids, position_ids=torch.zeros_like(ids), use_cache=True).past_key_values.layers[layer].keys
        at_zero = at_zero.float()
    pre = torch_rkv.rope(at_zero, cos, sin, torch.zeros(40, dtype=torch.long), att.interleaved, inverse=True)
    pos = torch.arange(40)
    rotated = torch_rkv.rope(pre, cos, sin, pos, att.interleaved)
    assert torch.allclose(rotated, post, atol=1e-5, rtol=1e-5), (rotated - post).abs().max()
    back = torch_rkv.rope(post, cos, sin, pos, att.interleaved, inverse=True)
    assert torch.allclose(back, pre, atol=1e-5, rtol=1e-5)
    # and a wrong pairing would not pass: the check can fail
    assert not torch.allclose(torch_rkv.rope(pre, cos, sin, pos, not att.interleaved), post, atol=1e-3)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("scheme", [S.recommended(8).replace(k_block_tokens=16, recent=16), S.per_token(8)], ids=lambda s: s.name)
def test_rkv_cache_at_8_bits_generates_as_transformers_cache(name, scheme):
    """Prefill, then decode through the fused kernel (pre-RoPE keys with the family's own table, or
    per-token keys), and a second turn through the paged prefill kernel: the portable criterion. (rkv-8 with
    a 16-token recent window: 48 of the 76 tokens are read from quantized blocks.)"""
    assert_generates_as_transformers_cache(family(name), scheme)


def assert_generates_as_transformers_cache(model, scheme, sensitivity=TINY_SENSITIVITY) -> RKVCache:
    """60-token prompts, 16 new tokens, batch 2: RKVCache at 8 bits by the portable criterion; the cache."""
    ids = prompt(60, batch=2)
    want = model.generate(ids, max_new_tokens=16, do_sample=False)
    cache = RKVCache(model, scheme, capacity=128, batch=2)
    got = model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache)
    assert_agrees(model, ids, want, got, scheme, 8, sensitivity, 128)
    return cache


@pytest.mark.parametrize("name", list(FAMILIES))
def test_simulation_without_quantization_equals_the_stock_forward(name):
    """The report's simulation path with nothing quantized gives the stock model's logits (fp32)."""
    model = family(name)
    cos, sin = models.rope_tables(model, 64)
    assert_simulation_is_stock(model, prompt(50), Simulation(S.recommended(4), cos, sin, quantize_keys=False,
                                                             rope_interleaved=models.inspect(model).interleaved,
                                                             quantize_values=False))


def assert_simulation_is_stock(model, ids, sim):
    with torch.no_grad():
        want = model(ids).logits
        install(model, sim)
        got = model(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("name", ["gpt_neox", "gptj", "qwen3", "cohere"])
def test_the_simulation_quantizes_the_models_pre_rope_keys(name, monkeypatch):
    """What the simulation hands its quantizer for layer 0's keys is the model's pre-RoPE keys (partial or
    interleaved rotary undone with the model's pairing; Qwen3's normed keys): the keys at position 0."""
    model = family(name)
    ids = prompt(48)
    att = models.inspect(model)
    cos, sin = models.rope_tables(model, 64)
    seen = []
    round_trip = Simulation.round_trip
    monkeypatch.setattr(Simulation, "round_trip", lambda self, x, side, s, layer=None, **kw: (
        seen.append(x.clone()) if side == "k" else None) or round_trip(self, x, side, s, layer, **kw))
    with torch.no_grad():
        pre = model(ids, position_ids=torch.zeros_like(ids), use_cache=True).past_key_values.layers[0].keys.float()
        scheme = S.recommended(8).replace(k_block_tokens=16, sinks=0)
        install(model, Simulation(scheme, cos, sin, rope_interleaved=att.interleaved, view="all"))
        model(ids)
        install(model, None)
    assert torch.allclose(seen[0], pre, atol=1e-5, rtol=1e-5), (seen[0] - pre).abs().max()


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


UNSUPPORTED = {
    "ALiBi": (lambda: build("FalconConfig", "FalconForCausalLM", num_attention_heads=4, alibi=True), "ALiBi"),
    "chunked attention": (lambda: build("Llama4TextConfig", "Llama4ForCausalLM", num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32, attention_chunk_size=16,
                                        num_local_experts=2, intermediate_size_mlp=192),
                          "chunked local attention"),
    "encoder-decoder": (lambda: T.T5ForConditionalGeneration(T.T5Config(vocab_size=VOCAB, d_model=64, num_layers=1,
                                                                        num_heads=2, d_kv=32, d_ff=64)).eval(),
                        "an encoder-decoder model"),
    "MLA": (lambda: build("DeepseekV3Config", "DeepseekV3ForCausalLM", num_attention_heads=4, num_key_value_heads=4,
                          kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
                          v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                          moe_intermediate_size=64, n_group=1, topk_group=1),
            "multi-head latent attention"),
    # Zaya: its "hybrid" layers' attention holds a convolution's state beside its keys (Falcon-H1's alone served)
    "another family's hybrid layers": (lambda: build("ZayaConfig", "ZayaForCausalLM", num_attention_heads=4,
                                                     num_key_value_heads=2), re.escape("layers of type ['hybrid']")),
    "dynamic mask": (lambda: build("DogeConfig", "DogeForCausalLM", num_attention_heads=4, num_key_value_heads=2),
                     "dynamic mask attention"),
    "differential attention": (lambda: build("DiffLlamaConfig", "DiffLlamaForCausalLM", num_attention_heads=4,
                                             num_key_value_heads=2), "differential attention"),
    # XGLM keeps its own attention code (transformers only warns): its attention would never run the kernels
    "off the attention interface": (lambda: build("XGLMConfig", "XGLMForCausalLM", attention_heads=4, d_model=128,
                                                  num_layers=2, ffn_dim=192),
                                    "attention code off transformers' attention interface"),
    "bidirectional attention": (lambda: build("Gemma3TextConfig", "Gemma3ForCausalLM", num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=32, use_bidirectional_attention=True),
                                "bidirectional attention"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_features_raise_an_error_that_names_them(case):
    make, feature = UNSUPPORTED[case]
    model = make()
    for attempt in (lambda: RKVCache(model, S.recommended(4), capacity=64),
                    lambda: RKVCache(model, S.per_token(4), capacity=64)):  # post-RoPE keys are refused too
        with pytest.raises(models.UnsupportedModelFeature, match=feature):
            attempt()


# Sliding windows, soft-capping and per-layer RoPE tables: prompts longer than the window (16 tokens)
WINDOWED = {
    "mistral_v0.1": ("MistralConfig", "MistralForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                              "sliding_window": 16}),
    "qwen2_swa": ("Qwen2Config", "Qwen2ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "use_sliding_window": True, "sliding_window": 16,
                                                      "max_window_layers": 1}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                                     "sliding_window": 16, "query_pre_attn_scalar": 24,
                                                     "attn_logit_softcapping": 5.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                         "head_dim": 32, "sliding_window": 16,
                                                         "layer_types": ["sliding_attention", "full_attention"]}),
    # Command R7B / A and EXAONE 4: sliding layers with RoPE beside global layers without it
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                        "sliding_window": 16,
                                                        "layer_types": ["sliding_attention", "full_attention"]}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                        "sliding_window": 16,
                                                        "layer_types": ["sliding_attention", "full_attention"]}),
    # EXAONE 4's MoE sibling: NoPE global layers too; dots.llm1: windows by layer type (max_window_layers).
    # (Every expert chosen: their sigmoid routers' near-ties in a random tiny model flip an expert at
    # any perturbation, 8-bit keys included, a jump no bound on attention error covers.)
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                              "head_dim": 32, "sliding_window": 16, "num_experts": 4,
                                                              "num_experts_per_tok": 4,
                                                              "moe_intermediate_size": 64,
                                                              "layer_types": ["sliding_attention", "full_attention"]}),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                  "sliding_window": 16, "max_window_layers": 1, "n_routed_experts": 4,
                                                  "num_experts_per_tok": 4, "moe_intermediate_size": 64,
                                                  "first_k_dense_replace": 1, "n_shared_experts": 1}),
    # GPT-OSS: learned attention sinks, a YaRN table holding each frequency once, MoE, sliding layers
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "head_dim": 32, "sliding_window": 16, "num_local_experts": 4,
                                                      "num_experts_per_tok": 2}),
    # OLMo 3: a table per layer type (its rotary's forward takes the type); Beam, Ergo and Flint: RoPE in
    # the sliding layers, none in the global ones (Beam's and Ergo's rope parameters None for that type;
    # Ergo's tables interleaved as Cohere's; Flint's learned sinks); Cohere 2 MoE: Cohere 2's attention
    # beside experts
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                  "sliding_window": 16,
                                                  "layer_types": ["sliding_attention", "full_attention"]}),
    "beam": ("BeamConfig", "BeamForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                               "sliding_window": 16,
                                               "layer_types": ["sliding_attention", "full_attention"]}),
    "ergo": ("ErgoConfig", "ErgoForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                               "sliding_window": 16, "num_experts": 4, "num_experts_per_tok": 4,
                                               "moe_intermediate_size": 64, "first_dense_intermediate_size": 192,
                                               "shared_intermediate_size": 64, "global_attention_scale": 2.0,
                                               "layer_types": ["sliding_attention", "full_attention"]}),
    "flint": ("FlintConfig", "FlintForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                                  "sliding_window": 16, "num_experts": 4, "num_experts_per_tok": 4,
                                                  "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
                                                  "layer_types": ["sliding_attention", "full_attention"]}),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 16, "num_experts": 4,
        "num_experts_per_tok": 4, "moe_intermediate_size": 64, "layer_types": ["sliding_attention", "full_attention"]}),
    # PhiMoE: Phi-3's window on every layer, in the mask only (its module does not pass sliding_window)
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "sliding_window": 16, "num_local_experts": 4,
                                                     "num_experts_per_tok": 2}),
    # Gemma 4: global layers of their own head_dim (64, against 32) and KV heads (1, keys shared with the
    # values: attention_k_eq_v), rotated by a partial "proportional" table; q/k norms and a scale of 1
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "global_head_dim": 64,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 16,
        "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB,
        "layer_types": ["sliding_attention", "full_attention"]}),
    # KV sharing: layers 2 and 3 store nothing and attend over the keys and values of the last earlier layer of
    # their type (0: sliding, 1: global), Gemma 3n's and Gemma 4's small models' way
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 16,
        "num_hidden_layers": 4, "num_kv_shared_layers": 2, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB,
        "activation_sparsity_pattern": [0.0] * 4}),
}
WINDOWED["gemma4_shared"] = ("Gemma4TextConfig", "Gemma4ForCausalLM", {
    **WINDOWED["gemma4"][2], "num_hidden_layers": 4, "num_kv_shared_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"] * 2})
KV_SHARED = ("gemma3n", "gemma4_shared")
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
# Gemma 4 scores q . k of RMS-normed heads with a scale of 1, not 1 / sqrt(head_dim): its log-probabilities
# move about 3x more for the same key error (per-token-8: 0.032 nats where the tiny models' bound is 0.0125)
# (and where layers share KV caches, a key's error reaches twice the layers)
SENSITIVITY = {"gemma4": 0.6, "gemma3n": 0.4, "gemma4_shared": 1.2}


def windowed(name):
    config_cls, model_cls, kw = WINDOWED[name]
    model = build(config_cls, model_cls, **kw)
    if name == "gemma2":
        model.set_attn_implementation("eager")  # the stock path that soft-caps (SDPA refuses to)
    return model


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


NOPE = {"smollm3": lambda: family("smollm3"), "cohere2": lambda: windowed("cohere2"),
        "exaone4": lambda: windowed("exaone4"), "beam": lambda: windowed("beam"),
        "ergo": lambda: windowed("ergo")}  # layer 1 of each applies no RoPE


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


@pytest.mark.parametrize("name", list(NOPE))
def test_layers_without_rope_store_and_simulate_their_keys_as_they_are(name, monkeypatch):
    """A NoPE layer's keys reach the cache as the attention reads them: a pre-RoPE cache must not
    un-rotate them (its identity table), or they would quantize per channel in a basis that turns with
    the position. RKVCache stores them as they are, and the report's simulation quantizes them as they
    are; the rotated layer's keys are un-rotated, as ever."""
    from torch_rkv.eval.sensitivity import simulations_for

    model = NOPE[name]()
    assert models.inspect(model).rope_types[1] == models.NO_ROPE
    ids = prompt(48)  # (whole blocks of 16: the simulation's view "all")
    with torch.no_grad():
        post = [layer.keys.float() for layer in model(ids, cache=T.DynamicCache(), use_cache=True).past_key_values.layers]
    cache = RKVCache(model, S.recommended(8).replace(k_block_tokens=16), capacity=64)
    stored = [cache.layers[i].cache.to_storage(cache.layers[i].index, post[i], post[i])[0].float() for i in (0, 1)]
    assert not torch.allclose(stored[0], post[0], atol=1e-3)  # layer 0 rotates: its keys are un-rotated
    assert torch.allclose(stored[1], post[1], atol=1e-6, rtol=1e-6), (stored[1] - post[1]).abs().max()
    seen = []  # what the simulation quantizes, each layer's keys (returned as they are: layer 1's input is exact)
    monkeypatch.setattr(Simulation, "round_trip", lambda self, x, side, s, layer=None, **kw: (
        seen.append(x.clone()) if side == "k" else None) or x)
    with torch.no_grad():
        install(model, simulations_for(model, 64)(S.recommended(8).replace(k_block_tokens=16, sinks=0), view="all"))
        model(ids)
        install(model, None)
    assert torch.allclose(seen[1], post[1], atol=1e-5, rtol=1e-5), (seen[1] - post[1]).abs().max()
    assert not torch.allclose(seen[0], post[0], atol=1e-3)


def test_the_fused_attention_refuses_values_the_cache_did_not_store(monkeypatch):
    """The fused kernels attend over the values the cache stored. DiffLlama (its refusal by name set
    aside here) attends twice per update, each time over half of the values re-arranged: the error names
    that, instead of returning the first attention's output twice."""
    model = UNSUPPORTED["differential attention"][0]()
    monkeypatch.setattr(models, "_refuse", lambda kind, feature: None)
    cache = RKVCache(model, S.recommended(8).replace(k_block_tokens=16), capacity=128)
    with pytest.raises(ValueError, match="reads other values than it cached"):
        model.generate(prompt(40), max_new_tokens=4, do_sample=False, cache=cache)


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


def test_gemma4s_decoder_is_found_beside_its_vision_encoder():
    """Gemma 4 with its vision tower: the vision encoder's attention layers (with their own layer_idx) are
    not the decoder's; a text prompt generates as with transformers' cache at rkv-8."""
    torch.manual_seed(0)
    text = {**COMMON, **WINDOWED["gemma4"][2], "vocab_size": 262144, "vocab_size_per_layer_input": 262144}
    vision = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 32}
    model = T.Gemma4ForConditionalGeneration(T.Gemma4Config(text_config=text, vision_config=vision,
                                                            audio_config=None)).eval()
    att = models.inspect(model)
    assert [m.layer_idx for m in att.modules] == [0, 1] and att.layer_head_dims == (32, 64)
    ids = prompt(40)
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    scheme = S.recommended(8).replace(k_block_tokens=16)
    got = model.generate(ids, max_new_tokens=8, do_sample=False, cache=RKVCache(model, scheme, capacity=64))
    assert_agrees(model, ids, want, got, scheme, 8, SENSITIVITY["gemma4"], 64)


def test_kv_shared_layers_store_nothing_and_decode_what_the_simulation_measures():
    """Gemma 3n's KV-shared layers 2 and 3 hold no cache (half the bytes of a model that does not share) and,
    token by token through the fused kernel, attend over layers 0's and 1's quantized keys and values: the
    simulation's perplexity, in which each quantizes its source's keys as its source does."""
    model = windowed("gemma3n")
    scheme = S.recommended(4).replace(k_block_tokens=16, recent=8)
    cache = RKVCache(model, scheme, capacity=96)
    assert [type(layer).__name__ for layer in cache.layers] == ["RKVLayer", "RKVLayer", "DummyLayer", "DummyLayer"]
    unshared = RKVCache(build(*WINDOWED["gemma3n"][:2], **{**WINDOWED["gemma3n"][2], "num_kv_shared_layers": 0}),
                        scheme, capacity=96)
    assert 2 * cache.nbytes() == unshared.nbytes() and cache.schemes == [scheme] * 4
    assert_decodes_as_simulated(model, scheme, moves=1e-3)
    with pytest.raises(ValueError, match="layer 2 attends over layer 0's keys and values"):
        RKVCache(model, [scheme, scheme, S.per_token(4), scheme], capacity=96)
    # per-layer fits, which would take a shared layer's reads for a cache of its own, refuse the model by name
    from torch_rkv.eval import levels, sensitivity

    for fit in (lambda: sensitivity.load_or_measure(model, None, (2, 3)),
                lambda: levels.calibrate(model, prompt(96, seed=5))):
        with pytest.raises(models.UnsupportedModelFeature, match="whose layers share KV caches"):
            fit()


@pytest.mark.parametrize("name", KV_SHARED)
def test_kv_shared_layers_attend_over_a_chunk_before_it_is_appended_once(name, monkeypatch):
    """A chunk after the prefill (a second turn), its KV-shared layers keeping its last query only (Gemma's
    logits_to_keep): every reader of a cache attends over it as it stood before the chunk, plus the chunk,
    and the last one appends the chunk once; the logits stay within the 8-bit bound of transformers' cache."""
    from torch_rkv.cache import QuantizedKVCache

    model = windowed(name)
    ids = prompt(60, batch=2)
    calls = []
    attend_chunk = QuantizedKVCache.attend_chunk

    def recorded(self, layer, q, ks, vs, *args, **kwargs):
        calls.append((id(self), layer, int(self.lengths[layer][0]), q.shape[2], ks.shape[2]))
        return attend_chunk(self, layer, q, ks, vs, *args, **kwargs)

    monkeypatch.setattr(QuantizedKVCache, "attend_chunk", recorded)
    scheme = S.per_token(8)
    cache = RKVCache(model, scheme, capacity=128, batch=2)
    with torch.no_grad():
        want = model(ids, logits_to_keep=1).logits[:, -1]
        model(ids[:, :40], cache=cache, use_cache=True)
        got = model(ids[:, 40:], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    # layer 0's cache read by layers 0 and 2, layer 1's by 1 and 3 (a chunk of 20 over 40 cached tokens; the
    # shared layers' one query padded to the chunk)
    assert [c[2:] for c in calls] == [(40, 20, 20)] * 4, calls
    assert calls[0][:2] == calls[2][:2] and calls[1][:2] == calls[3][:2] and calls[0][:2] != calls[1][:2]
    assert [cache.layers[i].get_seq_length() for i in (0, 1)] == [60, 60]
    bound = logprob_bound(8, SENSITIVITY[name])
    err = (got.log_softmax(-1) - want.log_softmax(-1)).gather(-1, want.topk(8, -1).indices).abs().max()
    assert err <= bound, (err, bound)


def test_kv_shared_layers_keep_the_last_queries_of_a_prompt_causal():
    """Gemma 4's KV-shared layers keep only a prompt's last logits_to_keep queries, and the mask function
    leaves a short prompt's mask to SDPA's is_causal, which would align them with the first keys: the
    "rkv" attention masks them as the last ones, with the cache and without (the full forward's logits)."""
    model = windowed("gemma4_shared")
    ids = prompt(12)  # (shorter than the 16-token window: no mask on any layer)
    with torch.no_grad():
        want = model(ids).logits[:, -4:]
        cache = RKVCache(model, S.per_token(8), capacity=64)
        for got in (model(ids, logits_to_keep=4).logits, model(ids, cache=cache, logits_to_keep=4).logits):
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


# absolute position embeddings, no RoPE: GPT-2, OPT, and GPT-BigCode (StarCoder) with one KV head (multi_query) or
# one a query head (its config counts heads as n_head)
ABSOLUTE = {"gpt2": ("GPT2Config", "GPT2LMHeadModel", {"num_attention_heads": 4}),
            "opt": ("OPTConfig", "OPTForCausalLM", {"num_attention_heads": 4, "ffn_dim": 192,
                                                    "word_embed_proj_dim": 128}),
            "gpt_bigcode_mqa": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"n_head": 4, "multi_query": True}),
            "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"n_head": 4, "multi_query": False})}


@pytest.mark.parametrize("name", list(ABSOLUTE))
def test_models_of_absolute_positions_store_their_keys_as_they_are(name, monkeypatch):
    """A model of absolute positions rotates no layer (every layer NO_ROPE): pre-RoPE schemes store each key as
    it is, per channel (the identity table); rkv-8, per-token-8 and KIVI-8 generate as transformers' cache
    does, at each family's KV heads (GPT-BigCode's MQA: 1); the report's simulation, nothing quantized, is
    the stock forward."""
    model = build(*ABSOLUTE[name][:2], **ABSOLUTE[name][2])
    att = models.inspect(model)
    assert att.rotary is None and att.rope_types == (models.NO_ROPE,) * 2
    assert att.layer_kv_heads == ((1, 1) if name == "gpt_bigcode_mqa" else (4, 4))
    for scheme in (S.recommended(8).replace(k_block_tokens=16, recent=16), S.per_token(8),
                   S.kivi(8, block=8, recent=16)):
        cache = assert_generates_as_transformers_cache(model, scheme)
        assert cache.caches[0].layout.kv_heads == att.layer_kv_heads[0]
    cos, sin = models.rope_tables(model, 64)
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
    assert_simulation_is_stock(model, prompt(40), Simulation(S.recommended(4), cos, sin, quantize_keys=False,
                                                             quantize_values=False))


def test_rotary_inside_the_attention_is_refused_for_pre_rope_schemes():
    """RoFormer rotates inside its attention, by no model-level rotary module: a pre-RoPE scheme, which
    un-rotates by the model's table, is refused by name rather than taking its layers for NoPE ones."""
    model = build("RoFormerConfig", "RoFormerForCausalLM", num_attention_heads=4, is_decoder=True)
    assert models.inspect(model).rope_types == (None, None)
    with pytest.raises(models.UnsupportedModelFeature, match="rotary table is not a model-level module"):
        RKVCache(model, S.recommended(8), capacity=128)


# Hybrid models: recurrent layers (gated DeltaNet, Mamba 1 and 2, LFM2's short convolutions) or MLP-only layers
# beside attention layers. Only the attention layers keep a KV cache; the others keep a state of fixed size in
# transformers' own cache layers.
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "layer_types": ["linear_attention", "full_attention"]}
MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_chunk_size": 16}
HYBRID = {  # name: (config, model, arguments), layer 0 recurrent and layer 1 attention unless said
    # (partial rotary, gated attention output, q/k norms; two attention layers between recurrent ones; dense
    # MLPs: a tiny random router's near-ties flip experts at an 8-bit error, a jump the bound does not model)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": [0, 1, 2, 3], **LINEAR,
        "num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, **LINEAR}),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["linear_attention", "full_attention"]}),
    # Mamba beside attention with no positions at all (every attention layer NO_ROPE)
    "jamba": ("JambaConfig", "JambaForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 8}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["mamba", "attention"],
        "num_local_experts": 2, "num_experts_per_tok": 1, **MAMBA2}),
    # Nemotron-H: a Mamba 2 layer, an attention layer (no RoPE) and an MLP-only layer
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 3,
        "layers_block_type": ["mamba", "attention", "mlp"], "mamba_num_heads": 4, "mamba_head_dim": 16,
        "ssm_state_size": 16, "n_groups": 1, "chunk_size": 16}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"]}),
    # a sliding-window attention layer beside a gated DeltaNet
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 16,
        "layer_types": ["linear_attention", "sliding_attention"]}),
    # attention beside a Mamba 2 mixer in every layer (both states in one cache layer)
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "mamba_d_ssm": 64, "mamba_n_heads": 4,
        "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16}),
}
# which layers attend (the others: (False, True))
HYBRID_ATTENTION = {"nemotron_h": (False, True, False), "qwen3_next": (False, True) * 2, "falcon_h1": (True, True)}
# (rot_dim, interleaved) of the families that rotate (Jamba, Nemotron-H and Granite 4 by default have no positions in
# their attention)
HYBRID_ROTARY = {"qwen3_next": (8, False), "qwen3_5": (8, False), "olmo_hybrid": (32, False), "lfm2": (32, False),
                 "lara_mini": (128, False), "falcon_h1": (32, False)}


def hybrid(name, **changes):
    config_cls, model_cls, kw = HYBRID[name]
    return build(config_cls, model_cls, **{**kw, **changes})


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_models_keep_kv_caches_in_their_attention_layers_alone(name):
    """The attention layers hold RKVCache's quantized caches, their exact bytes; the recurrent and MLP-only
    layers hold what transformers' own cache gives them (their states stay in full precision)."""
    from torch_rkv.layout import CacheLayout, binding_window

    model = hybrid(name)
    att = models.inspect(model)
    attends = HYBRID_ATTENTION.get(name, (False, True))
    assert tuple(att.attends(i) for i in range(att.layers)) == attends
    scheme = S.recommended(4).replace(k_block_tokens=16)
    cache = RKVCache(model, scheme, capacity=128, batch=2)
    own = DynamicCache(config=model.config)
    # (Jamba's: a subclass that refuses several tokens over its state, below)
    mine, theirs = ([layer for layer, a in zip(c.layers, attends) if not a] for c in (cache, own))
    assert len(mine) == len(theirs) and all(isinstance(x, type(y)) for x, y in zip(mine, theirs))
    assert all((type(x) is type(y)) == (name != "jamba") for x, y in zip(mine, theirs))
    kind = "RKVHybridLayer" if name == "falcon_h1" else "RKVLayer"  # (Falcon-H1's keep the mixer's states too)
    assert [type(layer).__name__ for layer, a in zip(cache.layers, attends) if a] == [kind] * sum(attends)
    assert cache.schemes == [scheme if a else None for a in attends]
    want = sum(CacheLayout(scheme, 2, att.layer_kv_heads[i], att.layer_head_dims[i], 128, torch.float32,
                           sliding_window=binding_window(att.windows[i], 128)).nbytes()
               for i in range(att.layers) if attends[i])
    assert cache.nbytes() == want
    assert models.inspect(model).windows == ((0, 16) if name == "lara_mini" else (0,) * att.layers)
    # forgetting a refused step leaves the recurrent states; a reset (a new sequence) clears them
    recurrent = next(i for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states"))
    with torch.no_grad():
        model(prompt(20, batch=2), cache=cache, use_cache=True)
    state = cache.layers[recurrent].conv_states[0].clone()
    assert state.abs().sum() > 0 and cache.has_previous_state(recurrent)
    cache.reset_steps()
    assert torch.equal(cache.layers[recurrent].conv_states[0], state) and cache.has_previous_state(recurrent)
    assert int(cache.layers[recurrent].cumulative_length_linear) == 20 == cache.get_seq_length(attends.index(True))
    cache.reset()
    assert not cache.layers[recurrent].conv_states[0].any() and not cache.has_previous_state(recurrent)
    assert cache.get_seq_length(attends.index(True)) == 0


# hybrid families whose recurrent states the planner counts beyond those above (Mamba 2 groups of 2; their
# recurrent layers' states only, through transformers' own cache)
MORE_STATES = {
    "bamba": ("BambaConfig", "BambaForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [1], "mamba_n_groups": 2,
        **MAMBA2}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, **LINEAR, "linear_conv_kernel_dim": 3}),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_dense_layers": 0}),
}


def held_states(cache) -> int:
    """Bytes of the recurrent layers' states a cache holds (transformers' LinearAttentionLayer's)."""
    return sum(t.nbytes for layer in cache.layers if hasattr(layer, "conv_states")
               for states in (layer.conv_states, layer.recurrent_states) for t in states.values() if t is not None)


@pytest.mark.parametrize("name", list(MORE_STATES))
def test_more_hybrid_families_recurrent_states_are_what_the_plan_counts(name, tmp_path):
    """As below, for the families whose states the planner knows beyond the tested hybrids (Mamba 2 groups of
    two, a kernel of 3, MoE variants), against transformers' own cache."""
    from torch_rkv import plan

    config_cls, model_cls, kw = MORE_STATES[name]
    model = build(config_cls, model_cls, **kw).to(torch.bfloat16)
    model.config.to_json_file(tmp_path / "config.json")
    shape = plan.from_config(str(tmp_path / "config.json"), 1e6)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt(20, batch=2), cache=cache, use_cache=True)
    assert shape.recurrent_layers == 1 and held_states(cache) > 0
    assert 2 * shape.state_bytes(torch.bfloat16) == held_states(cache)


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_models_recurrent_states_are_what_the_plan_counts(name, tmp_path):
    """plan --config counts every recurrent layer's state per sequence (torch_rkv.recurrent: each family's
    mixer dimensions from its config keys), whatever the scheme: exactly the bytes the cache holds after a
    forward of a bfloat16 model (convolution windows in bfloat16, states in float32)."""
    from torch_rkv import plan

    model = hybrid(name).to(torch.bfloat16)
    model.config.to_json_file(tmp_path / "config.json")
    shape = plan.from_config(str(tmp_path / "config.json"), 1e6)
    cache = RKVCache(model, S.recommended(4).replace(k_block_tokens=16), capacity=64, batch=2)
    with torch.no_grad():
        model(prompt(20, batch=2), cache=cache, use_cache=True)
    held = held_states(cache)
    assert shape.recurrent_layers == sum(hasattr(layer, "conv_states") for layer in cache.layers)
    assert held > 0 and 2 * shape.state_bytes(torch.bfloat16) == held
    assert plan.kv_bytes(shape, cache.schemes[HYBRID_ATTENTION.get(name, (False, True)).index(True)], 64, 2,
                         torch.bfloat16) == cache.nbytes() + held


@pytest.mark.parametrize("name", list(HYBRID_ROTARY))
def test_hybrid_models_rotary_table_and_pairing_are_their_own(name):
    """The first attention layer's keys, as test_the_rotary_table_and_pairing_are_the_models_own reads layer 0's
    (the recurrent layer before it reads no positions): the table and pairing inspect reports are the model's."""
    model = hybrid(name, **({"sliding_window": 64} if name == "lara_mini" else {}))  # (every key kept)
    assert_rotary_round_trip(model, HYBRID_ROTARY[name], layer=HYBRID_ATTENTION.get(name, (False, True)).index(True))


@pytest.mark.parametrize("name", list(HYBRID))
@pytest.mark.parametrize("scheme", [S.recommended(8).replace(k_block_tokens=16, recent=16), S.per_token(8)],
                         ids=lambda s: s.name)
def test_hybrid_rkv_cache_at_8_bits_generates_as_transformers_cache(name, scheme):
    """Prefill, decode and teacher-forced decoding with the recurrent layers' states beside the quantized
    caches: the portable criterion against transformers' own cache."""
    assert_generates_as_transformers_cache(hybrid(name), scheme)


@pytest.mark.parametrize("name", ["qwen3_next", "jamba", "falcon_h1"])
def test_hybrid_decode_measures_what_the_simulation_does(name):
    """Token by token through the fused kernel, Qwen3-Next's attention layers (1 and 3, their partial rotary
    table) and Jamba's (no RoPE) decode the simulation's perplexity: the simulation quantizes each attention
    layer as its own, by its model layer's table, not by the index of its module among the attention ones.
    (A sharper random Qwen3-Next, so that the scheme moves its perplexity.)"""
    model = hybrid(name, **({"initializer_range": 0.05} if name == "qwen3_next" else {}))
    assert_decodes_as_simulated(model, S.recommended(2).replace(k_block_tokens=16, recent=8), moves=3e-4)


def assert_decodes_as_simulated(model, scheme, moves: float) -> None:
    """A 96-token text decoded token by token through RKVCache has the simulation's perplexity (1e-5), which
    the scheme moves from full precision's by more than `moves` (the check can fail)."""
    ids = prompt(96, seed=5)
    rope = models.layer_rope_tables(model, 128)
    simulated = perplexity.simulated(model, ids, Simulation(scheme, *rope[0], layer_rope=rope))
    decoded = perplexity.decoded(model, ids, lambda n: RKVCache(model, scheme, capacity=n))
    assert abs(decoded / simulated - 1) < 1e-5, (simulated, decoded)
    assert abs(perplexity.simulated(model, ids, None) / simulated - 1) > moves  # (the scheme moves it)


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "falcon_h1"])
def test_hybrid_models_attend_over_a_second_turn_chunk(name):
    """A chunk after the prefill (a second turn): the attention layer reads its cache and the chunk through
    the fused prefill, the recurrent layer continues its state; the logits within the 8-bit bound of the full
    forward's, and each kind of layer counts 60 tokens."""
    model = hybrid(name)
    ids = prompt(60, batch=2)
    cache = RKVCache(model, S.recommended(8).replace(k_block_tokens=16, recent=16), capacity=128, batch=2)
    with torch.no_grad():
        want = model(ids).logits[:, -1]
        model(ids[:, :40], cache=cache, use_cache=True)
        got = model(ids[:, 40:], cache=cache, use_cache=True).logits[:, -1]
    assert [int(layer.get_seq_length()) for layer in cache.layers] == [60] * len(cache.layers)
    err = (got.log_softmax(-1) - want.log_softmax(-1)).gather(-1, want.topk(8, -1).indices).abs().max()
    assert err <= logprob_bound(8, TINY_SENSITIVITY), err


@pytest.mark.parametrize("name", [name for name in HYBRID if name != "jamba"] + ["gemma3n"])
def test_localization_rewinds_a_hybrids_recurrent_states(name):
    """The report's localization asks every question over one prefill of its document, rolled back after each:
    the attention layers drop the question's keys, and the recurrent layers, whose states cannot be cropped,
    take back the document's. So each question, asked again or after another, sees what it sees after a fresh
    prefill of the document, and what one forward of both sees (LaraMini's sliding layer keeps every key; its
    mask limits it). Gemma 3n's KV-shared layers keep no cache to drop. (Jamba's mixer drops the state here:
    refused, below.)"""
    from torch_rkv.eval import localization

    model = windowed(name) if name in KV_SHARED else hybrid(name)
    doc, questions = prompt(40), [prompt(6, seed=seed) for seed in (2, 3)]

    def after_document(q):
        cache = localization.document_cache(model)
        model(doc, cache=cache, use_cache=True)
        return model(q, cache=cache, use_cache=True).logits[0]

    cache = localization.document_cache(model)
    with torch.no_grad():
        model(doc, cache=cache, use_cache=True)
        states = localization.recurrent_states(cache)
        assert len(states) == sum(hasattr(layer, "conv_states") for layer in cache.layers)
        assert bool(states) == (name not in KV_SHARED)
        for q in questions + questions:
            got = model(q, cache=cache, use_cache=True).logits[0]
            localization.rewind(cache, 40, states)
            torch.testing.assert_close(got, after_document(q), rtol=0, atol=1e-6)
            one = model(torch.cat([doc, q], dim=1)).logits[0, 40:]
            torch.testing.assert_close(got, one, rtol=0, atol=1e-4)


def test_several_tokens_over_jambas_cached_state_are_refused_by_name():
    """transformers' Jamba scans several tokens over a cached Mamba state from a zero state (mamba_scan_forward's
    TODO): a chunk after the first would be silently wrong, 1e-3 off one forward of the whole here. RKVCache
    refuses it by name before any recurrent state changes, and so does the report's localization and chunked
    prefill; a prefill and one token a step read the state (the generation tests)."""
    from torch_rkv.eval.report import Options, Report

    model = hybrid("jamba")
    cache = RKVCache(model, S.recommended(8).replace(k_block_tokens=16), capacity=64)
    with torch.no_grad():
        model(prompt(20), cache=cache, use_cache=True)
        before = [t.clone() for layer in cache.layers if hasattr(layer, "conv_states")
                  for t in (*layer.conv_states.values(), *layer.recurrent_states.values())]
        with pytest.raises(models.UnsupportedModelFeature, match="a forward of 6 tokens over a cached recurrent state"):
            model(prompt(6, seed=2), cache=cache, use_cache=True)
        after = [t for layer in cache.layers if hasattr(layer, "conv_states")
                 for t in (*layer.conv_states.values(), *layer.recurrent_states.values())]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        model(prompt(1, seed=3), cache=cache, use_cache=True)  # (one token a step)
    for opts in (Options(alloc_targets=(), split_targets=(), chunk_sizes=()),
                 Options(alloc_targets=(), split_targets=(), loc_lengths=())):
        with pytest.raises(models.UnsupportedModelFeature, match="the report's localization and chunked prefill"):
            Report(model, None, "", opts)


def test_report_options_without_per_layer_rows():
    """Options.without_per_layer leaves no row that measures or fits every layer's own cache, for the default,
    quick and full options alike, and keeps every uniform scheme."""
    from torch_rkv.eval.report import Options

    for opts in (Options(), Options.quick(), Options.full()):
        assert opts.per_layer() and not opts.without_per_layer().per_layer()
        assert not opts.without_per_layer().uses_profile()
    full = Options.full().without_per_layer()
    assert full.loc_schemes == ("rkv-4", "rkv-2") and "rkv-sparse-2" in full.decode_schemes


@pytest.mark.slow
def test_the_report_runs_on_a_hybrid_model_less_its_per_layer_rows(smollm2_alice, tmp_path, capsys):
    """`report --model` of a hybrid (a tiny Qwen3.5 with SmolLM2's tokenizer) runs every section but the
    per-layer rows, which it leaves out and says why: the localization rewinds the recurrent states, the
    decode protocol and chunked prefill serve it through RKVCache."""
    from torch_rkv.__main__ import main

    _, tok, _ = smollm2_alice
    model = hybrid("qwen3_5", vocab_size=len(tok), max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "report.json"
    assert main(["report", "--model", str(tmp_path / "model"), "--quick", "--tokens", "512", "--out",
                 str(tmp_path / "plots"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "left out: torch_rkv: the report's per-layer rows" in printed
    assert "whose layers [0] keep a recurrent" in printed
    results = json.loads(out.read_text())
    assert results["options"]["alloc_targets"] == [] and results["allocation"] == []
    assert {x["scheme"] for x in results["localization"]} == {"full precision", "per-token-2", "rkv-2"}
    (decoded,) = results["decode_protocol"]
    assert abs(decoded["relative_difference"]) < 1e-4 and results["chunked_prefill"]


def test_per_layer_fits_and_the_report_refuse_hybrid_models_by_name():
    """The sensitivity profile and the calibrated levels measure every layer's cache: a hybrid's recurrent
    layers have none, so they refuse it by name (a uniform scheme serves it). The report asked for its per-layer
    rows refuses it before any row runs, and a model of recurrent layers alone is refused by inspect."""
    from torch_rkv.eval import levels, sensitivity
    from torch_rkv.eval.report import Options, Report

    model = hybrid("qwen3_next")
    for fit in (lambda: sensitivity.load_or_measure(model, None, (2, 3)),
                lambda: levels.calibrate(model, prompt(64)),
                lambda: Report(model, None, "", Options())):
        with pytest.raises(models.UnsupportedModelFeature, match=re.escape("whose layers [0, 2] keep a recurrent")):
            fit()
    falcon = hybrid("falcon_h1")  # (every layer attends, beside a Mamba mixer: refused too, untested there)
    for fit in (lambda: sensitivity.load_or_measure(falcon, None, (2, 3)), lambda: Report(falcon, None, "", Options())):
        with pytest.raises(models.UnsupportedModelFeature, match=re.escape("whose layers [0, 1] keep a recurrent")):
            fit()
    recurrent = build(*HYBRID["lfm2"][:2], **{**HYBRID["lfm2"][2], "layer_types": ["conv", "conv"]})
    with pytest.raises(models.UnsupportedModelFeature, match="a model without attention layers"):
        models.inspect(recurrent)


# RoPE whose table changes with the sequence length, prompts of 40 tokens decoded to 100: Phi-3's LongRoPE
# (short factors up to 64 tokens, long ones past them) and dynamic NTK (a larger base every token past 32;
# a sharper random model, so that the table's change shows)
LENGTH_DEPENDENT = {
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 16,
                            "long_factor": [1.0 + i for i in range(16)], "original_max_position_embeddings": 64}}),
    "qwen2_dynamic": ("Qwen2Config", "Qwen2ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "initializer_range": 0.03,
        "rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 1e4}}),
    # a hybrid whose first layer is recurrent: the table is re-read at its first attention layer's update
    "qwen3_5_dynamic": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        **HYBRID["qwen3_5"][2], "max_position_embeddings": 32, "initializer_range": 0.03,
        "rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
}
PROMPT = 40


def length_dependent(name):
    config_cls, model_cls, kw = LENGTH_DEPENDENT[name]
    return build(config_cls, model_cls, **kw)


def restart(model) -> None:
    """A one-token forward: transformers' dynamic NTK only grows its table, except below its original
    length, where it starts over (so each sequence below gets the table of its own length)."""
    with torch.no_grad():
        model(torch.ones(1, 1, dtype=torch.long))


@torch.no_grad()
def fresh_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(n, vocab): row t - 1 predicts token t, for t >= prompt_len, from a fresh forward over ids[:, :t]
    (no cache: every key rotated by the table of t tokens); earlier rows zero."""
    rows = torch.zeros(ids.shape[1], VOCAB)
    for t in range(prompt_len, ids.shape[1] + 1):
        restart(model)
        rows[t - 1] = torch.log_softmax(model(ids[:, :t]).logits[0, -1].float(), dim=-1)
    return rows


def own_cache_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """fresh_logprobs' rows through transformers' own cache: each key rotated by the table of its step."""
    restart(model)
    rows = torch.zeros(ids.shape[1], VOCAB)
    rows[prompt_len - 1 :] = cached_logprobs(model, ids, prompt_len, DynamicCache(config=model.config))
    return rows


@pytest.mark.parametrize("name", list(LENGTH_DEPENDENT))
def test_pre_rope_keys_follow_a_length_dependent_table_as_a_fresh_forward(name, monkeypatch):
    """Pre-RoPE keys are re-rotated by the table the model's rotary chose for the current step, so every
    decode step attends as a fresh forward over the whole sequence does: rkv-8 within the 8-bit bound of
    it. transformers' own cache keeps keys rotated by older tables and is off by more than the bound (the
    test can fail), and so is RKVCache without following the table."""
    model = length_dependent(name)
    att = models.inspect(model)
    assert att.length_dependent
    ids = prompt(100)
    ref = fresh_logprobs(model, ids, PROMPT)
    bound = logprob_bound(8, TINY_SENSITIVITY)
    scheme = S.recommended(8).replace(k_block_tokens=16)
    restart(model)
    forced = teacher_forced(model, ids, PROMPT, lambda: RKVCache(model, scheme, capacity=128), bound, reference=ref)
    assert forced, forced.detail
    own = own_cache_logprobs(model, ids, PROMPT)
    assert (own - ref)[PROMPT - 1 :].abs().amax() > bound
    monkeypatch.setattr(RKVCache, "_follow_rope", lambda self: None)
    restart(model)
    stale = teacher_forced(model, ids, PROMPT, lambda: RKVCache(model, scheme, capacity=128), bound, reference=ref)
    assert not stale, stale.detail


@pytest.mark.parametrize("name", list(LENGTH_DEPENDENT))
def test_post_rope_keys_keep_the_tables_they_were_rotated_by(name):
    """A post-RoPE scheme stores keys as the model rotated them, each by its own step's table, as
    transformers' own cache does: per-token-8 within the 8-bit bound of that cache."""
    model = length_dependent(name)
    ids = prompt(100)
    ref = own_cache_logprobs(model, ids, PROMPT)
    restart(model)
    forced = teacher_forced(model, ids, PROMPT, lambda: RKVCache(model, S.per_token(8), capacity=128),
                            logprob_bound(8, TINY_SENSITIVITY), reference=ref)
    assert forced, forced.detail


@pytest.mark.parametrize("name", list(LENGTH_DEPENDENT))
def test_a_length_dependent_table_is_read_as_it_stands_and_the_simulation_refuses_it(name):
    """Reading the table leaves the model's rotary as it was (transformers' own update would re-choose its
    frequencies for the table's length); the report's simulations, one fixed table for a whole forward,
    refuse such a RoPE by name."""
    model = length_dependent(name)
    rotary = models.inspect(model).rotary
    before = rotary.inv_freq.clone()
    cos, _ = models.rope_tables(model, 200)
    assert torch.equal(rotary.inv_freq, before)
    assert torch.allclose(cos[1], torch.cos(before) * rotary.attention_scaling)
    with pytest.raises(models.UnsupportedModelFeature, match="changes with the sequence length"):
        models.layer_rope_tables(model, 64)


# Vision-language models: the decoder's M-RoPE (Qwen2-VL's sections, Qwen3-VL's interleaved ones) lives in
# the language model; text positions are equal in its three sections, so its table for them is a plain
# rotate-half one. An image's tokens take grid positions and every later token runs behind its cache slot.
VISION_LANGUAGE = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {},
                 {"depth": 1, "embed_dim": 32, "hidden_size": 128, "num_heads": 2, "out_hidden_size": 128}),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {},
                   {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128,
                    "fullatt_block_indexes": [0], "window_size": 56}),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", {"head_dim": 32, "mrope_interleaved": True},
                 {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128,
                  "deepstack_visual_indexes": []}),
}
IMAGE_TOKEN, VISION_START = 5, 6


def vision_language(name):
    """The tiny model, a prompt of 20 text tokens, an image (an 8 x 8 grid of patches: 16 tokens after
    the 2 x 2 merge) and 40 text tokens, and the image's inputs."""
    config_cls, model_cls, text, vision = VISION_LANGUAGE[name]
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6],
            **{k: text.pop(k) for k in ("mrope_interleaved",) if k in text}}
    torch.manual_seed(0)
    cfg = getattr(T, config_cls)(text_config={**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, **text,
                                              "rope_parameters": rope},
                                 vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=7,
                                 vision_start_token_id=VISION_START)
    model = getattr(T, model_cls)(cfg).eval()
    vc, g = cfg.vision_config, torch.Generator().manual_seed(1)
    pixels = torch.randn(64, 3 * vc.temporal_patch_size * vc.patch_size ** 2, generator=g)
    image = torch.tensor([[VISION_START] + [IMAGE_TOKEN] * 16])
    words = lambda n: torch.randint(10, VOCAB, (1, n), generator=g)  # noqa: E731
    ids = torch.cat([words(20), image, words(40)], 1)
    return model, ids, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 8, 8]]),
                        "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}


@pytest.mark.parametrize("name", list(VISION_LANGUAGE))
def test_vision_language_models_take_their_decoders_rotary_table(name):
    """The language model's M-RoPE module is found (not refused as a model without RoPE), and its table
    rotates layer 0's pre-RoPE keys of a text prompt to the model's own."""
    model, _, _ = vision_language(name)
    assert models.inspect(model).rotary is model.model.language_model.rotary_emb
    assert_rotary_round_trip(model, (32, False))


@pytest.mark.parametrize("name", list(VISION_LANGUAGE))
@pytest.mark.parametrize("scheme", [S.recommended(8).replace(k_block_tokens=16, recent=16), S.per_token(8)],
                         ids=lambda s: s.name)
def test_vision_language_models_attend_over_an_image_as_transformers_cache(name, scheme):
    """A prompt with an image, whose tokens (in the quantized blocks: the window is 16 tokens) take M-RoPE
    grid positions, and whose later tokens run behind their cache slots: a pre-RoPE cache un-rotates each
    key by its slot's table and the kernel re-rotates it by the same one, so the attention reads the
    model's own keys whatever the positions. Greedy generation and every step's top-8 log-probabilities
    (while both took the same tokens) within the 8-bit bound of transformers' cache."""
    model, ids, image = vision_language(name)
    bound = logprob_bound(8, TINY_SENSITIVITY)
    run = {"max_new_tokens": 8, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        want = model.generate(ids, **image, **run)
        cache = RKVCache(model, scheme, capacity=128)
        got = model.generate(ids, **image, **run, cache=cache)
    n = ids.shape[1]
    assert quantized_count(n, scheme.recent, scheme.block) >= 37  # the image's tokens (21 to 36) are quantized
    ref, lp = (torch.log_softmax(torch.stack(r.logits)[:, 0].float(), dim=-1) for r in (want, got))
    agree = greedy_agrees(want.sequences[0, n:], got.sequences[0, n:], ref, eps=2 * bound)
    assert agree, agree.detail
    differ = (want.sequences[0, n:] != got.sequences[0, n:]).nonzero()
    steps = int(differ[0]) + 1 if differ.numel() else ref.shape[0]  # (step i's logits follow tokens < i)
    cand = ref[:steps].topk(8, dim=-1).indices
    err = (lp[:steps].gather(-1, cand) - ref[:steps].gather(-1, cand)).abs().max()
    assert 0 < err <= bound, (float(err), bound)
