"""The rotary tables of the models whose pre-RoPE keys the vLLM backend stores: rebuilt from vLLM's own
rotary embedding (get_rope with each model's parameters), so that the backend undoes and redoes exactly
the rotation vLLM applied."""

from __future__ import annotations

import torch

from .models import LENGTH_DEPENDENT_ROPE, identity_rope
from .vllm import PRE_ROPE_MODELS, text_config

# vLLM models whose rotary embedding is a get_rope(...) table built from the config the way each model
# builds it: rotate-half pairs (is_neox_style) over rotary_dim = head_size x partial_rotary_factor
# channels, or interleaved pairs (GPT-J's over its rotary_dim, Cohere's over head_size); Gemma 3 one table
# per layer type (its rope_parameters keyed by "sliding_attention" / "full_attention"; Gemma 4's global
# "proportional" table spans the whole head, its unrotated pairs cos 1, sin 0: gemma4_rope.py); Cohere 2's and
# EXAONE 4's global layers none (vllm_applies_rope), nor SmolLM3's no_rope_layers (vLLM runs SmolLM3 through
# its transformers backend: transformers' rotary, the same table); Granite with one RoPE base (granite.py
# takes a base per layer from layer_rope_theta, refused); GPT-OSS with the YaRN fields its model passes, in
# float32. The MoE families have their dense family's attention. Of the hybrids: Qwen3-Next's partial table
# (rope_parameters' partial_rotary_factor) and Falcon-H1's; Granite 4's only where position_embedding_type is
# "rope" (its default: none), Nemotron-H's none.
# Another family would have its pre-RoPE keys un-rotated wrongly, so a pre-RoPE scheme refuses it by name
# (PRE_ROPE_MODELS, in integrations/vllm.py, where plan --vllm reads it too).
INTERLEAVED_MODELS = ("gptj", "cohere", "cohere2")


def vllm_applies_rope(hf, sliding: bool) -> bool:
    """Whether vLLM 0.32's model of config `hf` rotates a layer's queries and keys (commandr.py: Cohere 2 only
    its sliding layers; exaone4.py: its sliding layers, or every layer where none slides; granitemoehybrid.py:
    with position_embedding_type "rope"; nemotron_h.py: never). transformers decides two edge cases of EXAONE
    4 otherwise (models.applies_rope); each engine's plugin follows its own. (SmolLM3 names its NoPE layers by
    index: RKVAttentionImpl.process_weights_after_loading.)"""
    kind = getattr(hf, "model_type", None)
    if kind == "cohere2":
        return sliding
    if kind == "exaone4":
        return sliding or "sliding_attention" not in (getattr(hf, "layer_types", None) or [])
    if kind == "granitemoehybrid":
        return getattr(hf, "position_embedding_type", None) == "rope"
    return kind != "nemotron_h"


def model_rope_tables(vllm_config, head_size: int, layer_type: str = "full_attention"
                      ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(cos, sin, interleaved): tables of shape (positions, rotary_dim / 2), float32, from the rotary
    embedding vLLM builds for the model's layers of `layer_type` (get_rope with the model's own
    parameters), and its pairing; the identity for a layer vLLM does not rotate (vllm_applies_rope)."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    hf = text_config(vllm_config)
    kind = getattr(hf, "model_type", "?")
    if kind not in PRE_ROPE_MODELS:
        raise NotImplementedError(f"torch_rkv's vLLM backend: pre-RoPE schemes are supported for "
                                  f"{', '.join(PRE_ROPE_MODELS)} models (rotary tables the backend rebuilds), not "
                                  f"{kind!r}; a post-RoPE scheme (kivi-2, per-token-4, quarot-4, ...) serves any decoder")
    if getattr(hf, "layer_rope_theta", None) is not None:  # (vllm/model_executor/models/granite.py)
        raise NotImplementedError("torch_rkv's vLLM backend: pre-RoPE schemes on a model with a RoPE base per "
                                  "layer (layer_rope_theta) are not supported; a post-RoPE scheme serves it")
    interleaved = kind in INTERLEAVED_MODELS
    max_len = vllm_config.model_config.max_model_len
    if not vllm_applies_rope(hf, layer_type == "sliding_attention"):
        return *identity_rope(max_len, head_size // 2), interleaved  # a NoPE layer
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if isinstance(params.get(layer_type), dict):  # parameters per layer type (vllm/model_executor/models/gemma3.py)
        params = dict(params[layer_type])
    rope_type = str(params.get("rope_type", "default"))
    if kind == "smollm3" and rope_type.startswith(LENGTH_DEPENDENT_ROPE):  # (transformers' rotary re-picks it)
        raise NotImplementedError(f"torch_rkv's vLLM backend: pre-RoPE schemes on SmolLM3 with a {rope_type} RoPE "
                                  "are not supported: vLLM runs it through transformers, whose rotary changes the "
                                  "table with the length; a post-RoPE scheme serves it")
    if kind == "gptj":  # (vllm/model_executor/models/gpt_j.py)
        params["partial_rotary_factor"] = hf.rotary_dim / head_size
    if kind == "falcon_h1":  # (vllm/model_executor/models/falcon_h1.py sets both on the config as it builds a layer)
        params["partial_rotary_factor"] = getattr(hf, "attn_rotary_emb", head_size) / head_size
        params.setdefault("rope_theta", 1e11)
    dtype = None  # (get_rope's default: the model's dtype)
    if kind == "gpt_oss":  # (vllm/model_executor/models/gpt_oss.py: these YaRN fields alone, a float32 table)
        params = {"rope_theta": params["rope_theta"], "rope_type": "yarn", "factor": params["factor"],
                  "original_max_position_embeddings": params["original_max_position_embeddings"],
                  "beta_fast": params["beta_fast"], "beta_slow": params["beta_slow"],
                  "truncate": params.get("truncate", True)}
        rope_type, dtype = "yarn", torch.float32
    max_pos = max(max_len, getattr(hf, "max_position_embeddings", max_len))
    if rope_type.startswith(LENGTH_DEPENDENT_ROPE):
        # vLLM fixes these tables for the engine's life (dynamic NTK: scaled for max_position; LongRoPE: the
        # long factors when max_model_len exceeds original_max_position_embeddings, for every position), and
        # their values depend on max_position: build them with the model's own (its max_position_embeddings)
        max_pos = getattr(hf, "max_position_embeddings", None) or max_pos
    rotary = get_rope(head_size, max_position=max_pos, rope_parameters=params or None, is_neox_style=not interleaved,
                      dtype=dtype)
    if rope_type == "longrope":  # (vllm/model_executor/layers/rotary_embedding/phi3_long_rope_scaled_rope.py)
        short = rotary.original_max_position_embeddings  # [short table | long table], the long one from here
        table = rotary.long_short_cos_sin_cache  # (the model's own module: get_rope caches it by its arguments)
        table = (table[short:] if rotary.use_long_rope else table[:short]).float()
    else:
        table = rotary.cos_sin_cache.float()
    if table.shape[0] < max_len:  # (the kernels would read past it)
        raise ValueError(f"torch_rkv's vLLM backend: the model's {rope_type} rotary table covers {table.shape[0]} "
                         f"positions, fewer than max_model_len {max_len}")
    half = table.shape[-1] // 2
    return table[:, :half].contiguous(), table[:, half:].contiguous(), interleaved
