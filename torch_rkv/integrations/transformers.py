"""Hugging Face transformers integration: a `Cache` backed by QuantizedKVCache, and the "rkv" attention.

    from torch_rkv.integrations.transformers import RKVCache
    cache = RKVCache(model, torch_rkv.scheme.recommended(4), capacity=4096)   # also enables "rkv" attention
    out = model.generate(ids, max_new_tokens=64, cache=cache)   # or past_key_values=cache

Prefill runs the model's ordinary (SDPA) attention on the fresh keys and values while they are written
into the quantized cache; every decode step (one new token) runs rkv::decode_attention on the quantized
cache, and every later chunk of several tokens (a second turn, chunked prefill, speculative
verification) rkv::paged_prefill_attention: the cache as stored, the chunk itself in full precision
(soft-capped models and those with learned attention sinks take that path for the prefill too: SDPA can
apply neither). Sliding-window layers keep a
ring of their window (QuantizedKVCache(sliding_window=)). Pre-RoPE storage needs no model change: keys
arrive post-RoPE, the cache undoes the rotation
with a table built from the model's own rotary module (so its RoPE scaling variant matches) and the
kernel re-applies it. The model families of integrations/models.py (Llama, Qwen2/3, Mistral, Phi-3,
GPT-NeoX, Phi-2, StableLM, GPT-J, Gemma 2, 3 and 4, Cohere 1 and 2, SmolLM3, EXAONE 4, Granite, OLMo 2 and 3,
GPT-OSS, ...: GQA, partial and interleaved rotary, sliding windows, soft-capping, learned attention sinks,
per-layer RoPE tables, layers without RoPE, layers of their own KV heads and head_dim, KV-shared layers
that attend over another layer's cache and keep none, hybrids whose recurrent layers keep their states in
transformers' own cache layers);
transformers 5.x (tested with 5.25). Not supported, each an error
on every device (a device-side check, no host sync per step): left-padded batches and position offsets;
also the model features models.py names and beam-search cropping. A RoPE whose table changes with the
length (dynamic NTK, LongRoPE): pre-RoPE caches re-rotate every key by the table of the current step,
as a fresh forward over the whole sequence would (RKVCache._follow_rope).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.cache_utils import (
        DYNAMIC_LAYER_TYPE_MAPPING,
        Cache,
        CacheLayerMixin,
        DummyLayer,
        LinearAttentionLayer,
        get_layer_types_and_kwargs,
    )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("torch_rkv.integrations.transformers needs `pip install transformers` (5.x)") from e

import transformers as _transformers

# The tested versions (pyproject's hf extra). Earlier 5.x releases run the cache interface differently:
# on 5.19 (what vLLM 0.32 pins) a chunked prefill through RKVCache gives a perplexity of 29.4 where
# 5.24 gives 19.95, with no error, so they are refused rather than silently wrong.
TESTED_TRANSFORMERS = ((5, 24), (6, 0))  # [low, high)
_version = tuple(int(x) for x in _transformers.__version__.split(".")[:2] if x.isdigit())
if not TESTED_TRANSFORMERS[0] <= _version < TESTED_TRANSFORMERS[1]:
    raise ImportError(f"torch_rkv.integrations.transformers is tested with transformers >= 5.24, < 6 (this is "
                      f"{_transformers.__version__}, whose cache interface it does not drive correctly); "
                      "pip install 'transformers>=5.24,<6'")

from ..cache import QuantizedKVCache
from ..layout import binding_window, max_tokens
from ..reference import softmax_with_sinks
from ..scheme import Scheme, per_layer
from . import models

ATTENTION = "rkv"


def rkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "rkv" attention: the fused kernels for a step the cache marked (a decode token, or a chunk
    after the prefill), SDPA otherwise (the prefill itself, on its fresh keys and values)."""
    layer = getattr(key, "_rkv_layer", None)
    sink_logits = kwargs.pop("s_aux", None)  # learned attention sinks (GPT-OSS), (Hq,)
    if layer is None and (kwargs.get("softcap") or sink_logits is not None):
        return _eager_attention(query, key, value, attention_mask, scaling, kwargs.get("softcap") or 0.0, sink_logits)
    m, n = query.shape[2], key.shape[2]
    if layer is None:
        if attention_mask is None and 1 < m < n:  # (SDPA's is_causal aligns the queries with the first keys; Gemma
            # 4's KV-shared layers keep the last logits_to_keep queries of a prompt, whose mask the mask function
            # left to is_causal): the queries are the last ones
            attention_mask = torch.ones(m, n, dtype=torch.bool, device=query.device).tril(n - m)[None, None]
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    idx = getattr(module, "layer_idx", layer.readers[0])  # (the model layer calling: the cache's own, or a sharer)
    if idx not in layer.awaiting or value is not layer.value:  # the fused kernels read the values the cache stored
        what = ("reads other values than it cached" if idx in layer.awaiting else "runs twice for one cache update"
                if idx in layer.readers else f"reads layer {layer.readers[0]}'s cache, which it does not share")
        raise ValueError(f"torch_rkv: layer {idx}'s attention {what} (a model that "
                         "transforms its values after the cache update, or attends twice over them, is not "
                         "supported: DiffLlama's differential attention)")
    window = layer.cache.sliding_window
    for name, want, got in (("sliding_window", layer.window, kwargs.get("sliding_window")),
                            ("softcap", layer.cache.softcap, kwargs.get("softcap"))):
        # (PhiMoE masks by its window without naming it: the mask check below holds that mask to the cache's)
        unnamed = name == "sliding_window" and layer.window_in_mask and name not in kwargs
        if (got or 0) != want and not unnamed:
            raise ValueError(f"torch_rkv: layer {getattr(module, 'layer_idx', '?')}'s attention asks for {name}={got}, "
                             f"but its cache was built for {want} (from the model's config)")
    if (sink_logits is not None) != layer.learned_sinks:
        raise ValueError(f"torch_rkv: layer {getattr(module, 'layer_idx', '?')}'s attention "
                         f"{'passes' if sink_logits is not None else 'does not pass'} learned attention sinks "
                         f"(s_aux), but its cache was built for a model {'with' if layer.learned_sinks else 'without'} "
                         "them")
    layer.awaiting.discard(idx)  # (after the checks: a refused call leaves the step to the hook, chunk and all)
    chunk, final = layer.chunk, not layer.awaiting  # the last reader of a chunk appends it
    if final:
        layer.chunk, layer.value = None, None
    if attention_mask is not None:  # checked on the mask's device: no host sync per step
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        width = allowed.shape[-1]  # cached + new tokens (the keys handed in are the new ones alone)
        kv = torch.arange(width, device=allowed.device)[None, :]
        last = width - m + torch.arange(m, device=allowed.device)[:, None]  # each query's position
        visible = (kv <= last) & ((kv > last - window) if window else True)
        torch._assert_async((allowed[..., -m:, :] == visible).all(), "torch_rkv: the fused attention attends "
                            "causally to every cached token (of its sliding window); padded batches (an attention "
                            "mask with masked positions) are not supported")
    if chunk is not None:  # several new tokens over the cache: rkv::paged_prefill_attention, then the append
        ks, vs = chunk
        pad = ks.shape[-2] - m  # (Gemma's KV-shared layers may keep only the chunk's last queries: logits_to_keep)
        q = torch.cat([query.new_zeros(*query.shape[:2], pad, query.shape[3]), query], 2) if pad else query
        out = layer.cache.attend_chunk(layer.index, q, ks, vs, scale=scaling, sink_logits=sink_logits)[:, :, pad:]
        if final:
            layer.cache.append_stored(layer.index, ks, vs)
        return out.transpose(1, 2).to(query.dtype), None
    out = layer.cache.attend(layer.index, query[:, :, 0], scale=scaling, sink_logits=sink_logits)  # (B, Hq, D)
    return out[:, None].to(query.dtype), None  # (B, 1, Hq, D)


def _eager_attention(query, key, value, attention_mask, scaling, softcap=0.0, sink_logits=None):
    """Attention that SDPA cannot run, for a forward without the cache: soft-capped scores (Gemma 2) and
    learned attention sinks (GPT-OSS: one more logit per query head, dropped after the softmax), as the
    families' own eager computations, (B, m, Hq, D)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ key.transpose(-1, -2) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:  # the mask function left a purely causal mask to SDPA's is_causal
        m, n = query.shape[-2], key.shape[-2]
        attention_mask = torch.ones(m, n, dtype=torch.bool, device=query.device).tril(n - m)
    mask = attention_mask[..., : key.shape[-2]]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    sinks = None if sink_logits is None else sink_logits.to(scores.dtype).float().reshape(1, -1, 1, 1)
    probs = softmax_with_sinks(scores.float(), sinks).to(query.dtype)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def enable(model) -> None:
    """Register the "rkv" attention (and its mask) with transformers and select it for `model`."""
    AttentionInterface.register(ATTENTION, rkv_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    models.check_attention_interface(model, ATTENTION)
    if not getattr(model, "_rkv_checks_steps", False):  # (once per model, whatever the caches built on it)
        model.register_forward_hook(_check_steps_ran, with_kwargs=True)
        model._rkv_checks_steps = True


def _check_steps_ran(model, args, kwargs, output) -> None:
    """After a forward over an RKVCache: every step it marked ran the fused attention. A model whose
    attention left it (switched back to SDPA, or attention code off transformers' attention interface)
    attended over the new tokens alone; the next update would catch it, but a last step has none, and its
    output is wrong, so it is refused here. The cache keeps the forward's tokens (a chunk no reader
    appended is appended), so that its layers stay at one length."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:  # (passed by position)
        names = _forward_parameters(model)
        cache = next((a for name, a in zip(names, args) if name in ("cache", "past_key_values")), None)
    if not isinstance(cache, RKVCache):
        return
    missed = [i for i, layer in enumerate(cache.layers) if getattr(layer, "pending", False)]
    if missed:
        for i in missed:
            layer = cache.layers[i]
            if layer.chunk is not None:
                layer.cache.append_stored(layer.index, *layer.chunk)
        cache.reset_steps()
        raise RuntimeError(f"torch_rkv: layers {missed} did not use the fused attention for the step the cache "
                           "marked (the model's attention is not the \"rkv\" one: enable it with "
                           "torch_rkv.integrations.transformers.enable(model), which RKVCache(model, ...) does; or "
                           "the model's attention code does not go through transformers' attention interface); "
                           "the cache holds this forward's tokens")


def _forward_parameters(model) -> list[str]:
    """The names of the model's forward parameters, in order (read once per model)."""
    if not hasattr(model, "_rkv_forward_parameters"):
        model._rkv_forward_parameters = list(inspect.signature(model.forward).parameters)
    return model._rkv_forward_parameters


class RKVLayer(CacheLayerMixin):
    """One decoder layer's view of the shared QuantizedKVCache."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: QuantizedKVCache, index: int, window: int = 0, learned_sinks: bool = False,
                 window_in_mask: bool = False, readers: Sequence[int] = (0,)):
        super().__init__()
        self.cache = cache
        self.index = index
        # the model layers that attend over this cache at every step: its own, then the KV-shared layers that
        # reuse it (Gemma 3n, Gemma 4), each once
        self.readers = tuple(readers)
        self.window = window  # the model's sliding window for this layer (the cache's, or one it never reaches)
        self.learned_sinks = learned_sinks  # the model has learned attention sinks, which SDPA cannot apply
        self.window_in_mask = window_in_mask  # the model masks by its window without passing it (PhiMoE)
        self.awaiting: set[int] = set()  # the readers a step still awaits (each runs the fused attention)
        self.chunk = None  # the keys / values of a chunk (storage form) its last reader appends after attending
        self.value = None  # the values update returned for the pending step: the attention must read these
        self.is_initialized = True

    @property
    def pending(self) -> bool:  # a step awaits the fused attention
        return bool(self.awaiting)

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are preallocated
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.pending:
            raise RuntimeError("torch_rkv: the last decode step did not use the fused attention; enable it with "
                               "torch_rkv.integrations.transformers.enable(model) (RKVCache(model, ...) does)")
        m = key_states.shape[-2]
        self._check_positions(kwargs, m)
        if m == 1:  # decode (a first token too): the attention reads the quantized cache, the key says where
            self.cache.append(self.index, key_states, value_states)
            key = key_states.view_as(key_states)
            key._rkv_layer = self
            self.awaiting, self.value = set(self.readers), value_states
            return key, value_states
        n_before = self.cache.seq_length(self.index)  # a host read per chunk of several tokens, never per step
        if n_before == 0 and self.cache.softcap == 0 and not self.learned_sinks:  # prefill: SDPA on the fresh keys and
            # values (SDPA cannot soft-cap nor add sinks: then the fused prefill runs over the empty cache, as for
            # a later chunk)
            self.cache.append(self.index, key_states, value_states)
            return key_states, value_states
        # a later chunk (a second turn, chunked prefill, speculative verification): the attention reads the
        # cache as stored and the chunk in full precision, then appends the chunk
        key = key_states.view_as(key_states)
        key._rkv_layer = self
        self.chunk = self.cache.to_storage(self.index, key_states, value_states)
        self.awaiting, self.value = set(self.readers), value_states
        return key, value_states

    def _check_positions(self, kwargs, m: int) -> None:
        """The kernel rotates cached keys to their slot; the model's positions must be those slots.
        Checked on the device of the positions, with no host sync, the same way on every device."""
        pos = kwargs.get("position_ids", kwargs.get("kwargs", {}).get("position_ids"))
        if pos is None:
            return
        lengths = self.cache.lengths[self.index]  # (B,) before this append
        want = lengths[:, None] + torch.arange(m, device=lengths.device)  # (B, m)
        torch._assert_async((pos.reshape(-1, pos.shape[-1]).to(want.device) == want).all(),
                            "torch_rkv: position_ids must equal the cache slots (no left padding or position "
                            "offsets)")

    def get_seq_length(self) -> int:
        return self.cache.seq_length(self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.cache.capacity

    def reset(self) -> None:
        self.forget_step()

    def forget_step(self) -> None:
        """Forget a step awaiting the fused attention (the cache keeps what it holds)."""
        self.awaiting = set()
        self.chunk = None
        self.value = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("torch_rkv: beam search is not supported by RKVCache")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("torch_rkv: RKVCache cannot be cropped")


class RKVHybridLayer(RKVLayer, LinearAttentionLayer):
    """A layer of attention beside a recurrent mixer (Falcon-H1's "hybrid" type): the attention's keys and
    values in RKVLayer's quantized cache, the mixer's conv and recurrent states as transformers'
    LinearAttentionLayer keeps them (its LinearAttentionAndFullAttentionLayer pairs them the same way)."""

    def __init__(self, *args, number_of_states: int = 1, **kwargs):
        RKVLayer.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if not args:  # (the mixer's states, by keyword; the attention's buffers are preallocated)
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:  # (the mixer's states; the quantized cache is RKVCache.reset's)
        RKVLayer.reset(self)
        LinearAttentionLayer.reset(self)


class OneTokenOverStateLayer(LinearAttentionLayer):
    """A recurrent layer of a family whose mixer scans several tokens over a cached state from a zero state
    (models.refuse_chunks_over_state: Jamba's): such a forward is refused by name before the layer's state
    changes; a prefill into an empty state and one token a step read it right."""

    def __init__(self, model_type: str, **kwargs):
        super().__init__(**kwargs)
        self.model_type = model_type

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        if self.has_previous_state[state_idx] and conv_states.shape[-1] > 1:
            what = f"a forward of {conv_states.shape[-1]} tokens over a cached recurrent state (chunked prefill, a " \
                   "second turn)"
            models.refuse_chunks_over_state(self.model_type, what)
        return super().update_conv_state(conv_states, state_idx, **kwargs)


class RKVCache(Cache):
    """A transformers Cache storing every layer's keys and values in torch_rkv's quantized format.

    model: a model of a supported family (integrations/models.py; its config gives layers, KV heads and
    head_dim, its rotary module the pre-RoPE table and pairing; a feature it cannot honour is an
    UnsupportedModelFeature naming it). scheme: one for every layer, or a list of one per layer (a
    per-layer bit allocation, torch_rkv.allocate). capacity: tokens per sequence. dtype: full-precision
    dtype of the sinks and window (default: the model's). Enables the "rkv" attention on the model.
    """

    def __init__(self, model, scheme: Scheme | Sequence[Scheme], capacity: int, batch: int = 1,
                 dtype: torch.dtype | None = None, device=None, enable_attention: bool = True):
        att = models.inspect(model)
        device = device if device is not None else next(model.parameters()).device
        dtype = dtype if dtype is not None else next(model.parameters()).dtype
        schemes = per_layer(scheme, att.layers, "RKVCache", f"a model of {att.layers} layers")
        for s, head_dim in set(zip(schemes, att.layer_head_dims)):
            s.check_head_dim(head_dim)
        # KV-shared layers store nothing; a hybrid's recurrent layers keep their state in transformers' own layers
        owners = [i for i in range(att.layers) if att.attends(i) and att.source(i) == i]
        for i in set(range(att.layers)) - set(owners):
            if schemes[i] != schemes[att.source(i)]:
                raise ValueError(f"RKVCache: layer {i} attends over layer {att.source(i)}'s keys and values (KV "
                                 f"sharing), so its scheme must be that layer's ({schemes[att.source(i)].name}), "
                                 f"not {schemes[i].name}")
        # one QuantizedKVCache per kind of layer: sliding-window layers keep a ring of their window (a window
        # as long as the capacity never binds), Gemma 3's local and global layers rotate by their tables,
        # layers of a per-layer allocation store their own bit widths, and Gemma 4's global layers their
        # own KV heads and head_dim
        kinds: dict[tuple, list[int]] = {}
        for i in owners:
            window = binding_window(att.windows[i], capacity)
            shape = (att.layer_kv_heads[i], att.layer_head_dims[i])
            kinds.setdefault((window, att.rope_types[i], schemes[i], shape), []).append(i)
        layers: list = [DummyLayer() for _ in range(att.layers)]  # (as transformers' own caches hold shared layers)
        # a hybrid's recurrent (and MLP-only) layers as transformers' DynamicCache builds them: their conv and
        # recurrent states are small and stay exact
        types, type_kwargs = get_layer_types_and_kwargs(models.text_config(model))
        for i in range(att.layers):
            if not att.attends(i):
                kind = DYNAMIC_LAYER_TYPE_MAPPING[types[i]]
                if kind is LinearAttentionLayer and att.model_type in models.CHUNKS_DROP_STATE:
                    layers[i] = OneTokenOverStateLayer(att.model_type, **type_kwargs[i])
                else:
                    layers[i] = kind(**type_kwargs[i])
        self.caches: list[QuantizedKVCache] = []
        tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # one per (table, length): kinds share them
        for (window, rope_type, scheme, (kv_heads, head_dim)), ids in kinds.items():
            rope = None
            if scheme.pre_rope:
                key = (rope_type, max_tokens(scheme, capacity))
                if key not in tables:
                    tables[key] = models.module_rope_tables(att, key[1], device, rope_type)
                rope = tables[key]
            cache = QuantizedKVCache(scheme, len(ids), batch, kv_heads, head_dim, capacity, dtype=dtype,
                                     device=device, rope=rope, rope_interleaved=att.interleaved,
                                     sliding_window=window, softcap=att.softcap, model_layers=ids)
            self.caches.append(cache)
            for j, i in enumerate(ids):
                # (attention beside a recurrent mixer in one layer: both states in one layer, Falcon-H1)
                kind, extra = (RKVHybridLayer, type_kwargs[i]) if types[i] == "hybrid" else (RKVLayer, {})
                layers[i] = kind(cache, j, att.windows[i], att.learned_sinks,
                                 att.model_type in models.WINDOW_IN_MASK_ONLY,
                                 readers=[r for r in range(att.layers) if att.source(r) == i], **extra)
        super().__init__(layers=layers)
        # a length-dependent RoPE (dynamic NTK, LongRoPE): the pre-RoPE caches follow the table the model's
        # rotary module chose for this forward (update)
        self._attention = att
        self._first = owners[0]
        self._follow = [(cache, rope_type) for cache, (_, rope_type, kind, _) in zip(self.caches, kinds)
                        if kind.pre_rope and att.length_dependent and rope_type != models.NO_ROPE]
        if enable_attention:
            enable(model)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == self._first and self._follow:  # (the model's first attention layer: a hybrid may begin
            # with recurrent layers, which never update)
            self._follow_rope()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _follow_rope(self) -> None:
        """Re-read the rotary module's table, as its forward for this step chose it (the model runs its
        rotary before the first layer), into every pre-RoPE cache's table, in place. The cache un-rotates
        this step's keys with it, and the kernels rotate every cached key and the queries by it: each step
        attends as a fresh forward over the whole sequence would, where a post-RoPE cache (transformers' own)
        keeps each key rotated by the table of its own step. Costs one table (capacity x rot_dim / 2) per
        forward, on the cache's device; no host sync."""
        fresh: dict = {}
        for cache, rope_type in self._follow:
            n = cache.rope_cos.shape[0]
            if (rope_type, n) not in fresh:
                fresh[rope_type, n] = models.module_rope_tables(self._attention, n, cache.rope_cos.device, rope_type,
                                                                check=False)
            cos, sin = fresh[rope_type, n]
            cache.rope_cos.copy_(cos)
            cache.rope_sin.copy_(sin)

    @property
    def scheme(self) -> Scheme:
        """The scheme of every layer (an error for a per-layer allocation: see `schemes`)."""
        if len({c.scheme for c in self.caches}) > 1:
            raise ValueError("RKVCache: the layers store different schemes; read RKVCache.schemes")
        return self.caches[0].scheme

    @property
    def schemes(self) -> list[Scheme]:
        """Each layer's scheme (None: a hybrid's layer that keeps no KV cache)."""
        att = self._attention
        return [self.layers[att.source(i)].cache.scheme if att.attends(i) else None for i in range(len(self.layers))]

    def nbytes(self) -> int:
        """Exact bytes of the quantized KV buffers (every kind of layer; a hybrid's recurrent states, in
        transformers' own layers, are not KV buffers)."""
        return sum(c.nbytes() for c in self.caches)

    def reset(self) -> None:
        for cache in self.caches:
            cache.reset()
        for layer in self.layers:  # (a hybrid's recurrent states too)
            layer.reset()

    def reset_steps(self) -> None:
        """Forget the steps awaiting the fused attention (the caches, and a hybrid's recurrent states, keep what
        they hold)."""
        for layer in self.layers:
            if isinstance(layer, RKVLayer):
                layer.forget_step()
