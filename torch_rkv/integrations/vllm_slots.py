"""Side slots for vLLM: each running request's full-precision rows (sinks and the window ring of
torch_rkv's paged format) in a slot of a fixed pool, kept from the step vLLM first schedules the request
until vLLM says it finished, was aborted or was preempted. Plain Python, no vLLM: the plugin's KV
connector (vllm_connector.py) drives it from vLLM's scheduler output, which names every request; tests
drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable

INITIAL_SLOTS = 16  # a vLLM engine's side pool's first size; it doubles as more requests run at once


def slot_limit(max_num_seqs: int) -> int:
    """A vLLM engine's side pool's most slots: one per request it may run at once, and a few more, so
    that the slots of requests that leave in a step can lend their sinks before they are reused."""
    return max_num_seqs + 8


def pool_slots(running: int, limit: int, initial: int = INITIAL_SLOTS) -> int:
    """A bound on the slots SlotTracker's pool grows to while at most `running` requests run at once (what
    plan --vllm counts). It grows only when every slot is held by a request or lends its sinks in the step
    (at most 2 x running), so it stops by the first doubling of `initial` past 2 x running + 1, or at
    `limit`."""
    n = min(initial, limit)
    while n <= 2 * running + 1 and n < limit:
        n = min(2 * n, limit)
    return n


@dataclass(frozen=True)
class Row:
    """A request that vLLM scheduled in a step, as its scheduler output names it.

    req: vLLM's request id. cached: tokens it holds in its pages before the step (a prefix-cache hit's
    length on its first step). count: tokens the step writes. first: the identity of its first block's
    tokens (vLLM's hash of that block), None while it has fewer tokens than a block. new: vLLM schedules
    it for the first time, or again after preempting it."""

    req: str
    cached: int
    count: int
    first: Hashable | None = None
    new: bool = False


@dataclass(frozen=True)
class SlotInit:
    """Before this step's attention, each layer fills slot `dst` for request `req`, which starts with
    `cached` tokens in its pages (a prefix-cache hit): its sinks from the slot of a request with the same
    first block (`sinks_from`), else from the sink store's entry `sinks_stored`; its window rows by
    dequantizing its own pages, all of whose rows are written (`cached` is a multiple of the block)."""

    req: str
    dst: int
    cached: int
    sinks_from: int = -1
    sinks_stored: int = -1


@dataclass
class StepPlan:
    """What a step's layers do with the side pool: each request's slot, the sink-store saves (slot,
    entry) they copy first, then the inits; `evict`: first blocks whose sinks no slot or entry keeps any
    more, which vLLM must drop from its prefix cache so that no later request hits them; `slot_count`: the
    pool's size."""

    slots: dict[str, int] = field(default_factory=dict)
    inits: list[SlotInit] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    evict: list[Hashable] = field(default_factory=list)
    slot_count: int = 0


@dataclass
class _Request:
    slot: int
    first: Hashable | None
    length: int  # tokens its slot holds once the step that last scheduled it has run


class SlotTracker:
    """Assigns each request vLLM runs a side slot, for as long as vLLM runs it.

    A request keeps its slot however many steps it sits out, and frees it when vLLM names it finished,
    aborted or preempted. A request that starts with cached tokens (a prefix-cache hit, or a preempted
    request resumed) gets a SlotInit: the sinks from a request with the same first block, running or
    leaving in this step, else from the sink store. When the last request that holds a first block's
    sinks leaves, they go to the store (one entry a slot of the pool); when the store is full its least
    recently used entry is dropped and its first block named in `evict`, so that vLLM never serves a hit
    on a prefix whose sinks are gone. A slot that lends its sinks in a step, or an entry that is read in
    it, is not given to another request or page in that step.

    The pool starts at `initial` slots (default: all of them) and grows by doubling up to `limit`.
    """

    def __init__(self, limit: int, sinks: int, block: int, initial: int | None = None):
        if limit < 1 or block < 1:
            raise ValueError(f"SlotTracker: limit and block must be >= 1, got {limit} and {block}")
        self.limit, self.sinks, self.block = limit, sinks, block
        self.size = min(limit, initial or limit)
        self.requests: dict[str, _Request] = {}
        self.owner: dict[int, str] = {}  # slot -> the request holding it
        self.holders: dict[Hashable, set[str]] = {}  # first block -> the requests whose slots hold its sinks
        self.stored: dict[Hashable, int] = {}  # first block -> its sink-store entry
        self.entry_of: dict[int, Hashable] = {}  # entry -> first block
        self.entry_step: dict[int, int] = {}  # entry -> the step it was last written or read
        self.step_no = 0

    def step(self, rows: list[Row], leaving: Iterable[str] = ()) -> StepPlan:
        """The plan of a step that schedules `rows`, once the requests in `leaving` (vLLM's finished,
        aborted and preempted ones since the last step) have left."""
        self.step_no += 1
        plan = StepPlan()
        gone = [req for req in dict.fromkeys(leaving) if req in self.requests]
        for row in rows:
            if row.new and row.req in self.requests and row.req not in gone:
                gone.append(row.req)  # (scheduled anew without a notice: it restarts from its pages)
            elif not row.new and row.req not in self.requests:
                raise RuntimeError(f"torch_rkv: vLLM continues request {row.req!r}, which never started in a side slot")
        # where each hit's sinks come from, chosen before any slot or entry changes hands
        sources, lenders = {}, set()
        for row in rows:
            if row.new and row.cached:
                sources[row.req] = self._source(row)
                lenders.add(sources[row.req][0])
        for req in gone:
            self._release(req, plan)
        for row in rows:
            if row.new:
                slot = self._take_slot(lenders)
                self.requests[row.req] = _Request(slot, None, 0)
                self.owner[slot] = row.req
                if row.cached:
                    donor, entry = sources[row.req]
                    plan.inits.append(SlotInit(row.req, slot, row.cached, donor, entry))
        for row in rows:
            r = self.requests[row.req]
            r.length = row.cached + row.count
            if r.first is None and row.first is not None:
                r.first = row.first
                self.holders.setdefault(row.first, set()).add(row.req)
            plan.slots[row.req] = r.slot
        plan.slot_count = self.size
        return plan

    def _source(self, row: Row) -> tuple[int, int]:
        """(donor slot, sink-store entry) that a hit takes its sinks from (-1: none)."""
        if row.cached % self.block:
            raise RuntimeError(f"torch_rkv: request {row.req!r} starts with {row.cached} cached tokens, not a multiple "
                               f"of the scheme's block of {self.block}: the rows of its open block were never written "
                               "to its pages, and its window cannot be read back")
        need = min(self.sinks, row.cached)
        if not need:
            return -1, -1
        donors = [self.requests[r].slot for r in self.holders.get(row.first, ())
                  if self.requests[r].length >= need]
        if donors:
            return min(donors), -1
        entry = self.stored.get(row.first, -1) if row.first is not None else -1
        if entry < 0:
            raise RuntimeError(f"torch_rkv: request {row.req!r} hits a cached prefix whose sinks no side slot or "
                               "sink-store entry keeps; its first block should have left vLLM's prefix cache")
        self.entry_step[entry] = self.step_no
        return -1, entry

    def _held(self, first: Hashable) -> bool:
        """Whether a running request's slot holds all the sinks of this first block."""
        return any(self.requests[r].length >= self.sinks for r in self.holders.get(first, ()))

    def _release(self, req: str, plan: StepPlan) -> None:
        """Free a leaving request's slot; its sinks go to the store when no other slot holds them whole."""
        r = self.requests.pop(req)
        del self.owner[r.slot]
        if r.first is None:
            return
        self.holders[r.first].discard(req)
        if not self.holders[r.first]:
            del self.holders[r.first]
        if not self.sinks or self._held(r.first):
            return
        entry = self.stored.get(r.first, -1)
        if r.length < self.sinks:  # (never whole here: an entry keeps them, or vLLM must not serve them)
            if entry < 0:
                plan.evict.append(r.first)
            return
        if entry < 0:
            entry = self._take_entry(plan)
        if entry < 0:  # (every entry is read in this step)
            plan.evict.append(r.first)
            return
        self.stored[r.first], self.entry_of[entry], self.entry_step[entry] = entry, r.first, self.step_no
        plan.saves.append((r.slot, entry))

    def _take_entry(self, plan: StepPlan) -> int:
        """A sink-store entry for new sinks: a free one, else one whose sinks a running request's slot
        holds, else the least recently used (its first block then leaves vLLM's prefix cache); never one
        read or written in this step. -1: none."""
        free = [e for e in range(self.size) if e not in self.entry_of]
        if free:
            return free[0]
        old = [e for e in self.entry_of if self.entry_step[e] < self.step_no]
        if not old:
            return -1
        entry = min(old, key=lambda e: (not self._held(self.entry_of[e]), self.entry_step[e]))
        first = self.entry_of.pop(entry)
        del self.stored[first]
        if not self._held(first):
            plan.evict.append(first)
        return entry

    def _take_slot(self, lenders: set[int]) -> int:
        """A free slot that lends no sinks in this step, growing the pool by doubling rather than fail."""
        free = [s for s in range(self.size) if s not in self.owner and s not in lenders]
        if free:
            return free[0]
        if self.size < self.limit:
            slot, self.size = self.size, min(2 * self.size, self.limit)
            return slot
        raise RuntimeError(f"torch_rkv: more running requests than the {self.limit} side slots (max_num_seqs + 8)")


def check_drafts(scheme, drafts: int) -> None:
    """Speculative decoding's drafts a step (num_speculative_tokens) that a scheme's side slots follow:
    a step's tokens must all land in the full-precision ring (an append writes there only the tokens it
    leaves unquantized, and a rollback may read them from it), so at most recent - 1 drafts for a
    scheme with a ring (tests/test_drafts.py)."""
    if drafts and scheme.block > 1 and drafts >= scheme.recent:
        raise NotImplementedError(f"torch_rkv: num_speculative_tokens={drafts} must be less than scheme "
                                  f"{scheme.name}'s recent window of {scheme.recent} tokens, so that a step's tokens "
                                  "stay in the full-precision ring until their drafts are verified")


def growth_beyond_headroom(slot_bytes: int, initial: int, limit: int, device_bytes: int,
                           utilization: float) -> str | None:
    """On a GPU, vLLM sizes its pages from a memory profile that holds the side pool's first `initial`
    slots; the pool's growth to `limit` slots comes out of the (1 - gpu_memory_utilization) share vLLM
    leaves free. A warning when that growth would take more than half of it, else None."""
    growth, headroom = (limit - initial) * slot_bytes, (1.0 - utilization) * device_bytes
    if growth <= headroom / 2:
        return None
    return (f"torch_rkv: the side pool may grow by {growth / 2**30:.1f} GiB past vLLM's memory profile "
            f"({limit} slots at most: max_num_seqs + 8, {slot_bytes / 2**20:.1f} MiB each), more than half of "
            f"the {headroom / 2**30:.1f} GiB that gpu_memory_utilization={utilization} leaves free; lower "
            "max_num_seqs to the requests you run at once, or gpu_memory_utilization")
