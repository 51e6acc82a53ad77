"""Side slots for an engine that names no requests: each running request's full-precision rows (sinks and
the window ring of torch_rkv's paged format) in a slot of a fixed pool, found again every step from the
pages the request writes. Plain Python, no vLLM: the vLLM backend (vllm_backend.py) drives it from the
attention metadata, tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

INITIAL_SLOTS = 16  # a vLLM engine's side pool's first size; it doubles as more requests run at once


def slot_limit(max_num_seqs: int) -> int:
    """A vLLM engine's side pool's most slots: one per request it may run at once, and a few for requests
    that just left."""
    return max_num_seqs + 8


def pool_slots(running: int, limit: int, initial: int = INITIAL_SLOTS) -> int:
    """The most slots SlotTracker's pool grows to while at most `running` requests run at once. It grows
    only when every slot it may take is busy: used in this step or the last (at most 2 x running) or a
    hit's donor (one more); so it stops at the first doubling of `initial` past 2 x running + 1, or at
    `limit`."""
    n = min(initial, limit)
    while n <= 2 * running + 1 and n < limit:
        n = min(2 * n, limit)
    return n


@dataclass
class SlotInit:
    """Before this step's attention, each layer fills slot `dst`: a copy of slot `src` (a request at the
    same point of the same tokens), or else its sinks from a slot that began with the same first page
    (`sinks_from`, -1: none), else from the sink store (`sinks_stored`), else by dequantizing their
    quantized rows (clipped to ranges they did not set: far off), and the rest by dequantizing the
    request's own quantized rows."""

    dst: int
    src: int
    sinks_from: int
    cached: int  # tokens the request already holds in its pages
    pages: list[int]
    sinks_stored: int = -1  # with no slot to take them from: the sink store's entry that kept them, or -1


@dataclass
class _Slot:
    length: int = 0
    page0: int = -1
    last_step: int = -1
    open_page: int = -1  # the page of its newest token


class SlotTracker:
    """Assigns each row of a step to a side slot, following requests by their pages (the attention
    metadata has no request ids).

    A request's open page (the one its newest token is in) is its key: vLLM never shares a page that is
    still filling, and a page's id stays with the request until it leaves. Each step, row b with n
    cached tokens finds its slot under the page holding token n - 1 when that slot is at length n;
    otherwise it is a new request. One that starts at n > 0 (a prefix-cache hit: its first pages are
    another request's) gets a new slot initialized by a SlotInit. Slots of requests that left are
    reclaimed least recently used first, once idle for a whole step (the pool doubles, up to `slots`,
    rather than take a slot used in the previous step); a request that was away long enough to lose its
    slot comes back as a hit (its window then read from its quantized rows).

    The pool starts at `initial` slots (default: all of them) and grows by doubling, so that its memory
    follows the number of requests running at once rather than the most the engine allows.

    drafts: speculative tokens a step may append and the next take back (vLLM's num_speculative_tokens;
    rejected drafts leave the request at fewer tokens than its slot holds). A slot is then also found at
    up to `drafts` tokens past the request's, under the pages of its newest drafts + 1 tokens; past a
    page's end only by the request whose next page is the slot's open page, since a full page may be
    another request's prefix-cache hit (which must not take the slot). The stale rows are the next
    tokens' rows, which the step writes again (the ring's rows: layout.side_shapes and check_drafts).
    """

    def __init__(self, slots: int, page_size: int, sinks: int, initial: int | None = None, drafts: int = 0):
        if not 0 <= drafts < page_size:
            raise ValueError(f"SlotTracker: drafts must be in [0, page_size = {page_size}), got {drafts}")
        self.page_size, self.sinks, self.limit, self.drafts = page_size, sinks, slots, drafts
        self.slots = [_Slot() for _ in range(min(slots, initial or slots))]
        self.key: dict[int, set[int]] = {}  # page -> the slots whose requests may resume in it
        self.keyed: dict[int, list[int]] = {}  # slot -> its pages in `key`
        # page -> the slots whose requests began in it and may lend their sinks to a hit there; a slot leaves
        # when another request writes the page (vLLM gave it away: a hit there is on that request's tokens)
        self.first: dict[int, set[int]] = {}
        self.first_of: dict[int, int] = {}  # slot -> its page in `first`
        # the sink store: a slot's sinks outlive it. Its sinks are copied there (`saves`: (slot, entry) for the
        # layers to copy before the step) when the slot is taken for another request while the last to lend
        # them, so that a request coming back to a cached prefix (the next turn of a chat) after its slot
        # went to another gets them: read back from their quantized rows they cost SmolLM2 +6.7 perplexity
        # at rkv-8, +6.8 at rkv-4. One entry per slot of the pool (layout.side_shapes' sink store), least
        # recently used first; an entry is dropped when another request writes its page.
        self.stored: dict[int, int] = {}  # page -> entry
        self.stored_at: dict[int, tuple[int, int]] = {}  # entry -> (page, step last written or read)
        self.saves: list[tuple[int, int]] = []  # the last assign's (slot, entry) copies
        self.step = 0

    def _unkey(self, slot: int) -> None:
        for page in self.keyed.pop(slot, ()):
            self.key[page].discard(slot)
            if not self.key[page]:
                del self.key[page]

    def _set_first(self, slot: int, page: int) -> None:
        """Slot `slot` lends its sinks to hits on `page` from now on (-1: to none)."""
        old = self.first_of.pop(slot, -1)
        if old in self.first:
            self.first[old].discard(slot)
            if not self.first[old]:
                del self.first[old]
        if page >= 0:
            self.first.setdefault(page, set()).add(slot)
            self.first_of[slot] = page

    def _drop_stored(self, page: int) -> None:
        entry = self.stored.pop(page, None)
        if entry is not None:
            del self.stored_at[entry]

    def _keep_sinks(self, slot: int) -> None:
        """Before `slot` is given to another request: its sinks into the store when no other slot lends them."""
        page = self.first_of.get(slot, -1)
        if page < 0 or self.first[page] != {slot} or self.slots[slot].length < self.sinks or not self.sinks:
            return
        entry = self.stored.get(page)
        if entry is None:
            free = set(range(len(self.slots))) - set(self.stored_at)
            # (an entry read or written this step is not taken: the saves run before this step's inits)
            old = [e for e, (_, step) in self.stored_at.items() if step < self.step]
            if not free and not old:
                return
            entry = min(free) if free else min(old, key=lambda e: self.stored_at[e][1])
            if entry in self.stored_at:
                self._drop_stored(self.stored_at[entry][0])
            self.stored[page] = entry
        self.stored_at[entry] = (page, self.step)
        self.saves.append((slot, entry))

    def _free_slot(self, avoid: set[int], fallback: int = -1) -> int:
        """The least recently used slot outside `avoid`, growing the pool rather than reuse one that was
        used in the previous step (else `fallback`), its keys dropped."""
        best = min((s for s in range(len(self.slots)) if s not in avoid), key=lambda s: self.slots[s].last_step,
                   default=None)
        if (best is None or self.slots[best].last_step >= self.step - 1) and len(self.slots) < self.limit:
            best = len(self.slots)
            self.slots += [_Slot() for _ in range(min(len(self.slots), self.limit - len(self.slots)))]
        if best is None:
            if fallback < 0:
                raise RuntimeError(f"torch_rkv: more running requests than the {len(self.slots)} side slots "
                                   "(max_num_seqs)")
            best = fallback
        self._unkey(best)
        self._keep_sinks(best)
        self._set_first(best, -1)
        return best

    def assign(self, cached: list[int], counts: list[int], tables: list[list[int]]):
        """(slot per row, SlotInits) for rows with `cached` tokens, `counts` new ones and their pages."""
        self.step += 1
        self.saves = []
        p = self.page_size

        def holds(s, n, pages):  # whether slot s holds this request's first n tokens (and rejected drafts)
            sl = self.slots[s]
            if sl.page0 != pages[0] or not n <= sl.length <= n + self.drafts:
                return False
            return sl.length == n or n % p or (n // p < len(pages) and pages[n // p] == sl.open_page)

        def lookup(n, pages):  # the slot that holds this request's first n tokens, from the step's start
            if n == 0:
                return None
            found = [s for s in self.key.get(pages[(n - 1) // p], ()) if holds(s, n, pages)]
            return min(found, key=lambda s: (self.slots[s].length != n, s), default=None)

        found = [lookup(n, pages) for n, pages in zip(cached, tables)]
        donors, entries = [-1] * len(found), [-1] * len(found)
        for i, (n, pages) in enumerate(zip(cached, tables)):
            if found[i] is None and n > 0:  # a prefix-cache hit, or a request that lost its slot: its sinks
                donors[i] = min((d for d in self.first.get(pages[0], ())  # from a slot with the same first page
                                 if self.slots[d].length >= min(self.sinks, n)), default=-1)
                if donors[i] < 0 and pages[0] in self.stored:  # else from the store (read this step: kept)
                    entries[i] = self.stored[pages[0]]
                    self.stored_at[entries[i]] = (pages[0], self.step)
        keep = {s for s in found if s is not None}  # slots this step reads: not to be reused by the others
        slots, inits, taken = [], [], set()
        for i, (n, m, pages) in enumerate(zip(cached, counts, tables)):
            if m == 0 and n == 0:  # padding: no token read or written
                slots.append(0)
                continue
            slot = found[i]
            if slot is not None and slot in taken:  # two requests at the same point of the same tokens
                dst = self._free_slot(taken | keep)
                inits.append(SlotInit(dst, slot, -1, n, pages))
                slot = dst
            elif slot is None:
                donor = donors[i]
                slot = self._free_slot(taken | keep | {donor}, fallback=donor if donor not in taken | keep else -1)
                if n > 0:
                    inits.append(SlotInit(slot, -1, donor, n, pages, entries[i]))
            taken.add(slot)
            slots.append(slot)
            sl = self.slots[slot]
            self._unkey(slot)
            if slot != found[i]:  # a request new to this slot (a sliding layer's table keeps the ids of pages it
                self._set_first(slot, pages[0])  # freed: a running request's first page may be another's now)
            sl.length, sl.page0, sl.last_step = n + m, pages[0], self.step
            # the pages it writes are its own now: a slot keyed there by a request that has left (vLLM gave
            # the page to this one) must not be found under them again, nor lend its sinks as the first
            # page's (a later hit on this request's first page would take another prompt's sinks)
            for page in pages[n // p : (n + m - 1) // p + 1]:
                for other in self.key.pop(page, set()) - {slot}:
                    self.keyed[other].remove(page)
                for other in self.first.get(page, set()) - {slot}:
                    self._set_first(other, -1)  # (its own slot keeps its rows: only the lending stops)
                self._drop_stored(page)
            if n + m > 0:
                sl.open_page = pages[(n + m - 1) // p]
                keyed = sorted(set(pages[max(0, n + m - 1 - self.drafts) // p : (n + m - 1) // p + 1]))
                for page in keyed:
                    self.key.setdefault(page, set()).add(slot)
                self.keyed[slot] = keyed
        return slots, inits


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
