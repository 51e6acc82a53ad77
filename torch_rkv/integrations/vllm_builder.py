"""The vLLM backend's attention metadata: what each step's rows are (RKVMetadata) and the builder that
makes it, once a step for all its layers: the rows' side slots from the KV connector's plan, and each
layer's side pool grown and prepared, so that a layer's forward only launches kernels."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata

from ..layout import side_shapes
from ..reference import append_keeps_reads
from ..scheme import Scheme
from .vllm import ALLOCATION_ENV, CONNECTOR, KV_TRANSFER_CONFIG, configured_layers
from .vllm_layers import codebook_rows, layer_scheme, served_scheme
from .vllm_pool import slot_bytes
from .vllm_side import plan_side_work
from .vllm_slots import INITIAL_SLOTS, check_drafts, growth_beyond_headroom, slot_limit

logger = logging.getLogger("vllm.torch_rkv")  # under vLLM's logger: printed with its log


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
        self.scheme = scheme = served_scheme()  # (every layer's recent, block and sinks: an allocation's layers share them)
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
