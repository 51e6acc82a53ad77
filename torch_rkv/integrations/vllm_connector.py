"""The plugin's KV connector: how the attention backend learns which request each row of a step is.

vLLM's attention metadata names no requests. Its KV connector interface does: the scheduler side sees
every step's scheduler output (the scheduled requests by id, with their block ids and token counts, and
the requests that finished, were aborted or were preempted), and every worker receives what the
scheduler side builds from it before the step runs. So the slot bookkeeping (vllm_slots.SlotTracker)
runs once a step in the scheduler process, and each worker's metadata builder only finds its rows in the
plan (RKVMetadataBuilder.build). It moves no KV data: the connector loads and saves nothing.

A user passes it as vLLM's kv_transfer_config (vllm.KV_TRANSFER_CONFIG; `plan --vllm` prints the
command). The vLLM internals it relies on (vLLM 0.32):
- ``KVConnectorBase_V1``: ``build_connector_meta(scheduler_output)``, ``on_new_request`` and
  ``request_finished``; ``bind_kv_cache_manager`` (the scheduler's ``KVCacheManager``: ``get_block_ids``,
  ``block_pool.blocks`` and ``evict_blocks``); ``SupportsHMA``, without which vLLM turns its hybrid KV cache
  manager off;
- ``SchedulerOutput``: ``scheduled_new_reqs`` (``req_id``, ``num_computed_tokens``),
  ``scheduled_cached_reqs`` (``req_ids``, ``num_computed_tokens``, ``resumed_req_ids``),
  ``num_scheduled_tokens``, ``finished_req_ids``, ``preempted_req_ids``;
- ``Request.block_hashes`` (the first block's hash identifies its tokens) and ``KVCacheBlock.block_hash``;
- the V1 model runner calls the worker side's ``handle_preemptions(metadata)`` at the start of each
  ``execute_model``, before it builds the attention metadata (the V2 runner builds it first: refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.kv_cache_interface import AttentionSpec

from .vllm import configured_scheme
from .vllm_slots import INITIAL_SLOTS, Row, SlotTracker, StepPlan, slot_limit


@dataclass
class RKVStep(KVConnectorMetadata):
    """One step's side-slot plan, and for each scheduled request (cached tokens, tokens this step, and
    per KV cache group the block its first new token is written in, -1 for a group without attention
    pages): a block being written belongs to one request only, so it finds the request's row."""

    plan: StepPlan
    rows: dict[str, tuple[int, int, tuple[int, ...]]] = field(default_factory=dict)


class RKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Request identity for torch_rkv's attention backend (module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.step: RKVStep | None = None  # (worker) this step's plan, from handle_preemptions
        self.groups = [(g.kv_cache_spec.block_size if isinstance(g.kv_cache_spec, AttentionSpec) else 0)
                       for g in (kv_cache_config.kv_cache_groups if kv_cache_config is not None else [])]
        if role == KVConnectorRole.SCHEDULER:
            scheme = configured_scheme()
            if scheme is None:
                raise RuntimeError("torch_rkv's KV connector is configured but the plugin is off: set "
                                   "TORCH_RKV_SCHEME or TORCH_RKV_ALLOCATION")
            limit = slot_limit(vllm_config.scheduler_config.max_num_seqs)
            self.tracker = SlotTracker(limit, scheme.sinks, scheme.block, INITIAL_SLOTS)
            self.requests: dict[str, Any] = {}  # request id -> vLLM's Request (its block hashes)
            self.first_blocks: dict[bytes, set[int]] = {}  # first block's hash -> block ids that held it

    # ---- scheduler side ----

    def on_new_request(self, request) -> None:
        self.requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # (no external KV)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self.requests.pop(request.request_id, None)  # (its slot is freed by finished_req_ids next step)
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output) -> RKVStep:
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        scheduled = [(r.req_id, r.num_computed_tokens, True) for r in so.scheduled_new_reqs]
        scheduled += [(r, n, r in resumed) for r, n in zip(cached.req_ids, cached.num_computed_tokens)]
        rows, info = [], {}
        for req_id, n, new in scheduled:
            m = so.num_scheduled_tokens[req_id]
            request = self.requests[req_id]
            first = request.block_hashes[0] if request.block_hashes else None
            blocks = self._kv_cache_manager.get_block_ids(req_id)
            info[req_id] = (n, m, tuple(ids[n // size] if size else -1 for ids, size in zip(blocks, self.groups)))
            if first is not None:
                self.first_blocks.setdefault(first, set()).update(ids[0] for ids, size in zip(blocks, self.groups)
                                                                  if size and ids)
            rows.append(Row(req_id, n, m, first, new))
        leaving = list(so.finished_req_ids) + list(so.preempted_req_ids or ())
        plan = self.tracker.step(rows, leaving)
        self._evict(plan.evict)
        return RKVStep(plan, info)

    def _evict(self, firsts: list) -> None:
        """Drop from vLLM's prefix cache the first blocks whose sinks no slot or store entry keeps, so that
        no request hits them again (it computes them instead)."""
        pool = self._kv_cache_manager.block_pool
        drop = set()
        for first in firsts:
            for block_id in self.first_blocks.pop(first, ()):
                held = pool.blocks[block_id].block_hash
                if held is not None and get_block_hash(held) == first:  # (else vLLM gave the block away)
                    drop.add(block_id)
        if drop:
            self._kv_cache_manager.evict_blocks(drop)

    # ---- worker side ----

    def handle_preemptions(self, kv_connector_metadata: RKVStep) -> None:
        self.step = kv_connector_metadata  # (the V1 runner's first call of a step: before its attention metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.step = None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def group_of(self, layer_names: list[str]) -> int:
        """The KV cache group index of a metadata builder's layers (the first that the connector's KV cache
        config names: vLLM adds KV-shared layers to the groups after it made the connector)."""
        for name in layer_names:
            for i, group in enumerate(self._kv_cache_config.kv_cache_groups):
                if name in group.layer_names:
                    return i
        raise RuntimeError(f"torch_rkv's KV connector: layers {layer_names} are in no KV cache group")
