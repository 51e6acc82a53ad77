"""Tiny random models' configs that the main suite and tests/in_vllm both build (transformers config class,
model class, keyword arguments)."""

TINY_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 1024}

TINY_HYBRIDS = {
    # Qwen3-Next: gated DeltaNet layers beside attention layers with a partial rotary (16 of 64 channels), q/k
    # norms and a gated output; MoE MLPs
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **TINY_SHAPE, "num_hidden_layers": 4, "head_dim": 64, "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "num_experts": 4, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "tie_word_embeddings": False}),
    # Granite 4: Mamba 2 beside attention with RoPE (its default keeps no positions in attention)
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        **TINY_SHAPE, "layer_types": ["mamba", "attention"], "num_local_experts": 0, "mamba_n_heads": 8,
        "mamba_d_head": 64, "mamba_d_state": 16, "position_embedding_type": "rope",
        "tie_word_embeddings": False}),
    # Falcon-H1: attention beside a Mamba 2 mixer in every layer
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {
        **TINY_SHAPE, "head_dim": 64, "mamba_d_ssm": 256, "mamba_n_heads": 4, "mamba_d_head": 64,
        "mamba_d_state": 16, "tie_word_embeddings": False}),
    # Nemotron-H: a Mamba 2 layer, an attention layer without positions, an MLP-only layer
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        **TINY_SHAPE, "num_hidden_layers": 3, "head_dim": 64, "layers_block_type": ["mamba", "attention", "mlp"],
        "mamba_num_heads": 4, "mamba_head_dim": 64, "ssm_state_size": 16, "n_groups": 1,
        "tie_word_embeddings": False}),
}

# Gemma 4: global layers of their own head_dim (256 against 64) and KV heads (1: their keys are also their
# values; pages of other bytes), rotated by a partial "proportional" table over the whole head; q/k/v norms
# and a scale of 1
TINY_GEMMA4 = {
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", {
        **TINY_SHAPE, "head_dim": 64, "global_head_dim": 256, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "sliding_window": 64, "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 512, "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": True}),
}
# Gemma 4 with KV sharing (its E2B / E4B): layers 2 and 3 attend over layers 0's and 1's caches and keep none
TINY_GEMMA4["gemma4_shared"] = ("Gemma4TextConfig", "Gemma4ForCausalLM", {
    **TINY_GEMMA4["gemma4"][2], "num_hidden_layers": 4, "num_kv_shared_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"] * 2})

# Phi-3 with LongRoPE: short factors up to 64 positions, long ones (1 to 32) past them
PHI3_LONGROPE = {**TINY_SHAPE, "original_max_position_embeddings": 64,
                 "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 32,
                                     "long_factor": [1.0 + i for i in range(32)],
                                     "original_max_position_embeddings": 64},
                 "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}

TINY_FAMILIES = {  # beyond Llama's layout: vLLM's own model code for each, a tiny random model
    # GPT-J: interleaved pairs over a partial rotary (16 of 64 channels)
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 256, "n_head": 4, "n_layer": 2, "rotary_dim": 16,
                                               "n_positions": 1024, "tie_word_embeddings": False}),
    # Gemma 2: sliding-window layers (64 tokens) interleaved with global ones (vLLM's hybrid allocator),
    # attention-logit soft-capping, query_pre_attn_scalar
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**TINY_SHAPE, "head_dim": 64, "sliding_window": 64,
                                                     "query_pre_attn_scalar": 48, "attn_logit_softcapping": 20.0,
                                                     "tie_word_embeddings": True}),  # (vLLM's Gemma 2 ties them)
    # a MoE family: Qwen3's attention (q/k norms) beside vLLM's CPU MoE layers (Mixtral's and Qwen2-MoE's
    # attention is Mistral's and Qwen2's: their rotary tables are checked below)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**TINY_SHAPE, "moe_intermediate_size": 128,
                                                           "num_experts": 4, "num_experts_per_tok": 2,
                                                           "head_dim": 64, "tie_word_embeddings": False}),
    # Phi-3's LongRoPE past its 64 original positions: vLLM rotates every position by the long factors
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", PHI3_LONGROPE),
    # Gemma 3: sliding layers rotated by a local table (base 1e4), global ones by a global table (1e6)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**TINY_SHAPE, "head_dim": 64, "sliding_window": 64,
                                                         "layer_types": ["sliding_attention", "full_attention"],
                                                         "tie_word_embeddings": True}),
    # Granite: attention_multiplier as the softmax scale (vLLM passes it to the backend), scaled
    # embeddings, residuals and logits
    "granite": ("GraniteConfig", "GraniteForCausalLM", {**TINY_SHAPE, "attention_multiplier": 0.05,
                                                        "embedding_multiplier": 2.0,
                                                        "residual_multiplier": 0.5, "logits_scaling": 4.0,
                                                        "tie_word_embeddings": False}),
    # Command R7B / A: interleaved pairs in its sliding layers, no RoPE in its global ones
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {**TINY_SHAPE, "sliding_window": 64,
                                                        "layer_types": ["sliding_attention", "full_attention"],
                                                        "tie_word_embeddings": True}),
    # GPT-OSS: learned attention sinks (set large by tests/in_vllm's large_sinks), a YaRN table in float32, sliding layers beside
    # global ones, MoE (every expert chosen: a tiny random router's near-ties would flip at any perturbation)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {**TINY_SHAPE, "head_dim": 64, "sliding_window": 64,
                                                      "num_local_experts": 4, "num_experts_per_tok": 4,
                                                      "tie_word_embeddings": False, "rope_parameters": {
                                                          "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                          "beta_slow": 1.0, "truncate": False,
                                                          "original_max_position_embeddings": 256,
                                                          "rope_theta": 150000.0}}),
}
TINY_FAMILIES.update(TINY_GEMMA4)  # (Gemma 4, and with KV-shared layers: the main suite plans their pools too)

# SmolLM3 with its second layer without RoPE (no_rope_layers: 0 marks a NoPE layer)
SMOLLM3 = {**TINY_SHAPE, "no_rope_layers": [1, 0], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
