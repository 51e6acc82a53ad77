"""torch_rkv inside vLLM (the plugin, torch_rkv/integrations/vllm.py): SmolLM2 served with its KV cache in
torch_rkv's pages. Runs in the vLLM venv (scripts/vllm_venv.sh; .ci/run); skipped where vLLM is not
installed (this folder is not named vllm: on sys.path it would pass for the package). Each engine is its
own process (scripts/vllm_engine.py), forked from one that imported vLLM once, with vLLM's engine core and
worker inside it (about 5 s a start on 2 cores, where the three processes of the default take 36),
started once per module and shared by the tests that read it; `vllm serve` runs the default multiprocess
layout."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints")  # a submodule: a folder named vllm on sys.path is not vLLM

from torch_rkv.eval import data
from torch_rkv.eval.agreement import logprob_bound
from torch_rkv.integrations import vllm as plugin

SCRIPTS = Path(__file__).parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import vllm_engine
from tiny_models import SMOLLM3, TINY_FAMILIES, TINY_GEMMA4, TINY_HYBRIDS, TINY_SHAPE  # noqa: E402 (tests/: the main suite's too)

SMOLLM2_SENSITIVITY = 8.0  # tests/test_transformers.py: nats per sqrt(relative step), with headroom
TINY_SENSITIVITY = 0.2  # the same for a tiny random model
KV_GB = "2"


@pytest.fixture(scope="module")
def model_dir() -> str:
    try:
        return str(data.model_hf(fetch=False))
    except data.MissingMaterial as e:
        pytest.skip(f"{e} (the main venv exports it: python -m torch_rkv export-model)")


@pytest.fixture(scope="module")
def alice(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        text = data.read_text(str(data.text_path(fetch=False)))
    except data.MissingMaterial as e:
        pytest.skip(str(e))
    return tok("<|endoftext|>" + text).input_ids


def run_engine(scheme: str | None, job: dict, timeout: int = 900, codebook: str | None = None,
               allocation: str | None = None, channels: str | None = None) -> dict:
    return vllm_engine.run(scheme, job, KV_GB, timeout, in_process=True, codebook=codebook, allocation=allocation,
                           channels=channels)


_runs: dict = {}


def engine(name: str, scheme: str | None, job_fn, codebook: str | None = None, allocation: str | None = None,
           channels: str | None = None) -> dict:
    """An engine run shared by the module's tests (started on first use)."""
    if name not in _runs:
        _runs[name] = run_engine(scheme, job_fn(), codebook=codebook, allocation=allocation, channels=channels)
    return _runs[name]


def prompts_from(ids: list[int], count: int, length: int) -> list[list[int]]:
    starts = [1 + i * 997 for i in range(count)]
    return [[ids[0]] + ids[s : s + length - 1] for s in starts]


def shared_prefix_prompts(ids: list[int]) -> list[list[int]]:
    """One long prefix (700 tokens: five full pages of 128 and an open one) and four continuations, one
    of them shorter than the recent window (its window then lies in the shared pages)."""
    prefix = ids[:700]
    return [prefix + ids[5000 : 5000 + n] for n in (200, 120, 64, 10)]


def assert_reads_agree(ref: list, got: list, allowed: float, what: str) -> None:
    """Greedy continuations whose engines read the same context by different paths: at every step up to
    and including the first token where they differ (the same context until then), the chosen token's
    log-probability agrees within `allowed`, and they may first differ only where the reference's margin
    (top-1 minus top-2) is under 2 x allowed, which is all such a gap can overturn. (A greedy
    criterion that stopped at the first near-tie checked 0 to 8 of 24 tokens at 8 bits here, and none
    with SmolLM2's 4-bit bound.)"""
    assert len(ref) == len(got) and all(len(a["tokens"]) == len(b["tokens"]) for a, b in zip(ref, got))
    for i, (a, b) in enumerate(zip(ref, got)):
        differ = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        gaps = [abs(x[0] - y[0]) for x, y in zip(a["top2"][: differ + 1], b["top2"][: differ + 1])]
        assert max(gaps) <= allowed, f"{what} {i}: the log-probabilities differ by {max(gaps):.3f} > {allowed:.3f} " \
                                     f"by token {differ}"
        if differ < len(a["tokens"]):
            margin = a["top2"][differ][0] - a["top2"][differ][1]
            assert margin < 2 * allowed, f"{what} {i}: token {differ} differs where the margin is {margin:.3f}"


def forced_logprobs(run: dict) -> list[float]:
    """The log-probability of each sequence's own next token, in order, from a "forced" task."""
    f = run["forced"]
    return [row[str(seq[start + j])] for seq, start, rows in zip(f["ids"], f["starts"], f["logprobs"])
            for j, row in enumerate(rows)]


def fp32_job(model_dir, prompts, forced=None, **engine_args):
    tasks = [{"kind": "generate", "prompts": prompts, "max_tokens": 24}]
    if forced is not None:
        tasks.append({"kind": "forced", **forced})
    return {"model": model_dir, "engine": {"dtype": "float32", "max_model_len": 4096, **engine_args}, "tasks": tasks}


# ------------------------------------------------------------------------------------------------


def assert_8_bits_agree_with_vllms_own_cache(name, model_dir, prompts, sensitivity, **engine_args) -> tuple:
    """rkv-8 generations against vLLM's own cache (float32 unless engine_args say), by the portable criteria:
    assert_reads_agree within the 8-bit bound (rkv-8 is within it of full precision), and the reference tokens'
    teacher-forced log-probabilities, through both engines, within it at every position. The two engine
    runs."""
    ref = engine(f"{name}-auto", None, lambda: fp32_job(model_dir, prompts, {"ids": "generated", "starts": None,
                                                                             "top": 1}, **engine_args))
    seqs = ref["forced"]["ids"]
    got = engine(f"{name}-rkv-8", "rkv-8", lambda: fp32_job(model_dir, prompts, {"ids": seqs, "starts":
                                                                                   ref["forced"]["starts"], "top": 1},
                                                           **engine_args))
    bound = logprob_bound(8, sensitivity)
    assert_reads_agree(ref["generate"], got["generate"], bound, "prompt")
    for k, (a, b) in enumerate(zip(forced_logprobs(ref), forced_logprobs(got), strict=True)):
        assert abs(a - b) <= bound, (k, a, b, bound)
    return ref, got


def test_8_bit_generations_agree_with_vllms_own_cache(model_dir, alice):
    ref, got = assert_8_bits_agree_with_vllms_own_cache("smollm2", model_dir, prompts_from(alice, 3, 300),
                                                        SMOLLM2_SENSITIVITY)
    assert got["kv_tokens"] > ref["kv_tokens"]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    """A tiny random Qwen3 (q/k RMSNorm before RoPE: the pre-RoPE keys are the normed ones; 8 query heads
    for 2 KV heads) saved as a Hugging Face directory; no tokenizer (the prompts are token ids)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_a_qwen3_model_agrees_at_8_bits_with_vllms_own_cache(tiny_qwen3):
    """Another family and GQA ratio through the plugin: rkv-8 (pre-RoPE keys: the normed keys, un-rotated
    with vLLM's table for the model) against vLLM's own float32 cache, by the portable criterion."""
    gen = __import__("random").Random(0)
    prompts = [[gen.randrange(512) for _ in range(300)] for _ in range(2)]
    assert_8_bits_agree_with_vllms_own_cache("qwen3", tiny_qwen3, prompts, TINY_SENSITIVITY,
                                             skip_tokenizer_init=True, max_model_len=512)


# Gemma 4 scores q . k of RMS-normed heads with a scale of 1 (not 1 / sqrt(head_dim)): its log-probabilities
# move about 3x more for the same key error, and where layers share caches a key's error reaches twice the
# layers (tests/familybuild.py)
FAMILY_SENSITIVITY = {"gemma4": 0.6, "gemma4_shared": 1.2}


def large_sinks(model) -> None:
    """GPT-OSS's sinks large enough to take much of the attention (its initialisation leaves them near 0,
    where serving them wrong would hardly show)."""
    import torch

    for layer in model.model.layers:
        layer.self_attn.sinks.data.copy_(torch.linspace(-1.0, 4.0, layer.self_attn.sinks.numel()))


TINY_WEIGHTS = {"gpt_oss": large_sinks}  # weights a family's test needs beyond random ones


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_other_families_agree_at_8_bits_with_vllms_own_cache(tmp_path_factory, family):
    """GPT-J's interleaved partial rotary (un-rotated with the table and pairing vLLM builds for it),
    Gemma 2's sliding windows (300-token prompts over 64-token windows: the kernel masks, vLLM frees the
    pages before the window) and soft-capping, Gemma 3's local and global layers, Cohere 2's interleaved
    sliding layers beside its NoPE global ones, Granite's attention_multiplier, Qwen3-MoE, GPT-OSS's
    learned sinks and YaRN table, Gemma 4's layers of two shapes and its KV-shared layers: rkv-8
    against vLLM's own float32 cache. (Which table a layer un-rotates with shows in quantization error only: its own
    test checks the tables.)"""
    gen = __import__("random").Random(0)
    prompts = [[gen.randrange(512) for _ in range(300)] for _ in range(2)]
    model_dir = tiny_family(tmp_path_factory, family)
    runs = assert_8_bits_agree_with_vllms_own_cache(family, model_dir, prompts,
                                                    FAMILY_SENSITIVITY.get(family, TINY_SENSITIVITY),
                                                    skip_tokenizer_init=True, max_model_len=512)
    if family in TINY_GEMMA4:
        assert_plan_vllm_logs(model_dir, runs, 512)


def assert_plan_vllm_logs(model_dir: str, runs: tuple, max_model_len: int, dtype: str = "float32", **engine) -> None:
    """The capacity vLLM's own cache and rkv-8 (`runs`, the model in `dtype`) logged is the one plan --vllm's pool
    gives for the model's config: Gemma 4's pages of two shapes (the plugin's published to divide one size) and
    its KV-shared layers, which keep no pages; a hybrid's block grown to hold a state, its states padded, prefix
    caching's blocks, the SSM dtype this CPU makes vLLM keep."""
    import torch

    from torch_rkv import plan
    from torch_rkv import scheme as S

    shape = plan.from_config(f"{model_dir}/config.json", 1e6)
    planned = plan.VllmEngine(getattr(torch, dtype), "cpu", **engine)
    for run, schemes in zip(runs, (None, [S.by_name("rkv-8")] * shape.layers)):
        tokens, concurrency = planned.pool(shape, schemes).capacity(int(KV_GB) * 2**30, max_model_len)
        assert (run["kv_tokens"], run["concurrency"]) == (tokens, round(concurrency, 2)), run["log"][-2000:]


def test_kv_shared_layers_read_each_chunk_before_it_is_appended(tmp_path_factory):
    """Gemma 4's KV-shared layers over prompts prefilled in chunks of 128 tokens: every reader of a cache
    attends over it as it stood before the chunk (whose append would overwrite the window's ring and
    quantize its blocks), and the last appends the chunk; rkv-8 agrees with vLLM's own cache, whose shared
    layers read the target's pages. (Measured: appending before the readers attend fails this.)"""
    gen = __import__("random").Random(2)
    prompts = [[gen.randrange(512) for _ in range(300)] for _ in range(2)]
    model_dir = tiny_family(tmp_path_factory, "gemma4_shared")
    runs = assert_8_bits_agree_with_vllms_own_cache("gemma4-shared-chunked", model_dir, prompts,
                                                    FAMILY_SENSITIVITY["gemma4_shared"], skip_tokenizer_init=True,
                                                    max_model_len=512, max_num_batched_tokens=128)
    assert_plan_vllm_logs(model_dir, runs, 512, max_num_batched_tokens=128)


# Gemma 3 with 7 sliding layers and 2 full ones: vLLM's hybrid manager cuts the sliding bucket into 4
# groups of 2 (one short: a padding layer) beside the full one, blocks of 2 pages
GEMMA3_HYBRID = ["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]


def test_a_hybrid_models_capacity_is_what_plan_vllm_predicts(tmp_path_factory):
    """Gemma 3, 7 sliding layers (64 tokens) and 2 full ones, through the plugin and through vLLM's own
    cache: rkv-8 generations agree with vLLM's (several KV-cache groups of several layers each), and
    the capacity each engine logs is the one VllmPool plans from vLLM's groups and the tokens in flight
    (max_num_batched_tokens 256, without async scheduling on CPU)."""
    import torch

    from torch_rkv.integrations.vllm_pool import VllmPool
    from torch_rkv.scheme import by_name

    model = tiny_family(tmp_path_factory, "gemma3", num_hidden_layers=9, layer_types=GEMMA3_HYBRID)
    gen = __import__("random").Random(1)
    prompts = [[gen.randrange(512) for _ in range(300)] for _ in range(2)]
    runs = assert_8_bits_agree_with_vllms_own_cache("gemma3-hybrid", model, prompts, TINY_SENSITIVITY,
                                                    skip_tokenizer_init=True, max_model_len=1024,
                                                    max_num_batched_tokens=256)
    windows = tuple(64 if t == "sliding_attention" else 0 for t in GEMMA3_HYBRID)
    for run, schemes in zip(runs, (None, (by_name("rkv-8"),) * 9)):
        pool = VllmPool(9, 2, 64, torch.float32, schemes, 128, windows, in_flight_tokens=256)
        assert [len(g) for g in pool.groups] == [2, 2, 2, 1, 2]
        tokens, concurrency = pool.capacity(float(KV_GB) * 2**30, 1024)
        assert (run["kv_tokens"], run["concurrency"]) == (tokens, round(concurrency, 2)), schemes


def test_prefix_caching_on_sliding_layers(tmp_path_factory):
    """Prefix caching on Gemma 3 (a 64-token sliding layer beside a full one): the shared-prefix requests
    of test_prefix_caching_gives_the_same_outputs, random tokens. vLLM's hit hands the sliding layer a
    block table whose pages before its window are the null block; the slot's sinks and window rows read
    from there (or sinks copied from another slot that began on the null block) are never attended: the
    kernel reads only the newest 64 keys. So prefix caching on agrees with off within one 8-bit bound
    (assert_reads_agree), rkv-8. Measured: 2.4e-4 at most (allowed 1.25e-2); a slot that skips the
    shared window's rows is 7e-2 off."""
    model = tiny_family(tmp_path_factory, "gemma3")
    gen = __import__("random").Random(2)
    prefix = [gen.randrange(512) for _ in range(700)]
    prompts = [prefix + [gen.randrange(512) for _ in range(n)] for n in (200, 120, 64, 10)]

    def job(prefix_caching):
        return {"model": model, "tasks": [{"kind": "generate", "prompts": prompts, "max_tokens": SERVED_TOKENS,
                                           "batches": [[0], [1, 2, 3]]}],
                "engine": {**CHUNKED, "max_model_len": 1024, "skip_tokenizer_init": True,
                           "enable_prefix_caching": prefix_caching}}

    off, on = run_engine("rkv-8", job(False)), run_engine("rkv-8", job(True))
    hits = [g["cached_tokens"] for g in on["generate"]]
    assert sum(n >= 640 for n in hits[1:]) >= 2, hits  # five full shared pages (vLLM's pick: [0, 0, 640, 640])
    assert_reads_agree(off["generate"], on["generate"], logprob_bound(8, TINY_SENSITIVITY), "continuation")


def tiny_llama_forced(tmp_path_factory, scheme: str | None, tp: int = 1, **engine_args) -> dict:
    """Teacher-forced log-probabilities of two 600-token random prompts through a tiny Llama with 4 KV heads
    (shared by the tests that compare engine modes; an engine run per distinct arguments)."""
    def job():
        gen = __import__("random").Random(0)
        prompts = [[gen.randrange(512) for _ in range(600)] for _ in range(2)]
        return {"model": tiny_family(tmp_path_factory, "llama-4kv"),
                "tasks": [{"kind": "forced", "ids": prompts, "starts": [1, 1], "top": 1}],
                "engine": {"dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 256,
                           "skip_tokenizer_init": True, "tensor_parallel_size": tp,
                           "distributed_executor_backend": "mp" if tp > 1 else "uni", **engine_args}}

    return engine(f"tiny-llama-{scheme}-tp{tp}-{sorted(engine_args.items())}", scheme, job)


def test_tensor_parallel_ranks_read_what_one_rank_reads(tmp_path_factory, monkeypatch):
    """Tensor parallelism over 2 ranks (vLLM's multiprocess executor on CPU, a core each) shards a tiny
    Llama's 4 KV heads, 2 on each rank's pages: rkv-4's teacher-forced log-probabilities equal one rank's
    up to float reordering (1e-3; vLLM's own cache is 2.8e-2 from rkv-4 on these prompts, so the
    comparison feels the cache), and each engine logs the capacity `plan --vllm --tensor-parallel-size`
    plans from one rank's heads (twice the tokens: each rank holds half of every token)."""
    import torch

    from torch_rkv import plan
    from torch_rkv.scheme import by_name

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tensor parallelism on CPU needs 2 CPUs (one a rank)")
    own, one = tiny_llama_forced(tmp_path_factory, None), tiny_llama_forced(tmp_path_factory, "rkv-4")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")  # vLLM binds a rank's threads
    two = tiny_llama_forced(tmp_path_factory, "rkv-4", tp=2)
    assert max(abs(a - b) for a, b in zip(forced_logprobs(one), forced_logprobs(two))) < 1e-3
    assert max(abs(a - b) for a, b in zip(forced_logprobs(own), forced_logprobs(one))) > 1e-2
    shape = plan.ModelShape("tiny", 2, 4, 64, 1e6)
    for got, tp in ((one, 1), (two, 2)):
        engine = plan.VllmEngine(torch.float32, "cpu", tensor_parallel=tp)
        tokens, concurrency = engine.pool(engine.rank(shape), [by_name("rkv-4")] * 2).capacity(
            float(KV_GB) * 2**30, 1024)
        assert (got["kv_tokens"], got["concurrency"]) == (tokens, round(concurrency, 2)), tp
    assert two["kv_tokens"] > 1.9 * one["kv_tokens"]


def test_vllms_compiled_mode_reads_what_eager_mode_reads(tmp_path_factory):
    """vLLM's default mode (no enforce_eager; on CPU: the model traced once by Dynamo and compiled by
    Inductor, attention an opaque op that calls the plugin's forward): rkv-4's teacher-forced
    log-probabilities through the tiny Llama equal eager mode's up to float reordering (1e-3; vLLM's own
    cache is 2.8e-2 away), with the same capacity logged. (CUDA graphs: the builder keeps vLLM's default
    of no CUDA-graph support, which turns vLLM's CUDA default into piecewise graphs with attention run
    between them; not run here.)"""
    own, eager = tiny_llama_forced(tmp_path_factory, None), tiny_llama_forced(tmp_path_factory, "rkv-4")
    compiled = tiny_llama_forced(tmp_path_factory, "rkv-4", enforce_eager=False)
    assert "CompilationMode.DYNAMO_TRACE_ONCE" in compiled["log"] and "'backend': 'inductor'" in compiled["log"]
    assert "CompilationMode.DYNAMO_TRACE_ONCE" not in eager["log"]
    assert max(abs(a - b) for a, b in zip(forced_logprobs(eager), forced_logprobs(compiled))) < 1e-3
    assert max(abs(a - b) for a, b in zip(forced_logprobs(own), forced_logprobs(eager))) > 1e-2
    assert (compiled["kv_tokens"], compiled["concurrency"]) == (eager["kv_tokens"], eager["concurrency"])


# tiny models other tests build like the families (not part of the families' agreement test)
TINY_MODELS = {**TINY_FAMILIES,
               # Llama with 4 KV heads for 8 query heads: two ranks of tensor parallelism hold 2 each
               "llama-4kv": ("LlamaConfig", "LlamaForCausalLM", {**TINY_SHAPE, "num_attention_heads": 8,
                                                                "num_key_value_heads": 4, "head_dim": 64,
                                                                "tie_word_embeddings": False})}


def tiny_family(tmp_path_factory, family: str, **overrides) -> str:
    """TINY_MODELS[family] (its config updated by `overrides`), random weights (seed 0), saved as a
    Hugging Face directory."""
    import torch
    import transformers

    config_cls, model_cls, kw = TINY_MODELS[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=512, **{**kw, **overrides})
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():
        TINY_WEIGHTS.get(family, lambda m: None)(model)
    model.save_pretrained(path)
    return str(path)


CHUNKED = {"dtype": "float32", "max_model_len": 4096, "max_num_batched_tokens": 256, "long_prefill_token_threshold": 256,
           "enable_prefix_caching": False}  # prefills in chunks of 256 tokens


def chunked_job(model_dir, alice):
    """alice29's 2048 tokens in chunks of 256."""
    return {"model": model_dir, "tasks": [{"kind": "ppl", "ids": alice[:2048]}], "engine": dict(CHUNKED)}


def serving_job(model_dir, alice, prefix_caching=False):
    """Greedy continuations in chunks of 256: the shared-prefix requests (one, then the others) and, with
    prefix caching off, the preemption test's requests with room for all."""
    prompts, batches = shared_prefix_prompts(alice), [[0], [1, 2, 3]]
    counts = [SERVED_TOKENS] * len(prompts)
    if not prefix_caching:
        batches.append(list(range(len(prompts), len(prompts) + PREEMPT["count"])))
        prompts = prompts + preempt_prompts(alice)
        counts += [PREEMPT["new"]] * PREEMPT["count"]
    return {"model": model_dir, "tasks": [{"kind": "generate", "prompts": prompts, "max_tokens": counts,
                                           "batches": batches}],
            "engine": {**CHUNKED, "enable_prefix_caching": prefix_caching}}


@pytest.fixture(scope="module")
def layer_codebook(model_dir, tmp_path_factory) -> str:
    """A codebook file for SmolLM2 whose levels differ by layer and side: the uniform grid with each
    inner level moved by up to 0.3 of a step and the ends pulled in, by a pattern of the layer, side and
    level (a calibrated file's shape, without the minute of calibration)."""
    import math

    from torch_rkv.codebook import Codebook

    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]

    def values(layer: int, side: int, bits: int) -> list[float]:
        top = 2**bits - 1
        moved = [i + 0.3 * math.sin(1.7 * layer + 2.3 * i + side) for i in range(top + 1)]
        return [min(max(x, 0.0), float(top)) for x in moved]

    book = Codebook([{side: {str(b): values(i, j, b) for b in (2, 3, 4)} for j, side in enumerate("kv")}
                     for i in range(layers)], model="SmolLM2 (test pattern)")
    path = tmp_path_factory.mktemp("codebook") / "levels.json"
    book.save(path)
    return str(path)


LAYER_BITS = ((4, 4), (2, 2), (4, 2), (3, 3), (2, 4), (3, 2))  # by turns: four page sizes, three of one


@pytest.fixture(scope="module")
def layer_allocation(model_dir, tmp_path_factory) -> str:
    """An allocation file for SmolLM2 whose layers keep LAYER_BITS by turns: unequal key + value totals,
    so pages of four sizes, and three splits of 6 bits whose pages are the same size (the shape
    `calibrate --bits` writes, without the calibration)."""
    from torch_rkv.allocate import Allocation

    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    path = tmp_path_factory.mktemp("allocation") / "layers.json"
    Allocation(tuple(LAYER_BITS[i % len(LAYER_BITS)] for i in range(layers)), (2, 3, 4), 0.0).save(path)
    return str(path)


@pytest.fixture(scope="module")
def lean_sparse_allocation(layer_allocation, tmp_path_factory) -> str:
    """layer_allocation with rkv-sparse's outliers and rkv-lean's float8 value metadata in every layer
    (`calibrate --bits B --sparse --lean`; the layout of the goal row rkv-lean-sparse-alloc-2.5)."""
    from torch_rkv.allocate import Allocation

    path = tmp_path_factory.mktemp("allocation") / "lean-sparse.json"
    Allocation.load(layer_allocation).with_layout(sparse=True, lean=True).save(path)
    return str(path)


@pytest.fixture(scope="module")
def lean_allocation(layer_allocation, tmp_path_factory) -> str:
    """layer_allocation with rkv-lean's float8 value metadata in every layer (the layout of the goal rows
    rkv-lean-alloc-<bits>+8, whose refined key channels come from TORCH_RKV_CHANNELS)."""
    from torch_rkv.allocate import Allocation

    path = tmp_path_factory.mktemp("allocation") / "lean.json"
    Allocation.load(layer_allocation).with_layout(lean=True).save(path)
    return str(path)


@pytest.fixture(scope="module")
def key_ranking(model_dir, tmp_path_factory) -> str:
    """A key-channel ranking file for SmolLM2 whose order differs by layer and KV head: a pattern of both
    (a calibrated file's shape, without the calibration pass)."""
    from torch_rkv.channels import KeyChannels

    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    ranks = [[[(c * (2 * layer + 1) + 7 * h) % dim for c in range(dim)] for h in range(heads)] for layer in range(layers)]
    path = tmp_path_factory.mktemp("channels") / "key-channels.json"
    KeyChannels(ranks, model="SmolLM2 (test pattern)").save(path)
    return str(path)


@pytest.fixture(scope="module")
def transformers_ppl(model_dir, layer_codebook, layer_allocation, lean_sparse_allocation, lean_allocation,
                     key_ranking):
    """The same chunked protocol through torch_rkv's transformers integration, in the main venv
    (TORCH_RKV_HF_PYTHON: it needs transformers >= 5.24; vLLM pins an older one); "rkv-3+codebook":
    rkv-3 with layer_codebook's levels; "allocation": layer_allocation's per-layer schemes."""
    code = ("import json\nfrom torch_rkv.eval import data, perplexity\nfrom torch_rkv import scheme as S\n"
            "from torch_rkv.integrations.transformers import RKVCache\n"
            f"model, tok = data.load_model({model_dir!r})\n"
            "ids = tok('<|endoftext|>' + data.read_text(str(data.text_path()))).input_ids[:2048]\n"
            "import torch\nids = torch.tensor([ids])\nout = {}\n"
            "schemes = {name: S.by_name(name) for name in ('rkv-4', 'rkv-3', 'rkv-2', 'rkv-sparse-2')}\n"
            "schemes['rkv-3+codebook'] = schemes['rkv-3'].replace(levels='calibrated', "
            f"codebook={layer_codebook!r})\n"
            "from torch_rkv.allocate import Allocation\n"
            f"schemes['allocation'] = Allocation.load({layer_allocation!r}).schemes()\n"
            f"schemes['allocation+sparse+lean'] = Allocation.load({lean_sparse_allocation!r}).schemes()\n"
            f"schemes['allocation+lean'] = Allocation.load({lean_allocation!r}).schemes()\n"
            f"schemes['allocation+lean+32'] = [S.refined(s, 32, {key_ranking!r}) for s in schemes['allocation+lean']]\n"
            "for name, scheme in schemes.items():\n"
            "    out[name] = perplexity.chunked(model, ids, lambda n, s=scheme: RKVCache(model, s, capacity=n), 256)\n"
            "print('RESULT ' + json.dumps(out))\n")
    return json.loads(in_main_venv(code))


def in_main_venv(code: str) -> str:
    """Run `code` with the main venv's python (TORCH_RKV_HF_PYTHON: torch_rkv's transformers integration
    needs transformers >= 5.24; vLLM pins an older one) and return what it printed after "RESULT "."""
    py = os.environ.get("TORCH_RKV_HF_PYTHON")
    if not py:
        pytest.skip("TORCH_RKV_HF_PYTHON (the main venv's python) is not set")
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=900, check=False)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return line[-1][len("RESULT "):]


@pytest.mark.parametrize("scheme", ["rkv-4", "rkv-3", "rkv-2", "rkv-sparse-2"])
def test_same_perplexity_in_both_engines(model_dir, alice, transformers_ppl, scheme):
    """alice29, 2048 tokens, chunks of 256 (later chunks read quantized pages): vLLM with the plugin and
    torch_rkv's transformers integration agree to 1e-3 relative (rkv-sparse-2: the sparse outliers in
    vLLM's pages, chosen by the same appends, and they change the result)."""
    got = engine(f"{scheme}-chunked", scheme, lambda: chunked_job(model_dir, alice))
    want = transformers_ppl[scheme]
    assert abs(got["ppl"] / want - 1) < 1e-3, (got["ppl"], want)
    if scheme == "rkv-sparse-2":
        assert abs(want / transformers_ppl["rkv-2"] - 1) > 3e-3, (want, transformers_ppl["rkv-2"])


def test_calibrated_levels_give_the_same_perplexity_in_both_engines(model_dir, alice, layer_codebook,
                                                                    transformers_ppl):
    """rkv-3 with a per-layer codebook (TORCH_RKV_CODEBOOK): each layer decodes through its own levels in
    vLLM as in the transformers integration (1e-3 relative; the same chunked protocol), and the levels
    change the result (they are read, not ignored)."""
    got = engine("rkv-3-codebook-chunked", "rkv-3", lambda: chunked_job(model_dir, alice), codebook=layer_codebook)
    want = transformers_ppl["rkv-3+codebook"]
    assert abs(got["ppl"] / want - 1) < 1e-3, (got["ppl"], want)
    assert abs(want / transformers_ppl["rkv-3"] - 1) > 3e-3, (want, transformers_ppl["rkv-3"])


def test_per_layer_bits_give_the_same_perplexity_in_both_engines(model_dir, alice, layer_allocation,
                                                                  transformers_ppl):
    """TORCH_RKV_ALLOCATION: each layer stores its own key and value bits (LAYER_BITS by turns: pages of
    unequal bytes) in vLLM as in the transformers integration (1e-3 relative; the same chunked
    protocol), and the per-layer bits change the result (they are read, not ignored). vLLM sizes each
    layer's pages by its own bits: the capacity it logs is the one `plan --vllm` predicts for these
    pages, not the one of pages all sized by layer 0's bits."""
    import torch

    from torch_rkv.allocate import Allocation
    from torch_rkv.integrations.vllm_pool import VllmPool

    got = engine("allocation-chunked", None, lambda: chunked_job(model_dir, alice), allocation=layer_allocation)
    want = transformers_ppl["allocation"]
    assert abs(got["ppl"] / want - 1) < 1e-3, (got["ppl"], want)
    assert abs(want / transformers_ppl["rkv-3"] - 1) > 3e-3, (want, transformers_ppl["rkv-3"])
    schemes = tuple(Allocation.load(layer_allocation).schemes())
    kept = set(re.findall(r"torch_rkv: (\d+) layers keep (\d)-bit keys and (\d)-bit values", got["log"]))
    assert kept == {("5", str(k), str(v)) for k, v in LAYER_BITS}  # one metadata builder per layer scheme

    def capacity(layer_schemes):
        return VllmPool(30, 3, 64, torch.float32, layer_schemes).capacity(float(KV_GB) * 2**30, 4096)

    tokens, concurrency = capacity(schemes)
    assert (got["kv_tokens"], got["concurrency"]) == (tokens, round(concurrency, 2))
    assert tokens > capacity((schemes[0],) * 30)[0]


def test_a_lean_sparse_allocation_gives_the_same_perplexity_in_both_engines(model_dir, alice, lean_sparse_allocation,
                                                                           transformers_ppl):
    """TORCH_RKV_ALLOCATION with sparse and lean set: every layer's pages hold float8 value metadata and
    sparse outliers beside its own bits, in vLLM as in the transformers integration (1e-3 relative; the
    same chunked protocol), and the layout changes the result. The capacity vLLM logs is the one
    `plan --vllm` predicts for these pages (rkv-lean's float8 metadata; docs/serving.md's figures for
    the rkv-lean presets come from the same count)."""
    import torch

    from torch_rkv.allocate import Allocation
    from torch_rkv.integrations.vllm_pool import VllmPool

    got = engine("lean-sparse-allocation-chunked", None, lambda: chunked_job(model_dir, alice),
                 allocation=lean_sparse_allocation)
    want = transformers_ppl["allocation+sparse+lean"]
    assert abs(got["ppl"] / want - 1) < 1e-3, (got["ppl"], want)
    assert abs(want / transformers_ppl["allocation"] - 1) > 3e-3, (want, transformers_ppl["allocation"])
    schemes = tuple(Allocation.load(lean_sparse_allocation).schemes())
    tokens, concurrency = VllmPool(30, 3, 64, torch.float32, schemes).capacity(float(KV_GB) * 2**30, 4096)
    assert (got["kv_tokens"], got["concurrency"]) == (tokens, round(concurrency, 2))


def test_refined_key_channels_give_the_same_perplexity_in_both_engines(model_dir, alice, lean_allocation, key_ranking,
                                                                       transformers_ppl):
    """TORCH_RKV_CHANNELS over a lean allocation (the goal rows' layout): every layer's pages hold the
    refinement codes of its own key channels beside its own bits, in vLLM as in the transformers
    integration (1e-3 relative; the same chunked protocol), the refinement changes the result, and vLLM's
    capacity is the one `plan --vllm` predicts for these pages. 32 channels a head: with a test-pattern
    ranking (not the calibrated one) 8 move the perplexity too little to tell apart from the tolerance."""
    import torch

    from torch_rkv import scheme as S
    from torch_rkv.allocate import Allocation
    from torch_rkv.integrations.vllm_pool import VllmPool

    got = engine("lean-allocation-refined-chunked", None, lambda: chunked_job(model_dir, alice),
                 allocation=lean_allocation, channels=f"32:{key_ranking}")
    want = transformers_ppl["allocation+lean+32"]
    assert abs(got["ppl"] / want - 1) < 1e-3, (got["ppl"], want)
    assert abs(want / transformers_ppl["allocation+lean"] - 1) > 3e-3, (want, transformers_ppl["allocation+lean"])
    schemes = tuple(S.refined(s, 32, key_ranking) for s in Allocation.load(lean_allocation).schemes())
    tokens, concurrency = VllmPool(30, 3, 64, torch.float32, schemes).capacity(float(KV_GB) * 2**30, 4096)
    assert (got["kv_tokens"], got["concurrency"]) == (tokens, round(concurrency, 2))


def test_per_layer_bits_on_a_sliding_and_a_global_layer(tmp_path_factory, tmp_path):
    """Gemma 2's sliding layer at 4 + 4 bits and its global layer at 2 + 2 (vLLM's hybrid allocator: a
    KV-cache group each, whose pages it brings to one size by padding the smaller): the same chunked
    perplexity as the transformers integration (2e-5 relative; 700 random tokens over 64-token
    windows; the allocation moves it by 2e-4 from 4 + 4 bits in both layers, which a random model
    hardly feels), and the plugin warns that the padding costs the allocation its capacity."""
    from torch_rkv.allocate import Allocation

    if not os.environ.get("TORCH_RKV_HF_PYTHON"):  # (before the engine run: in_main_venv would skip after it)
        pytest.skip("TORCH_RKV_HF_PYTHON (the main venv's python) is not set")
    model = tiny_family(tmp_path_factory, "gemma2")
    path = tmp_path / "gemma2.json"
    Allocation(((4, 4), (2, 2)), (2, 3, 4), 0.0).save(path)
    gen = __import__("random").Random(0)
    ids = [gen.randrange(512) for _ in range(700)]
    job = chunked_job(model, ids)
    job["tasks"] = [{"kind": "ppl", "ids": ids}]
    job["engine"].update(max_model_len=1024, skip_tokenizer_init=True)
    got = run_engine(None, job, allocation=str(path))
    code = ("import torch, transformers\nfrom torch_rkv.allocate import Allocation\nfrom torch_rkv.eval import perplexity\n"
            "from torch_rkv.integrations.transformers import RKVCache\n"
            f"m = transformers.AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32).eval()\n"
            f"ids = torch.tensor([{ids!r}])\nout = []\n"
            f"for schemes in (Allocation.load({str(path)!r}).schemes(), Allocation(((4, 4),) * 2, (2, 3, 4), 0.0)"
            ".schemes()):\n    with torch.no_grad():\n"
            "        out.append(perplexity.chunked(m, ids, lambda n: RKVCache(m, schemes, capacity=n), 256))\n"
            "print(f'RESULT {out[0]!r} {out[1]!r}')\n")
    want, uniform = map(float, in_main_venv(code).split())
    assert abs(got["ppl"] / want - 1) < 2e-5, (got["ppl"], want)
    assert abs(uniform / want - 1) > 1e-4, (uniform, want)
    assert "vLLM pads the pages of model.layers.1.self_attn.attn" in got["log"]


def test_capacity_follows_the_packed_bytes(model_dir, alice):
    """At the same KV memory (VLLM_CPU_KVCACHE_SPACE=2), the tokens vLLM reports against its bfloat16
    cache: at least 3.5x for rkv-4, 4.5x for rkv-3, 6x for rkv-2, 5x for rkv-sparse-2 (its pages hold the
    outliers' entries too; the rkv engines run in float32, where a page takes as many bytes or more), and
    the maximum concurrency follows. Every count is the one
    `plan --vllm` predicts (integrations/vllm_pool.py)."""
    import torch

    from torch_rkv.integrations.vllm_pool import VllmPool
    from torch_rkv.scheme import by_name

    def planned(dtype, scheme):
        schemes = None if scheme is None else (by_name(scheme),) * 30  # SmolLM2: 30 layers, 3 KV heads of 64
        return VllmPool(30, 3, 64, dtype, schemes).capacity(float(KV_GB) * 2**30, 4096)

    bf16 = engine("auto-bf16", None, lambda: {"model": model_dir, "engine": {"dtype": "bfloat16", "max_model_len": 4096},
                                              "tasks": []})
    assert bf16["kv_tokens"] == planned(torch.bfloat16, None)[0]
    for scheme, factor in (("rkv-4", 3.5), ("rkv-3", 4.5), ("rkv-2", 6.0), ("rkv-sparse-2", 5.0)):
        run = engine(f"{scheme}-chunked", scheme, lambda: chunked_job(model_dir, alice))
        tokens, concurrency = planned(torch.float32, scheme)
        assert (run["kv_tokens"], run["concurrency"]) == (tokens, round(concurrency, 2)), scheme
        ratio = run["kv_tokens"] / bf16["kv_tokens"]
        assert ratio >= factor, (scheme, run["kv_tokens"], bf16["kv_tokens"])
        assert run["concurrency_len"] == bf16["concurrency_len"]
        assert abs(run["concurrency"] / bf16["concurrency"] - ratio) < 0.01 * ratio + 0.01, (scheme, run["concurrency"])


def test_vllms_own_fp8_cache_holds_what_plan_counts_and_loses_more_than_rkv_4(model_dir, alice):
    """vLLM's own fp8 cache (--kv-cache-dtype fp8) on alice29's 2048 tokens in chunks of 256, float32
    engines: vLLM logs the tokens `plan --vllm` counts for it (one byte an element), and it loses over
    four times what rkv-4 loses at half its bytes (measured +0.82 and +0.08 against vLLM's own float32
    cache: vLLM's CPU kernels truncate to e4m3, csrc/cpu/cpu_attn_fp8.hpp; on CUDA it rounds, queries
    included, the report's vllm-fp8 row, +0.48). vLLM runs fp8 on CPU only with AVX-512 or AMX."""
    import torch

    from torch_rkv.integrations.vllm_pool import VllmPool

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's fp8 KV cache on CPU needs AVX-512 or AMX")
    fp8 = engine("fp8-chunked", None, lambda: {**chunked_job(model_dir, alice),
                                               "engine": {**CHUNKED, "kv_cache_dtype": "fp8"}})
    own = engine("auto-chunked", None, lambda: chunked_job(model_dir, alice))
    rkv4 = engine("rkv-4-chunked", "rkv-4", lambda: chunked_job(model_dir, alice))
    pool = VllmPool(30, 3, 64, torch.float32, cache_dtype=torch.float8_e4m3fn)  # SmolLM2
    tokens, concurrency = pool.capacity(float(KV_GB) * 2**30, 4096)
    assert (fp8["kv_tokens"], fp8["concurrency"]) == (tokens, round(concurrency, 2))
    assert fp8["ppl"] - own["ppl"] > 4 * (rkv4["ppl"] - own["ppl"]) > 0, (fp8["ppl"], rkv4["ppl"], own["ppl"])


def test_speculative_decoding_reads_what_plain_decoding_reads(model_dir, alice):
    """ngram speculative decoding, 3 drafts a step: vLLM verifies them in the next step and takes back the
    rejected ones, whose positions that step writes again (the slot tracker finds the request at fewer
    tokens than its slot holds; a block a draft completed is quantized again). rkv-8, 4 prompts, 150
    tokens each, drafts both accepted and rejected: at every step up to the first token where the two
    runs differ (the same context until then), the chosen token's log-probability agrees with plain
    decoding within twice the 8-bit bound (each run is within one of full precision; the greedy
    criterion alone would stop at the first near-tie, within 3 tokens here). Measured: 8e-4 at most.
    A rollback taken for a new request fails it (0.6 to 1.7 nats by the first differing token, over
    the 1.0 allowed, 3.7 later). tests/test_drafts.py checks the pages and ring at the ops, bit for bit."""
    def job(spec):
        engine = {"dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 256, "disable_log_stats": False}
        if spec:
            engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                            "prompt_lookup_min": 2}
        prompts = [[alice[0]] + alice[1 + i * 997 : 121 + i * 1034] for i in range(4)]
        return {"model": model_dir, "engine": engine,
                "tasks": [{"kind": "generate", "prompts": prompts, "max_tokens": 150}]}

    plain, spec = run_engine("rkv-8", job(False)), run_engine("rkv-8", job(True))
    drafted = spec["metrics"]["vllm:spec_decode_num_draft_tokens"]
    accepted = spec["metrics"]["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)
    assert_reads_agree(plain["generate"], spec["generate"], 2 * logprob_bound(8, SMOLLM2_SENSITIVITY), "prompt")


SERVED_TOKENS = 48  # new tokens a shared-prefix request


def test_prefix_caching_gives_the_same_outputs(model_dir, alice):
    """Requests sharing a 700-token prefix, one first and the others after it (prefix-cache hits on its
    full pages), against prefix caching off, rkv-8. A hit changes only how the request reads the shared
    prefix's window (its quantized rows: their full-precision rows left with the request that wrote
    them), at most an 8-bit cache's error, so assert_reads_agree within one 8-bit bound (0.5 nats).
    Measured: 1.8e-2 at most. A slot that skips those rows fails it twice: 1.2 nats off by the first
    differing token, and a first token that differs where the margin is 1.25."""
    off = engine("rkv-8-served", "rkv-8", lambda: serving_job(model_dir, alice))
    on = engine("rkv-8-prefix", "rkv-8", lambda: serving_job(model_dir, alice, prefix_caching=True))
    assert all(g["cached_tokens"] >= 640 for g in on["generate"][1:])  # five full shared pages were hits
    assert all(g["cached_tokens"] == 0 for g in off["generate"])  # (the preemption test's requests too)
    assert_reads_agree(off["generate"][: len(on["generate"])], on["generate"], logprob_bound(8, SMOLLM2_SENSITIVITY),
                       "continuation")


def test_a_prefix_whose_slot_went_to_another_request_keeps_its_sinks(model_dir, alice):
    """A chat's next turn: request 0 writes a 700-token prefix and leaves, 20 others then take side slots
    (the pool starts at 16), request 0's among them, and request 21 comes back to the prefix (a hit on its
    five full pages) with no slot left to lend it the prefix's sinks. They come from the sink store, where
    request 0's slot left them, and request 21 agrees with prefix caching off within a tenth of one 8-bit
    bound (assert_reads_agree, rkv-8: the hit changes only how the prefix's window rows are read, 1.8e-2
    in the prefix test), without the plugin's warning about sinks read back. Measured: the 48 tokens the
    same, 1.8e-3 at most. Read back from their quantized rows instead (the store off), the sinks are
    clipped to ranges they did not set: the second token differs, 0.45 nats off (in the report's
    simulation at 2048 tokens such sinks cost +6.7 perplexity at rkv-8, +6.8 at rkv-4)."""
    prefix = alice[:700]
    prompts = [prefix + alice[5000:5200], *prompts_from(alice[8000:], 20, 40), prefix + alice[6000:6100]]

    def job(prefix_caching):
        return {"model": model_dir, "tasks": [{"kind": "generate", "prompts": prompts,
                                               "batches": [[0], list(range(1, 21)), [21]],
                                               "max_tokens": [SERVED_TOKENS] + [4] * 20 + [SERVED_TOKENS]}],
                "engine": {**CHUNKED, "enable_prefix_caching": prefix_caching}}

    off, on = run_engine("rkv-8", job(False)), run_engine("rkv-8", job(True))
    assert on["generate"][21]["cached_tokens"] >= 640 and "whose sinks no side slot" not in on["log"]
    assert "side pool of 32 slots" in on["log"]  # (the 20 took every slot of the first 16)
    assert_reads_agree(off["generate"][21:], on["generate"][21:], logprob_bound(8, SMOLLM2_SENSITIVITY) / 10,
                       "next turn")


CHATS = 48  # 4 x the side pool's 12 slots at max_num_seqs 4 (slot_limit: max_num_seqs + 8)


def test_every_chats_next_turn_reads_what_it_reads_without_prefix_caching(model_dir, alice):
    """Many chats: 48 conversations with distinct first tokens each run a first turn (a 200-token prompt,
    8 tokens, four at a time), and then each comes back for a second (its first prompt and 40 new tokens),
    after all the others ran, at max_num_seqs 4 and rkv-8. Every second turn agrees
    with prefix caching off within one 8-bit bound (assert_reads_agree). Before, a side pool of 12 slots
    kept at most 12 conversations' sinks, and every second turn read them back from quantized rows whose
    ranges they did not set (0.15-0.58 nats per token); now a first block whose sinks no slot or store
    entry keeps leaves vLLM's prefix cache, and its conversation is recomputed instead. The second turns
    come back newest first, so that both paths run: the newest 12 hit their prefixes, with their sinks from
    the store, and the older 36 find their first blocks dropped and are recomputed."""
    first = [alice[1 + 613 * i: 1 + 613 * i + 200] for i in range(CHATS)]
    assert len({p[0] for p in first}) > CHATS // 2  # (distinct openings, so distinct sinks)

    second = [p + alice[30000 + 41 * i: 30000 + 41 * i + 40] for i, p in enumerate(first)]
    batches = [list(range(i, i + 4)) for i in range(0, CHATS, 4)]

    def job(prefix_caching):  # (second turns newest first: the store's 12 entries serve the newest 12 chats)
        return {"model": model_dir, "tasks": [{"kind": "generate", "prompts": prompts, "max_tokens": 8,
                                               "batches": order} for prompts, order in
                                              ((first, batches), (second, [b[::-1] for b in batches[::-1]]))],
                "engine": {**CHUNKED, "max_num_seqs": 4, "enable_prefix_caching": prefix_caching}}

    turns = {caching: run_engine("rkv-8", job(caching)) for caching in (False, True)}
    on, off = turns[True], turns[False]
    assert "Traceback" not in on["log"] and "whose sinks no side slot" not in on["log"]
    hits = [g["cached_tokens"] > 0 for g in on["generate"]]
    assert sum(hits) >= 12 and not all(hits)  # (the newest chats hit their sinks in the store; the rest recompute)
    assert_reads_agree(off["generate"], on["generate"], logprob_bound(8, SMOLLM2_SENSITIVITY), "second turn")


PREEMPT = {"count": 8, "prompt": 192, "new": 128, "room": 1900}  # 8 x 320 tokens wanted, room for 1900


def preempt_prompts(alice):
    return prompts_from(alice, PREEMPT["count"], PREEMPT["prompt"])


def test_preempted_requests_are_recomputed_to_the_same_outputs(model_dir, alice):
    """Eight requests that outgrow a small pool (192-token prompts, 128 new tokens each, room for 1900
    tokens: every prompt fits, not every continuation): vLLM preempts some and recomputes them later in
    other pages and side slots. A recomputed request reads its older tokens as their final positions
    place them (quantized once past the window), at most an 8-bit cache's error from the pool with room
    for all, so assert_reads_agree within one 8-bit bound, rkv-8. Measured: 4e-3 at most."""
    import torch

    from torch_rkv.integrations.vllm_pool import content_bytes
    from torch_rkv.scheme import by_name

    roomy = engine("rkv-8-served", "rkv-8", lambda: serving_job(model_dir, alice))
    per_token = 30 * content_bytes(by_name("rkv-8"), 3, 64, torch.float32)  # SmolLM2's 30 layers, one page's bytes
    job = serving_job(model_dir, alice)
    job["tasks"] = [{"kind": "generate", "prompts": preempt_prompts(alice), "max_tokens": PREEMPT["new"]}]
    # (vLLM refuses a pool smaller than one max_model_len request)
    job["engine"].update(kv_cache_memory_bytes=PREEMPT["room"] * per_token, disable_log_stats=False, max_model_len=1024)
    tight = engine("rkv-8-tight", "rkv-8", lambda: job)
    assert tight["kv_tokens"] < PREEMPT["count"] * (PREEMPT["prompt"] + PREEMPT["new"]) <= roomy["kv_tokens"]
    assert tight["metrics"].get("vllm:num_preemptions", 0) > 0, tight["metrics"]
    assert_reads_agree(roomy["generate"][-PREEMPT["count"]:], tight["generate"], logprob_bound(8, SMOLLM2_SENSITIVITY),
                       "request")


def test_requests_that_miss_steps_read_what_they_read_when_they_miss_none(model_dir, alice):
    """Two requests of 290 tokens generate 48 each (past token 320, where rkv-8 quantizes a block that
    leaves the window) beside 24 short ones (40 tokens, 2 new), at max_num_seqs 4: once with vLLM's
    scheduler, and once with one under which the second long request misses 2 steps, and later 24 in a
    row while the short ones pass through every side slot (scripts/vllm_sit_out.py: vLLM's own skip,
    which pipeline parallelism uses). A request keeps its side slot however many steps it
    misses, so both runs read the same cache: the same greedy reads within a tenth of the 8-bit bound
    (only the batches differ). Before the plugin took request identity from vLLM, the absent request's
    slot went to a short one, and it came back with a window read from page rows never written."""
    import vllm_sit_out

    prompts = prompts_from(alice, 2, 290) + [p[:40] for p in prompts_from(alice[5000:], 24, 40)]
    counts = [48, 48] + [2] * 24

    def job(scheduler):
        engine = {**CHUNKED, "max_num_seqs": 4, **({"scheduler_cls": scheduler} if scheduler else {})}
        return {"model": model_dir, "tasks": [{"kind": "generate", "prompts": prompts, "max_tokens": counts}],
                "engine": engine}

    plain, sitting = run_engine("rkv-8", job(None)), run_engine("rkv-8", job("vllm_sit_out.SittingOutScheduler"))
    assert "sit-out:" not in plain["log"], plain["log"][-3000:]
    assert sitting["log"].count("sit-out:") == vllm_sit_out.LONG + 2, sitting["log"][-3000:]
    assert_reads_agree(plain["generate"], sitting["generate"], logprob_bound(8, SMOLLM2_SENSITIVITY) / 10, "request")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("served", ["rkv-4", "allocation"])
def test_vllm_serve_answers_a_completion(model_dir, served, request):
    """`vllm serve` with the plugin on loopback answers an OpenAI completion request, then shuts down:
    with rkv-4, run by the command `plan --vllm` prints for it, whose tokens and concurrency vLLM then
    logs (through scripts/vllm_serve.py, with --enforce-eager added: the compiled test shows the same
    capacity), and with per-layer bits (layer_allocation: each layer bound to its scheme in vLLM's worker
    process, the default multiprocess layout)."""
    port = _free_port()
    planned = None
    if served == "rkv-4":  # 4 requests of 2048 tokens in 1 GB: plan's row and command for rkv-4
        rows = json.loads(subprocess.run(
            [sys.executable, "-P", "-m", "torch_rkv", "plan", "--vllm", "--json", "--config", f"{model_dir}/config.json",
             "--device", "cpu", "--dtype", "bfloat16", "--budget-gb", "1", "--context", "2048", "--batch", "4",
             "--max-num-seqs", "8", "--schemes", "rkv-4"], capture_output=True, text=True, check=True).stdout)["rows"]
        planned = next(row for row in rows if row["scheme"] == "rkv-4")
        setting, unset, args = planned["serve"]["env"], planned["serve"]["unset"], planned["serve"]["args"]
    else:
        setting = {plugin.ALLOCATION_ENV: request.getfixturevalue("layer_allocation"), "VLLM_CPU_KVCACHE_SPACE": KV_GB}
        unset, args = [plugin.ENV, plugin.CODEBOOK_ENV], ["--dtype", "bfloat16", "--max-model-len", "2048",
                                                          "--kv-transfer-config", json.dumps(plugin.KV_TRANSFER_CONFIG)]
    env = {k: v for k, v in dict(os.environ, **setting).items() if k not in unset}
    server = subprocess.Popen([sys.executable, str(SCRIPTS / "vllm_serve.py"), "serve", model_dir, "--host", "127.0.0.1",
                               "--port", str(port), "--enforce-eager", *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert server.poll() is None, server.stdout.read()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("vllm serve did not come up within 300 s")
        body = json.dumps({"model": model_dir, "prompt": "The capital of France is", "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"].strip(), answer
    finally:
        server.terminate()
        try:
            out, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            out, _ = server.communicate()
    assert "TORCH_RKV" in out or "KV cache size" in out
    if planned is not None:
        tokens, length, concurrency = vllm_engine.kv_capacity(out)
        assert (tokens, length, concurrency) == (planned["kv_tokens"], 2048, round(planned["max_concurrency"], 2))
    if served == "allocation":  # every layer scheme's pages (one metadata builder each)
        kept = set(re.findall(r"torch_rkv: \d+ layers keep (\d)-bit keys and (\d)-bit values", out))
        assert kept == {(str(k), str(v)) for k, v in LAYER_BITS}, out[-4000:]


def test_a_codebook_names_its_file_and_needs_a_scheme(monkeypatch, layer_codebook, tmp_path):
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.setenv(plugin.CODEBOOK_ENV, layer_codebook)
    with pytest.raises(ValueError, match="TORCH_RKV_SCHEME is not"):
        plugin.configured_scheme()
    monkeypatch.setenv(plugin.ENV, "rkv-3")
    s = plugin.configured_scheme()
    assert (s.name, s.levels, s.codebook) == ("rkv-3+codebook", "calibrated", layer_codebook)
    monkeypatch.setenv(plugin.CODEBOOK_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        plugin.configured_scheme()


def test_a_codebook_short_of_the_models_layers_fails_at_engine_start(tiny_qwen3, tmp_path):
    """A codebook for one layer, served to a two-layer model: the engine refuses at start (the metadata
    builder reads every layer's levels), naming the layer, rather than at the first request."""
    from torch_rkv.codebook import Codebook

    path = tmp_path / "one-layer.json"
    Codebook([{side: {"3": [float(i) for i in range(8)]} for side in "kv"}], model="one layer").save(path)
    job = {"model": tiny_qwen3, "engine": {"dtype": "float32", "max_model_len": 512, "skip_tokenizer_init": True},
           "tasks": []}
    with pytest.raises(RuntimeError, match="layer 1 is out of range for 1 layers"):
        run_engine("rkv-3", job, codebook=str(path))


def test_an_allocation_for_another_model_fails_at_engine_start(tiny_qwen3, tmp_path):
    """Per-layer bits for three layers, served to a two-layer model: the engine refuses at start, naming
    both counts, rather than serving some layers with another model's bits."""
    from torch_rkv.allocate import Allocation

    path = tmp_path / "three-layers.json"
    Allocation(((4, 2), (3, 3), (2, 4)), (2, 3, 4), 0.0).save(path)
    job = {"model": tiny_qwen3, "engine": {"dtype": "float32", "max_model_len": 512, "skip_tokenizer_init": True},
           "tasks": []}
    with pytest.raises(RuntimeError, match="the allocation has 3 layers, the model 2"):
        run_engine(None, job, allocation=str(path))


def test_smollm3s_layers_without_rope_keep_their_keys_as_they_are(tmp_path_factory):
    """SmolLM3 (vLLM's transformers backend; its second layer without RoPE): rkv-8 against vLLM's own
    cache by the portable criterion, and the NoPE layer, found by vLLM's layer index, un-rotates by the
    identity (the engine logs it for layer 1 alone; an 8-bit agreement cannot see which table)."""
    import torch
    import transformers

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-smollm3")
    transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(vocab_size=512, **SMOLLM3)).save_pretrained(path)
    gen = __import__("random").Random(0)
    prompts = [[gen.randrange(512) for _ in range(300)] for _ in range(2)]
    _, got = assert_8_bits_agree_with_vllms_own_cache("smollm3", str(path), prompts, TINY_SENSITIVITY,
                                                      skip_tokenizer_init=True, max_model_len=512)
    assert "Using Transformers modeling backend" in got["log"]
    nope = [line for line in got["log"].splitlines() if "applies no RoPE" in line]
    assert len(nope) == 1 and "model.layers.1." in nope[0], nope


# hybrid models: vLLM's own recurrent layers (their states in pages of the same pool, padded to the attention
# pages' size) beside attention layers in torch_rkv's pages; bfloat16, the only dtype vLLM's CPU gated-DeltaNet
# kernel takes (its linear heads of 128 channels, too)
@pytest.mark.parametrize("family", list(TINY_HYBRIDS))
def test_hybrid_models_agree_at_8_bits_with_vllms_own_cache(tmp_path_factory, family):
    """Hybrid models through the plugin: vLLM sizes its attention pages (torch_rkv's, from customize_spec) to
    hold at least a recurrent layer's state, pads the state pages to them, and runs its own recurrent layers;
    rkv-8 generations and teacher-forced log-probabilities agree with vLLM's own cache by the portable
    criterion, prompts prefilled in chunks, and vLLM's pool holds more tokens with them."""
    gen = __import__("random").Random(0)
    prompts = [[gen.randrange(512) for _ in range(300)] for _ in range(2)]
    # (prefills in chunks of 128 tokens: vLLM 0.32's CPU Mamba 2 fails on a longer prefill, with its own cache too)
    model_dir = tiny_hybrid(tmp_path_factory, family)
    ref, got = assert_8_bits_agree_with_vllms_own_cache(family, model_dir, prompts, TINY_SENSITIVITY,
                                                        dtype="bfloat16", skip_tokenizer_init=True,
                                                        max_model_len=512, max_num_batched_tokens=128)
    assert got["kv_tokens"] > ref["kv_tokens"] and got["concurrency"] > ref["concurrency"]
    assert_plan_vllm_logs(model_dir, (ref, got), 512, "bfloat16", max_num_batched_tokens=128)


def test_prefix_caching_on_a_hybrid_model(tmp_path_factory):
    """Prefix caching on Qwen3-Next (vLLM's default there: its recurrent states cached at page boundaries,
    mamba_cache_mode "align"): a shared prefix of 1100 tokens, one page of 1024 (the page vLLM sizes to the
    recurrent states at rkv-8), and four continuations; the later requests hit the page, their attention
    layers read its packed rows and their side slots take its window, and their generations agree with
    prefix caching off within one 8-bit bound."""
    model = tiny_hybrid(tmp_path_factory, "qwen3_next", max_position_embeddings=2048)
    gen = __import__("random").Random(3)
    prefix = [gen.randrange(512) for _ in range(1100)]
    prompts = [prefix + [gen.randrange(512) for _ in range(n)] for n in (200, 120, 64, 10)]

    def job(prefix_caching):
        return {"model": model, "tasks": [{"kind": "generate", "prompts": prompts, "max_tokens": SERVED_TOKENS,
                                           "batches": [[0], [1, 2, 3]]}],
                "engine": {**CHUNKED, "dtype": "bfloat16", "max_model_len": 1536, "skip_tokenizer_init": True,
                           "max_num_batched_tokens": 128, "long_prefill_token_threshold": 128,
                           "enable_prefix_caching": prefix_caching}}

    off, on = run_engine("rkv-8", job(False)), run_engine("rkv-8", job(True))
    assert "attention block size to 1024 tokens" in on["log"]
    hits = [g["cached_tokens"] for g in on["generate"]]
    assert hits[0] == 0 and all(n == 1024 for n in hits[1:]), hits
    assert_reads_agree(off["generate"], on["generate"], logprob_bound(8, TINY_SENSITIVITY), "continuation")


def tiny_hybrid(tmp_path_factory, family: str, **overrides) -> str:
    """TINY_HYBRIDS[family] (its config updated by `overrides`), random weights (seed 0), saved."""
    import torch
    import transformers

    config_cls, model_cls, kw = TINY_HYBRIDS[family]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    cfg = getattr(transformers, config_cls)(vocab_size=512, **{**kw, **overrides})
    getattr(transformers, model_cls)(cfg).save_pretrained(path)
    return str(path)


