"""torch_rkv's paged quantized KV cache as a vLLM attention backend: the classes the plugin
(integrations/vllm.py) registers, imported by vLLM when it selects the backend (docs/serving.md).

Here: the backend class and the attention layer (RKVAttentionImpl). Beside it: the metadata builder
(vllm_builder.py), the layers' schemes (vllm_layers.py), the rotary tables (vllm_rope.py), the side
slots (vllm_slots.py, vllm_side.py, vllm_connector.py) and the page bytes (vllm_pool.py)."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionType,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..layout import PageLayout, side_shapes
from ..ops.paged import paged_append, paged_decode_attention, paged_prefill_attention
from ..ops.structs import CacheFormat, CacheSide
from ..rotations import Rotations, scheme_rotations
from ..scheme import Scheme
from .models import identity_rope
from .vllm import (
    ALLOCATION_ENV,
    TESTED_VLLM,
    configured_layers,
    overridden_backend,
    text_config,
)
from .vllm_builder import RKVMetadata, RKVMetadataBuilder, speculative_tokens
from .vllm_layers import codebook_rows, layer_scheme, refined_channels, served_scheme
from .vllm_pool import block_multiple, content_bytes, published_token_bytes
from .vllm_refusals import unsupported_features
from .vllm_rope import model_rope_tables
from .vllm_side import SideWork, run_side_work
from .vllm_slots import INITIAL_SLOTS

logger = logging.getLogger("vllm.torch_rkv")  # under vLLM's logger: printed with its log


class RKVAttentionBackend(AttentionBackend):
    """torch_rkv's paged quantized KV cache as a vLLM attention backend (decoder self-attention)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True  # the attention must read the cache before the append
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return overridden_backend()

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(block_multiple(served_scheme()))]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # the scheme decides (checked when a layer is built)

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)  # a page is [1 head slot, block tokens, content bytes], contiguous

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # the paged ops take sliding_window; vLLM frees the pages before the window

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # learned attention sinks (GPT-OSS): the paged attention ops take them

    scheme: ClassVar[Scheme | None] = None  # the layer's, on layer_backend's classes (an allocation's rows)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if spec.state_content_bytes is not None:
            return spec
        scheme = cls.scheme
        if scheme is None:
            if configured_layers() is not None:  # (vLLM asks after loading the model, which binds every layer)
                raise RuntimeError(f"torch_rkv's vLLM backend: {ALLOCATION_ENV} is set but vLLM asked for a layer's "
                                   "KV cache spec before the layer was bound to its scheme (process_weights_after_"
                                   "loading); this vLLM calls its hooks in another order than vLLM "
                                   f"{', '.join(TESTED_VLLM)}")
            scheme = served_scheme()
        per_token = content_bytes(scheme, spec.num_kv_heads, spec.head_size, spec.dtype)
        if cls.scheme is None:  # (pages of several shapes that divide one size: _publish_pages)
            per_token = _published(spec) or per_token
        return replace(spec, num_head_slots=1, state_content_bytes=per_token)

    @staticmethod
    def get_impl_cls():
        return RKVAttentionImpl

    @staticmethod
    def get_builder_cls():
        return RKVMetadataBuilder


_LAYER_BACKENDS: dict[Scheme, type[RKVAttentionBackend]] = {}


def layer_backend(scheme: Scheme) -> type[RKVAttentionBackend]:
    """The backend class of the layers that keep `scheme` (an allocation's row), whose customize_spec
    publishes that scheme's page. vLLM's customize_spec hook sees the spec but not the layer, and it
    asks the layer's own backend class (Attention.attn_backend), so a layer gets its page bytes from
    its class: one KV cache group of pages of unequal bytes (UniformTypeKVCacheSpecs), and one
    metadata builder per distinct scheme (vLLM groups layers by backend class and spec). vLLM finds a
    backend class again by module and qualified name, and an allocation's schemes are known only when the
    engine starts, so each class is made here and set as this module's attribute of its name."""
    if scheme not in _LAYER_BACKENDS:
        name = "RKVAttentionBackend_" + "".join(c if c.isalnum() else "_" for c in scheme.name)
        cls = type(name, (RKVAttentionBackend,), {"scheme": scheme, "__module__": __name__, "__qualname__": name})
        _LAYER_BACKENDS[scheme] = globals()[name] = cls
    return _LAYER_BACKENDS[scheme]


# the bytes a token the pages of each (KV heads, head_dim, dtype) publish, where they are not their own:
# _publish_pages, for the engine whose config "config" refers to (weakly: a config holds its engine's layers
# and their KV tensors; a new engine's layers clear another's entry as they are built)
_PUBLISHED: dict = {"config": None, "bytes": {}}


def _publisher():
    """The live engine config whose pages _PUBLISHED holds (None: none, or its engine is gone)."""
    config = _PUBLISHED["config"]
    return config() if config is not None else None


def _published(spec) -> int | None:
    """The bytes a token _publish_pages chose for pages of this spec's shape, while its engine lives."""
    if _publisher() is None:
        return None
    return _PUBLISHED["bytes"].get((spec.num_kv_heads, spec.head_size, spec.dtype))


def _publish_pages(vllm_config, dtype: torch.dtype) -> None:
    """Where one scheme's layers of two shapes (Gemma 4's sliding and global layers) attend to different windows,
    vLLM pads the smaller pages to the largest unless they divide it; choose pages that do
    (vllm_pool.published_token_bytes, which plan --vllm counts), once per engine, before vLLM asks for the
    specs (customize_spec; a hybrid's block alignment asks before the model is built, but a hybrid's layers
    keep one shape, whose pages are their own)."""
    if _publisher() is vllm_config:
        return
    impls = [getattr(x, "impl", None) for x in vllm_config.compilation_config.static_forward_context.values()]
    owners = [i for i in impls if isinstance(i, RKVAttentionImpl) and i.kv_source is None]
    natural, count = {}, {}
    for impl in owners:
        kind = (impl.num_kv_heads, impl.head_size, dtype)
        natural[kind] = content_bytes(impl.scheme, impl.num_kv_heads, impl.head_size, dtype)
        count[kind] = count.get(kind, 0) + 1
    grouped = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and \
        len({impl.sliding_window for impl in owners}) > 1  # (else vLLM keeps each page as it is)
    published = {}
    if configured_layers() is None and grouped and len(natural) > 1:
        published = published_token_bytes(natural, count, dtype.itemsize)
        for (heads, head_dim, _), per_token in published.items():
            if per_token != natural[(heads, head_dim, dtype)]:
                logger.info("torch_rkv: layers of %d KV heads x head_dim %d publish pages of %d bytes a token (%d "
                            "their own), so that vLLM's pages of every shape divide one size and none is padded to it",
                            heads, head_dim, per_token, natural[(heads, head_dim, dtype)])
    _PUBLISHED.update(config=weakref.ref(vllm_config), bytes=published)


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------


class RKVAttentionImpl(AttentionImpl[RKVMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **unsupported) -> None:
        from vllm.config import get_current_vllm_config

        self.scheme = served_scheme()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        # a KV-shared layer (Gemma 3n, Gemma 4's small models) attends over its target layer's cache and keeps none
        self.kv_source = kv_sharing_target_layer_name
        self._source_impl: RKVAttentionImpl | None = None  # (its impl, on the first forward: _source)
        config = get_current_vllm_config()
        if (live := _publisher()) is not None and live is not config:
            _PUBLISHED.update(config=None, bytes={})  # (another engine's pages)
        refused = unsupported_features(config, alibi=alibi_slopes is not None, kv_shared=self.kv_source is not None,
                                       kv_cache_dtype=kv_cache_dtype, attn_type=attn_type, unknown=tuple(unsupported))
        if refused:
            raise NotImplementedError(f"torch_rkv's vLLM backend: {refused[0]} is not supported")
        self.scheme.check_head_dim(head_size)
        self.sliding_window = int(sliding_window or 0)  # each query sees the newest sliding_window keys
        self.softcap = float(logits_soft_cap or 0.0)  # Gemma 2's attention-logit soft-capping
        self.sink_logits = sinks  # GPT-OSS's learned attention sinks (Hq,): the model's parameter, loaded later
        self.vllm_config = config
        self.rope_cos = self.rope_sin = None
        self.rope_interleaved = False
        if self.scheme.pre_rope:
            # (Gemma 3 keys its RoPE parameters by layer type, and its sliding layers are the local ones)
            layer_type = "sliding_attention" if self.sliding_window else "full_attention"
            self.rope_cos, self.rope_sin, self.rope_interleaved = model_rope_tables(config, head_size, layer_type)
        self.drafts = speculative_tokens(config.speculative_config, self.scheme)  # (the side ring's extra rows)
        self._tensors = None  # (side pool, rotations), made by the profiling run or the first prepare
        self.state: LayerState | None = None  # what the forward reads, gathered by prepare
        self._views = None  # (key, page region views) of the cache tensor (regions)
        self.levels = None  # (k_levels, v_levels) of this layer, read on the first forward (it names the layer)
        self.channels = None  # its refined key channels (kv_heads, m), or None; read with the levels
        self.readers: tuple[str, ...] | None = None  # the KV-shared layers reading this layer's cache (_bind)
        self.step: _Step | None = None  # this step's cache, for its readers
        # (self.scheme is the shared one until then: side rows, signs and RoPE are the same in every layer)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """vLLM calls this once the model is loaded, before its memory profile and before it asks the
        layers for their KV cache specs: the pages of each shape are chosen (_publish_pages); a layer the
        model names as one without RoPE (SmolLM3's no_rope_layers, by vLLM's layer index) takes the identity
        table; with an allocation, the layer gets the backend class of its scheme (layer_backend), whose
        pages have that scheme's bytes."""
        _publish_pages(self.vllm_config, act_dtype)
        hf = text_config(self.vllm_config)  # (vLLM's own model code for other families ignores no_rope_layers)
        nope = hf.no_rope_layers if self.rope_cos is not None and hf.model_type == "smollm3" else None  # (0: NoPE)
        if nope is None and configured_layers() is None:
            return
        layers = self.vllm_config.compilation_config.static_forward_context.values()
        layer = next((x for x in layers if getattr(x, "impl", None) is self), None)
        if layer is None:
            raise RuntimeError("torch_rkv's vLLM backend: this attention impl's layer is not in vLLM's "
                               "static_forward_context, so its scheme or RoPE cannot be found")
        if nope is not None and not nope[extract_layer_index(layer.layer_name)]:
            self.rope_cos, self.rope_sin = identity_rope(*self.rope_cos.shape)
            logger.info("torch_rkv: %s applies no RoPE (no_rope_layers): its keys are stored as they are",
                        layer.layer_name)
        if configured_layers() is not None:
            layer.attn_backend = layer_backend(layer_scheme(layer.layer_name))

    def _bind(self, layer, device) -> tuple:
        """This layer's scheme (its row of an allocation) and codebook_rows, on the device, and the KV-shared
        layers that read its cache: read once, on the first forward, which names the layer. Returns the levels."""
        if self.levels is None:
            self.scheme = layer_scheme(layer.layer_name)
            rows = codebook_rows(self.scheme, layer.layer_name)
            self.levels = tuple(None if t is None else t.to(device) for t in rows)
            channels = refined_channels(self.scheme, layer.layer_name, self.num_kv_heads, self.head_size)
            self.channels = None if channels is None else channels.to(device)
            layers = self.vllm_config.compilation_config.static_forward_context
            named = [n for n, x in layers.items()
                     if getattr(x, "kv_sharing_target_layer_name", None) == layer.layer_name]
            self.readers = tuple(n for n in named
                                 if getattr(getattr(layers[n], "impl", None), "kv_source", None) == layer.layer_name)
            if len(self.readers) != len(named):  # (a layer whose target was set after its impl was built: a
                # drafter's layers, Gemma 4's MTP proposer)
                raise NotImplementedError(f"torch_rkv's vLLM backend: {sorted(set(named) - set(self.readers))} share "
                                          f"{layer.layer_name}'s KV cache, but their attention was not built as "
                                          "KV-shared layers of torch_rkv's backend")
        return self.levels

    def _source(self, layer) -> RKVAttentionImpl:
        """The impl of the layer whose cache this KV-shared layer reads (checked to keep the same shape,
        window and soft-cap: the cache was built for those), found on the first forward."""
        if self._source_impl is None:
            self._source_impl = self._find_source(layer)
        return self._source_impl

    def _find_source(self, layer) -> RKVAttentionImpl:
        target = self.vllm_config.compilation_config.static_forward_context.get(self.kv_source)
        src = getattr(target, "impl", None)
        if not isinstance(src, RKVAttentionImpl):
            raise NotImplementedError(f"torch_rkv's vLLM backend: {layer.layer_name} shares the KV cache of "
                                      f"{self.kv_source}, which is not a torch_rkv layer of this process (pipeline "
                                      "parallelism across a shared cache is not supported)")
        mine = (self.num_kv_heads, self.head_size, self.sliding_window, self.softcap)
        theirs = (src.num_kv_heads, src.head_size, src.sliding_window, src.softcap)
        if mine != theirs:
            raise NotImplementedError(f"torch_rkv's vLLM backend: {layer.layer_name} reads the cache of "
                                      f"{self.kv_source} with another (KV heads, head_size, sliding_window, "
                                      f"softcap): {mine} against {theirs}")
        return src

    def _attend(self, query: torch.Tensor, st: LayerState, md: RKVMetadata, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """This layer's queries over a step's cache (`st`: its own, or its target's for a KV-shared layer):
        the decode kernel (the new tokens already appended), or the prefill kernel over the cache as stored
        and the step's tokens k, v in full precision."""
        opts = st.rotations.options(self.scale, self.sliding_window, self.softcap, self.sink_logits)
        index = {"block_tables": md.block_tables, "side_slots": md.side_slots}
        if md.decode:
            return paged_decode_attention(query, st.k, st.v, st.format, opts, lengths=md.seq_lens, **index)
        return paged_prefill_attention(query, k, v, st.k, st.v, st.format, opts, query_start_loc=md.query_start_loc,
                                       max_query_len=md.max_query_len, lengths=md.lengths, **index)

    @staticmethod
    def _append(st: LayerState, md: RKVMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        paged_append(st.k, st.v, k, v, st.format, lengths=md.lengths, query_start_loc=md.query_start_loc,
                     block_tables=md.block_tables, side_slots=md.side_slots)

    def _forward_shared(self, layer, query: torch.Tensor, md: RKVMetadata, output: torch.Tensor) -> torch.Tensor:
        """A KV-shared layer: its queries over the step its target layer left (Gemma's shared layers pass
        no keys or values); the last reader of a chunk appends it."""
        source = self._source(layer)
        step = source.step
        if step is None or layer.layer_name not in step.awaiting:
            raise RuntimeError(f"torch_rkv's vLLM backend: {layer.layer_name} attends over {self.kv_source}'s cache, "
                               "which did not run this step (or this layer ran twice)")
        step.awaiting.discard(layer.layer_name)
        t = md.num_actual_tokens
        out = self._attend(query[:t], step.state, md, step.k, step.v)
        if not step.awaiting:
            if not md.decode:
                self._append(step.state, md, step.k, step.v)
            source.step = None  # (nothing is kept past the step)
        output[:t].copy_(out.view_as(output[:t]))
        return output

    def _layer_state(self, device, dtype: torch.dtype, slots: int):
        """(side pool, rotations) of this layer; the side pool grown to `slots`."""
        if self._tensors is not None and self._tensors[0]["k_window"].shape[0] < slots:
            old = self._tensors[0]
            grown = {k: torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=t.device) for k, t in old.items()}
            for k, t in old.items():
                grown[k][: t.shape[0]] = t
            self._tensors = (grown, *self._tensors[1:])
        if self._tensors is None:
            shapes = side_shapes(self.scheme, self.num_kv_heads, self.head_size, slots, dtype, self.drafts,
                                 sink_store=True)
            side = {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in shapes.items()}
            rope_tables = None if self.rope_cos is None else (self.rope_cos, self.rope_sin)
            rot = scheme_rotations(self.scheme, self.head_size, rope_tables, self.rope_interleaved, device,
                                   "torch_rkv's vLLM backend")
            self._tensors = (side, rot)
        return self._tensors

    def regions(self, kv_cache: torch.Tensor, page_size: int, dtype: torch.dtype) -> dict:
        """The page regions of this layer's cache view [blocks, 1, block tokens, content], made once per
        cache tensor (vLLM allocates it once)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype, page_size, dtype)
        if self._views is None or self._views[0] != key:
            layout = PageLayout(self.scheme, self.num_kv_heads, self.head_size, page_size, dtype)
            raw = kv_cache.view(torch.uint8).flatten(1)  # (blocks, block tokens * content bytes): one page each
            self._views = (key, layout.views(raw[:, : layout.page_bytes]))
        return self._views[1]

    def prepare(self, layer, kv_cache: torch.Tensor, slots: int, dtype: torch.dtype, work: SideWork | None) -> None:
        """The metadata builder's part of this layer's step (host work, once a step): the layer bound (_bind),
        its side pool grown to `slots`, the step's side work run on it, and the LayerState its forward reads."""
        levels = self._bind(layer, kv_cache.device)
        side, rotations = self._layer_state(kv_cache.device, dtype, slots)
        views = self.regions(kv_cache, kv_cache.shape[2], dtype)
        outliers = (views.get("k_outliers"), views.get("v_outliers"))  # sparse outliers: in the pages too
        refine = None if self.channels is None else (views["k_refine"], self.channels)  # and refined key channels
        if work is not None:
            run_side_work(work, side, views, self.scheme, levels, outliers, refine)
        if self.state is None or self.state.side is not side or self.state.views is not views:
            refined = (refine or (None, None), (None, None))  # (the keys' only)
            k, v = (CacheSide(views[f"{x}_codes"], views[f"{x}_scale"], views.get(f"{x}_zero"), side[f"{x}_window"],
                              side[f"{x}_sink"], levels[i], outliers[i], *refined[i]) for i, x in enumerate("kv"))
            self.state = LayerState(self.scheme.format, k, v, rotations, side, views)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: RKVMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """Kernel launches only: the step's host work ran in the metadata builder (prepare), so the forward
        reads no tensor value on the host and traces under torch.compile(fullgraph=True)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("torch_rkv's vLLM backend: fused output quantization is not supported")
        if self.kv_source is not None:  # (no side pool of its own either)
            return output if attn_metadata is None else self._forward_shared(layer, query, attn_metadata, output)
        if attn_metadata is None:  # profiling run: the side pool exists now, so that vLLM's memory profile
            self._layer_state(query.device, query.dtype, INITIAL_SLOTS)  # (on a GPU, what it leaves to the KV
            return output                                                  # pool) counts it
        md, st = attn_metadata, self.state
        if st is None:
            raise RuntimeError("torch_rkv's vLLM backend: a layer's forward ran before its metadata builder "
                               "prepared it (RKVMetadataBuilder.build)")
        if self.step is not None:
            raise RuntimeError(f"torch_rkv's vLLM backend: the KV-shared layers {sorted(self.step.awaiting)} did not "
                               f"attend over {layer.layer_name}'s cache in the last step")
        t = md.num_actual_tokens
        k, v = st.rotations.to_storage(key[:t], value[:t], md.positions[:, None])
        k, v = k.to(query.dtype).contiguous(), v.to(query.dtype).contiguous()
        if self.readers and not md.decode:  # (the last reader appends them, after later layers ran: under CUDA
            k, v = k.clone(), v.clone()   # graphs the memory of key / value, which they may alias, is reused)
        if md.decode:  # one new token a request and every older token read where it was (append_keeps_reads):
            self._append(st, md, k, v)  # appended first, it is read from the window by the decode kernel
        out = self._attend(query[:t], st, md, k, v)  # (a chunk: the cache as stored, the chunk in full precision)
        if not md.decode and not self.readers:  # (then appended, by the last reader where layers share the cache)
            self._append(st, md, k, v)
        if self.readers:
            self.step = _Step(st, k, v, set(self.readers))
        output[:t].copy_(out.view_as(output[:t]))
        return output


@dataclass
class LayerState:
    """A layer's tensors for its steps, gathered by its metadata builder (RKVAttentionImpl.prepare): its
    scheme's format, each side's cache as the paged ops take it (page regions, side slots, levels, sparse
    outliers), the rotations, and the side pool and page views they were gathered from (a pool that
    grows, or a cache tensor vLLM replaces, makes a new state)."""

    format: CacheFormat
    k: CacheSide
    v: CacheSide
    rotations: Rotations
    side: dict
    views: dict


@dataclass
class _Step:
    """What a layer's forward leaves for the KV-shared layers that read its cache in the same step: its
    state, and the step's tokens in storage form, which a chunk's last reader appends (a chunk is attended
    by every reader over the cache as it stood)."""

    state: LayerState
    k: torch.Tensor
    v: torch.Tensor
    awaiting: set  # the readers still to attend this step

