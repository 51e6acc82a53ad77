"""The vLLM plugin's side slots (torch_rkv/integrations/vllm_slots.py): a request keeps its slot from the
step vLLM first schedules it until vLLM names it finished, aborted or preempted; a prefix-cache hit takes
its sinks from a request with the same first block or from the sink store, and a first block whose sinks
are kept nowhere leaves vLLM's prefix cache.

The stateful test drives the tracker with a fake scheduler that knows the request ids, and a fake worker
that follows every slot's rows symbolically (which token each row holds), as the layers would fill them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_rkv.integrations.vllm_slots import Row, SlotTracker, growth_beyond_headroom, pool_slots

B, S, RECENT = 4, 2, 4  # the scheme's block, sinks and recent window in the fake engine


def quantized(n: int) -> int:
    """Tokens of a sequence of n that its pages hold quantized and the attention reads from there."""
    return B * (max(0, n - RECENT) // B)


def test_a_running_request_keeps_its_slot_however_many_steps_it_misses():
    t = SlotTracker(4, S, B, initial=2)
    a = t.step([Row("a", 0, 6, "A", True), Row("b", 0, 3, None, True)]).slots["a"]
    for step in range(10):  # a sits out; others come and go and take the free slots
        plan = t.step([Row(f"x{step}", 0, 3, None, True)], leaving=[f"x{step - 1}"])
        assert a not in plan.slots.values()
    assert t.step([Row("a", 6, 1, "A")]) .slots == {"a": a}


def test_a_prefix_hit_takes_its_sinks_from_a_running_request_with_the_same_first_block():
    t = SlotTracker(4, S, B)
    a = t.step([Row("a", 0, 9, "A", True)]).slots["a"]
    plan = t.step([Row("h", 8, 3, "A", True)])
    assert [(i.req, i.dst, i.cached, i.sinks_from, i.sinks_stored) for i in plan.inits] == \
        [("h", plan.slots["h"], 8, a, -1)] and plan.slots["h"] != a


def test_a_leaving_requests_sinks_go_to_the_store_and_a_later_hit_reads_them():
    t = SlotTracker(2, S, B, initial=2)
    a = t.step([Row("a", 0, 8, "A", True)]).slots["a"]
    plan = t.step([Row("b", 0, 3, None, True)], leaving=["a"])
    assert plan.saves == [(a, 0)] and plan.evict == []
    plan = t.step([Row("h", 4, 2, "A", True)])
    assert [(i.sinks_from, i.sinks_stored) for i in plan.inits] == [(-1, 0)]


def test_a_full_store_drops_its_oldest_entry_and_evicts_that_prefix():
    t = SlotTracker(1, S, B, initial=1)
    t.step([Row("a", 0, 8, "A", True)])
    assert t.step([Row("b", 0, 8, "B", True)], leaving=["a"]).saves == [(0, 0)]
    plan = t.step([Row("c", 0, 3, None, True)], leaving=["b"])
    assert plan.saves == [(0, 0)] and plan.evict == ["A"]  # the one entry now keeps B's sinks
    with pytest.raises(RuntimeError, match="no side slot or sink-store entry keeps"):
        t.step([Row("h", 4, 1, "A", True)])  # (vLLM would have dropped A's first block: a bug if it hits)


def test_two_hits_in_a_step_never_take_each_others_donor():
    """Path 2 of the issue: row X must not take the idle slot that row Y copies its sinks from. The
    donors leave in this step; their slots lend first and are reused only in a later step."""
    t = SlotTracker(4, S, B, initial=4)
    t.step([Row("p", 0, 8, "P", True), Row("q", 0, 8, "Q", True)])
    donors = {t.requests["p"].slot, t.requests["q"].slot}
    plan = t.step([Row("x", 4, 1, "Q", True), Row("y", 4, 1, "P", True)], leaving=["p", "q"])
    assert {i.dst for i in plan.inits}.isdisjoint(donors)
    assert {i.sinks_from for i in plan.inits} == donors


def test_a_hit_at_a_running_requests_length_does_not_take_its_slot():
    """Path 3: a hit at exactly the length of a running request that sits out the step."""
    t = SlotTracker(4, S, B)
    a = t.step([Row("a", 0, 8, "A", True)]).slots["a"]
    plan = t.step([Row("h", 8, 1, "A", True)])
    assert plan.slots["h"] != a and plan.inits[0].sinks_from == a


def test_a_hit_that_is_not_block_aligned_is_refused():
    """Rows of an open block live only in a slot: a request that starts inside one cannot be rebuilt."""
    t = SlotTracker(4, S, B)
    t.step([Row("a", 0, 8, "A", True)])
    with pytest.raises(RuntimeError, match="not a multiple of the scheme's block"):
        t.step([Row("h", 6, 1, "A", True)])


def test_a_request_continued_without_a_slot_is_refused():
    with pytest.raises(RuntimeError, match="never started in a side slot"):
        SlotTracker(4, S, B).step([Row("a", 3, 1, None)])


def test_the_pool_grows_only_when_every_slot_is_held_and_never_past_its_limit():
    t = SlotTracker(8, S, B, initial=1)
    for i in range(5):  # one request at a time, each leaving before the next
        t.step([Row(f"r{i}", 0, 3, None, True)], leaving=[f"r{i - 1}"])
    assert t.size == 1
    t.step([Row(f"s{i}", 0, 1, None, True) for i in range(5)], leaving=["r4"])
    assert t.size == 8
    with pytest.raises(RuntimeError, match="more running requests than the 8 side slots"):
        t.step([Row(f"u{i}", 0, 1, None, True) for i in range(4)])
    assert t.size <= pool_slots(5, 8, 1)


# ------------------------------------------------------------------------------------------------
# A fake scheduler and worker
# ------------------------------------------------------------------------------------------------


@dataclass
class FakeRequest:
    tokens: list  # every token it will hold (its prompt, then what it generates)
    n: int = 0  # tokens it holds in its pages (computed)
    started: bool = False
    pending_new: bool = True  # its next row is its first (or first after a preemption)


@dataclass
class FakeWorker:
    """Every slot's sink and window rows as {position: token}, and the sink store's entries."""

    slots: dict = field(default_factory=dict)
    store: dict = field(default_factory=dict)

    def rows(self, slot: int) -> tuple[dict, dict]:
        return self.slots.setdefault(slot, ({}, {}))

    def run(self, plan, scheduled: list[tuple[str, int, list]], tokens: dict) -> None:
        """A step's layers: saves, inits, then each row's append of its tokens (drafts included)."""
        for slot, entry in plan.saves:
            self.store[entry] = dict(self.rows(slot)[0])
        for init in plan.inits:
            sinks, window = self.rows(init.dst)
            sinks.clear()
            window.clear()
            need = min(S, init.cached)
            if need:
                src = self.rows(init.sinks_from)[0] if init.sinks_from >= 0 else self.store[init.sinks_stored]
                sinks.update({p: src[p] for p in range(need)})
            written = B * (init.cached // B)  # the page rows an append wrote: whole blocks
            for p in range(max(S, quantized(init.cached)), init.cached):
                assert p < written, f"an init reads row {p} of a page, which holds only {written} written rows"
                window[p] = tokens[init.req][p]
        for req, n, appended in scheduled:
            sinks, window = self.rows(plan.slots[req])
            for i, tok in enumerate(appended):
                (sinks if n + i < S else window)[n + i] = tok


def run_schedule(draw, tracker_step, steps: int = 40, max_running: int = 3, limit: int = 6,
                 worker: FakeWorker | None = None) -> None:
    """Drive a tracker through a random schedule; after every step, every running request's slot must
    hold its own sinks and window. draw(lo, hi) picks an integer in [lo, hi]. tracker_step(rows,
    leaving, tables) returns the step's plan; tables: each row's pages (a block a page, as vLLM would
    give them: a hit's first pages are the cached prefix's, new ones are fresh), which the tracker the
    plugin used before vLLM's request ids followed requests by."""
    openings = [[100 + 10 * k + i for i in range(B)] for k in range(3)]  # first blocks that requests share
    cache: dict[tuple, int] = {}  # prefix (whole blocks) -> step last used: vLLM's prefix cache
    page_of: dict[tuple, int] = {}  # cached prefix -> the page of its last block
    pages: dict[str, list[int]] = {}  # each running request's pages
    fresh = itertools.count(1)  # page ids never used before
    reqs: dict[str, FakeRequest] = {}
    worker, slot_of, leaving, serial = worker or FakeWorker(), {}, [], 0
    for step in range(steps):
        running = [r for r, q in reqs.items() if q.started and not q.pending_new]
        if draw(0, 2) == 0 and len(reqs) < max_running:  # a new request, often one of the shared openings
            serial += 1
            prompt = openings[draw(0, 2)] + [serial * 1000 + i for i in range(draw(0, 9))]
            reqs[f"r{serial}"] = FakeRequest(prompt + [serial * 1000 + 500 + i for i in range(draw(1, 12))])
        for r in list(running):
            event = draw(0, 19)
            if event == 0:  # finished early or aborted
                leaving.append(r)
                del reqs[r]
                running.remove(r)
            elif event == 1:  # preempted: its pages are freed (whole blocks stay cached), it starts over later
                leaving.append(r)
                reqs[r].n, reqs[r].pending_new = 0, True
                running.remove(r)
        for key in [k for k in cache if draw(0, 29) == 0]:  # vLLM evicts some cached prefixes itself
            cache.pop(key, None)
            page_of.pop(key, None)
        rows, scheduled = [], []
        for r, q in reqs.items():
            if q.started and not q.pending_new and draw(0, 3) == 0:
                continue  # sits out this step (pipeline stages, encoder budget, a token budget)
            first = tuple(q.tokens[:B]) if len(q.tokens) >= B else None
            new = q.pending_new
            if new:  # a hit on the longest cached prefix of whole blocks, leaving a token to compute
                hit = 0  # (every block from the first cached: vLLM's hashes chain)
                while tuple(q.tokens[: hit + B]) in cache and hit + B < len(q.tokens):
                    hit += B
                for j in range(1, hit // B + 1):
                    cache[tuple(q.tokens[: j * B])] = step
                q.n, q.started, q.pending_new = hit, True, False
                pages[r] = [page_of[tuple(q.tokens[: j * B])] for j in range(1, hit // B + 1)]
            remaining = len(q.tokens) - q.n
            if remaining <= 0:
                continue
            drafts = draw(0, 2) if q.n > B else 0
            count = min(remaining, draw(1, 6)) if drafts == 0 else min(remaining, 1 + drafts)
            accepted = count if drafts == 0 else draw(1, count)
            appended = q.tokens[q.n: q.n + accepted] + [-1] * (count - accepted)  # rejected drafts: junk
            rows.append(Row(r, q.n, count, first, new))
            scheduled.append((r, q.n, appended))
            while len(pages[r]) * B < q.n + count:
                pages[r].append(next(fresh))
        if not rows and not leaving:
            continue
        plan = tracker_step(rows, leaving, [pages[row.req] for row in rows])
        for key in plan.evict:  # vLLM drops the first block, and so every prefix through it
            for prefix in [p for p in cache if p[:B] == key]:
                del cache[prefix]
                page_of.pop(prefix, None)
        leaving = []
        worker.run(plan, scheduled, {r: q.tokens for r, q in reqs.items()})
        for r, n, appended in scheduled:
            q = reqs[r]
            q.n += sum(1 for t in appended if t != -1)
            slot_of[r] = plan.slots[r]
            for j in range(1, q.n // B + 1):  # whole blocks become cached as they are computed
                cache.setdefault(tuple(q.tokens[: j * B]), step)
                page_of.setdefault(tuple(q.tokens[: j * B]), pages[r][j - 1])
            if q.n >= len(q.tokens):
                leaving.append(r)
                del reqs[r]
        for r, q in reqs.items():
            if not q.started or q.pending_new:
                continue
            sinks, window = worker.rows(slot_of[r])
            want_sinks = {p: q.tokens[p] for p in range(min(S, q.n))}
            want_window = {p: q.tokens[p] for p in range(max(S, quantized(q.n)), q.n)}
            assert {p: sinks.get(p) for p in want_sinks} == want_sinks, (step, r, "sinks")
            assert {p: window.get(p) for p in want_window} == want_window, (step, r, "window")
        assert len(set(slot_of[r] for r, q in reqs.items() if q.started and not q.pending_new)) == \
            sum(1 for q in reqs.values() if q.started and not q.pending_new)


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_every_running_request_holds_its_own_sinks_and_window_in_any_schedule(data):
    """Requests arrive, run, sit out steps, are preempted and resumed, abort mid-prefill, have drafts
    rejected and hit the prefix cache (three shared openings), several in a step sharing donors; vLLM
    also evicts cached prefixes on its own. A small pool (limit 6) fills its sink store often."""
    tracker = SlotTracker(6, S, B, initial=2)
    run_schedule(lambda lo, hi: data.draw(st.integers(lo, hi)), lambda rows, leaving, _: tracker.step(rows, leaving))


def test_side_pool_growth_past_the_gpu_headroom_is_named():
    """A 32 MiB slot (every layer's; Llama-3-8B's at rkv-4 in bf16 is 24 MiB) on an 80 GiB GPU at vLLM's
    default utilization (0.92: 6.4 GiB free): vLLM's H100-class default of 1024 running requests would
    grow the pool by 31.8 GiB, past that; 64 of them by 1.8 GiB, within half of it."""
    slot, gpu = 32 * 2**20, 80 * 2**30
    warning = growth_beyond_headroom(slot, 16, 1024 + 8, gpu, 0.92)
    assert warning is not None and "max_num_seqs" in warning and "gpu_memory_utilization=0.92" in warning
    assert "31.8 GiB" in warning  # (1032 - 16) slots of 32 MiB
    assert growth_beyond_headroom(slot, 16, 64 + 8, gpu, 0.92) is None
    assert growth_beyond_headroom(slot, 16, 8, gpu, 0.92) is None  # a pool that never grows
