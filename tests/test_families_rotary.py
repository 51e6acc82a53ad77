"""Model families beyond Llama with RoPE (torch_rkv/integrations/models.py): per family, a tiny random model
built from its transformers config with the family's structure (GQA, qkv bias, q/k norms, fused qkv, partial rotary,
GPT-J's interleaved pairs; tests/familybuild.py); no download. Its rotary table and pairing, generation at 8 bits
and the report's simulation; unsupported features refused by name; models of absolute positions and layers
without RoPE; RoPE whose table changes with the sequence length (LongRoPE, dynamic NTK)."""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402
from familybuild import (  # noqa: E402
    HYBRID,
    VOCAB,
    assert_generates_as_transformers_cache,
    assert_rotary_round_trip,
    assert_simulation_is_stock,
    build,
    prompt,
    windowed,
)
from test_transformers import TINY_SENSITIVITY  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.eval.agreement import cached_logprobs, logprob_bound, teacher_forced  # noqa: E402
from torch_rkv.eval.simulate import Simulation, install  # noqa: E402
from torch_rkv.integrations import models  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402

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


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_rotary_table_and_pairing_are_the_models_own(name):
    """Layer 0's keys with every position at 0, un-rotated at position 0, are its pre-RoPE keys (the
    rotation at position 0 is the identity, up to a scaled table's attention scaling; nothing else in
    layer 0 depends on positions). Rotating them with the table and pairing models.inspect reports gives
    the model's own post-RoPE keys, and the inverse gives them back."""
    assert_rotary_round_trip(family(name), ROTARY[name])


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("scheme", [S.recommended(8).replace(k_block_tokens=16, recent=16), S.per_token(8)], ids=lambda s: s.name)
def test_rkv_cache_at_8_bits_generates_as_transformers_cache(name, scheme):
    """Prefill, then decode through the fused kernel (pre-RoPE keys with the family's own table, or
    per-token keys), and a second turn through the paged prefill kernel: the portable criterion. (rkv-8 with
    a 16-token recent window: 48 of the 76 tokens are read from quantized blocks.)"""
    assert_generates_as_transformers_cache(family(name), scheme)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_simulation_without_quantization_equals_the_stock_forward(name):
    """The report's simulation path with nothing quantized gives the stock model's logits (fp32)."""
    model = family(name)
    cos, sin = models.rope_tables(model, 64)
    assert_simulation_is_stock(model, prompt(50), Simulation(S.recommended(4), cos, sin, quantize_keys=False,
                                                             rope_interleaved=models.inspect(model).interleaved,
                                                             quantize_values=False))


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


NOPE = {"smollm3": lambda: family("smollm3"), "cohere2": lambda: windowed("cohere2"),
        "exaone4": lambda: windowed("exaone4"), "beam": lambda: windowed("beam"),
        "ergo": lambda: windowed("ergo")}  # layer 1 of each applies no RoPE


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
