"""A step's side-pool work in the vLLM plugin (torch_rkv/integrations/vllm_side.py): the metadata builder
turns the step's sink-store saves and slot inits into index tensors once, and each layer runs them in a
handful of ops. Checked against the saves, then the inits, run one at a time the way SlotInit describes
them."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedbuild import Pool
from torch_rkv import reference as ref
from torch_rkv.integrations.vllm_side import plan_side_work, run_side_work
from torch_rkv.integrations.vllm_slots import SlotInit
from torch_rkv.layout import PageLayout, side_shapes
from torch_rkv.scheme import by_name

H, D, P, SLOTS, PAGES = 2, 32, 16, 6, 24


def one_at_a_time(pool: Pool, scheme, inits, saves, ring: int) -> dict:
    """The side pool after the saves, then each init alone: the sinks a prefix holds (min(sinks, cached)
    rows), and the window's rows dequantized from the request's pages, as SlotInit describes."""
    side = {k: v.clone() for k, v in pool.side.items()}
    v = pool.views
    for slot, entry in saves:
        for part in "kv":
            side[f"{part}_sink_store"][entry] = side[f"{part}_sink"][slot]
    for init, pages in inits:
        need = min(scheme.sinks, init.cached)
        positions = range(max(scheme.sinks, ref.quantized_count(init.cached, scheme.recent, scheme.block)),
                          init.cached)
        for part, bits in (("k", scheme.k_bits), ("v", scheme.v_bits)):
            sink = side[f"{part}_sink"]
            src = sink[init.sinks_from] if init.sinks_from >= 0 else side[f"{part}_sink_store"][init.sinks_stored]
            sink[init.dst, :, :need] = src[:, :need].clone()
            for p in positions:
                row = ref.read_rows(v[f"{part}_codes"], v[f"{part}_scale"], v.get(f"{part}_zero"), bits,
                                    torch.tensor([pages[p // P]]), torch.tensor([p % P]), None,
                                    v.get(f"{part}_outliers"), scheme.block)
                side[f"{part}_window"][init.dst, :, p % ring] = row[:, 0].to(side[f"{part}_window"].dtype)
    return side


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["rkv-4", "rkv-sparse-2", "kivi-2"]), st.data())
def test_a_steps_side_work_is_each_save_then_each_init_alone(name, data):
    """Random saves and inits (destinations distinct and never a donor, as SlotTracker plans them; cached
    lengths whole blocks), on a canary-filled pool: every sink row a prefix holds and every window row
    read back is what one init at a time gives, bit for bit, and nothing else changes but the sink rows
    past a short prefix's own tokens (its append writes them before any read)."""
    s = by_name(name)  # (blocks of 8 tokens, for the test's pages of 16)
    scheme = s.replace(k_block_tokens=min(s.k_block_tokens, 8), v_block_tokens=min(s.v_block_tokens, 8), recent=8)
    layout = PageLayout(scheme, H, D, P, torch.float32)
    ring = side_shapes(scheme, 1, 1, 1, torch.float32)["k_window"][0][2]
    pool = Pool(layout, PAGES, SLOTS, torch.Generator().manual_seed(data.draw(st.integers(0, 2**16))))
    for part in "kv":  # the plugin's sink store: one entry a slot
        pool.side[f"{part}_sink_store"] = torch.randn_like(pool.side[f"{part}_sink"])
    slots = data.draw(st.permutations(range(SLOTS)))
    n_inits = data.draw(st.integers(0, 3))
    dsts, donors = slots[:n_inits], slots[n_inits:]
    inits = []
    for dst in dsts:
        cached = scheme.block * data.draw(st.integers(1, 8))
        pages = data.draw(st.lists(st.integers(0, PAGES - 1), min_size=-(-cached // P), max_size=-(-cached // P)))
        if data.draw(st.booleans()):
            inits.append((SlotInit("r", dst, cached, sinks_from=data.draw(st.sampled_from(donors))), pages))
        else:
            inits.append((SlotInit("r", dst, cached, sinks_stored=data.draw(st.integers(0, SLOTS - 1))), pages))
    saves = [(s, e) for s, e in zip(data.draw(st.permutations(range(SLOTS))), range(data.draw(st.integers(0, 3))))]
    want = one_at_a_time(pool, scheme, inits, saves, ring)

    work = plan_side_work(inits, saves, scheme, P, ring, "cpu")
    if not inits and not saves:
        assert work is None
        return
    got = {k: v.clone() for k, v in pool.side.items()}
    outliers = (pool.views.get("k_outliers"), pool.views.get("v_outliers"))
    run_side_work(work, got, pool.views, scheme, (None, None), outliers)
    for name_, t in want.items():
        w, g = t.clone(), got[name_].clone()
        if name_.endswith("_sink"):  # (rows past a short prefix's own tokens: free)
            for init, _ in inits:
                w[init.dst, :, min(scheme.sinks, init.cached):] = 0
                g[init.dst, :, min(scheme.sinks, init.cached):] = 0
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name_}: {m}")


def test_no_saves_and_no_inits_is_no_work():
    assert plan_side_work([], [], by_name("rkv-4"), P, 24, "cpu") is None
