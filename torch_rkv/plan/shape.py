"""A model as the planner counts it: ModelShape (its KV-keeping layers, their heads and head_dim, which of them
slide, and a hybrid's layers without a KV cache), and MODELS, the presets of released models."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..recurrent import RecurrentState


@dataclass(frozen=True)
class ModelShape:
    """layers: all of them that keep a KV cache; sliding_layers of them attend to (and so keep) only the newest
    sliding_window tokens, the rest attend to the whole context."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float  # number of weights
    sliding_layers: int = 0
    sliding_window: int | None = None
    sliding: tuple[bool, ...] | None = None  # which layers slide, where only some do (a per-layer allocation)
    # (KV heads, head_dim) of the full-attention layers where they differ from the sliding layers' (Gemma 4's
    # global layers; kv_heads and head_dim are then the sliding layers')
    global_shape: tuple[int, int] | None = None
    # layers beyond `layers` that attend over an earlier layer's cache and keep none (Gemma 3n, Gemma 4's small
    # models: num_kv_shared_layers), so they count no bytes
    kv_shared_layers: int = 0
    # layers beyond `layers` of a hybrid model that keep a recurrent state of fixed size per sequence (Mamba,
    # gated DeltaNet, short convolutions) or no mixer: no KV cache
    kv_free_layers: int = 0
    # layers (of all) that keep a recurrent state, beside a KV cache or not (Falcon-H1's keep both), and one such
    # layer's state per sequence (None: a family whose mixers torch_rkv does not know; then not counted)
    recurrent_layers: int = 0
    state: RecurrentState | None = None
    params_how: str = ""  # where `params` came from, where a config gave the shape (printed beside it)
    family: str = ""  # the config's (text) model_type, where a config gave the shape

    def __post_init__(self):
        if not 0 <= self.sliding_layers <= self.layers or (self.sliding_layers > 0) != bool(self.sliding_window):
            raise ValueError(f"ModelShape {self.name}: sliding_layers={self.sliding_layers} of {self.layers} needs a "
                             f"sliding_window > 0 exactly when some layer slides (got {self.sliding_window})")
        if self.sliding is not None and (len(self.sliding) != self.layers or sum(self.sliding) != self.sliding_layers):
            raise ValueError(f"ModelShape {self.name}: `sliding` must flag {self.sliding_layers} of {self.layers} "
                             "layers")

    def window_of(self, layer: int) -> int:
        """The layer's sliding window (0: it attends to the whole context)."""
        if self.sliding_layers in (0, self.layers):
            return self.sliding_window or 0
        if self.sliding is None:
            raise ValueError(f"ModelShape {self.name}: which of its layers slide is unknown; give --config with the "
                             "model's config.json")
        return self.sliding_window if self.sliding[layer] else 0

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_layers

    @property
    def full_shape(self) -> tuple[int, int]:
        """(KV heads, head_dim) of the full-attention layers."""
        return self.global_shape or (self.kv_heads, self.head_dim)

    def shape_of(self, layer: int) -> tuple[int, int]:
        """(KV heads, head_dim) of one layer."""
        return (self.kv_heads, self.head_dim) if self.window_of(layer) else self.full_shape

    def one_shape(self, what: str) -> None:
        """Refuse `what` (a computation that takes one KV heads x head_dim for every layer) for a model whose
        global layers have their own."""
        if self.global_shape and self.global_shape != (self.kv_heads, self.head_dim):
            raise ValueError(f"plan: {what} takes one KV heads x head_dim for every layer; {self.name}'s global "
                             f"layers have {self.global_shape[0]} x {self.global_shape[1]}, its sliding layers "
                             f"{self.kv_heads} x {self.head_dim}")

    @property
    def recurrent_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state or no mixer, and no KV cache (a hybrid's)."""
        return bool(self.kv_free_layers or self.recurrent_layers)

    def own_caches(self, what: str, counts_states: bool = False) -> None:
        """Refuse `what` (a computation whose engine gives every layer a cache) for a model with KV-shared
        layers, or (unless it counts_states) a hybrid's recurrent layers."""
        if self.kv_shared_layers:
            raise ValueError(f"plan: {what} does not count KV caches shared between layers ({self.name}: "
                             f"{self.kv_shared_layers} layers reuse earlier ones)")
        if self.recurrent_hybrid and not counts_states:
            raise ValueError(f"plan: {what} does not count a hybrid model's recurrent layers ({self.name}: "
                             f"{self.recurrent_layers} layers keep a recurrent state, {self.kv_free_layers} no KV "
                             "cache)")

    def weight_bytes(self, bits: float) -> float:
        return self.params * bits / 8

    def state_bytes(self, dtype=torch.float16) -> int:
        """The recurrent states one sequence holds, every layer (0 where unknown: `state` None)."""
        return self.recurrent_layers * self.state.nbytes(dtype) if self.state else 0


# public config facts (config.json of each release)
MODELS = {
    "llama-2-7b": ModelShape("Llama-2-7B", 32, 32, 128, 6.74e9),
    "llama-3-8b": ModelShape("Llama-3-8B", 32, 8, 128, 8.03e9),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 32, 8, 128, 8.03e9),
    "llama-3-70b": ModelShape("Llama-3-70B", 80, 8, 128, 70.6e9),
    "mistral-7b": ModelShape("Mistral-7B-v0.3", 32, 8, 128, 7.24e9),  # v0.2 and v0.3: sliding_window null
    "mistral-7b-v0.1": ModelShape("Mistral-7B-v0.1", 32, 8, 128, 7.24e9, sliding_layers=32, sliding_window=4096),
    # layer i attends to the whole context when (i + 1) % 6 == 0 (sliding_window_pattern 6): 10 of 62
    "gemma-3-27b": ModelShape("Gemma-3-27B", 62, 16, 128, 27.4e9, sliding_layers=52, sliding_window=1024,
                              sliding=tuple(bool((i + 1) % 6) for i in range(62))),
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 28, 4, 128, 7.62e9),
    "qwen2.5-72b": ModelShape("Qwen2.5-72B", 80, 8, 128, 72.7e9),
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 3, 64, 0.135e9),
    # SmolLM2's successor, to 128K tokens with YaRN; every 4th layer without RoPE (the same bytes a token)
    "smollm3-3b": ModelShape("SmolLM3-3B", 36, 4, 128, 3.08e9),
    # 32 KV heads (no GQA): 384 KiB a token in bf16; LongRoPE to 128K; its config's window, 262144, slides
    # every layer past any context it takes (vLLM keeps one block more a request for it)
    "phi-3.5-mini": ModelShape("Phi-3.5-mini", 32, 32, 96, 3.82e9, sliding_layers=32, sliding_window=262144),
    # MoE (every expert's weights held; MXFP4 in the release: --weight-bits 4.25), learned attention sinks
    # (no bytes); layer i slides (128 tokens) when i is even, so half the layers hold a 128K context
    "gpt-oss-20b": ModelShape("gpt-oss-20b", 24, 8, 64, 20.9e9, sliding_layers=12, sliding_window=128,
                              sliding=tuple(i % 2 == 0 for i in range(24))),
    "gpt-oss-120b": ModelShape("gpt-oss-120b", 36, 8, 64, 116.8e9, sliding_layers=18, sliding_window=128,
                               sliding=tuple(i % 2 == 0 for i in range(36))),
    # every sixth layer global: 10 of 4 KV heads x 512 (their keys also their values) beside 50 sliding ones of
    # 16 x 256 over 1,024 tokens; 30.7B weights as transformers counts its config
    "gemma-4-31b": ModelShape("Gemma-4-31B", 60, 16, 256, 30.7e9, sliding_layers=50, sliding_window=1024,
                              sliding=tuple(bool((i + 1) % 6) for i in range(60)), global_shape=(4, 512)),
}
