"""Reading a transformers config.json into a ModelShape (from_config): which layers slide, which keep a KV
cache (a hybrid's recurrent and MLP-only layers keep none), each kind's KV heads and head_dim, and the
number of weights. Shapes the planner cannot count (multi-head latent attention, layers of one kind with
different shapes, layer types it does not model) are refused by name."""

from __future__ import annotations

import json

from ..integrations.models import KV_FREE_LAYER_TYPES, RECURRENT_LAYER_TYPES, sliding_by_layer_type, uses_sliding_window
from ..recurrent import reads as recurrent_state_reads
from ..recurrent import state_of
from ..weights import built_config, estimate_params, params_of, special_floats
from .shape import ModelShape


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
    whole, cfg, built, error = _read(path)
    heads = cfg["num_attention_heads"]
    kv = _kv_heads(cfg, heads)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    layers = cfg["num_hidden_layers"]
    gemma4 = str(cfg.get("model_type", "")).startswith("gemma4")  # (its global layers' shape: read below)
    _one_cache_shape(path, cfg, kv, head_dim, gemma4)
    flags = sliding_layers_of(cfg)
    shared = _kv_shared_layers(path, cfg, layers)
    shapes, per_layer = _layer_shapes(cfg, layers, kv, head_dim, flags, gemma4)
    # a hybrid's recurrent and MLP-only layers keep no KV cache
    types = layer_types_of(cfg, built, error)
    keep = _cache_layers(path, types, layers - shared)
    recurrent = sum(t in RECURRENT_LAYER_TYPES for t in types)
    overridden = sorted({k for o in per_layer.values() for k in o if recurrent_state_reads(k)})
    if recurrent and overridden:
        raise ValueError(f"plan: {path} overrides {overridden} per layer (per_layer_config); the planner counts one "
                         "recurrent state shape for every recurrent layer")
    shapes, flags = [shapes[i] for i in keep], [flags[i] for i in keep]
    sliding = sum(flags)
    kv, head_dim, global_shape = _kind_shapes(path, shapes, flags)
    params, how = _params(path, params, whole, cfg, (kv, head_dim), recurrent)
    return ModelShape(cfg.get("_name_or_path") or path, len(keep), kv, head_dim, float(params), sliding,
                      cfg.get("sliding_window") if sliding else None, tuple(flags), global_shape, shared,
                      layers - shared - len(keep), recurrent,
                      state_of(built) if recurrent and built is not None else None, how,
                      str(cfg.get("model_type") or ""))


def _read(path: str) -> tuple[dict, dict, object, Exception | None]:
    """(the whole config, its text part with GPT-2-style names read as the planner's, that part's transformers
    config or None, and why there is none)."""
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
    return whole, cfg, built, error


def _kv_heads(cfg: dict, heads: int) -> int:
    """The config's KV heads, of `heads` attention heads."""
    # multi-query attention as a flag (GPT-BigCode; Falcon, by default, unless new_decoder_architecture: then its
    # num_kv_heads), as transformers' configs derive num_key_value_heads
    multi_query = cfg.get("multi_query", cfg.get("model_type") == "falcon") and not cfg.get("new_decoder_architecture")
    return cfg.get("num_key_value_heads") or (1 if multi_query else cfg.get("num_kv_heads") or heads)


def _one_cache_shape(path: str, cfg: dict, kv: int, head_dim: int, gemma4: bool) -> None:
    """Refuse a config whose caches are not one of KV heads x head_dim per layer: multi-head latent attention,
    values of another head_dim, or (but in Gemma 4, whose global layers are read by _layer_shapes) global
    layers of another shape."""
    if cfg.get("kv_lora_rank"):
        raise ValueError(f"plan: {path} has multi-head latent attention (kv_lora_rank {cfg['kv_lora_rank']}); the "
                         "planner counts one cache of KV heads x head_dim per layer")
    same = {"v_head_dim": head_dim, **({} if gemma4 else {"global_head_dim": head_dim,
                                                           "num_global_key_value_heads": kv})}
    for key, want in same.items():  # (MiMo-V2's values; global layers of their own shape in another family)
        if cfg.get(key) and cfg[key] != want:
            raise ValueError(f"plan: {path} gives some layers' or the values' caches another shape ({key} "
                             f"{cfg[key]}); the planner counts one cache of KV heads x head_dim per layer")


def _kv_shared_layers(path: str, cfg: dict, layers: int) -> int:
    """The layers that keep no cache of their own: KV sharing (Gemma 3n, Gemma 4's small models), where the
    last num_kv_shared_layers layers reuse the caches of earlier ones (of their type)."""
    shared = cfg.get("num_kv_shared_layers") or 0
    if not 0 <= shared < layers:
        raise ValueError(f"plan: {path} has num_kv_shared_layers {shared} of {layers} layers; some layer must keep "
                         "the cache the others share")
    return shared


def _layer_shapes(cfg: dict, layers: int, kv: int, head_dim: int, flags: list[bool], gemma4: bool
                  ) -> tuple[list[tuple[int, int]], dict[int, dict]]:
    """(each layer's (KV heads, head_dim), the per-layer overrides they came from): the config's, the
    overrides of a saved per_layer_config, or Gemma 4's global layers as Gemma4TextConfig builds them (their
    head_dim; their KV heads where keys are also values)."""
    shapes = [(kv, head_dim)] * layers
    per_layer = {int(i): o for i, o in (cfg.get("per_layer_config") or {}).items()}
    if gemma4 and not per_layer:
        glob = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):  # (False by default)
            glob["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        per_layer = {i: glob for i, f in enumerate(flags) if not f}
    for i, o in per_layer.items():
        shapes[i] = (o.get("num_key_value_heads", kv), o.get("head_dim", head_dim))
    return shapes, per_layer


def _cache_layers(path: str, types: list[str], layers: int) -> list[int]:
    """The first `layers` layers' indices that keep a KV cache; refuses layer types the planner does not
    model, and a model none of whose layers keeps a cache."""
    unmodelled = sorted(set(types) - set(PLANNED_LAYER_TYPES))
    if unmodelled:
        raise ValueError(f"plan: {path} has layers of type {unmodelled}, whose caches the planner does not model (it "
                         f"counts {', '.join(PLANNED_LAYER_TYPES)}); counted as full attention, their bytes would be "
                         "wrong")
    keep = [i for i, t in enumerate(types[:layers]) if t not in KV_FREE_LAYER_TYPES]
    if not keep:
        raise ValueError(f"plan: {path} has no attention layer (a recurrent model keeps no KV cache)")
    return keep


def _kind_shapes(path: str, shapes: list[tuple[int, int]], flags: list[bool]
                 ) -> tuple[int, int, tuple[int, int] | None]:
    """(KV heads, head_dim, global_shape) of the layers that keep a cache (`shapes`, `flags`: which slide):
    one shape for the sliding layers and one for the others, the latter the global_shape where it differs
    (ModelShape). There is always some layer, so one kind has a shape."""
    kinds = {f: {sh for sh, g in zip(shapes, flags) if g == f} for f in (True, False)}
    if any(len(k) > 1 for k in kinds.values()):
        raise ValueError(f"plan: {path} gives layers of one kind (sliding or not) different shapes {sorted(shapes)}; "
                         "the planner counts one shape for the sliding layers and one for the others")
    if sum(flags) and kinds[False] and kinds[False] != kinds[True]:
        return (*next(iter(kinds[True])), next(iter(kinds[False])))
    return (*next(iter(kinds[False] or kinds[True])), None)


def _params(path: str, params: float | None, whole: dict, cfg: dict, shape: tuple[int, int], recurrent: int
            ) -> tuple[float, str]:
    """(the number of weights, where it came from): --params, else counted by transformers, else estimated from
    the config (`shape`: the KV heads and head_dim read)."""
    if params is not None:
        return params, "--params"
    try:
        return params_of(whole), "counted by transformers"
    except Exception as e:  # (no transformers, or a config it cannot build)
        return estimate_params(path, cfg, whole, shape, recurrent, e), "estimated: embeddings, attention, MLP"
