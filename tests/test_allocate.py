"""Per-layer bit allocation: the knapsack is exact, the allocation spends its budget where the profile
says, the planner's bytes are the caches' bytes, and a per-layer cache serves what the simulation
measures."""

import itertools
import json
import math
import random

import pytest
import torch

from torch_rkv import allocate as A
from torch_rkv import plan
from torch_rkv import scheme as S


def brute_force(groups, capacity):
    best = (math.inf, None)
    for picks in itertools.product(*[range(len(g)) for g in groups]):
        if sum(g[i][0] for g, i in zip(groups, picks)) <= capacity:
            best = min(best, (sum(g[i][1] for g, i in zip(groups, picks)), picks))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_knapsack_is_exact(seed):
    rng = random.Random(seed)
    groups = [[(rng.randint(0, 6), rng.uniform(-1, 3)) for _ in range(rng.randint(1, 3))]
              for _ in range(rng.randint(1, 5))]
    capacity = rng.randint(0, 20)
    want, _ = brute_force(groups, capacity)
    if want == math.inf:
        with pytest.raises(ValueError, match="budget"):
            A.solve(groups, capacity)
        return
    picks = A.solve(groups, capacity)
    assert sum(g[i][0] for g, i in zip(groups, picks)) <= capacity
    assert math.isclose(sum(g[i][1] for g, i in zip(groups, picks)), want, abs_tol=1e-9)


def profile(layers, drops3, drops4=None):
    drops = {3: drops3}
    if drops4 is not None:
        drops[4] = drops4
    levels = (2, 3, 4) if drops4 is not None else (2, 3)
    return A.Sensitivity("tiny", "calibration", 64, levels, 10.0, {b: 10.0 for b in drops}, drops,
                         {b: [(0.0, 0.0)] * layers for b in drops})


def test_costs_chain_down_from_the_top_level():
    p = profile(2, [(0.1, 0.2), (0.3, 0.4)], [(1.0, 2.0), (3.0, 4.0)])
    assert p.cost(1, "k", 4) == 0 and p.cost(1, "k", 3) == 3.0 and math.isclose(p.cost(1, "v", 2), 4.4)
    with pytest.raises(ValueError, match="levels"):
        p.cost(0, "k", 8)
    again = A.Sensitivity.from_json(p.to_json())
    assert again == p and again.restricted((2, 3)).drops == {3: p.drops[3]}


def test_the_sensitive_sides_get_the_bits():
    """Half a bit above 2 on average over 4 layers: the 4 most costly (layer, side) drops keep 3 bits."""
    costs = [(0.5, 0.01), (0.02, 0.03), (0.9, 0.7), (0.04, 0.6)]
    alloc = A.allocate_average(profile(4, costs), 2.5)
    assert alloc.bits == ((3, 2), (2, 2), (3, 3), (2, 3))
    assert alloc.average_bits() == 2.5 and math.isclose(alloc.predicted, 0.01 + 0.02 + 0.03 + 0.04)
    assert [s.k_bits for s in alloc.schemes()] == [3, 2, 3, 2] and alloc.schemes()[1].k_clip  # rkv-2's keys
    assert A.allocate_average(profile(4, costs), 3.0).bits == ((3, 3),) * 4
    with pytest.raises(ValueError, match="outside"):
        A.allocate_average(profile(4, costs), 1.5)


def test_refine_takes_the_measured_moves_that_pay_within_the_budget():
    """Measured in place, layer 0's keys gain more from a fourth bit than layer 1's values lose from
    their third: the refined allocation trades them, at the same code size; moves that cost more than
    they save, or that the budget cannot hold, are left."""
    alloc = A.Allocation(((3, 3), (3, 3)), (2, 3, 4), predicted=0.0)
    moves = {(0, "k", 4): -0.5, (0, "k", 2): 0.3, (0, "v", 4): -0.05, (0, "v", 2): 0.2,
             (1, "k", 4): -0.01, (1, "k", 2): 0.4, (1, "v", 4): -0.02, (1, "v", 2): 0.1}
    better = A.refine(alloc, 0.9, moves)
    assert better.bits == ((4, 3), (3, 2)) and better.average_bits() == alloc.average_bits()
    assert math.isclose(better.predicted, 0.9 - 0.5 + 0.1)
    # nothing pays: the allocation stays, predicted at its measured cost
    stay = A.refine(alloc, 0.9, {key: abs(c) for key, c in moves.items()})
    assert stay.bits == alloc.bits and stay.predicted == 0.9
    # a sliding layer (weight 1 against 2) frees too little to pay for a full layer's upgrade: the
    # upgrade is paid by the full layer's own values, which cost more to drop
    assert A.refine(alloc, 0.9, moves, weights=[2, 1]).bits == ((4, 2), (3, 3))
    with pytest.raises(ValueError, match=r"move \(2, 'k', 4\)"):
        A.refine(alloc, 0.9, {(2, "k", 4): -1.0})


def test_edges_take_8_bits_inside_the_budget():
    """allocate_edges: the first and last layers at 8 bits, counted in the average; the middle layers
    allocated from the profile under what is left (the costliest sides keep the bits); a budget that
    cannot hold the edges is refused."""
    costs = [(0.5, 0.5), (0.02, 0.9), (0.8, 0.03), (0.04, 0.6), (0.1, 0.1)]
    alloc = A.allocate_edges(profile(5, costs), 4.6)  # 46 code bits: 32 on the edges, 14 on 3 middle layers
    assert alloc.bits[0] == alloc.bits[-1] == (8, 8) and 8 in alloc.levels
    assert alloc.bits[1:-1] == ((2, 3), (3, 2), (2, 2)) and math.isclose(alloc.predicted, 0.02 + 0.03 + 0.04 + 0.6)
    assert alloc.average_bits() == 4.6 and [s.k_bits for s in alloc.schemes()] == [8, 2, 3, 2, 8]
    with pytest.raises(ValueError, match="cannot hold two layers at 8 bits"):
        A.allocate_edges(profile(5, costs), 4.0)  # 8 bits left for 3 layers' 12 at 2 bits
    with pytest.raises(ValueError, match="no layers between"):
        A.allocate_edges(profile(2, costs[:2]), 6.0)


def test_layers_of_one_allocation_differ_only_in_bits():
    a, b = A.layer_scheme(2, 4, (2, 3, 4)), A.layer_scheme(4, 3, (2, 3, 4))
    assert (a.k_bits, a.v_bits, a.k_clip, b.k_clip) == (2, 4, True, False)
    fields = ("sinks", "recent", "k_block_tokens", "pre_rope", "v_hadamard", "k_group_size")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields] == \
        [getattr(S.recommended(2), f) for f in fields]


@pytest.mark.parametrize("seed", range(10))
def test_a_split_keeps_every_layers_total_and_takes_its_cheapest_split(seed):
    """allocate_split: every layer at 2 x target key + value bits, each layer's split the cheapest of
    its choices (brute force over the levels; ties to more key bits)."""
    rng = random.Random(seed)
    layers = rng.randint(1, 6)
    p = profile(layers, [(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(layers)],
                [(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(layers)])
    for target in (2.0, 2.5, 3.0, 3.5, 4.0):
        alloc = A.allocate_split(p, target)
        assert alloc.layer_totals() == [int(2 * target)] * layers
        for layer, (k, v) in enumerate(alloc.bits):
            options = [(p.cost(layer, "k", kk) + p.cost(layer, "v", 2 * target - kk), -kk)
                       for kk in (2, 3, 4) if 2 * target - kk in (2, 3, 4)]
            assert (p.cost(layer, "k", k) + p.cost(layer, "v", v), -k) == min(options)
        assert math.isclose(alloc.predicted, sum(p.cost(i, "k", k) + p.cost(i, "v", v)
                                                 for i, (k, v) in enumerate(alloc.bits)))
    costs = [(0.5, 0.01), (0.02, 0.9)]  # layer 0's keys, layer 1's values hurt most when dropped
    assert A.allocate_split(profile(2, costs, [(0.0, 0.0)] * 2), 2.5).bits == ((3, 2), (2, 3))
    assert A.allocate_split(profile(1, [(0.0, 0.0)], [(0.0, 0.0)]), 3.0).bits == ((4, 2),)  # a tie: keys
    for bad in (2.25, 1.5, 4.5):
        with pytest.raises(ValueError, match="multiple of 0.5"):
            A.allocate_split(p, bad)
    gap = A.Sensitivity("tiny", "calibration", 64, (2, 4), 10.0, {4: 10.0}, {4: [(0.0, 0.0)]}, {4: [(0.0, 0.0)]})
    with pytest.raises(ValueError, match="5 key \\+ value bits have no split"):
        A.allocate_split(gap, 2.5)


def test_a_split_gives_every_layer_pages_of_the_same_bytes():
    """Equal key + value bits: every layer's page has the same bytes (an engine with one page size for
    every layer can hold them); other totals give other pages."""
    from torch_rkv.layout import PageLayout

    split = A.Allocation(((4, 2), (3, 3), (2, 4)), (2, 3, 4), 0.0).schemes()
    for heads, dim in ((3, 64), (8, 128), (1, 80)):
        pages = {PageLayout(s, heads, dim, 128).page_bytes for s in split}
        assert len(pages) == 1
        assert pages != {PageLayout(A.layer_scheme(3, 2, (2, 3, 4)), heads, dim, 128).page_bytes}


def test_an_allocation_file_round_trips_and_is_checked(tmp_path):
    alloc = A.Allocation(((4, 2), (3, 3)), (2, 3, 4), 0.25)
    path = tmp_path / "a.json"
    alloc.save(path, model="tiny", calibration="64 tokens")
    assert A.Allocation.load(path) == alloc
    d = json.loads(path.read_text())
    for change, match in (({"format": "other"}, "not a torch_rkv.allocation"), ({"bits": [[4, 5]]}, "layer 0"),
                          ({"bits": []}, "no layers"), ({"version": 2}, "version 1"),
                          ({"bits": [4, 2]}, "needs 'levels'"), ({"levels": None}, "needs 'levels'")):
        path.write_text(json.dumps({**d, **change}))
        with pytest.raises(ValueError, match=match):
            A.Allocation.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="JSON"):
        A.Allocation.load(path)


def test_an_allocations_layout_travels_in_its_file(tmp_path):
    """sparse / lean: every layer rkv-sparse's outliers and / or rkv-lean's float8 value metadata, beside its
    bits; saved only when set (a plain allocation's file is as before), read back, and checked."""
    plain = A.Allocation(((4, 2), (3, 3)), (2, 3, 4), 0.25)
    path = tmp_path / "a.json"
    plain.save(path)
    assert "sparse" not in json.loads(path.read_text()) and A.Allocation.load(path) == plain
    for layout in (dict(sparse=True), dict(lean=True), dict(sparse=True, lean=True)):
        alloc = plain.with_layout(**layout)
        alloc.save(path)
        assert A.Allocation.load(path) == alloc
        for s, (k, v) in zip(alloc.schemes(), alloc.bits):
            assert (s.k_bits, s.v_bits) == (k, v)
            assert s.outliers == (S.SPARSE_FRACTION if layout.get("sparse") else 0.0)
            assert s.side_meta_dtype("v") == (S.LEAN_META if layout.get("lean") else torch.float16)
            assert s.side_meta_dtype("k") == torch.float16
    path.write_text(json.dumps({**json.loads(path.read_text()), "lean": "yes"}))
    with pytest.raises(ValueError, match="'lean' must be true or false"):
        A.Allocation.load(path)


def test_the_vllm_plugin_takes_an_allocation_file(tmp_path, monkeypatch):
    """TORCH_RKV_ALLOCATION (torch_rkv.integrations.vllm; vLLM itself is not imported here): each
    layer's scheme from the file, whether or not the layers' key + value totals are equal (each layer's
    pages have its own bytes), layer 0's for the shared sinks, window and block; a file beside
    TORCH_RKV_SCHEME is refused by name."""
    from torch_rkv.integrations import vllm as plugin

    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.delenv(plugin.CODEBOOK_ENV, raising=False)
    for bits in (((4, 2), (3, 3), (2, 4)), ((3, 3), (4, 3), (2, 2))):
        path = tmp_path / f"{len({k + v for k, v in bits})}.json"
        A.Allocation(bits, (2, 3, 4), 0.0).save(path)
        monkeypatch.setenv(plugin.ALLOCATION_ENV, str(path))
        layers = plugin.configured_layers()
        assert [(s.k_bits, s.v_bits) for s in layers] == list(bits)
        assert plugin.configured_scheme() == layers[0]
        assert {(s.sinks, s.recent, s.block) for s in layers} == {(layers[0].sinks, layers[0].recent, layers[0].block)}
    lean = tmp_path / "lean.json"
    A.Allocation(((4, 2), (3, 3)), (2, 3, 4), 0.0, sparse=True, lean=True).save(lean)
    monkeypatch.setenv(plugin.ALLOCATION_ENV, str(lean))
    assert all(s.outliers and s.v_meta_dtype == S.LEAN_META for s in plugin.configured_layers())
    monkeypatch.setenv(plugin.ENV, "rkv-3")
    with pytest.raises(ValueError, match="unset TORCH_RKV_SCHEME"):
        plugin.configured_scheme()


def test_calibrate_writes_the_allocation_or_the_split_it_is_asked_for(tmp_path, monkeypatch, capsys):
    """python -m torch_rkv calibrate --bits B / --split B: the allocation file at B average code bits
    (each layer its cheapest bits; or every layer the same total), from the profile (here a given one,
    in place of a measured one); a width outside the levels is refused before any calibration."""
    from torch_rkv.__main__ import main
    from torch_rkv.eval import sensitivity

    costs = [(0.5 - 0.01 * i, 0.2) for i in range(6)]
    given = profile(6, costs, costs)
    monkeypatch.setattr(sensitivity.data, "load_model", lambda *a: (torch.nn.Linear(1, 1), None))
    monkeypatch.setattr(sensitivity, "load_or_measure", lambda *a, **k: given)
    monkeypatch.setattr(sensitivity, "model_key", lambda model: "tiny")
    for flag, solve in (("--bits", A.allocate_average), ("--split", A.allocate_split)):
        out = tmp_path / f"{flag[2:]}.json"
        assert main(["calibrate", flag, "2.5", "--out", str(out)]) == 0
        assert A.Allocation.load(out) == solve(given, 2.5)
        assert f"TORCH_RKV_ALLOCATION={out}" in capsys.readouterr().out
    assert len(set(A.allocate_average(given, 2.5).layer_totals())) > 1  # (the two differ here)
    out = tmp_path / "lean.json"
    assert main(["calibrate", "--bits", "2.5", "--lean", "--sparse", "--out", str(out)]) == 0
    assert A.Allocation.load(out) == A.allocate_average(given, 2.5).with_layout(sparse=True, lean=True)
    assert main(["calibrate", "--bits", "4.5"]) == 2
    assert "4.5 bits is outside the levels" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--bits", "3", "--split", "3"])


GEMMA_LIKE = plan.ModelShape("gemma-like", 6, 2, 64, 1e6, sliding_layers=4, sliding_window=256,
                             sliding=(True, True, False, True, True, False))


@pytest.mark.parametrize("context,batch", [(4096, 1), (1000, 3)])
def test_planned_allocation_bytes_are_the_layouts_bytes(context, batch):
    """Equal costs everywhere: the budget buys bits where they are cheapest, the sliding layers' small
    rings first; the bytes it reports are the per-layer layouts' and fit the budget."""
    p = profile(6, [(1.0, 1.0)] * 6, [(1.0, 1.0)] * 6)
    low = sum(lay.nbytes() for lay in plan.layer_layouts(GEMMA_LIKE, [A.layer_scheme(2, 2, (2, 3, 4))] * 6, context,
                                                          batch))
    high = sum(lay.nbytes() for lay in plan.layer_layouts(GEMMA_LIKE, [A.layer_scheme(4, 4, (2, 3, 4))] * 6, context,
                                                           batch))
    budget = (low + high) // 2
    alloc, nbytes, rows = plan.allocation_for_budget(GEMMA_LIKE, p, budget, context, batch)
    assert nbytes == sum(lay.nbytes() for lay in plan.layer_layouts(GEMMA_LIKE, alloc.schemes(), context, batch))
    assert nbytes <= budget
    full = -(-context // 128) * 128  # whole blocks
    assert rows == [256, 256, full, 256, 256, full]
    sliding = [alloc.bits[i] for i in (0, 1, 3, 4)]
    assert all(k == v == 4 for k, v in sliding), alloc.bits  # cheap bits first
    assert nbytes > budget - 2 * batch * 2 * 64 * full // 8  # no full layer's step left unbought
    with pytest.raises(ValueError, match="even at 2 bits"):
        plan.allocation_for_budget(GEMMA_LIKE, p, low - 1, context, batch)


@pytest.mark.parametrize("context,batch", [(4096, 1), (1000, 3)])
def test_a_planned_split_is_the_most_bits_that_fit(context, batch):
    """plan --split: every layer the same key + value bits (pages of one size), the most
    that fit the budget, each layer's split the cheapest; its bytes are the layouts' bytes."""
    costs = [(1.0, 0.1), (0.1, 1.0), (1.0, 0.1), (0.5, 0.5), (0.1, 1.0), (1.0, 0.1)]
    p = profile(6, costs, costs)

    def nbytes(total):
        return sum(lay.nbytes() for lay in plan.layer_layouts(GEMMA_LIKE, A.allocate_split(p, total / 2).schemes(),
                                                               context, batch))

    assert [nbytes(t) for t in range(4, 9)] == sorted(nbytes(t) for t in range(4, 9))
    for total in range(4, 9):
        for budget in (nbytes(total), nbytes(total + 1) - 1 if total < 8 else 10 * nbytes(8)):
            alloc, got, _ = plan.split_for_budget(GEMMA_LIKE, p, budget, context, batch)
            assert set(alloc.layer_totals()) == {total}, (total, budget, alloc.bits)
            assert alloc == A.allocate_split(p, total / 2) and got == nbytes(total) <= budget
    with pytest.raises(ValueError, match="even at 2 bits"):
        plan.split_for_budget(GEMMA_LIKE, p, nbytes(4) - 1, context, batch)
    free, _, _ = plan.allocation_for_budget(GEMMA_LIKE, p, nbytes(6), context, batch)
    assert free.predicted <= A.allocate_split(p, 3.0).predicted  # the split is one of the free solver's choices


def test_a_model_whose_sliding_layers_are_unknown_is_refused():
    p = profile(6, [(1.0, 1.0)] * 6)
    unknown = plan.ModelShape("unknown", 6, 2, 64, 1e6, sliding_layers=4, sliding_window=256)
    with pytest.raises(ValueError, match="which of its layers slide"):
        plan.allocation_for_budget(unknown, p, 1e9, 4096)
    with pytest.raises(ValueError, match="5 layers"):
        plan.allocation_for_budget(plan.ModelShape("x", 5, 2, 64, 1e6), p, 1e9, 4096)


def test_plan_budget_gb_prints_the_allocation(tmp_path, capsys):
    from torch_rkv.__main__ import main

    costs = [(0.5 - 0.01 * i, 0.2) for i in range(30)]
    path = tmp_path / "profile.json"
    path.write_text(profile(30, costs, costs).to_json())
    assert main(["plan", "--model", "smollm2-135m", "--budget-gb", "2.5", "--context", "131072", "--batch", "4",
                 "--sensitivity", str(path), "--schemes", "rkv-3"]) == 0
    out = capsys.readouterr().out
    assert "2.5 GB for the KV cache (--budget-gb)" in out and "K/V bits by layer: " in out
    assert main(["plan", "--model", "smollm2-135m", "--budget-gb", "2.5", "--batch", "4", "--sensitivity", str(path),
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["allocation"]
    assert got["kv_bytes"] <= 2.5e9 and len(got["bits"]) == 30
    assert got["bits"][0][0] >= got["bits"][-1][0]  # the first layers' keys cost the most here
    out_file = tmp_path / "split.json"
    assert main(["plan", "--model", "smollm2-135m", "--budget-gb", "2.5", "--batch", "4", "--sensitivity", str(path),
                 "--split", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    alloc = A.Allocation.load(out_file)
    assert len(set(alloc.layer_totals())) == 1 and f"TORCH_RKV_ALLOCATION={out_file}" in out
    with pytest.raises(SystemExit, match="needs --sensitivity"):
        main(["plan", "--model", "smollm2-135m", "--budget-gb", "2.5", "--split"])


def test_kl_divergence_is_torch_kl():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    other = logits + 0.3 * torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    from torch_rkv.eval.perplexity import kl_divergence

    ref, out = torch.log_softmax(logits, -1), torch.log_softmax(other, -1)
    want = torch.nn.functional.kl_div(out, ref, log_target=True, reduction="batchmean").item()
    assert math.isclose(kl_divergence(ref, out), want, rel_tol=1e-5) and kl_divergence(ref, ref) == 0
