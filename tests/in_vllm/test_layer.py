"""The plugin's attention layer without an engine (torch_rkv/integrations/vllm_backend.py): its forward is
kernel launches only, the step's host work having run in the metadata builder (RKVAttentionImpl.prepare),
so it traces whole under torch.compile with the step's metadata as an input. Runs in the vLLM venv."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.entrypoints")  # a submodule: a folder named vllm on sys.path is not vLLM
import torch  # noqa: E402

from torch_rkv.integrations import vllm as plugin  # noqa: E402

HQ, HKV, D, PAGE = 4, 2, 64, 128


def llama_layer(monkeypatch):
    """An rkv-4 layer of a small Llama (pre-RoPE keys: vLLM's own rotary table for it) and a cache of 8
    pages, prepared for a step with a side pool of 16 slots."""
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config

    from torch_rkv.integrations.vllm_backend import RKVAttentionImpl
    from torch_rkv.integrations.vllm_pool import content_bytes
    from torch_rkv.scheme import by_name

    monkeypatch.setenv(plugin.ENV, "rkv-4")
    hf = transformers.LlamaConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D)
    config = VllmConfig()
    object.__setattr__(config, "model_config", SimpleNamespace(hf_config=hf, max_model_len=1024))
    with set_current_vllm_config(config):
        impl = RKVAttentionImpl(HQ, D, D ** -0.5, HKV)
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    kv_cache = torch.zeros(8, 1, PAGE, content_bytes(by_name("rkv-4"), HKV, D, torch.float32), dtype=torch.uint8)
    impl.prepare(layer, kv_cache, 16, torch.float32, None)
    return impl, layer, kv_cache


def step(cached: list[int], counts: list[int], decode: bool, gen: torch.Generator):
    """(metadata, query, key, value) of a step of two requests in pages 0-3 and 4-7, side slots 3 and 9."""
    from torch_rkv.integrations.vllm_builder import RKVMetadata

    qsl = torch.tensor([0, *counts]).cumsum(0)
    lengths = torch.tensor(cached)
    md = RKVMetadata(num_actual_tokens=sum(counts), max_query_len=max(counts), query_start_loc=qsl, lengths=lengths,
                     seq_lens=lengths + torch.tensor(counts), decode=decode,
                     block_tables=torch.arange(8, dtype=torch.int32).reshape(2, 4),
                     side_slots=torch.tensor([3, 9], dtype=torch.int32), slot_count=16,
                     positions=torch.cat([torch.arange(n, n + m) for n, m in zip(cached, counts)]))
    t = sum(counts)
    return md, *(torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))


def test_a_layers_forward_traces_whole_and_reads_what_eager_reads(monkeypatch):
    """After a prefill of 150 and 300 tokens (some of them quantized), a chunk of 5 more and a decode
    step each run eagerly and compiled with fullgraph=True, from the same cache: the same output and the
    same cache, bit for bit. A host read of a tensor value or any other graph break fails the trace.
    (Dynamo's graph, run as it is: AOT autograd refuses mutated inputs that view one storage with
    different dtypes, as the page regions do; vLLM never puts attention there, it splits its graphs at
    the attention op.)"""
    impl, layer, kv_cache = llama_layer(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    md, q, k, v = step([0, 0], [150, 300], False, gen)
    impl.forward(layer, q, k, v, kv_cache, md, torch.empty_like(q))
    compiled = torch.compile(impl.forward, fullgraph=True, backend="eager")
    for cached, counts, decode in (([150, 300], [5, 5], False), ([155, 305], [1, 1], True)):
        md, q, k, v = step(cached, counts, decode, gen)
        before = (kv_cache.clone(), {n: t.clone() for n, t in impl.state.side.items()})
        eager = impl.forward(layer, q, k, v, kv_cache, md, torch.empty_like(q)).clone()
        after = (kv_cache.clone(), {n: t.clone() for n, t in impl.state.side.items()})
        kv_cache.copy_(before[0])
        for n, t in impl.state.side.items():
            t.copy_(before[1][n])
        got = compiled(layer, q, k, v, kv_cache, md, torch.empty_like(q))
        assert torch.equal(got, eager) and torch.isfinite(got).all()
        assert torch.equal(kv_cache, after[0])
        assert all(torch.equal(t, after[1][n]) for n, t in impl.state.side.items())
        assert not torch.equal(after[1]["k_window"], before[1]["k_window"])  # (the step's tokens: in the window)
