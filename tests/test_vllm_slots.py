"""The vLLM backend's side slots (torch_rkv/integrations/vllm_slots.py): requests followed from step to
step by the pages they write, new slots initialized on a prefix-cache hit, least recently used reuse."""

import pytest

from torch_rkv.integrations.vllm_slots import SlotTracker, growth_beyond_headroom

P = 4  # tokens per page


def pages_for(first: int, n: int) -> list[int]:
    """A request's pages: ids first, first + 1, ... enough for n tokens."""
    return list(range(first, first + -(-n // P)))


def test_requests_keep_their_slots_across_steps_and_page_boundaries():
    t = SlotTracker(4, P, sinks=2)
    slots, inits = t.assign([0, 0], [6, 3], [pages_for(10, 6), pages_for(20, 3)])  # two prefills
    assert len(set(slots)) == 2 and inits == []
    a, b = slots
    for step in range(8):  # decode: 6, 7, 8 (a page boundary), ... tokens cached
        slots, inits = t.assign([6 + step, 3 + step], [1, 1], [pages_for(10, 7 + step), pages_for(20, 4 + step)])
        assert slots == [a, b] and inits == []


def test_a_prefix_cache_hit_gets_a_new_slot_with_the_donors_sinks():
    t = SlotTracker(4, P, sinks=2)
    (a,), _ = t.assign([0], [9], [pages_for(10, 9)])
    # b shares a's first two full pages (8 tokens), its own page 30 on
    shared = pages_for(10, 8)
    (b,), inits = t.assign([8], [3], [shared + [30]])
    assert b != a and len(inits) == 1
    init = inits[0]
    assert (init.dst, init.src, init.sinks_from, init.cached) == (b, -1, a, 8)
    # next step b continues in its own slot
    (b2,), inits = t.assign([11], [1], [shared + [30]])
    assert b2 == b and inits == []


def test_two_requests_at_the_same_point_of_the_same_tokens_copy_the_slot():
    t = SlotTracker(4, P, sinks=2)
    (a,), _ = t.assign([0], [8], [pages_for(10, 8)])  # a fills two pages exactly
    # a and a request that hit a's two pages both start their third page now
    slots, inits = t.assign([8, 8], [1, 1], [pages_for(10, 8) + [12], pages_for(10, 8) + [40]])
    assert slots[0] == a and slots[1] != a
    assert [(i.dst, i.src) for i in inits] == [(slots[1], a)]


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
@pytest.mark.parametrize("start", [2, 3, 4, 5, 7])  # (drafts within a page, across its end, from its end)
def test_a_request_keeps_its_slot_when_its_drafts_are_rejected(start, accepted):
    """Speculative decoding: a step appends a token and 3 drafts, the next resumes after the accepted
    ones (the rest are rewritten): the same slot, whichever page the drafts reached; without room for
    drafts the tracker would take the request for a new one."""
    for drafts, same in ((3, True), (0, accepted == 3)):
        t = SlotTracker(4, P, sinks=2, drafts=drafts)
        (a,), _ = t.assign([0], [start], [pages_for(10, start)])
        t.assign([start], [4], [pages_for(10, start + 4)])  # the next token and 3 drafts
        n = start + 1 + accepted  # the verified token(s) and the bonus one
        for m in (1, 4):  # whether or not this step drafts again (its pages reach less far)
            t2 = __import__("copy").deepcopy(t)
            (a2,), inits = t2.assign([n], [m], [pages_for(10, n + m)])
            assert (a2 == a and inits == []) == same, (drafts, n, m)


def test_a_prefix_hit_does_not_take_a_slot_whose_drafts_passed_the_shared_page():
    """Request a filled page 10 and drafted into its page 11; b hits a's full page 10 (8 tokens: two
    pages of 4 here, 10 and 11 are a's) while a sits out a step. b starts in a new slot with a's sinks,
    and a, back, still finds its own slot."""
    t = SlotTracker(4, P, sinks=2, drafts=3)
    (a,), _ = t.assign([0], [6], [[9, 10]])
    t.assign([6], [4], [[9, 10, 11]])  # a: a token and 3 drafts, to 10 tokens
    (b,), inits = t.assign([8], [2], [[9, 10, 30]])  # b: a's two full pages, its own page 30
    assert b != a and [(i.dst, i.src, i.sinks_from) for i in inits] == [(b, -1, a)]
    (a2,), inits = t.assign([8], [1], [[9, 10, 11]])  # a: 1 of 3 drafts accepted, and the bonus token
    assert a2 == a and inits == []


@pytest.mark.parametrize("drafts", [0, 3])
def test_a_page_given_to_another_request_no_longer_finds_the_slot_of_the_one_that_left(drafts):
    """r0 wrote pages 10 and 11 and left; r hits the full page 10 and vLLM gives it page 11 again. r
    keeps the slot it starts in at every later step, and never switches to r0's (whose length r passes
    through). With drafts it may start in r0's: r0 is gone, and the slot's rows of r's first 4 tokens
    are r0's of the same shared page."""
    t = SlotTracker(4, P, sinks=2, drafts=drafts)
    (r0,), _ = t.assign([0], [5], [[10, 11]])
    t.assign([5], [1], [[10, 11]])  # r0 at 6 tokens, then it leaves
    (r,), inits = t.assign([4], [1], [[10, 11]])  # r: a hit on page 10, page 11 its own now
    if drafts == 0:
        assert r != r0 and [(i.dst, i.sinks_from) for i in inits] == [(r, r0)]
    for n in (5, 6, 7):
        (again,), inits = t.assign([n], [1], [[10, 11]])
        assert again == r and inits == [], n


def test_a_hit_never_takes_sinks_from_a_request_whose_first_page_was_given_to_another():
    """a began in page 10 and left; vLLM evicted its pages and gave page 10 to b, a new prompt, as b's
    first page. A hit on b's first page must take b's sinks (or read them back), never a's, whose slot
    still names page 10 as where it began: a's first tokens need not be b's. When page 10 went to b as a
    later page, a's slot no longer lends sinks for page 10 either (a hit beginning there would be
    another request's, which first writes it)."""
    for b_pages in ([10, 12], [12, 10]):
        t = SlotTracker(8, P, sinks=2, initial=4)
        (a,), _ = t.assign([0], [8], [[10, 11]])
        t.assign([0], [3], [[20]])  # another request, so that a's slot ages and b takes a new one
        (b,), _ = t.assign([0], [8], [b_pages])
        assert b != a
        (c,), inits = t.assign([4], [2], [[b_pages[0], 13]])
        assert [(i.dst, i.sinks_from) for i in inits] == [(c, b)], b_pages
        assert a not in t.first.get(10, ())


def test_a_sliding_layers_request_keeps_its_slot_when_its_first_page_is_given_away():
    """A sliding layer's block table keeps the ids of the pages vLLM freed behind the window: running
    request a still shows page 10 first after vLLM gave it to b, a new prompt. a keeps its slot (found by
    its table, as before), and a hit on b's first page takes b's sinks, not a's."""
    t = SlotTracker(8, P, sinks=2, initial=4)
    (a,), _ = t.assign([0], [8], [[10, 11]])
    slots, _ = t.assign([8, 0], [1, 4], [[10, 11, 12], [10]])  # page 10 is b's now; a's table still names it
    assert slots[0] == a
    b = slots[1]
    assert t.assign([9, 4], [1, 1], [[10, 11, 12], [10, 13]]) == ([a, b], [])
    slots, inits = t.assign([10, 4], [1, 2], [[10, 11, 12], [10, 14]])  # a hit on b's full first page
    assert slots[0] == a and [(i.dst, i.src, i.sinks_from) for i in inits] == [(slots[1], -1, b)]


def test_a_slots_sinks_outlive_it_in_the_sink_store():
    """A slot given to another request while it is the last to lend its sinks leaves them in the sink store
    (a save the layers copy before the step); a request coming back to that cached prefix later (a chat's
    next turn) takes them from there instead of reading them back from their quantized rows. The entry goes
    when another request writes the page, and the store never holds more entries than the pool slots."""
    t = SlotTracker(2, P, sinks=2, initial=2)
    (a,), _ = t.assign([0], [8], [[10, 11]])
    (b,), _ = t.assign([0], [3], [[20]])
    (c,), _ = t.assign([0], [3], [[30]])  # a left: its slot goes to c, its sinks to the store
    assert c == a and len(t.saves) == 1 and t.saves[0][0] == a
    kept = t.saves[0][1]
    (d,), inits = t.assign([4], [2], [[10, 40]])  # the next turn of a's conversation hits page 10
    assert d == b and [(i.dst, i.src, i.sinks_from, i.sinks_stored) for i in inits] == [(d, -1, -1, kept)]
    assert [slot for slot, _ in t.saves] == [b] and t.saves[0][1] != kept and len(t.stored_at) <= len(t.slots)
    assert set(t.stored) == {10, 20}
    t.assign([0], [4], [[20]])  # page 20, b's first, is written by a new prompt: its stored sinks go
    assert 20 not in t.stored and len(t.stored) == len(t.stored_at) <= len(t.slots)


def test_a_store_entry_read_in_a_step_is_not_given_to_another_page_in_it():
    """The layers copy a step's saves before its inits: an entry an init reads in this step must not take
    another slot's sinks in the same step. A pool of one slot (one entry): a request comes back to page 10
    (its sinks from the entry) while another's slot goes to it, which would have saved into that entry."""
    t = SlotTracker(1, P, sinks=2, initial=1)
    t.assign([0], [8], [[10, 11]])
    t.assign([0], [3], [[20]])  # the only slot goes to another request: page 10's sinks into the one entry
    assert t.stored == {10: 0}
    (d,), inits = t.assign([4], [2], [[10, 40]])  # (the slot goes to it: page 20's sinks are not kept)
    assert [(i.src, i.sinks_from, i.sinks_stored) for i in inits] == [(-1, -1, 0)] and t.saves == []
    assert t.stored == {10: 0}


def test_slots_of_requests_that_left_are_reused_least_recently_used_first():
    t = SlotTracker(2, P, sinks=0)
    (a,), _ = t.assign([0], [3], [[1]])
    (b,), _ = t.assign([0], [3], [[2]])
    (c,), _ = t.assign([0], [3], [[3]])  # a left long ago: its slot
    assert c == a and b != a
    with pytest.raises(RuntimeError, match="more running requests than the 2 side slots"):
        t.assign([0, 0, 0], [1, 1, 1], [[5], [6], [7]])


def test_a_preempted_request_restarts_in_a_fresh_slot():
    t = SlotTracker(3, P, sinks=2)
    (a,), _ = t.assign([0], [6], [pages_for(10, 6)])
    (a2,), inits = t.assign([0], [6], [pages_for(50, 6)])  # recomputed from scratch in other pages
    assert inits == [] and a2 != a
    (a3,), inits = t.assign([6], [1], [pages_for(50, 7)])
    assert a3 == a2 and inits == []


def test_the_pool_grows_with_the_requests_running_at_once_not_past_its_limit():
    t = SlotTracker(8, P, sinks=0, initial=1)
    for first in range(1, 6):  # one request at a time, each leaving: the slots of those idle for a step
        t.assign([0], [3], [[first]])
    assert len(t.slots) == 2
    slots, _ = t.assign([0] * 5, [1] * 5, [[10 + i] for i in range(5)])  # five at once: doubled to 8
    assert len(set(slots)) == 5 and len(t.slots) == 8
    slots2, _ = t.assign([1] * 5, [1] * 5, [[10 + i] for i in range(5)])
    assert slots2 == slots and len(t.slots) == 8
    with pytest.raises(RuntimeError, match="more running requests than the 8 side slots"):
        t.assign([0] * 9, [1] * 9, [[30 + i] for i in range(9)])


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
