"""What `python -m torch_rkv plan` prints of a PlanResult: print_plan, as JSON or as the report, the ledger's
(print_contiguous) or a vLLM engine's (print_vllm), and a per-layer allocation's (print_allocation)."""

from __future__ import annotations

import json
from dataclasses import asdict

from .ledger import GB
from .request import PlanRequest
from .run import PlanResult
from .serve import ALLOCATION_PLACEHOLDER, MODEL_PLACEHOLDER, model_path, shell_command
from .vllm import VLLM_CACHES

OUR_PRESETS = ("rkv-",)  # rkv-<bits>, rkv-mixed-<bits>, rkv-sparse-<bits>: one layout, ranked by their bits


def print_plan(request: PlanRequest, result: PlanResult) -> None:
    """The plan as --json asks: one JSON object, else the report of its rows and allocation."""
    if request.json:
        print_json(request, result)
        return
    if request.engine is not None:
        print_vllm(request, result.rows)
    else:
        print_contiguous(request, result.rows)
    if result.allocation:
        print_allocation(request, result)


def print_json(request: PlanRequest, result: PlanResult) -> None:
    """The plan as one JSON object: the model (with --vllm: one GPU's share of the KV heads), the rows, the
    schemes left out, and the allocation."""
    model, engine, allocation = request.model, request.engine, result.allocation
    out = {"model": {**asdict(model), "state_bytes": model.state_bytes()}, "rows": result.rows,
           "left_out": request.left_out}
    if engine is not None:
        out["tensor_parallel_size"] = engine.tensor_parallel
    if allocation:
        out["allocation"] = {"bits": allocation[0].bits, "kv_bytes": allocation[1], "split": result.split,
                             "predicted_kl": allocation[0].predicted, "profile": request.sensitivity,
                             "file": request.out}
        if result.serving is not None:
            out["allocation"]["vllm"] = result.serving
    print(json.dumps(out, indent=1))


def print_vllm(request: PlanRequest, rows: list[dict]) -> None:
    """The report of a vLLM engine's rows (vllm_row): the engine and the model as vLLM keeps it, each scheme's
    KV memory, tokens and concurrency, and the command that serves the best of those that fit."""
    model, engine, budget = request.model, request.engine, request.budget
    weight, weighed = request.weight, request.weighed
    tp = engine.tensor_parallel
    pool = engine.pool(model, None)  # (vLLM's own cache: its groups, page unification and states)
    print(f"{model.name} in vLLM on {engine.device}: {model.layers} layers x {model.kv_heads} KV heads"
          f"{f' a GPU (tensor parallel {tp})' if tp > 1 else ''} x head_dim {model.head_dim}, {request.dtype}, "
          f"max_num_seqs {engine.max_num_seqs}; {budget / GB:.2f} GB{' a GPU' if tp > 1 else ''} for the KV pages "
          "and the plugin's side pool")
    if not request.budget_given:
        print(f"weights {weight / GB:.1f} GB ({weighed}){f', {weight / tp / GB:.1f} GB a GPU' if tp > 1 else ''}; "
              f"GPU {request.gpu_gb:.0f} GB, reserve {request.reserve_gb:.0f} GB")
    if model.sliding_layers:
        if engine.windows(model):
            groups = pool.groups
            print(f"{model.sliding_layers} of {model.layers} layers slide over {model.sliding_window:,} tokens: a "
                  f"request holds in them only its blocks of the newest {model.sliding_window - 1:,} tokens and the "
                  f"{engine.in_flight_tokens:,} in flight (max_num_batched_tokens {engine.max_num_batched_tokens:,}"
                  f"{' x 2, async scheduling' if engine.async_scheduling else ''}), and one more; vLLM's "
                  f"{len(groups)} KV-cache groups of at most {max(map(len, groups))} layers (the hybrid manager)")
        else:
            print(f"{model.sliding_layers} of {model.layers} layers slide, but without the hybrid KV-cache manager "
                  "vLLM keeps every block of theirs, like a full layer's")
    if model.global_shape:
        print(f"the {model.full_layers} global layers: {model.global_shape[0]} KV heads{' a GPU' if tp > 1 else ''} x "
              f"head_dim {model.global_shape[1]} (bits/el below at head_dim {model.head_dim}); "
              + ("vLLM brings every page to the largest, a smaller one holding more tokens a block where it divides "
                 "it (the plugin's pages of each shape are published to divide one size), else padded"
                 if len(pool.buckets) > 1 else "each layer keeps pages of its own bytes in one KV-cache group"))
    if model.kv_shared_layers:
        print(f"{model.kv_shared_layers} more layers attend over those layers' caches (KV sharing): vLLM gives them "
              "no pages, and the plugin no side slots")
    if model.recurrent_layers:
        state = model.state
        print(f"{model.recurrent_layers} layers keep a recurrent state ({state.mixer}): {pool.state_bytes / 1024:,.1f} "
              f"KiB a request{' a GPU' if tp > 1 else ''} each in vLLM's layout (its SSM in "
              f"{str(engine.state_ssm_dtype(state)).removeprefix('torch.')}), padded to an attention page; "
              f"{pool.state_blocks} blocks a request in each of their groups"
              f"{' (prefix caching: align mode)' if engine.prefix_caching else ''}; vLLM grows the block to hold one")
    print(f"{request.batch} requests at once; vLLM's capacity for requests of {request.context:,} tokens (max_model_len)\n")
    print(f"{'scheme':14s} {'bits/el':>7s} {'block':>5s} {'page KiB':>9s} {'side MiB':>9s} "
          f"{'kv_cache_memory_bytes':>22s} {'KV tokens':>12s} {'concurrency':>11s} {'fits':>5s}")
    for r in rows:
        print(f"{r['scheme']:14s} {r['bits_per_element']:7.2f} {r['block_size']:5d} {r['page_bytes'] / 1024:9.1f} "
              f"{r['side_pool_bytes'] / 2**20:9.1f} {r['kv_cache_memory_bytes']:22,d} {r['kv_tokens']:12,d} "
              f"{r['max_concurrency']:10.2f}x {'yes' if r['fits'] else 'no':>5s}")
    print(f"\nauto, fp8: vLLM's own cache in the model dtype, in 8-bit floats (--kv-cache-dtype fp8: per-tensor "
          f"scales{'; on CPU it needs AVX-512 or AMX' if engine.device == 'cpu' else ''}); block: tokens a vLLM block "
          f"holds; page: one layer's block; side: the plugin's full-precision rows for {request.batch} requests at "
          "once, at most (outside vLLM's KV memory); fits: the concurrency and max_num_seqs hold the requests")
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        print(f"\nnone of these holds {request.batch} requests of {request.context:,} tokens at once")
        return
    # vLLM's own cache when it fits, else the rkv preset of the most bits that fits, else the listed scheme
    # of the most bits, else vLLM's fp8 (bits alone do not rank schemes of different layouts: per-token-4
    # keeps more bits than rkv-4 and loses more, and vLLM's fp8, 8 bits, more than rkv-3 on SmolLM2: the
    # report's 8-bit rows)
    ours = [r for r in fitting if r["scheme"] == "auto" or r["scheme"].startswith(OUR_PRESETS)]
    listed = [r for r in fitting if r["scheme"] not in VLLM_CACHES]
    best = max(ours or listed or fitting, key=lambda r: r["bits_per_element"])
    why = ("vLLM's own cache holds them" if best["scheme"] == "auto" else
           "the rkv preset of the most bits that fits" if ours else "the most bits that fit" if listed else
           "vLLM's own fp8 cache: nothing listed fits")
    path = model_path(request.config)
    where = f"; {MODEL_PLACEHOLDER}: {model.name}'s Hugging Face id or directory" if path == MODEL_PLACEHOLDER else ""
    print(f"\nserve {best['scheme']} ({why}{where}):\n  " + shell_command(best["serve"], path))


def print_contiguous(request: PlanRequest, rows: list[dict]) -> None:
    """The ledger's report (ledger_rows): the model, the budget left for the cache, and each scheme's row."""
    model, weight, weighed, budget = request.model, request.weight, request.weighed, request.budget
    if request.budget_given:
        print(f"{model.name}: {model.layers} layers x {model.kv_heads} KV heads x head_dim {model.head_dim}; "
              f"{budget / GB:.1f} GB for the KV cache (--budget-gb)")
    else:
        print(f"{model.name}: {model.layers} layers x {model.kv_heads} KV heads x head_dim {model.head_dim}, "
              f"{model.params / 1e9:.2f}B weights{f' ({model.params_how})' if model.params_how else ''} = "
              f"{weight / GB:.1f} GB ({weighed}); GPU {request.gpu_gb:.0f} GB, reserve "
              f"{request.reserve_gb:.0f} GB -> {budget / GB:.1f} GB for the KV cache")
        if budget <= 0:
            print("the weights and the reserve alone take more than the GPU, so no cache fits (--weight-bits: the "
                  "weights as they will be served)")
    if model.sliding_layers:
        print(f"{model.sliding_layers} of {model.layers} layers slide: each keeps only its newest "
              f"{model.sliding_window:,} tokens (a fixed-size cache); {model.full_layers} attend to the whole context")
    if model.global_shape:
        print(f"the {model.full_layers} global layers: {model.global_shape[0]} KV heads x head_dim "
              f"{model.global_shape[1]} (bits/el above at head_dim {model.head_dim})")
    if model.kv_shared_layers:
        print(f"{model.kv_shared_layers} more layers attend over those layers' caches (KV sharing) and keep none")
    if model.kv_free_layers:
        print(f"{model.kv_free_layers} more layers (a hybrid's) keep a recurrent state or no mixer, and no KV cache")
    if model.state:
        print(f"{model.recurrent_layers} layers keep a recurrent state of fixed size, in full precision: "
              f"{model.state_bytes() / 2**20:.1f} MiB a sequence (convolution windows in fp16, states in float32, "
              "as transformers keeps them), counted in every row")
    elif model.recurrent_layers:
        print(f"{model.recurrent_layers} layers keep a recurrent state of fixed size per sequence, not counted here "
              "(the shape of its state: from the transformers config class of a family torch_rkv.recurrent knows)")
    print(f"context {request.context:,} tokens x batch {request.batch}\n")
    print(f"{'scheme':14s} {'bits/el':>7s} {'KB/token':>9s} {'KV cache GB':>12s} {'fits':>5s} "
          f"{'longest ctx (b=1)':>18s} {'seqs @ ctx':>11s} {'paged':>6s}")
    for r in rows:
        longest = "unbounded" if r["longest_context_batch1"] is None else f"{r['longest_context_batch1']:,d}"
        print(f"{r['scheme']:14s} {r['bits_per_element']:7.2f} {r['bytes_per_token'] / 1024:9.1f} "
              f"{r['kv_bytes'] / GB:12.2f} {'yes' if r['fits'] else 'no':>5s} {longest:>18s} "
              f"{r['max_sequences_at_context']:11d} {r['paged_sequences_at_context']:6d}")
    print("\nseqs @ ctx: a contiguous cache of that batch; paged: PagedQuantizedKVCache, page rounding and each "
          "sequence's side slot (sinks and window) included")


def print_allocation(request: PlanRequest, result: PlanResult) -> None:
    """The report of a per-layer allocation (PlanResult.allocation): its bits by layer, their cost and bytes,
    where it was written, and with an engine how to serve it."""
    model, budget, engine = request.model, request.budget, request.engine
    profile, split, serving = result.profile, result.split, result.serving
    alloc, nbytes, weights = result.allocation
    print(f"\nper-layer allocation for {request.batch} x {request.context:,} tokens in {budget / GB:.2f} GB "
          f"(profile {request.sensitivity}: {profile.model} on {profile.text}, levels {profile.levels}):")
    print(f"  K/V bits by layer: {alloc.describe()}")
    where = "vLLM's KV pages and the side pool" if engine is not None else "the cache"
    print(f"  {alloc.average_bits(weights):.2f} code bits ({alloc.effective_bits(model.head_dim, weights):.2f} "
          f"with metadata) per element; {where}: {nbytes / GB:.2f} GB; predicted cost {alloc.predicted:.4f} "
          "nats/token (the profile's KL, summed)")
    if split:
        print(f"  every layer keeps {alloc.layer_totals()[0]} key + value bits: pages of one size"
              + ("" if request.split else " (vLLM pads the pages of sliding and full layers to one size, so "
                 "unequal totals would buy nothing there)"))
    if request.out:
        print(f"  written to {request.out}: serve it in vLLM with TORCH_RKV_ALLOCATION={request.out}")
    if serving is not None:
        print(f"  vLLM holds {serving['max_concurrency']:.2f} requests of {request.context:,} tokens; serve it"
              + ("" if request.out else f" (--out writes {ALLOCATION_PLACEHOLDER})") + ":\n  "
              + shell_command(serving["serve"], model_path(request.config)))
