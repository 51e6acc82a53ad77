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
