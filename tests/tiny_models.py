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
