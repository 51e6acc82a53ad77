"""The engine features the vLLM plugin refuses by name where a layer is built
(torch_rkv/integrations/vllm_refusals.py), checked on plain config objects: each feature alone is named,
and an engine without any is served. tests/in_vllm builds the layer with vLLM's own configs."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from torch_rkv.integrations import vllm_refusals
from torch_rkv.integrations.vllm_refusals import unsupported_features


def engine(**changes) -> NS:
    """A plain engine config the plugin serves (a dense model, one pipeline stage, no connector but its own)."""
    config = NS(scheduler_config=NS(async_scheduling=True), parallel_config=NS(pipeline_parallel_size=1,
                                                                               use_ubatching=False),
                model_config=NS(is_hybrid=False, hf_config=NS(model_type="llama")), speculative_config=None,
                kv_transfer_config=NS(kv_connector="RKVConnector"), cache_config=NS(kv_sharing_fast_prefill=False))
    for path, value in changes.items():
        *parents, name = path.split("__")
        target = config
        for p in parents:
            target = getattr(target, p)
        setattr(target, name, value)
    return config


def test_an_engine_with_none_of_them_is_served(monkeypatch):
    monkeypatch.setattr(vllm_refusals, "configured_layers", lambda: None)
    assert unsupported_features(engine()) == []
    assert unsupported_features(engine(parallel_config__tensor_parallel_size=2)) == []  # (no refined channels)
    assert unsupported_features(engine(kv_transfer_config=None, scheduler_config__async_scheduling=False)) == []
    assert unsupported_features(engine(), kv_shared=True) == []  # (Gemma's KV-shared layers, one scheme)
    hybrid = engine(model_config=NS(is_hybrid=True, hf_config=NS(model_type="qwen3_next")))
    assert unsupported_features(hybrid) == []


@pytest.mark.parametrize("named, config, layer, allocation", [
    ("ALiBi", {}, {"alibi": True}, False),
    ("KV cache sharing between layers with a per-layer allocation", {}, {"kv_shared": True}, True),
    ("kv_sharing_fast_prefill", {"cache_config__kv_sharing_fast_prefill": True}, {"kv_shared": True}, False),
    ("kv_cache_dtype='fp8'", {}, {"kv_cache_dtype": "fp8"}, False),
    ("another KV connector than torch_rkv's (LMCacheConnectorV1", {"kv_transfer_config__kv_connector":
                                                                   "LMCacheConnectorV1"}, {}, False),
    ("pipeline parallelism", {"parallel_config__pipeline_parallel_size": 2}, {}, False),
    ("refined key channels (TORCH_RKV_CHANNELS) with tensor parallelism", {"parallel_config__tensor_parallel_size": 2},
     {}, False),
    ("asynchronous scheduling with speculative decoding", {"speculative_config": NS(method="ngram")}, {}, False),
    ("microbatching", {"parallel_config__use_ubatching": True}, {}, False),
    ("attention type encoder", {}, {"attn_type": "encoder"}, False),
    ("a per-layer allocation (TORCH_RKV_ALLOCATION) on a hybrid model",
     {"model_config": NS(is_hybrid=True, hf_config=NS(model_type="qwen3_next"))}, {}, True),
    ("a hybrid model of another family than qwen3_next", {"model_config": NS(is_hybrid=True, hf_config=NS(
        model_type="jamba_wrapper", text_config=NS(model_type="jamba")))}, {}, False),
    ("['alibi_bias']", {}, {"unknown": ("alibi_bias",)}, False),
])
def test_each_refused_feature_is_named_alone(monkeypatch, named, config, layer, allocation):
    monkeypatch.setattr(vllm_refusals, "configured_layers", lambda: [object()] if allocation else None)
    monkeypatch.setenv("TORCH_RKV_CHANNELS", "8:ranks.json")  # (refused with tensor parallelism only)
    refused = unsupported_features(engine(**config), **layer)
    assert len(refused) == 1 and refused[0].startswith(named), refused
