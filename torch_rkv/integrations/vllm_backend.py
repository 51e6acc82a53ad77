"""torch_rkv's paged quantized KV cache as a vLLM attention backend: the classes the plugin
(integrations/vllm.py) registers, imported by vLLM when it selects the backend (docs/serving.md)."""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..codebook import SIDES
from ..layout import PageLayout, side_shapes
from ..ops.hadamard import hadamard, hadamard_signs
from ..ops.paged import paged_append, paged_decode_attention, paged_prefill_attention
from ..ops.rope import rope
from ..reference import append_keeps_reads
from ..scheme import Scheme
from .models import LENGTH_DEPENDENT_ROPE, identity_rope
from .vllm import (
    ALLOCATION_ENV,
    CONNECTOR,
    ENV,
    KV_TRANSFER_CONFIG,
    PRE_ROPE_MODELS,
    TESTED_VLLM,
    configured_layers,
    configured_scheme,
    overridden_backend,
    text_config,
)
from .vllm_pool import block_multiple, content_bytes, published_token_bytes, slot_bytes
from .vllm_refusals import unsupported_features
from .vllm_side import SideWork, plan_side_work, run_side_work
from .vllm_slots import INITIAL_SLOTS, check_drafts, growth_beyond_headroom, slot_limit

logger = logging.getLogger("vllm.torch_rkv")  # under vLLM's logger: printed with its log


def _scheme() -> Scheme:
    """The scheme every layer's sinks, window and block follow (with an allocation: layer 0's, which
    every layer shares but for its bits)."""
    s = configured_scheme()
    if s is None:
        raise RuntimeError(f"torch_rkv's vLLM backend is in use but neither {ENV} nor {ALLOCATION_ENV} is set")
    s.check_served()
    return s


def layer_scheme(layer_name: str) -> Scheme:
    """The scheme of vLLM's layer `layer_name`: its row of the allocation, found by vLLM's layer index
    (the number in the layer's name: the model's own numbering, which the calibration uses), or the one
    scheme."""
    layers = configured_layers()
    if layers is None:
        return _scheme()
    index = extract_layer_index(layer_name)
    if not 0 <= index < len(layers):
        raise ValueError(f"{ALLOCATION_ENV}: the allocation has {len(layers)} layers; vLLM's layer {layer_name} "
                         f"(index {index}) is not among them: it was made for another model")
    layers[index].check_served()
    return layers[index]


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
        return [MultipleOf(block_multiple(_scheme()))]

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
            scheme = _scheme()
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
    metadata builder per distinct scheme (vLLM groups layers by backend class and spec). Kept in this
    module under its name, so that vLLM's (module, qualname) of it resolves."""
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
# Metadata
# ------------------------------------------------------------------------------------------------


@dataclass
class RKVMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # (B+1,) int64
    lengths: torch.Tensor  # (B,) int64: tokens cached before this step
    seq_lens: torch.Tensor  # (B,) int64: and after it
    decode: bool  # one new token a request, no block leaving the recent window: the decode kernel may read it
    block_tables: torch.Tensor  # (B, max_pages) int32
    side_slots: torch.Tensor  # (B,) int32
    slot_count: int  # the side pool's size this step (it grows with the requests running at once)
    positions: torch.Tensor  # (T,) int64


class RKVMetadataBuilder(AttentionMetadataBuilder[RKVMetadata]):
    """Each step's host work, once for all its layers: the rows' side slots from the connector's plan, and
    each layer's side pool grown and prepared (saves and inits run, the step's tensors gathered in its
    LayerState), so that a layer's forward only launches kernels and reads no tensor value on the host."""

    # No full CUDA graphs: a captured decode would keep one step's metadata tensors (this builder makes new
    # ones each step, not persistent buffers) and one path (decode or prefill kernel), which this builder
    # chooses per step from where the step's blocks leave the window. vLLM's CUDA default then captures
    # piecewise graphs and runs attention (an opaque op, a splitting op) eagerly between them.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        if getattr(kv_cache_spec, "attention_chunk_size", None):  # (ChunkedLocalAttention subclasses this builder)
            raise NotImplementedError("torch_rkv's vLLM backend: chunked local attention (attention_chunk_size, Llama "
                                      "4's local layers) is not supported: its virtual batches are not requests")
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.scheme = scheme = _scheme()  # (every layer's recent, block and sinks: an allocation's layers share them)
        drafts = speculative_tokens(vllm_config.speculative_config, scheme)
        self.page_size = kv_cache_spec.block_size
        # the window ring's rows of this builder's side pools (its layers share recent, block and drafts)
        self.ring = side_shapes(scheme, 1, 1, 1, torch.float32, drafts)["k_window"][0][2]
        for name in layer_names:  # at engine start: a codebook or allocation without some layer fails here
            codebook_rows(layer_scheme(name), name)
        layers = configured_layers()
        total = vllm_config.model_config.get_total_num_hidden_layers()  # (every pipeline stage's)
        if layers is not None and len(layers) != total:
            raise ValueError(f"{ALLOCATION_ENV}: the allocation has {len(layers)} layers, the model {total}: it was "
                             "made for another model")
        if self.page_size % scheme.block:
            raise ValueError(f"torch_rkv: vLLM's block_size ({self.page_size}) must be a multiple of scheme "
                             f"{scheme.name}'s block of {scheme.block} tokens (--block-size)")
        if layers is not None:  # (an allocation: one builder per distinct layer scheme, layer_backend)
            mine = layer_scheme(layer_names[0])
            logger.info("torch_rkv: %d layers keep %d-bit keys and %d-bit values, pages of %d bytes a token (%s, ...)",
                        len(layer_names), mine.k_bits, mine.v_bits, kv_cache_spec.real_page_size_bytes //
                        kv_cache_spec.block_size, layer_names[0])
        padded, real = getattr(kv_cache_spec, "page_size_padded", None), kv_cache_spec.real_page_size_bytes
        if padded is not None and padded > real:  # (vLLM's hybrid allocator: sliding and global layers' groups)
            logger.warning("torch_rkv: vLLM pads the pages of %s from %d to %d bytes to give every KV-cache group "
                           "pages of one size; an allocation whose layers keep other key + value totals holds no "
                           "more tokens here than its largest page allows (python -m torch_rkv calibrate --split "
                           "keeps one total)", ", ".join(layer_names), real, padded)
        self.limit = side_slot_count(vllm_config)
        self.connector = request_identity(vllm_config)
        self.group = self.connector.group_of(layer_names)
        self.planned = False  # whether a step with requests was built (before: warm-up batches, no requests)
        self.prepared = None  # the connector's step whose side work this builder ran (once, however often it builds)
        self.context = context = vllm_config.compilation_config.static_forward_context
        # (KV-shared layers keep no side slots)
        self.owners = [n for n in layer_names if getattr(context.get(n), "kv_sharing_target_layer_name", None) is None]
        self.slot_bytes = slot_bytes(scheme, len(self.owners), kv_cache_spec.num_kv_heads, kv_cache_spec.head_size,
                                     kv_cache_spec.dtype, drafts)
        self.logged_slots = 0
        logger.info("torch_rkv: side pool of at most %d slots (max_num_seqs + 8), %.1f MiB, outside vLLM's KV pages",
                    self.limit, self.limit * self.slot_bytes / 2**20)
        if torch.device(device).type == "cuda":
            warning = growth_beyond_headroom(self.slot_bytes, INITIAL_SLOTS, self.limit,
                                             torch.cuda.get_device_properties(device).total_memory,
                                             vllm_config.cache_config.gpu_memory_utilization)
            if warning:
                logger.warning(warning)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RKVMetadata:
        cm = common_attn_metadata
        b = cm.num_reqs
        qsl = cm.query_start_loc[: b + 1].to(torch.int64)
        seq_lens = cm.seq_lens[:b].to(torch.int64)
        counts = qsl[1:] - qsl[:-1]
        cached = seq_lens - counts
        tables = cm.block_table_tensor[:b].to(torch.int32)
        host_cached, host_counts = cached.cpu().tolist(), counts.cpu().tolist()
        pages_per = [-(-(n + m) // self.page_size) for n, m in zip(host_cached, host_counts)]
        host_tables = tables.cpu()
        rows = [host_tables[i, :k].tolist() for i, k in enumerate(pages_per)]
        slots, inits, saves, slot_count = self._plan(host_cached, host_counts, rows)
        self._prepare(slot_count, inits, saves)
        if slot_count > self.logged_slots:
            self.logged_slots = slot_count
            logger.info("torch_rkv: side pool of %d slots, %.1f MiB over %d layers from %s (of at most %d slots)",
                        self.logged_slots, self.logged_slots * self.slot_bytes / 2**20, len(self.layer_names),
                        self.layer_names[0], self.limit)
        positions = torch.cat([torch.arange(n, n + m) for n, m in zip(host_cached, host_counts)] or
                              [torch.zeros(0, dtype=torch.int64)]).to(qsl.device)
        tokens = int(qsl[-1])
        s = self.scheme
        decode = tokens == b and all(m == 1 and append_keeps_reads(n, s.recent, s.block)
                                     for n, m in zip(host_cached, host_counts))
        return RKVMetadata(num_actual_tokens=tokens, max_query_len=int(cm.max_query_len), query_start_loc=qsl,
                           lengths=cached, seq_lens=seq_lens, decode=decode, block_tables=tables.contiguous(),
                           side_slots=torch.tensor(slots, dtype=torch.int32, device=qsl.device),
                           slot_count=slot_count, positions=positions)

    def _prepare(self, slot_count: int, inits: list, saves: list) -> None:
        """Every owner layer's side pool grown to `slot_count` slots and its LayerState made; the step's
        saves and inits (SideWork) run on each, once per connector step (vLLM may build a step's metadata
        twice: a save must not copy a slot an init has since filled)."""
        step = self.connector.step
        work = None
        if step is not None and step is not self.prepared:
            self.prepared = step
            work = plan_side_work(inits, saves, self.scheme, self.page_size, self.ring, self.device)
        dtype = self.kv_cache_spec.dtype
        for name in self.owners:
            layer = self.context[name]
            layer.impl.prepare(layer, layer.kv_cache, slot_count, dtype, work)  # (what its forward gets)

    def _plan(self, cached: list[int], counts: list[int], tables: list[list[int]]):
        """(slot of each row, (init, pages) pairs, saves, pool size) of this step, from the plan the connector
        received from vLLM's scheduler: each row's request is the one whose first new token this step is
        written in the row's block at that position (a block being written belongs to one request)."""
        step = self.connector.step
        if step is None:  # (vLLM's warm-up batches run before any request, with no plan)
            if self.planned:
                raise RuntimeError("torch_rkv's vLLM backend: attention metadata built without the step plan "
                                   f"of its KV connector ({CONNECTOR}); this vLLM builds it before it hands "
                                   "the connector the step (the V2 model runner does)")
            return [0] * len(cached), [], [], INITIAL_SLOTS
        self.planned = True
        writer = {info[2][self.group]: (req, info) for req, info in step.rows.items()}
        slots, row_of = [], {}
        for i, (n, m, pages) in enumerate(zip(cached, counts, tables)):
            if m == 0:  # (padding: nothing read or written)
                slots.append(0)
                continue
            req, info = writer.get(pages[n // self.page_size], (None, None))
            if req is None or info[:2] != (n, m):
                raise RuntimeError(f"torch_rkv's vLLM backend: row {i} ({n} cached tokens, {m} new, block "
                                   f"{pages[n // self.page_size]}) is no request of the step vLLM's scheduler "
                                   f"planned{'' if req is None else f' (its block is {req}: {info[:2]})'}")
            slots.append(step.plan.slots[req])
            row_of[req] = i
        inits = [(init, tables[row_of[init.req]]) for init in step.plan.inits]
        return slots, inits, list(step.plan.saves), step.plan.slot_count


# speculative decoding whose proposer adds no attention layers (a draft model's or EAGLE head's layers
# would need their own pre-RoPE tables and pages; medusa and MLP speculators are untested here)
DRAFTERS_WITHOUT_LAYERS = ("ngram", "ngram_gpu", "suffix")


def speculative_tokens(config, scheme: Scheme) -> int:
    """The draft tokens a step may append (vLLM's num_speculative_tokens; 0 without speculative
    decoding). The next step takes the rejected ones back and writes those positions again: the slot
    tracker finds the request at fewer tokens than its slot holds, a block a draft completed is
    quantized again, and the window ring holds `drafts` more rows (layout.side_shapes), so that the row
    a rejected draft overwrote belongs to a token no later step reads from the ring; check_drafts."""
    if config is None:
        return 0
    method, k = getattr(config, "method", None), int(config.num_speculative_tokens or 0)
    if method not in DRAFTERS_WITHOUT_LAYERS:
        raise NotImplementedError(f"torch_rkv's vLLM backend: speculative decoding with method {method!r} is not "
                                  f"supported; {', '.join(DRAFTERS_WITHOUT_LAYERS)} are (no draft layers)")
    check_drafts(scheme, k)
    return k


def codebook_rows(scheme: Scheme, layer_name: str) -> tuple:
    """(k_levels, v_levels) of vLLM's layer `layer_name`: its rows of the scheme's codebook, found by vLLM's
    layer index (the number in the layer's name: the model's own numbering, which calibrate-levels uses),
    or None each (the uniform grid)."""
    if scheme.levels != "calibrated":
        return None, None
    index = extract_layer_index(layer_name)
    return tuple(scheme.side_levels(index, side) for side in SIDES)


def side_slot_count(vllm_config) -> int:
    """The side pool's limit (slot_limit) for this engine's max_num_seqs."""
    return slot_limit(vllm_config.scheduler_config.max_num_seqs)


def request_identity(vllm_config):
    """This worker's instance of the plugin's KV connector (vllm_connector.py), which hands the builder
    each step's plan; refused by name where vLLM would not."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from .vllm_connector import RKVConnector

    if getattr(vllm_config, "use_v2_model_runner", False):
        raise NotImplementedError("torch_rkv's vLLM backend: the V2 model runner builds the attention metadata "
                                  "before it hands the KV connector the step's plan; set VLLM_USE_V2_MODEL_RUNNER=0")
    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    if not isinstance(connector, RKVConnector):
        raise RuntimeError(missing_connector())
    return connector


def missing_connector() -> str:
    return (f"torch_rkv's vLLM backend needs its KV connector ({CONNECTOR}), which tells it which request each row "
            f"of a step is: pass kv_transfer_config={json.dumps(KV_TRANSFER_CONFIG)} to LLM(...), or "
            f"--kv-transfer-config '{json.dumps(KV_TRANSFER_CONFIG)}' to vllm serve")


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

        self.scheme = _scheme()
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
        self._tensors = None  # (side pool, signs, RoPE tables), made by the profiling run or the first prepare
        self.state: LayerState | None = None  # what the forward reads, gathered by prepare
        self._views = None  # (key, page region views) of the cache tensor (regions)
        self.levels = None  # (k_levels, v_levels) of this layer, read on the first forward (it names the layer)
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
        s = st.scheme
        common = (md.block_tables, md.side_slots)
        attend = (s.k_bits, s.v_bits, s.block, s.recent, *st.rope, st.interleaved, *st.signs, self.scale, 0,
                  self.sliding_window, self.softcap)
        if md.decode:
            return paged_decode_attention(query, *st.cache, *common, md.seq_lens, *attend, **st.kw,
                                          sink_logits=self.sink_logits)
        return paged_prefill_attention(query, k, v, md.query_start_loc, md.max_query_len, *st.cache, *common,
                                       md.lengths, *attend, **st.kw, sink_logits=self.sink_logits)

    @staticmethod
    def _append(st: LayerState, md: RKVMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        s = st.scheme
        paged_append(*st.cache, None, md.block_tables, md.side_slots, md.lengths, md.query_start_loc, k, v, s.k_bits,
                     s.v_bits, s.block, s.recent, s.k_clip, s.v_clip, **st.kw)

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
        """(side pool, Hadamard signs, RoPE tables) of this layer; the side pool grown to `slots`."""
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
            s = self.scheme
            signs = (hadamard_signs(self.head_size, s.hadamard_seed, device) if s.k_hadamard else None,
                     hadamard_signs(self.head_size, s.hadamard_seed + 1, device) if s.v_hadamard else None)
            rope_tables = (None, None)
            if self.rope_cos is not None:
                rope_tables = (self.rope_cos.to(device), self.rope_sin.to(device))
            self._tensors = (side, signs, rope_tables)
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
        side, signs, rope_tables = self._layer_state(kv_cache.device, dtype, slots)
        views = self.regions(kv_cache, kv_cache.shape[2], dtype)
        outliers = (views.get("k_outliers"), views.get("v_outliers"))  # sparse outliers: in the pages too
        if work is not None:
            run_side_work(work, side, views, self.scheme, levels, outliers)
        if self.state is None or self.state.side is not side or self.state.views is not views:
            cache = [views["k_codes"], views["k_scale"], views.get("k_zero"), views["v_codes"], views["v_scale"],
                     views.get("v_zero"), side["k_window"], side["v_window"], side["k_sink"], side["v_sink"]]
            kw = {"k_levels": levels[0], "v_levels": levels[1], "k_outliers": outliers[0], "v_outliers": outliers[1]}
            self.state = LayerState(self.scheme, cache, kw, rope_tables, self.rope_interleaved, signs, side, views)

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
        k, v = key[:t], value[:t]
        if st.scheme.pre_rope:
            k = rope(k, *st.rope, md.positions[:, None], st.interleaved, inverse=True)
        if st.signs[0] is not None:
            k = hadamard(k, st.signs[0])
        if st.signs[1] is not None:
            v = hadamard(v, st.signs[1])
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
    """A layer's tensors for its steps, gathered by its metadata builder (RKVAttentionImpl.prepare): the
    scheme, the cache in the paged ops' order (page regions, then side slots), the ops' keyword arguments
    (levels, sparse outliers), RoPE tables and pairing, Hadamard signs, and the side pool and page views
    they were gathered from (a pool that grows, or a cache tensor vLLM replaces, makes a new state)."""

    scheme: Scheme
    cache: list
    kw: dict
    rope: tuple
    interleaved: bool
    signs: tuple
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
