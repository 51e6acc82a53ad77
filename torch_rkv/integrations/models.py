"""What torch_rkv needs to know about a transformers model's attention, for every family it supports:
where the attention modules and the rotary table are, how RoPE pairs the channels (rotate-half or
GPT-J's interleaved pairs) and over how many (partial rotary), and which features of the model it cannot
honour yet, each refused by name (UnsupportedModelFeature) rather than served wrong.

Supported (tested on tiny random models of each: tests/test_families_*.py): Llama, Qwen2 / 2.5 (qkv bias,
use_sliding_window), Qwen3 (q/k RMSNorm before RoPE: the pre-RoPE keys are the normed ones), Mistral
(v0.1's sliding window too), Phi-3-style models (fused qkv, LongRoPE), Gemma 2
(sliding layers interleaved with global ones, attention-logit soft-capping, query_pre_attn_scalar) and
Gemma 3 (a local and a global RoPE table), GPT-NeoX / Pythia, Phi-2 and StableLM (partial rotary),
GPT-J (interleaved pairs), Cohere / Command R (interleaved pairs from a cos/sin table), GPT-OSS (learned
attention sinks, a table of each frequency once, sliding layers), the decoders of Qwen2-VL, Qwen2.5-VL and Qwen3-VL
(M-RoPE in the language model: the cache un-rotates and re-rotates each key by its slot's table, exact
whatever an image does to the positions), layers without
RoPE beside rotated ones (SmolLM3's no_rope_layers, Cohere 2's, EXAONE 4's and EXAONE MoE's global layers:
NO_ROPE; Beam's, Ergo's and Flint's global layers, whose rope parameters are None or that skip it);
Gemma 4 (global layers of their own head_dim and KV heads, each kind of layer its own cache, and a
partial "proportional" table; its decoder beside the vision encoder); models of absolute positions (GPT-2,
GPT-BigCode, OPT, ...: every layer NO_ROPE); RoPE whose table changes with the
sequence length (dynamic NTK, Phi-3's LongRoPE) in the cache (RKVCache re-reads the table every forward:
length_dependent), not in the report's simulations. Also run and tested: Granite, OLMo 2 and 3,
dots.llm1, CodeGen (GPT-J's pairs), Cohere 2 MoE, PhiMoE (its mask slides without the module naming the
window). Not supported, each refused by name: ALiBi (Falcon, BLOOM, MPT), encoder-decoder models,
bidirectional attention, chunked attention (Llama 4), other families' "hybrid" layers (Zamba 2, Zaya),
multi-head latent attention, values of another head_dim than the keys (MiMo-V2-Flash), DiffLlama's
differential attention, Doge's dynamic mask. KV cache sharing between layers (Gemma 3n, Gemma 4's small
models): a shared layer attends over the cache of the layer it reuses (kv_sources), which alone stores it.
Hybrid models (Qwen3-Next, Qwen3.5, OLMo Hybrid, Jamba, Granite 4, Nemotron-H, LFM2): their recurrent and
MLP-only layers (KV_FREE_LAYER_TYPES) keep no KV cache (modules[i] None), their attention layers do;
Falcon-H1's layers keep both (the "hybrid" type).
"""

from __future__ import annotations

import inspect as inspect_module
from dataclasses import dataclass

import torch
from torch import nn

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # rope_type prefixes whose table changes with the length
_INTERLEAVED = ("gptj", "codegen")  # pairs (2j, 2j + 1) from a fixed [sin | cos] table (embed_positions)
# pairs (2j, 2j + 1) from cos/sin with each frequency repeated
_INTERLEAVED_TABLES = ("cohere", "cohere2", "cohere2_moe", "ergo")
_HALF_TABLES = ("gpt_oss",)  # rotate-half pairs (j, j + D/2) from cos/sin holding each frequency once
# families that rotate inside their attention modules, by no rotary module at the model level (nor one named so)
_ROTARY_IN_ATTENTION = ("roformer",)
NO_ROPE = "no_rope"  # the rope type of a layer that rotates nothing (NoPE): its table is the identity
# layer types of a hybrid model that keep no KV cache: a recurrent state of fixed size (Mamba, gated DeltaNet,
# LFM2's short convolutions) in transformers' own cache layers, or no mixer at all (Nemotron-H's MLP layers)
# ("mamba": Granite 4's and Bamba's config.json name, which their config classes read as "linear_attention")
KV_FREE_LAYER_TYPES = ("linear_attention", "conv", "mamba", "mlp", "moe")
# layer types that keep a recurrent state: without a KV cache, or beside one (Falcon-H1's "hybrid")
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding")
# families whose "hybrid" layers are attention beside a recurrent mixer, each its own module (others that name the
# type, Zaya's attention with a convolution inside, Zamba 2's shared blocks, are refused)
_HYBRID_LAYERS = ("falcon_h1",)
# families whose recurrent mixer scans several tokens over a state it already holds from a zero state
# (transformers 5.25's Jamba: mamba_scan_forward, its TODO): a chunk after the first is silently wrong there
CHUNKS_DROP_STATE = ("jamba",)


class UnsupportedModelFeature(NotImplementedError):
    """A model feature torch_rkv does not implement; the message names it and the model type."""


@dataclass(frozen=True)
class ModelAttention:
    model_type: str
    layers: int
    layer_kv_heads: tuple[int, ...]  # every layer's KV heads and head_dim (Gemma 4's global layers differ)
    layer_head_dims: tuple[int, ...]
    rotary: nn.Module | None  # the model's rotary embedding module (None: no RoPE)
    interleaved: bool  # pairs (2j, 2j + 1) (GPT-J, Cohere); else rotate-half pairs (j, j + rot_dim / 2)
    # the attention module of every layer, in order; None for a layer that keeps no KV cache (KV_FREE_LAYER_TYPES:
    # a hybrid model's recurrent and MLP-only layers, which the cache leaves to transformers' own layers)
    modules: tuple[nn.Module | None, ...]
    windows: tuple[int, ...] = ()  # every layer's sliding window (0: it attends to the whole context)
    # every layer's rotary table: None (the model's one table), Gemma 3's layer type, or NO_ROPE (a layer
    # that applies none: pre-RoPE schemes store its keys as they are, rotated by the identity)
    rope_types: tuple = ()
    softcap: float = 0.0  # attention-logit soft-capping (Gemma 2; 0: none)
    length_dependent: bool = False  # the rotary module picks its frequencies by the sequence length
    learned_sinks: bool = False  # learned attention sinks (GPT-OSS: a logit per query head in every softmax)
    # the layer whose cache each layer attends over: itself, or, for a KV-shared layer (Gemma 3n, Gemma 4's
    # small models), the earlier layer of its type that stores the keys and values it reuses (empty: itself)
    kv_sources: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # every layer's type, as the config names it (full_attention: none given)

    def attends(self, layer: int) -> bool:
        """Whether `layer` is an attention layer (else a hybrid's recurrent or MLP-only layer: no KV cache)."""
        return self.modules[layer] is not None

    def source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over (itself unless it shares another's)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    @property
    def kv_heads(self) -> int:
        return self._uniform(self.layer_kv_heads, "KV heads")

    @property
    def head_dim(self) -> int:
        return self._uniform(self.layer_head_dims, "head_dim")

    def _uniform(self, values: tuple[int, ...], what: str) -> int:
        if len(set(values)) > 1:
            _refuse(self.model_type, f"one {what} for a model whose layers differ in it ({list(values)}): where "
                                     "layers differ, each kind of layer needs its own cache (RKVCache builds them)")
        return values[0]


def text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def identity_rope(positions: int, half: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of a layer without RoPE (NO_ROPE): cos 1, sin 0, which the kernels apply exactly."""
    return torch.ones(positions, half, device=device), torch.zeros(positions, half, device=device)


def uses_sliding_window(layer_types, sliding_window, use_sliding_window=True) -> bool:
    """Whether a config masks some layer to a window: a "sliding_attention" layer type, or a
    sliding_window that is switched on (Mistral and Phi-3 mask by it whatever layer_types says; Qwen2/3
    clear it unless use_sliding_window). The cache, the report and the planner all ask this."""
    return "sliding_attention" in (layer_types or []) or (sliding_window is not None and bool(use_sliding_window))


# families whose masks follow their config's layer_types alone (each module names its window by its layer's
# type): there a config window with no "sliding_attention" type masks nothing. (Mistral v0.1 and Phi-3
# mask every layer by the config's window.)
WINDOWS_BY_LAYER_TYPE = ("gemma2", "gemma3", "gemma3_text", "qwen2", "qwen3", "smollm3", "cohere2", "exaone4",
                         "exaone_moe", "dots1", "gpt_oss", "cohere2_moe", "flint", "mellum", "laguna", "olmo3",
                         "beam", "ergo", "gemma4", "gemma4_text")
# families whose mask slides while their attention module does not pass its window (the mask check holds the
# mask to the cache's window)
WINDOW_IN_MASK_ONLY = ("phimoe",)


def sliding_by_layer_type(model_type: str, layer_types) -> bool:
    """Whether a config's layer_types (None: not given) alone say which of its layers slide, for a config
    that uses_sliding_window (the cache, the report and the planner all ask this)."""
    return "sliding_attention" in (layer_types or []) or (bool(layer_types) and model_type in WINDOWS_BY_LAYER_TYPE)


def attention_modules(model) -> tuple[nn.Module, ...]:
    """Every layer's attention module (the one that calls the attention function), in layer order
    (inspect() checks there is exactly one per layer)."""
    decoder = getattr(getattr(model, "base_model", model), "language_model", None) or model  # (a vision-language
    # model's vision encoder has attention layers of its own)
    found = [m for m in decoder.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    return tuple(sorted(found, key=lambda m: -1 if m.layer_idx is None else m.layer_idx))


def applies_rope(model_type: str, module: nn.Module) -> bool:
    """Whether a layer rotates its queries and keys, as its transformers module decides it (vLLM decides
    some edge cases otherwise: vllm_rope.vllm_applies_rope). A family that skips RoPE in layers not
    listed here would still be served right (a pre-RoPE cache un-rotates and re-rotates by one table),
    but its keys would quantize in a basis that turns with the position, as post-RoPE keys do."""
    if hasattr(module, "use_rope"):  # SmolLM3 (config.no_rope_layers)
        return bool(module.use_rope)
    if model_type in ("cohere2", "cohere2_moe", "flint"):  # Command R7B / A: the sliding layers rotate, the
        # global ones are NoPE (but the MoE's dense prefix layers where its config forces RoPE)
        return module.sliding_window is not None or bool(getattr(module, "force_rope", False))
    if model_type in ("exaone4", "exaone_moe"):  # EXAONE 4 (and its MoE): likewise, in a config with a window
        return module.sliding_window is None or module.is_sliding
    return True


def learned_sinks(modules) -> bool:
    """Whether the attention modules hold learned attention sinks (GPT-OSS's `sinks` parameter, one logit
    per query head that joins every softmax with no value; its attention function receives them as s_aux)."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in modules)


def _refuse(model_type: str, feature: str) -> None:
    raise UnsupportedModelFeature(f"torch_rkv: {feature} is not supported yet ({model_type} model); "
                                  "see torch_rkv/integrations/models.py for the supported families")


def inspect(model) -> ModelAttention:
    """The model's attention as torch_rkv sees it; UnsupportedModelFeature for a feature it cannot honour."""
    cfg = text_config(model)
    kind = getattr(cfg, "model_type", type(model).__name__)
    if getattr(model.config, "is_encoder_decoder", False):
        _refuse(kind, "an encoder-decoder model (cross attention)")
    if (getattr(cfg, "alibi", False) or getattr(cfg, "position_embedding_type", None) == "alibi" or kind == "bloom"
            or getattr(getattr(cfg, "attn_config", None), "alibi", False)):  # (BLOOM always, MPT by its attn_config)
        _refuse(kind, "ALiBi position bias")
    if getattr(cfg, "attention_chunk_size", None) or "chunked_attention" in (getattr(cfg, "layer_types", None) or []):
        _refuse(kind, "chunked local attention (attention_chunk_size)")
    given = getattr(cfg, "layer_types", None)
    layer_types = list(given or ["full_attention"] * cfg.num_hidden_layers)
    # ("hybrid": attention beside a Mamba mixer in one layer, Falcon-H1; its cache layer keeps both)
    served = {"full_attention", "sliding_attention"} | ({"hybrid"} if kind in _HYBRID_LAYERS else set())
    other = sorted(set(layer_types) - served - set(KV_FREE_LAYER_TYPES))
    if other:  # (a sliding "hybrid_sliding"; GLM's indexed attention; DeepSeek-V4's compressed layers)
        _refuse(kind, f"layers of type {other} (attention whose cache is not one KV cache a layer)")
    if getattr(cfg, "kv_lora_rank", None):  # (keys of two parts, a RoPE part shared by the heads)
        _refuse(kind, "multi-head latent attention (kv_lora_rank: DeepSeek-V2/V3-style MLA)")
    if kind == "diffllama":  # (two softmaxes over one cache, each with half of the values)
        _refuse(kind, "differential attention (DiffLlama)")
    if kind == "doge":  # (its mask is computed from the values: the fused kernels attend causally)
        _refuse(kind, "dynamic mask attention (Doge's learned, input-dependent attention mask)")
    found = attention_modules(model)
    attending = [i for i, t in enumerate(layer_types) if t not in KV_FREE_LAYER_TYPES]
    if not attending:
        _refuse(kind, "a model without attention layers (a recurrent model keeps no KV cache)")
    if [getattr(m, "layer_idx", None) for m in found] != attending:
        _refuse(kind, "a model whose attention modules are not one self-attention per attention layer (none found, "
                      "cross-attention layers, or no layer_idx)")
    # every layer's module; None where the layer keeps no KV cache (a hybrid's recurrent or MLP-only layers)
    by_layer = {m.layer_idx: m for m in found}
    modules: tuple = tuple(by_layer.get(i) for i in range(len(layer_types)))
    if any(getattr(m, "is_causal", True) is False for m in modules):  # (EmbeddingGemma, Gemma 4's "all", a BERT
        # without is_decoder: the fused kernels attend causally)
        _refuse(kind, "bidirectional attention (attention modules with is_causal False)")
    shapes = [_layer_shape(cfg, i) for i in range(cfg.num_hidden_layers)]
    v_head_dim = getattr(cfg, "v_head_dim", None)
    if v_head_dim and v_head_dim != shapes[0][1]:  # (MiMo-V2-Flash: values of 128 beside keys of 192)
        _refuse(kind, f"values of another head_dim than the keys (v_head_dim {v_head_dim})")
    window = getattr(cfg, "sliding_window", None)
    if not uses_sliding_window(layer_types, window, getattr(cfg, "use_sliding_window", True)):
        windows = [0] * len(modules)
    elif sliding_by_layer_type(kind, given):  # Gemma 2 / 3, Qwen2 with use_sliding_window: the types say which
        windows = [window if t == "sliding_attention" else 0 for t in layer_types]
    else:  # Mistral v0.1, Phi-3: every layer masks by the config's window
        windows = [window] * len(modules)
    windows = [w if m is not None else 0 for m, w in zip(modules, windows)]
    for m, w in zip(modules, windows):  # where a module names its window, it must be the one the mask uses
        if hasattr(m, "sliding_window"):  # (EXAONE 4's global layers name the config's window, unused: is_sliding)
            named = (m.sliding_window or 0) if getattr(m, "is_sliding", True) else 0
            if named != w:
                _refuse(kind, f"layer {m.layer_idx}'s sliding window {m.sliding_window} that differs from its "
                              f"mask's {w}")
    rotary, rope_types, length_dependent = _rope_types(model, cfg, kind, modules, layer_types)
    sources = kv_sources(kind, modules, [(shapes[i], windows[i], rope_types[i]) for i in range(len(modules))])
    return ModelAttention(kind, cfg.num_hidden_layers, tuple(s[0] for s in shapes), tuple(s[1] for s in shapes), rotary,
                          interleaved=kind in _INTERLEAVED + _INTERLEAVED_TABLES,
                          modules=modules, windows=tuple(int(w) for w in windows), rope_types=tuple(rope_types),
                          softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
                          length_dependent=length_dependent,
                          learned_sinks=learned_sinks(modules), kv_sources=sources, layer_types=tuple(layer_types))


def _rope_types(model, cfg, kind: str, modules: tuple, layer_types: list[str]) -> tuple[object, list, bool]:
    """(the model's rotary embedding, None where it keeps none; each layer's rope type, NO_ROPE where its keys
    are not rotated; whether the rotary table depends on the context length), for inspect: `modules` are the
    layers' attention modules (None where a layer keeps no KV cache), `layer_types` their types."""
    base = getattr(model, "base_model", model)
    # (a vision-language model keeps its decoder's, M-RoPE in Qwen2/2.5/3-VL, in its language model)
    rotary = getattr(base, "rotary_emb", None) or getattr(getattr(base, "language_model", None), "rotary_emb", None)
    rope_types = [None] * len(modules)
    length_dependent = False
    if rotary is None and kind not in _ROTARY_IN_ATTENTION and not any(
            "rotary" in type(m).__name__.lower() for m in model.modules()):
        # absolute positions (GPT-2, GPT-BigCode, OPT, XGLM, BioGPT, ...): no layer rotates, so pre-RoPE schemes
        # store each key as it is (the identity table), per channel
        rope_types = [NO_ROPE] * len(modules)
    if rotary is not None:
        tables = getattr(rotary, "layer_types", None) or []
        kinds = getattr(rotary, "rope_type", None) or (getattr(cfg, "rope_parameters", None) or {}).get(
            "rope_type", "default")
        length_dependent = any(str(t).startswith(LENGTH_DEPENDENT_ROPE)
                               for t in (kinds.values() if isinstance(kinds, dict) else [kinds]))
        if tables:  # Gemma 3, OLMo 3: a table per layer type, as the model's forward picks them (its forward
            # takes the type, even where every layer is of one); a type without rope parameters is NoPE (Beam)
            rope_types = [t if not isinstance(kinds, dict) or t in kinds else NO_ROPE for t in layer_types]
        if hasattr(rotary, "embed_positions") != (kind in _INTERLEAVED):
            _refuse(kind, f"the rotary table of {type(rotary).__name__}")
        rope_types = [t if m is None or applies_rope(kind, m) else NO_ROPE for m, t in zip(modules, rope_types)]
    rope_types = [t if m is not None else NO_ROPE for m, t in zip(modules, rope_types)]  # (no keys to rotate)
    return rotary, rope_types, length_dependent


def check_attention_interface(model, implementation: str) -> None:
    """After model.set_attn_implementation(implementation): refuse a model that kept its own attention code,
    off transformers' attention interface (XGLM, BigBird, RoFormer, ...: transformers only warns, and their
    attention would never run the fused kernels)."""
    cfg = text_config(model)
    if getattr(cfg, "_attn_implementation", None) != implementation:
        _refuse(getattr(cfg, "model_type", type(model).__name__),
                "attention code off transformers' attention interface (the model kept its "
                f"{getattr(cfg, '_attn_implementation', None)!r} attention)")


def refuse_cacheless_layers(att: ModelAttention, what: str) -> None:
    """Refuse `what`, a per-layer computation that takes every layer for a cache of its own, for a model
    some of whose layers keep none: layers that share KV caches, or a hybrid's (or whose layers keep a
    recurrent state beside their cache: untested there)."""
    if any(att.source(i) != i for i in range(att.layers)):
        _refuse(att.model_type, f"{what} for a model whose layers share KV caches (Gemma 3n, Gemma 4's small models: "
                                "a uniform scheme serves it)")
    refuse_recurrent_layers(att, f"{what} (a uniform scheme serves it)")


def refuse_chunks_over_state(model_type: str, what: str) -> None:
    """Refuse `what`, a forward of several tokens over a cached recurrent state, for a family whose mixer
    then scans from a zero state (CHUNKS_DROP_STATE); one token a step (decoding) reads the state."""
    if model_type in CHUNKS_DROP_STATE:
        _refuse(model_type, f"{what}: its Mamba layers scan several tokens over a cached state from a zero state "
                            "(transformers' mamba_scan_forward), so only the first forward over the cache may take "
                            "several tokens")


def refuse_recurrent_layers(att: ModelAttention, what: str) -> None:
    """Refuse `what` for a hybrid model (some layers keep a recurrent state, beside a KV cache or not, or
    no mixer)."""
    types = att.layer_types or ("full_attention",) * att.layers
    recurrent = [i for i in range(att.layers) if not att.attends(i) or types[i] in RECURRENT_LAYER_TYPES]
    if recurrent:
        _refuse(att.model_type, f"{what} for a hybrid model whose layers {recurrent} keep a recurrent state or no "
                                "mixer")


def kv_sources(kind: str, modules, layouts) -> tuple[int, ...]:
    """Each layer's cache source (ModelAttention.kv_sources). A KV-shared layer (is_kv_shared_layer: Gemma 3n,
    Gemma 4) attends over the keys and values its model keeps by layer type from the layer of that type that
    stores them (store_full_length_kv), as transformers' shared_kv_states does; it must read them as that
    layer's cache holds them (shape, window, table). layouts: each layer's (shape, window, rope type)."""
    stores: dict = {}
    sources = []
    for i, m in enumerate(modules):
        if getattr(m, "store_full_length_kv", False):
            if getattr(m, "layer_type", None) in stores:
                _refuse(kind, f"two layers storing shared keys and values of type {m.layer_type}")
            stores[getattr(m, "layer_type", None)] = i
        if not getattr(m, "is_kv_shared_layer", False):
            sources.append(i)
            continue
        source = stores.get(getattr(m, "layer_type", None))
        if source is None:
            _refuse(kind, f"KV-shared layer {i} of type {getattr(m, 'layer_type', None)} without an earlier layer "
                          "that stores that type's keys and values")
        if layouts[i] != layouts[source]:
            _refuse(kind, f"KV-shared layer {i} that reads layer {source}'s keys and values with another "
                          f"(shape, window, RoPE table): {layouts[i]} against {layouts[source]}")
        sources.append(source)
    return tuple(sources)


def _layer_shape(cfg, layer: int) -> tuple[int, int]:
    """(KV heads, head_dim) of one layer: the config's, or the layer's own where the config gives them per
    layer (Gemma 4's global layers: a wider head_dim, fewer KV heads)."""
    per_layer = getattr(cfg, "per_layer_config", None)
    c = per_layer[layer] if per_layer is not None else cfg
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return kv_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def rope_tables(model, positions: int, device=None, rope_type=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape (positions, rot_dim / 2), float32, from the model's own rotary module (its
    scaling variant and attention scaling included) for the pairing inspect() reports; rope_type: the
    table of one layer type (Gemma 3; inspect().rope_types says each layer's). A length-dependent table
    (dynamic NTK, LongRoPE) is the one the module holds now, as its last forward chose it."""
    return module_rope_tables(inspect(model), positions, device, rope_type)


def module_rope_tables(att: ModelAttention, positions: int, device=None, rope_type=None, check: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_tables for a model already inspected. check=False skips the pairing checks, which read the
    table on the host (RKVCache re-reads a length-dependent table every forward, checked when built)."""
    if rope_type is None:
        kinds = set(att.rope_types) - {NO_ROPE}
        if len(kinds) > 1:
            _refuse(att.model_type, "one RoPE table for a model with a table per layer type (pass rope_type)")
        # (one type: the table every rotated layer uses; none where no layer rotates: the identity)
        rope_type = next(iter(kinds), NO_ROPE if NO_ROPE in att.rope_types else None)
    # the head_dim of the layers this table rotates (Gemma 4's global and sliding layers differ)
    head_dim = att._uniform(tuple(d for d, t in zip(att.layer_head_dims, att.rope_types) if t == rope_type)
                            or att.layer_head_dims, "head_dim")
    if rope_type == NO_ROPE:
        return identity_rope(positions, head_dim // 2, device)
    rotary = att.rotary
    if rotary is None:  # (RoFormer, Moshi: their rotary is inside the attention, where the cache cannot read it)
        _refuse(att.model_type, "a pre-RoPE scheme on a model whose rotary table is not a model-level module")
    if hasattr(rotary, "embed_positions"):  # GPT-J: a fixed [sin | cos] table of rot_dim / 2 frequencies each
        table = rotary.embed_positions.float()
        if positions > table.shape[0]:
            raise ValueError(f"torch_rkv: {positions} positions exceed the model's table of {table.shape[0]}")
        half = table.shape[-1] // 2
        if 2 * half > head_dim:
            _refuse(att.model_type, f"a rotary table of {2 * half} channels for head_dim {head_dim}")
        return table[:positions, half:].contiguous().to(device), table[:positions, :half].contiguous().to(device)
    dev = next((b.device for b in rotary.buffers()), torch.device("cpu"))
    x = torch.zeros(1, dtype=torch.float32, device=dev)
    # the forward without transformers' dynamic_rope_update: the frequencies as they are, not re-chosen for
    # `positions` tokens (which would also change what the model's next forward rotates by)
    forward = inspect_module.unwrap(type(rotary).forward)
    with torch.no_grad():
        pos = torch.arange(positions, device=dev)[None]
        out = forward(rotary, x, pos) if rope_type is None else forward(rotary, x, pos, rope_type)
    if not (isinstance(out, tuple) and len(out) == 2):  # (Llama 4's complex freqs_cis, ...)
        _refuse(att.model_type, f"a rotary module that does not return (cos, sin) ({type(rotary).__name__})")
    cos, sin = out[0][0].float(), out[1][0].float()
    if att.model_type in _HALF_TABLES:  # GPT-OSS: the table is the pairs' already, over the whole head
        if 2 * cos.shape[-1] != head_dim:
            _refuse(att.model_type, f"a rotary table of {2 * cos.shape[-1]} channels for head_dim {head_dim}")
        return cos.contiguous().to(device), sin.contiguous().to(device)
    half = cos.shape[-1] // 2
    if att.interleaved:  # Cohere: pair j's frequency at channels 2j and 2j + 1
        first, second, what = slice(0, None, 2), slice(1, None, 2), "a rotary table whose pairs differ"
    else:  # rotate-half: pair j's frequency at channels j and j + half
        first, second, what = slice(0, half), slice(half, None), "a rotary table whose halves differ"
    if check and not (torch.equal(cos[:, first], cos[:, second]) and torch.equal(sin[:, first], sin[:, second])):
        _refuse(att.model_type, f"{what} (not {'interleaved' if att.interleaved else 'rotate-half'} pairs)")
    if 2 * half > head_dim:
        _refuse(att.model_type, f"a rotary table of {2 * half} channels for head_dim {head_dim}")
    return cos[:, first].contiguous().to(device), sin[:, first].contiguous().to(device)


def layer_rope_tables(model, positions: int, device=None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (cos, sin) (rope_tables of its rope type; layers of one type share the tensors), one
    fixed table for the report's simulations: a length-dependent RoPE is refused by name (one forward's
    table would not be the next one's)."""
    att = inspect(model)
    if att.length_dependent:
        _refuse(att.model_type, "a RoPE whose table changes with the sequence length (dynamic NTK, LongRoPE) in "
                                "the report's simulations (RKVCache and the vLLM plugin serve it)")
    tables = {t: module_rope_tables(att, positions, device, rope_type=t) for t in set(att.rope_types)}
    return {i: tables[t] for i, t in enumerate(att.rope_types)}
