"""`python -m torch_rkv plan`: the memory ledger. How much context fits on one GPU with each KV scheme.

Byte counts come from torch_rkv.layout.CacheLayout, the code that sizes the real cache's buffers, so a
planned cache is exactly the cache that gets allocated (tests/test_plan.py proves it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, replace

import torch

from . import scheme as S
from .allocate import Allocation, Sensitivity, allocate, allocate_split, layer_scheme
from .integrations.models import KV_FREE_LAYER_TYPES, RECURRENT_LAYER_TYPES, sliding_by_layer_type, uses_sliding_window
from .integrations.vllm import ALLOCATION_ENV, CODEBOOK_ENV, ENV, KV_TRANSFER_CONFIG, PRE_ROPE_MODELS, VLLM_HYBRIDS
from .integrations.vllm_pool import OWN_KERNEL_BLOCK, VllmPool, block_multiple, hybrid_block_size, preferred_block_size
from .integrations.vllm_slots import check_drafts
from .layout import CacheLayout, PageLayout, binding_window, default_page_size
from .recurrent import RecurrentState, state_of
from .recurrent import reads as recurrent_state_reads
from .scheme import Scheme
from .weights import (
    built_config,
    checkpoint_folder,
    checkpoint_weight_bytes,
    estimate_params,
    holds_weights,
    params_of,
    special_floats,
)

GIB = 1024**3
GB = 1000**3


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

DEFAULT_SCHEMES = ("per-token-8", "per-token-4", "quarot-4", "kvquant-3", "kivi-2", "rkv-4", "rkv-3", "rkv-mixed-2", "rkv-2")


def sliding_layers_of(cfg: dict) -> list[bool]:
    """Which layers of a transformers config (its text part) attend to a sliding window, as transformers
    builds them: layer_types when given; else Qwen2/3 (use_sliding_window present) layers i >=
    max_window_layers when switched on; else an alternating pattern (Gemma 2: every 2nd layer full,
    Gemma 3: sliding_window_pattern, 6; Cohere 2 and EXAONE 4: 4, or EXAONE's "LLLG": a letter a layer,
    L local, G global, repeated); else a set sliding_window masks every layer (Mistral v0.1, Phi-3)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not uses_sliding_window(types, cfg.get("sliding_window"), cfg.get("use_sliding_window", True)):
        return [False] * n
    if sliding_by_layer_type(cfg.get("model_type", ""), types):
        return [t == "sliding_attention" for t in types]
    if "use_sliding_window" in cfg:  # Qwen2Config / Qwen3Config: max_window_layers defaults to 28
        return [i >= cfg.get("max_window_layers", 28) for i in range(n)]
    patterns = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "gemma4": 6, "gemma4_text": 6, "cohere2": 4,
                "exaone4": 4}  # their configs' defaults
    pattern = cfg.get("sliding_window_pattern") or patterns.get(cfg.get("model_type"))
    if isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise ValueError(f"sliding_window_pattern {pattern!r}: expected letters L (local) and G (global)")
        return [pattern[i % len(pattern)] == "L" for i in range(n)]
    if pattern:
        flags = [bool((i + 1) % pattern) for i in range(n)]
        if str(cfg.get("model_type", "")).startswith("gemma4"):  # (Gemma4TextConfig forces the last layer global)
            flags[-1] = False
        return flags
    return [True] * n


# config.json names of GPT-2-style families (transformers' attribute_map) -> the names the planner reads
GPT2_NAMES = {"num_attention_heads": "n_head", "num_hidden_layers": "n_layer", "hidden_size": "n_embd",
              "intermediate_size": "n_inner"}


# config.json keys in which hybrid families name their recurrent layers instead of layer_types (Jamba, Bamba,
# Nemotron-H, Qwen3-Next, Granite 4's older configs; and the recurrent mixers' own fields, which Falcon-H1's config
# names beside no layer types at all)
HYBRID_KEYS = ("attn_layer_period", "attn_layer_indices", "hybrid_override_pattern", "full_attention_interval",
               "layers_block_type", "mamba_d_state", "mamba_d_ssm", "ssm_state_size", "linear_num_value_heads")


def text_config_of(cfg: dict):
    """The config's (text part's) transformers config, its defaults filled in; raises where transformers is
    missing or does not know or cannot build it."""
    return built_config(cfg).get_text_config(decoder=True)


def layer_types_of(cfg: dict, built=None, error: Exception | None = None) -> list[str]:
    """Each layer's type in a config (its text part), as transformers names them: a hybrid's recurrent or
    MLP-only layers keep no KV cache (KV_FREE_LAYER_TYPES). Hybrid families name them in keys of their
    own (Jamba's attn_layer_period, Nemotron-H's hybrid_override_pattern, Qwen3-Next's
    full_attention_interval, ...), which their transformers config (`built`, text_config_of) reads into
    layer_types; without it (`error`: why), the config's own layer_types."""
    types = getattr(built, "layer_types", None) or cfg.get("layer_types")
    family_keys = sorted(set(cfg) & set(HYBRID_KEYS))
    if built is None and cfg.get("layer_types") is None and family_keys:
        raise ValueError(f"plan: the config names a hybrid's layers in {family_keys}, which only its transformers "
                         f"config class reads, and that failed ({type(error).__name__}: {error}); pip install a "
                         f"transformers that knows {cfg.get('model_type')!r}") from error
    return list(types or ["full_attention"] * cfg["num_hidden_layers"])


# layer types (transformers' names) whose bytes the planner counts: attention over the whole context or a
# sliding window (Granite 4's "attention" an older name of the first), Falcon-H1's attention beside a mixer,
# and a hybrid's layers without a KV cache. Others (Llama 4's chunked attention, sparse and compressed
# attention with caches of their own shapes) are refused by name.
PLANNED_LAYER_TYPES = ("full_attention", "sliding_attention", "attention", "hybrid", *KV_FREE_LAYER_TYPES)


def from_config(path: str, params: float | None) -> ModelShape:
    """A transformers config.json: layers (and which of them slide, sliding_layers_of), KV heads,
    head_dim; parameters from --params, else counted by transformers (params_of), else estimated for a dense
    decoder (estimate_params)."""
    with open(path) as f:
        whole = json.load(f, object_hook=special_floats)
    cfg = whole.get("text_config", whole)
    for name, gpt2 in GPT2_NAMES.items():  # (GPT-2-style configs: GPT-BigCode, GPT-J, ...)
        if name not in cfg and gpt2 in cfg:
            cfg[name] = cfg[gpt2]
    built = error = None
    try:
        built = text_config_of(cfg)
    except Exception as e:  # (no transformers; no or an unknown model_type; a config its class cannot build:
        error = e           # EXAONE 4's letter pattern without layer_types)
    if "num_hidden_layers" not in cfg and built is not None:  # (Nemotron-H's, saved by transformers 5: its
        cfg["num_hidden_layers"] = built.num_hidden_layers    # layers_block_type alone)
    heads = cfg["num_attention_heads"]
    # multi-query attention as a flag (GPT-BigCode; Falcon, by default, unless new_decoder_architecture: then its
    # num_kv_heads), as transformers' configs derive num_key_value_heads
    multi_query = cfg.get("multi_query", cfg.get("model_type") == "falcon") and not cfg.get("new_decoder_architecture")
    kv = cfg.get("num_key_value_heads") or (1 if multi_query else cfg.get("num_kv_heads") or heads)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    layers = cfg["num_hidden_layers"]
    if cfg.get("kv_lora_rank"):
        raise ValueError(f"plan: {path} has multi-head latent attention (kv_lora_rank {cfg['kv_lora_rank']}); the "
                         "planner counts one cache of KV heads x head_dim per layer")
    gemma4 = str(cfg.get("model_type", "")).startswith("gemma4")  # (its global layers' shape: read below)
    same = {"v_head_dim": head_dim, **({} if gemma4 else {"global_head_dim": head_dim,
                                                           "num_global_key_value_heads": kv})}
    for key, want in same.items():  # (MiMo-V2's values; global layers of their own shape in another family)
        if cfg.get(key) and cfg[key] != want:
            raise ValueError(f"plan: {path} gives some layers' or the values' caches another shape ({key} "
                             f"{cfg[key]}); the planner counts one cache of KV heads x head_dim per layer")
    flags = sliding_layers_of(cfg)
    # KV sharing (Gemma 3n, Gemma 4's small models): the last num_kv_shared_layers layers reuse the caches of
    # earlier ones (of their type) and keep none
    shared = cfg.get("num_kv_shared_layers") or 0
    if not 0 <= shared < layers:
        raise ValueError(f"plan: {path} has num_kv_shared_layers {shared} of {layers} layers; some layer must keep "
                         "the cache the others share")
    # each layer's (KV heads, head_dim): the config's, the overrides of a saved per_layer_config, or Gemma 4's
    # global layers as Gemma4TextConfig builds them (their head_dim; their KV heads where keys are also values)
    shapes = [(kv, head_dim)] * layers
    per_layer = {int(i): o for i, o in (cfg.get("per_layer_config") or {}).items()}
    if gemma4 and not per_layer:
        glob = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):  # (False by default)
            glob["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        per_layer = {i: glob for i, f in enumerate(flags) if not f}
    for i, o in per_layer.items():
        shapes[i] = (o.get("num_key_value_heads", kv), o.get("head_dim", head_dim))
    # a hybrid's recurrent and MLP-only layers keep no KV cache
    types = layer_types_of(cfg, built, error)
    unmodelled = sorted(set(types) - set(PLANNED_LAYER_TYPES))
    if unmodelled:
        raise ValueError(f"plan: {path} has layers of type {unmodelled}, whose caches the planner does not model (it "
                         f"counts {', '.join(PLANNED_LAYER_TYPES)}); counted as full attention, their bytes would be "
                         "wrong")
    keep = [i for i, t in enumerate(types[: layers - shared]) if t not in KV_FREE_LAYER_TYPES]
    if not keep:
        raise ValueError(f"plan: {path} has no attention layer (a recurrent model keeps no KV cache)")
    recurrent = sum(t in RECURRENT_LAYER_TYPES for t in types)
    overridden = sorted({k for o in per_layer.values() for k in o if recurrent_state_reads(k)})
    if recurrent and overridden:
        raise ValueError(f"plan: {path} overrides {overridden} per layer (per_layer_config); the planner counts one "
                         "recurrent state shape for every recurrent layer")
    shapes, flags = [shapes[i] for i in keep], [flags[i] for i in keep]
    sliding = sum(flags)
    kinds = {f: {sh for sh, g in zip(shapes, flags) if g == f} for f in (True, False)}
    if any(len(k) > 1 for k in kinds.values()):
        raise ValueError(f"plan: {path} gives layers of one kind (sliding or not) different shapes {sorted(shapes)}; "
                         "the planner counts one shape for the sliding layers and one for the others")
    global_shape = None
    if sliding and kinds[False] and kinds[False] != kinds[True]:
        (kv, head_dim), global_shape = next(iter(kinds[True])), next(iter(kinds[False]))
    elif kinds[False] or kinds[True]:
        kv, head_dim = next(iter(kinds[False] or kinds[True]))
    how = "--params"
    if params is None:
        try:
            params, how = params_of(whole), "counted by transformers"
        except Exception as e:  # (no transformers, or a config it cannot build)
            params = estimate_params(path, cfg, whole, (kv, head_dim), recurrent, e)
            how = "estimated: embeddings, attention, MLP"
    return ModelShape(cfg.get("_name_or_path") or path, len(keep), kv, head_dim, float(params), sliding,
                      cfg.get("sliding_window") if sliding else None, tuple(flags), global_shape, shared,
                      layers - shared - len(keep), recurrent,
                      state_of(built) if recurrent and built is not None else None, how,
                      str(cfg.get("model_type") or ""))


def kv_bytes(model: ModelShape, scheme: Scheme | None, context: int, batch: int, dtype=torch.float16) -> int:
    """Exact KV-cache bytes of every layer for `batch` sequences of `context` tokens, and a hybrid's
    recurrent states (ModelShape.state_bytes: in full precision, whatever the scheme). A sliding layer's
    cache is its ring (CacheLayout with sliding_window: the same bytes at any context longer than the
    window; RKVCache's binding_window). scheme None: a full-precision cache in `dtype` (the baseline),
    min(context, window) tokens in a sliding layer."""
    full_kv, full_dim = model.full_shape
    states = batch * model.state_bytes(dtype)
    if scheme is None:
        def fp(tokens, kv_heads=model.kv_heads, head_dim=model.head_dim):
            return 2 * batch * kv_heads * tokens * head_dim * torch.finfo(dtype).bits // 8

        sliding = fp(min(context, model.sliding_window)) if model.sliding_layers else 0
        return model.full_layers * fp(context, full_kv, full_dim) + model.sliding_layers * sliding + states
    full = CacheLayout(scheme, batch, full_kv, full_dim, context, dtype).nbytes() if model.full_layers else 0
    window = binding_window(model.sliding_window or 0, context)
    sliding = CacheLayout(scheme, batch, model.kv_heads, model.head_dim, context, dtype,
                          sliding_window=window).nbytes() if model.sliding_layers else 0
    return model.full_layers * full + model.sliding_layers * sliding + states


def bytes_per_token(model: ModelShape, scheme: Scheme | None) -> float:
    """Marginal bytes per token at a 64K context (all layers, batch 1): codes and metadata; the fixed
    sinks and window ring do not grow with the context, nor does a sliding layer whose window is shorter."""
    block = 1 if scheme is None else scheme.block
    a, b = 1 << 16, (1 << 16) + 64 * block
    return (kv_bytes(model, scheme, b, 1) - kv_bytes(model, scheme, a, 1)) / (b - a)


def longest_context(model: ModelShape, scheme: Scheme | None, budget: float, batch: int = 1) -> int | None:
    """Largest context whose cache fits in `budget` bytes (binary search on the exact byte count). None:
    no limit, every layer slides and their caches fit (they stop growing at the window)."""
    if budget <= 0 or kv_bytes(model, scheme, 1, batch) > budget:
        return 0
    if not model.full_layers and kv_bytes(model, scheme, 1 << 40, batch) <= budget:
        return None
    lo, hi = 1, 1
    while kv_bytes(model, scheme, hi, batch) <= budget and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv_bytes(model, scheme, mid, batch) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def most_sequences(model: ModelShape, scheme: Scheme | None, budget: float, context: int) -> int:
    one = kv_bytes(model, scheme, context, 1)
    if one > budget:
        return 0
    n = int(budget // one)
    while n > 0 and kv_bytes(model, scheme, context, n) > budget:
        n -= 1
    return n


def paged_sequence_bytes(model: ModelShape, scheme: Scheme | None, context: int, page_size: int | None = None,
                         dtype=torch.float16) -> int:
    """Exact bytes one sequence of `context` tokens holds in a paged cache, every layer: its pages (the
    last one partial: page rounding included), their page counts and its side slot of full-precision
    rows (PagedQuantizedKVCache, from PageLayout), and a hybrid's recurrent states. scheme None: a
    full-precision paged cache in `dtype` (pages of 16 tokens, vLLM's default).

    A sliding layer holds at most ceil((W + P) / P) pages of P tokens: its newest W tokens straddle at
    most ceil(W / P) + 1 pages, and pages wholly before the window are never read again, so an engine
    frees them (vLLM does). An upper bound for an engine that frees them; one that does not holds every
    page like a full layer."""
    p = page_size or (16 if scheme is None else default_page_size(scheme))

    def pages(layer_context: int) -> int:
        return -(-layer_context // p)

    sliding = min(pages(context), pages(model.sliding_window + p)) if model.sliding_layers else 0
    total = model.state_bytes(dtype)
    for layers, held, (kv_heads, head_dim) in ((model.full_layers, pages(context), model.full_shape),
                                               (model.sliding_layers, sliding, (model.kv_heads, model.head_dim))):
        if scheme is None:
            total += layers * held * 2 * kv_heads * p * head_dim * torch.finfo(dtype).bits // 8
        else:
            layout = PageLayout(scheme, kv_heads, head_dim, p, dtype)
            # codes and metadata, the page's block-table entry, and the layer's side slot
            total += layers * (held * (layout.payload_bytes + 4) + layout.slot_bytes)
    return total


def paged_sequences(model: ModelShape, scheme: Scheme | None, budget: float, context: int,
                    page_size: int | None = None) -> int:
    """Sequences of `context` tokens a paged cache of `budget` bytes holds at once."""
    return max(0, int(budget // paged_sequence_bytes(model, scheme, context, page_size)))


def layer_layouts(model: ModelShape, schemes: list[Scheme], context: int, batch: int,
                  dtype=torch.float16) -> list[CacheLayout]:
    """Each layer's CacheLayout under a per-layer allocation (a sliding layer: its ring)."""
    return [CacheLayout(s, batch, *model.shape_of(i), context, dtype,
                        sliding_window=binding_window(model.window_of(i), context)) for i, s in enumerate(schemes)]


def layouts_bytes(model: ModelShape, schemes: list[Scheme], context: int, batch: int, dtype=torch.float16) -> int:
    """The bytes of every layer's CacheLayout under a per-layer allocation."""
    return sum(lay.nbytes() for lay in layer_layouts(model, schemes, context, batch, dtype))


def _lowest(model: ModelShape, profile: Sensitivity, budget: float, context: int, batch: int,
            dtype, nbytes) -> tuple[list[int], int]:
    """(each layer's packed rows, the cache's bytes) at the profile's lowest level; refuses a profile of
    another model, or a budget that does not hold even that. nbytes(schemes): the bytes to fit
    (_bytes_to_fit)."""
    if profile.layers != model.layers:
        raise ValueError(f"plan: the sensitivity profile has {profile.layers} layers, {model.name} has {model.layers} "
                         "layers")
    schemes = [layer_scheme(min(profile.levels), min(profile.levels), profile.levels)] * model.layers
    low = layer_layouts(model, schemes, context, batch, dtype)
    lowest = nbytes(schemes)
    if budget < lowest:
        raise ValueError(f"plan: {budget / GB:.2f} GB does not hold {batch} x {context:,} tokens even at "
                         f"{min(profile.levels)} bits in every layer ({lowest / GB:.2f} GB)")
    return [lay.packed_capacity for lay in low], lowest


def _bytes_to_fit(model: ModelShape, context: int, batch: int, dtype, engine: VllmEngine | None):
    """nbytes(schemes): the bytes a per-layer allocation takes, as the layers' CacheLayouts or, with an
    engine, as its vLLM pages and side pool (vllm_bytes)."""
    def nbytes(schemes: list[Scheme]) -> int:
        if engine is None:
            return layouts_bytes(model, schemes, context, batch, dtype)
        return vllm_bytes(model, engine, schemes, context, batch)
    return nbytes


def _allocatable(model: ModelShape) -> None:
    """Refuse a per-layer allocation for a model it cannot plan: layers of two shapes (and in vLLM, the plugin
    publishes an allocation's pages unrounded, vllm_backend._publish_pages), KV-shared or recurrent layers."""
    model.one_shape("a per-layer allocation (its knapsack weighs every layer's rows alike)")
    model.own_caches("a per-layer allocation (its sensitivity profile measures every layer)")


def allocation_for_budget(model: ModelShape, profile: Sensitivity, budget: float, context: int, batch: int = 1,
                          dtype=torch.float16, engine: VllmEngine | None = None) -> tuple[Allocation, int, list[int]]:
    """(the per-layer K/V bits of least predicted cost whose cache of `batch` sequences of `context` tokens
    fits in `budget` bytes, its exact bytes, each layer's packed rows). A choice changes only the layer's
    code bytes, rows x head_dim x bits / 8 per kv head and side, so the knapsack weighs each layer by its
    rows (a sliding layer's ring holds fewer) and everything else is a fixed cost, counted at the lowest
    level. engine: a vLLM engine with the plugin, whose pages and side pool must fit (vllm_bytes; a
    layer's rows are then the tokens of the blocks it holds for a request, and each page's bytes per token are
    rounded up to the dtype, so the exact bytes are checked and the budget cut until they fit)."""
    _allocatable(model)
    nbytes = _bytes_to_fit(model, context, batch, dtype, engine)
    rows, lowest = _lowest(model, profile, budget, context, batch, dtype, nbytes)
    if engine is not None:  # a layer's pages hold the requests' whole blocks (a sliding one's: its window's)
        lowest_level = min(profile.levels)
        rows = engine.pool(model, [layer_scheme(lowest_level, lowest_level, profile.levels)] * model.layers) \
            .layer_rows(context)
    per_unit = batch * model.kv_heads * model.head_dim  # bits of code per (row x bit)
    fixed = lowest - 2 * min(profile.levels) * sum(rows) * per_unit // 8
    units = int((budget - fixed) * 8 // per_unit)
    while True:
        alloc = allocate(profile, units, weights=rows)
        exact = nbytes(alloc.schemes())
        if exact <= budget:
            return alloc, exact, rows
        units -= max(1, int((exact - budget) * 8 // per_unit))


def split_for_budget(model: ModelShape, profile: Sensitivity, budget: float, context: int, batch: int = 1,
                     dtype=torch.float16, engine: VllmEngine | None = None) -> tuple[Allocation, int, list[int]]:
    """allocation_for_budget for an allocation whose layers all keep the same key + value bits
    (allocate_split: every page the same bytes, for an engine with one page size): the most bits per
    layer whose cache (or the vLLM engine's pages and side pool) fits `budget`, each layer's split the
    one of least predicted cost."""
    _allocatable(model)
    nbytes = _bytes_to_fit(model, context, batch, dtype, engine)
    rows, _ = _lowest(model, profile, budget, context, batch, dtype, nbytes)
    # the totals a layer can keep: a key level plus a value level (levels 2 and 4 have no 5)
    for total in sorted({k + v for k in profile.levels for v in profile.levels}, reverse=True):
        alloc = allocate_split(profile, total / 2)
        exact = nbytes(alloc.schemes())
        if exact <= budget:
            return alloc, exact, rows
    raise AssertionError("unreachable: _lowest checked that the lowest total fits")


# ------------------------------------------------------------------------------------------------
# A vLLM engine with the plugin (integrations/vllm_pool.py): its KV pages and the plugin's side pool
# ------------------------------------------------------------------------------------------------


# vLLM's own caches, by the --kv-cache-dtype that serves them: the model dtype, and 8-bit floats (per-tensor
# scales: 1.0 unless the checkpoint carries calibrated ones; on CPU vLLM needs AVX-512 or AMX for them)
VLLM_CACHES = {"auto": None, "fp8": torch.float8_e4m3fn}

# vllm serve's max_num_batched_tokens (engine/arg_utils.py get_batch_defaults, one GPU or CPU socket):
# on GPUs by their memory (A100s aside, which keep the smallest), on CPUs 2048
SERVE_BATCHED_TOKENS = ((160 * 2**30, 16384), (70 * 2**30, 8192), (0, 2048))


@dataclass(frozen=True)
class VllmEngine:
    """How the engine runs: the model dtype (vLLM's own cache and the side rows), the device ("cuda" or
    "cpu": its default block size), the block size (None: the one vLLM picks for the backend),
    max_num_seqs (the side pool's limit), max_num_batched_tokens (what a sliding layer holds beyond its
    window) and the hybrid KV-cache manager (vLLM's default; off, every sliding layer keeps every block
    of its requests, like a full one)."""

    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    block_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    hybrid: bool = True
    tensor_parallel: int = 1
    speculative_tokens: int = 0  # ngram speculative decoding's num_speculative_tokens
    prefix_caching: bool = True  # (vLLM's default; a hybrid's recurrent states then take more blocks a request)
    ssm_dtype: str = "auto"  # vLLM's --mamba-ssm-cache-dtype

    def rank(self, model: ModelShape) -> ModelShape:
        """What one GPU of the engine holds of the model: tensor parallelism shards the KV heads evenly,
        and gives every rank one when there are fewer heads than ranks (each head on tp / heads ranks:
        vLLM's QKVParallelLinear), so the pages and side rows of a rank are the model's with that many
        heads (Gemma 4's global layers' heads too). vLLM logs the engine's capacity, which is every rank's
        (each holds its heads of every token)."""
        tp = self.tensor_parallel

        def shard(heads: int) -> int:
            if tp < 1 or (heads % tp if tp <= heads else tp % heads):
                raise ValueError(f"plan --vllm: --tensor-parallel-size {tp} neither divides {model.name}'s {heads} "
                                 "KV heads nor is a multiple of them, which vLLM needs to shard or replicate them")
            return max(1, heads // tp)

        glob = model.global_shape and (shard(model.global_shape[0]), model.global_shape[1])
        return replace(model, kv_heads=shard(model.kv_heads), global_shape=glob)

    def block_for(self, scheme: Scheme | None) -> int:
        """The block size the engine runs with this scheme (every layer's: an allocation's share it)."""
        return self.block_size or preferred_block_size(scheme, self.device)

    @property
    def async_scheduling(self) -> bool:
        """vLLM's default: on CUDA, unless ngram speculative decoding turns it off; never on CPU
        (platforms/cpu.py)."""
        return self.device == "cuda" and not self.speculative_tokens

    @property
    def in_flight_tokens(self) -> int:
        """Tokens scheduled before a step's blocks are freed: async scheduling runs one batch ahead."""
        return self.max_num_batched_tokens * (2 if self.async_scheduling else 1)

    def windows(self, model: ModelShape) -> tuple[int, ...] | None:
        """Each layer's sliding window as vLLM's KV-cache manager sees it (None: none slides). Without the
        hybrid manager, vLLM gives sliding layers beside full ones a full layer's blocks
        (_promote_local_kv_cache_specs); a model whose layers all slide keeps its windows."""
        if not model.sliding_layers or (not self.hybrid and model.full_layers):
            return None
        return tuple(model.window_of(i) for i in range(model.layers))

    def pads_unequal_pages(self, model: ModelShape) -> bool:
        """Whether vLLM groups the model's layers by window (sliding beside full layers), where it pads
        pages of unequal bytes to the largest: an allocation then keeps one total in every layer."""
        return len(set(self.windows(model) or ())) > 1

    def pool(self, model: ModelShape, schemes: list[Scheme] | None, cache_dtype: torch.dtype | None = None
             ) -> VllmPool:
        """The engine's pool with the plugin (`schemes`, one a layer) or vLLM's own cache (None) in
        cache_dtype (None: the model dtype)."""
        # (KV-shared layers get no pages from vLLM: model.layers are the ones that keep a cache)
        shapes = tuple(map(model.shape_of, range(model.layers))) if model.global_shape else None
        block = self.block_for(schemes[0] if schemes else None)
        pool = VllmPool(model.layers, model.kv_heads, model.head_dim, self.dtype,
                        None if schemes is None else tuple(schemes), block, self.windows(model),
                        self.in_flight_tokens, self.speculative_tokens, cache_dtype, shapes)
        if not model.recurrent_hybrid:
            return pool
        model.one_shape("plan --vllm (a hybrid's pool)")
        state = self.hybrid_state(model)
        drafts = self.speculative_tokens
        state_bytes = state.vllm_bytes(self.dtype, self.state_ssm_dtype(state), self.tensor_parallel, drafts)
        # (the plugin's kernel blocks: multiples of its block; an allocation on a hybrid is refused: one page)
        kernel = block_multiple(schemes[0]) if schemes else OWN_KERNEL_BLOCK[self.device]
        block = hybrid_block_size(block, pool.layer_pages[0] // block, kernel, state_bytes)
        blocks = 1 + drafts + (1 + (state.mixer == "mamba2") if self.prefix_caching else 0)
        return replace(pool, block_size=block, states=model.recurrent_layers, state_bytes=state_bytes,
                       state_blocks=blocks)

    def hybrid_state(self, model: ModelShape) -> RecurrentState:
        """A hybrid's recurrent layer, where the plugin serves its family and vLLM's pool is modelled: its
        recurrent layers each a Mamba spec of vLLM's, every other layer attention or an MLP alone."""
        if model.family not in VLLM_HYBRIDS:
            raise ValueError(f"plan --vllm: {model.name} is a hybrid of family {model.family or 'unknown'!r}; the "
                             f"plugin serves {', '.join(VLLM_HYBRIDS)} (give --config with such a model's config.json)")
        if model.state is None:
            raise ValueError(f"plan --vllm: {model.name}'s recurrent layers' state is unknown (its config was not "
                             "read by transformers' config class: install a transformers that knows "
                             f"{model.family!r})")
        return model.state

    def state_ssm_dtype(self, state: RecurrentState) -> torch.dtype:
        """The dtype vLLM keeps a recurrent state in: --mamba-ssm-cache-dtype, else the family's (Nemotron-H:
        float32), else the model dtype; on a CPU with AVX-512 BF16 (the one planning), float32 but for an
        explicit 16-bit dtype on gated DeltaNet (platforms/cpu.py: its accelerated kernels)."""
        name = self.ssm_dtype if self.ssm_dtype != "auto" else state.vllm_ssm_dtype
        if self.device == "cpu" and torch.cpu._is_avx512_bf16_supported() and name != "float32":
            if not (name in ("float16", "bfloat16") and state.mixer == "gated_delta_net"):
                name = "float32"
        return self.dtype if name == "auto" else getattr(torch, name)


def serve_batched_tokens(device: str, gpu_bytes: float, world_size: int = 1) -> int:
    """vllm serve's default max_num_batched_tokens on this device (SERVE_BATCHED_TOKENS; on CPU 2048
    a rank)."""
    if device == "cpu":
        return 2048 * world_size
    return next(tokens for least, tokens in SERVE_BATCHED_TOKENS if gpu_bytes >= least)


def vllm_bytes(model: ModelShape, engine: VllmEngine, schemes: list[Scheme] | None, context: int, batch: int) -> int:
    """Memory `batch` requests of `context` tokens take at once in a vLLM engine: their KV blocks, whole,
    and the plugin's side pool at its most for that many requests (VllmPool.side_bytes)."""
    pool = engine.pool(model, schemes)
    return pool.pages_bytes(context, batch) + pool.side_bytes(batch, engine.max_num_seqs)


def vllm_rows(model: ModelShape, engine: VllmEngine, budget: float, context: int, batch: int,
              schemes: list[tuple[str, Scheme | None]]) -> list[dict]:
    """Per scheme (None: vLLM's own cache of that name, VLLM_CACHES), vllm_row of every layer keeping it."""
    return [vllm_row(model, engine, budget, context, batch, name, None if scheme is None else [scheme] * model.layers)
            for name, scheme in schemes]


def vllm_row(model: ModelShape, engine: VllmEngine, budget: float, context: int, batch: int, name: str,
             schemes: list[Scheme] | None) -> dict:
    """What a vLLM engine holds in `budget` bytes with `batch` requests running at once, each layer
    keeping its scheme (None: vLLM's own cache `name`, VLLM_CACHES): the plugin's side pool for them
    comes first, and the rest is the KV memory to give vLLM (kv_cache_memory_bytes), whose tokens and
    concurrency for requests of `context` tokens are what vLLM logs."""
    for scheme in set(schemes or ()):
        scheme.check_served()
        check_drafts(scheme, engine.speculative_tokens)
    own = VLLM_CACHES[name] if schemes is None else None
    pool = engine.pool(model, schemes, own)
    side = pool.side_bytes(batch, engine.max_num_seqs)
    kv = max(0, int(budget) - side)
    tokens, concurrency = pool.capacity(kv, context)
    if schemes is None:
        bits = 8.0 * own.itemsize if own is not None else 16.0
    else:
        bits = sum(s.effective_bits(model.head_dim) for s in schemes) / len(schemes)
    return {"scheme": name, "bits_per_element": bits, "block_size": pool.block_size,
            "page_bytes": pool.layer_pages[0], "side_pool_bytes": side, "kv_cache_memory_bytes": kv,
            "kv_tokens": tokens, "max_concurrency": concurrency,
            "fits": concurrency >= batch and batch <= engine.max_num_seqs}


def serve_command(model: ModelShape, engine: VllmEngine, row: dict, context: int, dtype: str,
                  explicit_batched_tokens: bool = False, allocation: str | None = None) -> dict:
    """How to run `vllm serve MODEL` for the engine a vllm_row plans: {"env": variables to set (the
    plugin's scheme or allocation file), "unset": variables to remove (the plugin's others, which the
    shell may hold from another run), "args": the arguments (every engine option the plan's count
    depends on, and the plugin's KV connector)}, so that vLLM logs the planned tokens and concurrency. On CPU VLLM_CPU_KVCACHE_SPACE,
    when set, would override --kv-cache-memory-bytes (vllm/platforms/cpu.py), and vLLM fails on it
    empty, so it is unset too."""
    env = {}
    if allocation is not None:
        env[ALLOCATION_ENV] = allocation
    elif row["scheme"] not in VLLM_CACHES:
        env[ENV] = row["scheme"]
    unset = [name for name in (ENV, ALLOCATION_ENV, CODEBOOK_ENV) if name not in env]
    if engine.device == "cpu":
        unset.append("VLLM_CPU_KVCACHE_SPACE")
    args = ["--dtype", dtype, "--max-model-len", str(context), "--max-num-seqs", str(engine.max_num_seqs),
            "--block-size", str(row["block_size"]), "--kv-cache-memory-bytes", str(row["kv_cache_memory_bytes"])]
    if row["scheme"] in VLLM_CACHES and row["scheme"] != "auto":
        args += ["--kv-cache-dtype", row["scheme"]]
    if engine.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(engine.tensor_parallel)]
    if model.sliding_layers or explicit_batched_tokens:  # (what a sliding layer holds beyond its window)
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if not engine.hybrid:
        args.append("--disable-hybrid-kv-cache-manager")
    if engine.speculative_tokens:
        args += ["--speculative-config", json.dumps({"method": "ngram",
                                                     "num_speculative_tokens": engine.speculative_tokens})]
    if not engine.prefix_caching:
        args.append("--no-enable-prefix-caching")
    if engine.ssm_dtype != "auto":
        args += ["--mamba-ssm-cache-dtype", engine.ssm_dtype]
    if env:  # (the plugin's KV connector names each step's requests to its backend)
        args += ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":"))]
    return {"env": env, "unset": unset, "args": args}


def shell_command(serve: dict, model_path: str) -> str:
    """The one-line shell command of a serve_command."""
    prefix = ["env", *(f"-u {name}" for name in serve["unset"])] if serve["unset"] else []
    return " ".join([*prefix, *(f"{k}={shlex.quote(v)}" for k, v in serve["env"].items()), "vllm", "serve",
                     shlex.quote(model_path), *map(shlex.quote, serve["args"])])


def plan(model: ModelShape, gpu_bytes: float, weight_bytes: float, reserve_bytes: float, context: int, batch: int,
         schemes: list[tuple[str, Scheme | None]]) -> list[dict]:
    budget = gpu_bytes - weight_bytes - reserve_bytes
    rows = []
    for name, scheme in schemes:
        if scheme is not None:
            scheme.check_served()  # (the report's simulated peers have no cache to count)
        need = kv_bytes(model, scheme, context, batch)
        rows.append({
            "scheme": name,
            "bits_per_element": 16.0 if scheme is None else scheme.effective_bits(model.head_dim),
            "bytes_per_token": bytes_per_token(model, scheme),
            "kv_bytes": need,
            "fits": need <= budget,
            "longest_context_batch1": longest_context(model, scheme, budget),
            "max_sequences_at_context": most_sequences(model, scheme, budget, context),
            "paged_sequences_at_context": paged_sequences(model, scheme, budget, context),
            "paged_bytes_per_sequence": paged_sequence_bytes(model, scheme, context),
        })
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3-70b", help=f"a preset ({', '.join(MODELS)}) or use --config")
    p.add_argument("--config", help="config.json of any transformers model")
    p.add_argument("--params", type=float, help="number of weights (with --config; default: counted by "
                   "transformers on the meta device, else estimated for a dense decoder)")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory in GB (1e9 bytes)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--weight-bits", type=float, help="bits per weight (default: with --config, the bytes of the "
                         "checkpoint beside it, as loaded; else 4)")
    weights.add_argument("--weight-gb", type=float, help="weight memory in GB instead of --weight-bits")
    p.add_argument("--reserve-gb", type=float, default=4.0, help="activations, workspace, fragmentation (GB)")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), help="presets like rkv-3 or kivi-2")
    p.add_argument("--budget-gb", type=float, help="KV-cache memory in GB (instead of GPU - weights - reserve); "
                   "with --sensitivity, also the per-layer bit allocation that fits it")
    p.add_argument("--sensitivity", help="a per-layer sensitivity profile of this model (JSON, written by "
                   "python -m torch_rkv calibrate)")
    p.add_argument("--split", action="store_true", help="with --sensitivity: an allocation whose layers all keep the "
                   "same key + value bits (pages of one size; by default each layer keeps the bits that pay most)")
    p.add_argument("--out", help="with --sensitivity: write the allocation to this file (docs/format.md)")
    p.add_argument("--vllm", action="store_true", help="plan a vLLM engine with the plugin (docs/serving.md): per "
                   "scheme, the KV memory to give vLLM once the side pool for --batch requests at once is set aside, "
                   "and the tokens and concurrency vLLM reports for requests of --context tokens; with --sensitivity, "
                   "the allocation whose pages and side pool fit (serve it with TORCH_RKV_ALLOCATION)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="the model dtype: a float32 checkpoint's weights are held in it; with --vllm, vLLM's own "
                   "cache and the plugin's full-precision rows too")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="with --vllm: where vLLM runs (its "
                   "default block size: 16 tokens on CUDA, 128 on CPU)")
    p.add_argument("--block-size", type=int, help="with --vllm: vLLM's block size in tokens (default: the one vLLM "
                   "picks, the device's default or the smallest the scheme takes: a multiple of its block, 128 "
                   "for the rkv presets)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="with --vllm: the engine's max_num_seqs (it bounds the "
                   "side pool and the requests run at once; vLLM 0.32's default depends on the device and entry "
                   "point, 1024 on GPUs of 70 GiB or more: pass the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, help="with --vllm: the engine's max_num_batched_tokens, "
                   "what a sliding layer holds beyond its window (default: vllm serve's, 2048 on CPU; on CUDA 8192 "
                   "on GPUs of 70 GiB or more by --gpu-gb, 16384 from 160 GiB, 2048 below and on A100s)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", help="with --vllm: the engine runs "
                   "with this vLLM flag (sliding layers then keep every block, like full ones)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="with --vllm: GPUs the engine shards the "
                   "model over; --gpu-gb, --reserve-gb and --budget-gb are then one GPU's, which holds 1/N of the "
                   "weights and of the KV heads")
    p.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false", help="with --vllm: the "
                   "engine runs with this vLLM flag (a hybrid model's recurrent states then take 1 block a request, "
                   "not 2, or 3 for a Mamba 2 mixer)")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="with --vllm: vLLM's flag, the dtype of a hybrid's recurrent states (auto: the model dtype, "
                   "Nemotron-H's float32; on a CPU with AVX-512 BF16 vLLM keeps float32)")
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="with --vllm: ngram speculative decoding's "
                   "drafts a step (each side slot's ring holds that many more rows, and vLLM then schedules without "
                   "async scheduling)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    if args.config:
        try:
            model = from_config(args.config, args.params)
        except ValueError as e:
            raise SystemExit(f"torch_rkv {e}")
    elif args.model.lower() in MODELS:
        model = MODELS[args.model.lower()]
    else:
        raise SystemExit(f"torch_rkv plan: unknown model {args.model!r}; use one of {', '.join(MODELS)} or --config")
    weight, weighed = 0.0, "--budget-gb"
    if args.budget_gb is None:
        try:
            weight, weighed = weights_of(model, args)
        except ValueError as e:
            raise SystemExit(f"torch_rkv {e}")
    schemes: list[tuple[str, Scheme | None]] = [(name, None) for name in VLLM_CACHES] if args.vllm else [("fp16", None)]
    for spec in args.schemes:
        schemes.append((spec, S.by_name(spec)))
    # (the plugin rebuilds rotary tables for PRE_ROPE_MODELS alone, and refuses pre-RoPE schemes for others)
    unrotated = args.vllm and model.family and model.family not in PRE_ROPE_MODELS
    left_out = [name for name, scheme in schemes if unrotated and scheme is not None and scheme.pre_rope]
    schemes = [(name, scheme) for name, scheme in schemes if name not in left_out]
    if left_out:
        why = (f"left out: {', '.join(left_out)} (pre-RoPE schemes, which the plugin serves for "
               f"{', '.join(PRE_ROPE_MODELS)}, not {model.family!r}; post-RoPE ones serve any decoder)")
        print(why, file=sys.stderr)
    if args.budget_gb is not None:  # the KV budget itself
        gpu, weight, reserve = args.budget_gb * GB, 0.0, 0.0
    else:
        gpu, reserve = args.gpu_gb * GB, args.reserve_gb * GB
    engine = (VllmEngine(getattr(torch, args.dtype), args.device, args.block_size, args.max_num_seqs,
                         args.max_num_batched_tokens or serve_batched_tokens(args.device, args.gpu_gb * GB,
                                                                             args.tensor_parallel_size),
                         not args.disable_hybrid_kv_cache_manager, args.tensor_parallel_size,
                         args.num_speculative_tokens, args.prefix_caching, args.mamba_ssm_cache_dtype)
              if args.vllm else None)
    budget = gpu - weight / (engine.tensor_parallel if engine else 1) - reserve  # (one GPU's: its share of weights)
    if engine is not None:  # from here on one GPU's share of the KV heads too
        try:
            model = engine.rank(model)
        except ValueError as e:
            raise SystemExit(f"torch_rkv {e}")
    elif args.tensor_parallel_size != 1:
        raise SystemExit("torch_rkv plan: --tensor-parallel-size plans a vLLM engine; add --vllm")
    try:
        if engine is not None:
            rows = vllm_rows(model, engine, budget, args.context, args.batch, schemes)
        else:
            rows = plan(model, gpu, weight, reserve, args.context, args.batch, schemes)
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"torch_rkv {e}")
    allocation = None
    # vLLM pads a hybrid model's unequal pages to the largest: one total in every layer fits more there
    split = args.split or (engine is not None and engine.pads_unequal_pages(model))
    if (args.split or args.out) and not args.sensitivity:
        raise SystemExit("torch_rkv plan: --split and --out choose a per-layer allocation, which needs --sensitivity")
    if args.sensitivity and unrotated:
        raise SystemExit(f"torch_rkv plan: --sensitivity with --vllm plans an allocation of pre-RoPE schemes, which "
                         f"the plugin does not serve for {model.family!r} (only {', '.join(PRE_ROPE_MODELS)})")
    if args.sensitivity and engine is not None and model.recurrent_hybrid:
        raise SystemExit(f"torch_rkv plan: --sensitivity with --vllm plans a per-layer allocation, which the plugin "
                         f"does not serve on a hybrid model ({model.name}: vLLM pads its pages to one size)")
    if args.sensitivity:
        try:
            with open(args.sensitivity) as f:
                profile = Sensitivity.from_json(f.read())
        except (OSError, ValueError) as e:
            raise SystemExit(f"torch_rkv plan: --sensitivity {args.sensitivity}: {e}")
        try:
            solver = split_for_budget if split else allocation_for_budget
            allocation = solver(model, profile, budget, args.context, args.batch, engine=engine)
        except ValueError as e:
            raise SystemExit(f"torch_rkv {e}")
        if args.out:
            allocation[0].save(args.out, model=model.name, calibration=f"{profile.model} on {profile.text}")
    serving = None  # (with --vllm) how to serve each row, and the allocation's row
    if engine is not None:
        def serve(row, file=None):
            return serve_command(model, engine, row, args.context, args.dtype, args.max_num_batched_tokens is not None,
                                 file)

        for row in rows:
            row["serve"] = serve(row)
        if allocation:
            serving = vllm_row(model, engine, budget, args.context, args.batch, "allocation",
                               allocation[0].schemes())
            serving["serve"] = serve(serving, os.path.abspath(args.out) if args.out else ALLOCATION_PLACEHOLDER)
    if args.json:
        # (with --vllm: one GPU's share of the KV heads)
        out = {"model": {**asdict(model), "state_bytes": model.state_bytes()}, "rows": rows, "left_out": left_out}
        if engine is not None:
            out["tensor_parallel_size"] = engine.tensor_parallel
        if allocation:
            out["allocation"] = {"bits": allocation[0].bits, "kv_bytes": allocation[1], "split": split,
                                 "predicted_kl": allocation[0].predicted, "profile": args.sensitivity,
                                 "file": args.out}
            if serving is not None:
                out["allocation"]["vllm"] = serving
        print(json.dumps(out, indent=1))
        return 0
    if engine is not None:
        print_vllm(model, engine, weight, weighed, budget, args, rows)
    else:
        print_contiguous(model, weight, weighed, budget, args, rows)
    if allocation:
        print_allocation(model, budget, args, profile, allocation, engine, split, serving)
    return 0


OUR_PRESETS = ("rkv-",)  # rkv-<bits>, rkv-mixed-<bits>, rkv-sparse-<bits>: one layout, ranked by their bits
MODEL_PLACEHOLDER = "MODEL"  # vllm serve's model (a Hugging Face id or directory) where plan has no --config
ALLOCATION_PLACEHOLDER = "ALLOCATION.json"  # TORCH_RKV_ALLOCATION where plan writes no --out file


DEFAULT_WEIGHT_BITS = 4.0  # the article's example: a 70B-class model in 4-bit weights on one 80 GB GPU


def weights_of(model: ModelShape, args) -> tuple[float, str]:
    """(bytes, how) of the weights on the GPU: --weight-gb, --weight-bits, the checkpoint beside --config
    (the bytes an engine loads in --dtype, whatever its quantization), or DEFAULT_WEIGHT_BITS."""
    if args.weight_gb is not None:
        return args.weight_gb * GB, "--weight-gb"
    if args.weight_bits is not None:
        return model.weight_bytes(args.weight_bits), f"{args.weight_bits:g}-bit"
    found = checkpoint_weight_bytes(args.config, getattr(torch, args.dtype)) if args.config else None
    if found is not None:
        return float(found[0]), f"the checkpoint's {found[1]}"
    return model.weight_bytes(DEFAULT_WEIGHT_BITS), f"{DEFAULT_WEIGHT_BITS:g}-bit; --weight-bits sets it"


def model_path(args) -> str:
    """What `vllm serve` loads: the directory of --config when it holds the weights too, or
    MODEL_PLACEHOLDER (a config.json on its own)."""
    if args.config and holds_weights(args.config):
        return str(checkpoint_folder(args.config))
    return MODEL_PLACEHOLDER


def print_vllm(model: ModelShape, engine: VllmEngine, weight: float, weighed: str, budget: float, args,
               rows: list[dict]) -> None:
    tp = engine.tensor_parallel
    pool = engine.pool(model, None)  # (vLLM's own cache: its groups, page unification and states)
    print(f"{model.name} in vLLM on {engine.device}: {model.layers} layers x {model.kv_heads} KV heads"
          f"{f' a GPU (tensor parallel {tp})' if tp > 1 else ''} x head_dim {model.head_dim}, {args.dtype}, "
          f"max_num_seqs {engine.max_num_seqs}; {budget / GB:.2f} GB{' a GPU' if tp > 1 else ''} for the KV pages "
          "and the plugin's side pool")
    if args.budget_gb is None:
        print(f"weights {weight / GB:.1f} GB ({weighed}){f', {weight / tp / GB:.1f} GB a GPU' if tp > 1 else ''}; "
              f"GPU {args.gpu_gb:.0f} GB, reserve {args.reserve_gb:.0f} GB")
    if model.sliding_layers:
        if engine.windows(model):
            groups = pool.groups
            print(f"{model.sliding_layers} of {model.layers} layers slide over {model.sliding_window:,} tokens: a "
                  f"request holds in them only its blocks of the newest {model.sliding_window - 1:,} tokens and the "
                  f"{engine.in_flight_tokens:,} in flight (max_num_batched_tokens {engine.max_num_batched_tokens:,}"
                  f"{' x 2, async scheduling' if engine.async_scheduling else ''}), and one more; vLLM's "
                  f"{len(groups)} KV-cache groups of at most {max(map(len, groups))} layers (the hybrid manager)")
        else:
            print(f"{model.sliding_layers} of {model.layers} layers slide, but without the hybrid KV-cache manager "
                  "vLLM keeps every block of theirs, like a full layer's")
    if model.global_shape:
        print(f"the {model.full_layers} global layers: {model.global_shape[0]} KV heads{' a GPU' if tp > 1 else ''} x "
              f"head_dim {model.global_shape[1]} (bits/el below at head_dim {model.head_dim}); "
              + ("vLLM brings every page to the largest, a smaller one holding more tokens a block where it divides "
                 "it (the plugin's pages of each shape are published to divide one size), else padded"
                 if len(pool.buckets) > 1 else "each layer keeps pages of its own bytes in one KV-cache group"))
    if model.kv_shared_layers:
        print(f"{model.kv_shared_layers} more layers attend over those layers' caches (KV sharing): vLLM gives them "
              "no pages, and the plugin no side slots")
    if model.recurrent_layers:
        state = model.state
        print(f"{model.recurrent_layers} layers keep a recurrent state ({state.mixer}): {pool.state_bytes / 1024:,.1f} "
              f"KiB a request{' a GPU' if tp > 1 else ''} each in vLLM's layout (its SSM in "
              f"{str(engine.state_ssm_dtype(state)).removeprefix('torch.')}), padded to an attention page; "
              f"{pool.state_blocks} blocks a request in each of their groups"
              f"{' (prefix caching: align mode)' if engine.prefix_caching else ''}; vLLM grows the block to hold one")
    print(f"{args.batch} requests at once; vLLM's capacity for requests of {args.context:,} tokens (max_model_len)\n")
    print(f"{'scheme':14s} {'bits/el':>7s} {'block':>5s} {'page KiB':>9s} {'side MiB':>9s} "
          f"{'kv_cache_memory_bytes':>22s} {'KV tokens':>12s} {'concurrency':>11s} {'fits':>5s}")
    for r in rows:
        print(f"{r['scheme']:14s} {r['bits_per_element']:7.2f} {r['block_size']:5d} {r['page_bytes'] / 1024:9.1f} "
              f"{r['side_pool_bytes'] / 2**20:9.1f} {r['kv_cache_memory_bytes']:22,d} {r['kv_tokens']:12,d} "
              f"{r['max_concurrency']:10.2f}x {'yes' if r['fits'] else 'no':>5s}")
    print(f"\nauto, fp8: vLLM's own cache in the model dtype, in 8-bit floats (--kv-cache-dtype fp8: per-tensor "
          f"scales{'; on CPU it needs AVX-512 or AMX' if engine.device == 'cpu' else ''}); block: tokens a vLLM block "
          f"holds; page: one layer's block; side: the plugin's full-precision rows for {args.batch} requests at "
          "once, at most (outside vLLM's KV memory); fits: the concurrency and max_num_seqs hold the requests")
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        print(f"\nnone of these holds {args.batch} requests of {args.context:,} tokens at once")
        return
    # vLLM's own cache when it fits, else the rkv preset of the most bits that fits, else the listed scheme
    # of the most bits, else vLLM's fp8 (bits alone do not rank schemes of different layouts: per-token-4
    # keeps more bits than rkv-4 and loses more, and vLLM's fp8, 8 bits, more than rkv-3 on SmolLM2: the
    # report's 8-bit rows)
    ours = [r for r in fitting if r["scheme"] == "auto" or r["scheme"].startswith(OUR_PRESETS)]
    listed = [r for r in fitting if r["scheme"] not in VLLM_CACHES]
    best = max(ours or listed or fitting, key=lambda r: r["bits_per_element"])
    why = ("vLLM's own cache holds them" if best["scheme"] == "auto" else
           "the rkv preset of the most bits that fits" if ours else "the most bits that fit" if listed else
           "vLLM's own fp8 cache: nothing listed fits")
    path = model_path(args)
    where = f"; {MODEL_PLACEHOLDER}: {model.name}'s Hugging Face id or directory" if path == MODEL_PLACEHOLDER else ""
    print(f"\nserve {best['scheme']} ({why}{where}):\n  " + shell_command(best["serve"], path))


def print_contiguous(model: ModelShape, weight: float, weighed: str, budget: float, args, rows: list[dict]) -> None:
    if args.budget_gb is not None:
        print(f"{model.name}: {model.layers} layers x {model.kv_heads} KV heads x head_dim {model.head_dim}; "
              f"{budget / GB:.1f} GB for the KV cache (--budget-gb)")
    else:
        print(f"{model.name}: {model.layers} layers x {model.kv_heads} KV heads x head_dim {model.head_dim}, "
              f"{model.params / 1e9:.2f}B weights{f' ({model.params_how})' if model.params_how else ''} = "
              f"{weight / GB:.1f} GB ({weighed}); GPU {args.gpu_gb:.0f} GB, reserve "
              f"{args.reserve_gb:.0f} GB -> {budget / GB:.1f} GB for the KV cache")
        if budget <= 0:
            print("the weights and the reserve alone take more than the GPU, so no cache fits (--weight-bits: the "
                  "weights as they will be served)")
    if model.sliding_layers:
        print(f"{model.sliding_layers} of {model.layers} layers slide: each keeps only its newest "
              f"{model.sliding_window:,} tokens (a fixed-size cache); {model.full_layers} attend to the whole context")
    if model.global_shape:
        print(f"the {model.full_layers} global layers: {model.global_shape[0]} KV heads x head_dim "
              f"{model.global_shape[1]} (bits/el above at head_dim {model.head_dim})")
    if model.kv_shared_layers:
        print(f"{model.kv_shared_layers} more layers attend over those layers' caches (KV sharing) and keep none")
    if model.kv_free_layers:
        print(f"{model.kv_free_layers} more layers (a hybrid's) keep a recurrent state or no mixer, and no KV cache")
    if model.state:
        print(f"{model.recurrent_layers} layers keep a recurrent state of fixed size, in full precision: "
              f"{model.state_bytes() / 2**20:.1f} MiB a sequence (convolution windows in fp16, states in float32, "
              "as transformers keeps them), counted in every row")
    elif model.recurrent_layers:
        print(f"{model.recurrent_layers} layers keep a recurrent state of fixed size per sequence, not counted here "
              "(the shape of its state: from the transformers config class of a family torch_rkv.recurrent knows)")
    print(f"context {args.context:,} tokens x batch {args.batch}\n")
    print(f"{'scheme':14s} {'bits/el':>7s} {'KB/token':>9s} {'KV cache GB':>12s} {'fits':>5s} "
          f"{'longest ctx (b=1)':>18s} {'seqs @ ctx':>11s} {'paged':>6s}")
    for r in rows:
        longest = "unbounded" if r["longest_context_batch1"] is None else f"{r['longest_context_batch1']:,d}"
        print(f"{r['scheme']:14s} {r['bits_per_element']:7.2f} {r['bytes_per_token'] / 1024:9.1f} "
              f"{r['kv_bytes'] / GB:12.2f} {'yes' if r['fits'] else 'no':>5s} {longest:>18s} "
              f"{r['max_sequences_at_context']:11d} {r['paged_sequences_at_context']:6d}")
    print("\nseqs @ ctx: a contiguous cache of that batch; paged: PagedQuantizedKVCache, page rounding and each "
          "sequence's side slot (sinks and window) included")


def print_allocation(model: ModelShape, budget: float, args, profile: Sensitivity, allocation, engine,
                     split: bool, serving: dict | None = None) -> None:
    alloc, nbytes, weights = allocation
    print(f"\nper-layer allocation for {args.batch} x {args.context:,} tokens in {budget / GB:.2f} GB "
          f"(profile {args.sensitivity}: {profile.model} on {profile.text}, levels {profile.levels}):")
    print(f"  K/V bits by layer: {alloc.describe()}")
    where = "vLLM's KV pages and the side pool" if engine is not None else "the cache"
    print(f"  {alloc.average_bits(weights):.2f} code bits ({alloc.effective_bits(model.head_dim, weights):.2f} "
          f"with metadata) per element; {where}: {nbytes / GB:.2f} GB; predicted cost {alloc.predicted:.4f} "
          "nats/token (the profile's KL, summed)")
    if split:
        print(f"  every layer keeps {alloc.layer_totals()[0]} key + value bits: pages of one size"
              + ("" if args.split else " (vLLM pads the pages of sliding and full layers to one size, so "
                 "unequal totals would buy nothing there)"))
    if args.out:
        print(f"  written to {args.out}: serve it in vLLM with TORCH_RKV_ALLOCATION={args.out}")
    if serving is not None:
        print(f"  vLLM holds {serving['max_concurrency']:.2f} requests of {args.context:,} tokens; serve it"
              + ("" if args.out else f" (--out writes {ALLOCATION_PLACEHOLDER})") + ":\n  "
              + shell_command(serving["serve"], model_path(args)))
