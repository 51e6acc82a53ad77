"""The tiny random models of the families beyond Llama (torch_rkv/integrations/models.py) that several
tests/test_families_*.py files build from their transformers configs, no download (the windowed and KV-shared
families' configs, the hybrids'), and the checks they share: the rotary round trip, generation as transformers'
cache at 8 bits, the simulation with nothing quantized, decoding as the simulation measures. Imported as
`from familybuild import ...`, as cachebuild is (pytest's default import mode puts tests/ on sys.path)."""

import torch
import transformers as T
from test_transformers import TINY_SENSITIVITY, assert_agrees

import torch_rkv
from torch_rkv.eval import perplexity
from torch_rkv.eval.simulate import Simulation, install
from torch_rkv.integrations import models
from torch_rkv.integrations.transformers import RKVCache

VOCAB = 128
COMMON = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
          "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def build(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    cfg = getattr(T, config_cls)(**{**COMMON, **kw})
    return getattr(T, model_cls)(cfg).eval()


def prompt(n, batch=1, seed=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


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


def assert_generates_as_transformers_cache(model, scheme, sensitivity=TINY_SENSITIVITY) -> RKVCache:
    """60-token prompts, 16 new tokens, batch 2: RKVCache at 8 bits by the portable criterion; the cache."""
    ids = prompt(60, batch=2)
    want = model.generate(ids, max_new_tokens=16, do_sample=False)
    cache = RKVCache(model, scheme, capacity=128, batch=2)
    got = model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache)
    assert_agrees(model, ids, want, got, scheme, 8, sensitivity, 128)
    return cache


def assert_simulation_is_stock(model, ids, sim):
    with torch.no_grad():
        want = model(ids).logits
        install(model, sim)
        got = model(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


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


def assert_decodes_as_simulated(model, scheme, moves: float) -> None:
    """A 96-token text decoded token by token through RKVCache has the simulation's perplexity (1e-5), which
    the scheme moves from full precision's by more than `moves` (the check can fail)."""
    ids = prompt(96, seed=5)
    rope = models.layer_rope_tables(model, 128)
    simulated = perplexity.simulated(model, ids, Simulation(scheme, *rope[0], layer_rope=rope))
    decoded = perplexity.decoded(model, ids, lambda n: RKVCache(model, scheme, capacity=n))
    assert abs(decoded / simulated - 1) < 1e-5, (simulated, decoded)
    assert abs(perplexity.simulated(model, ids, None) / simulated - 1) > moves  # (the scheme moves it)
