"""The memory ledger: byte counts equal what a real cache allocates; fit and longest-context arithmetic."""

import json

import pytest
import torch

from torch_rkv import plan
from torch_rkv import scheme as S
from torch_rkv.cache import BUFFERS, QuantizedKVCache

SCHEMES = [S.per_token(8), S.kivi(2), S.kvquant(3), S.quarot(4), S.recommended(4), S.recommended(2),
           S.per_token(3).replace(k_symmetric=True, meta_dtype=torch.float32)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("context,batch", [(1, 1), (300, 2), (1000, 1)])
def test_planned_bytes_equal_the_allocated_cache(scheme, context, batch):
    model = plan.ModelShape("tiny", layers=3, kv_heads=2, head_dim=64, params=1e6)
    cos, sin = torch.zeros(4096, 32), torch.zeros(4096, 32)
    cache = QuantizedKVCache(scheme, model.layers, batch, model.kv_heads, model.head_dim, context,
                             dtype=torch.float16, rope=(cos, sin))
    allocated = sum(t.numel() * t.element_size() for name, t in cache.named_buffers() if name in BUFFERS)
    assert plan.kv_bytes(model, scheme, context, batch) == cache.nbytes() == allocated


# Bytes of one layer, worked out by hand from docs/format.md (not from CacheLayout, which is under test):
HAND_COUNTED = [
    # per-token 4-bit, batch 2 x 3 heads x 100 tokens, d=64: per token and head 32 code bytes + fp16 scale
    # and zero, for K and V: 2 * (32 + 2 + 2) = 72 bytes; x 600 token-heads
    (S.per_token(4), 2, 3, 64, 100, 600 * 72),
    # KIVI-2 (per-channel keys in blocks of 32, values in groups of 32) with 4 sinks, recent 128, d=64,
    # 1 x 2 heads, capacity 1000: packed rows round up to whole blocks (1000 -> 1024 = 32 blocks; the
    # sinks and the window have rows too, filled as their blocks complete); the window ring holds
    # recent + block - 1 = 159 rows.
    #   codes     2 sides x 2 heads x 1024 rows x 16 bytes         = 65536
    #   K meta    2 heads x 32 blocks x 64 channels x (scale+zero) x 2 B = 16384
    #   V meta    2 heads x 1024 rows x 2 groups x (scale+zero) x 2 B    = 16384
    #   window    2 sides x 2 heads x 159 x 64 x 2 B               = 81408
    #   sinks     2 sides x 2 heads x 4 x 64 x 2 B                 = 2048
    (S.kivi(2).replace(sinks=4), 1, 2, 64, 1000, 65536 + 16384 + 16384 + 81408 + 2048),
    # 3-bit per-token, symmetric keys (no zero), fp32 metadata, d=64, 1 x 2 heads x 10 tokens: 24 code
    # bytes per row; keys 24 + 4, values 24 + 4 + 4 per token and head
    (S.per_token(3).replace(k_symmetric=True, meta_dtype=torch.float32), 1, 2, 64, 10, 20 * (28 + 32)),
]


@pytest.mark.parametrize("scheme,batch,heads,dim,capacity,want", HAND_COUNTED, ids=lambda x: getattr(x, "name", None))
def test_bytes_match_a_count_by_hand(scheme, batch, heads, dim, capacity, want):
    from torch_rkv.layout import CacheLayout

    assert CacheLayout(scheme, batch, heads, dim, capacity, torch.float16).nbytes() == want
    cache = QuantizedKVCache(scheme, 3, batch, heads, dim, capacity, dtype=torch.float16,
                             rope=(torch.zeros(4096, dim // 2), torch.zeros(4096, dim // 2)))
    assert cache.nbytes() == 3 * want
    assert sum(t.numel() * t.element_size() for name, t in cache.named_buffers() if name in BUFFERS) == 3 * want
    model = plan.ModelShape("tiny", layers=3, kv_heads=heads, head_dim=dim, params=1e6)
    assert plan.kv_bytes(model, scheme, capacity, batch) == 3 * want


def test_full_precision_baseline_and_bytes_per_token():
    model = plan.MODELS["llama-3-8b"]
    assert plan.bytes_per_token(model, None) == 2 * 32 * 8 * 128 * 2  # K and V, fp16
    # 4-bit per-token keys and values: 64 code bytes + 4 metadata bytes per head and tensor
    assert plan.bytes_per_token(model, S.per_token(4)) == 2 * 32 * 8 * (64 + 4)


def test_longest_context_is_the_exact_boundary():
    model = plan.MODELS["smollm2-135m"]
    budget = 1.5e9
    for scheme in (None, S.recommended(3), S.kivi(2)):
        n = plan.longest_context(model, scheme, budget)
        assert plan.kv_bytes(model, scheme, n, 1) <= budget < plan.kv_bytes(model, scheme, n + 1, 1)
        seqs = plan.most_sequences(model, scheme, budget, 4096)
        assert plan.kv_bytes(model, scheme, 4096, seqs) <= budget < plan.kv_bytes(model, scheme, 4096, seqs + 1)


def test_the_articles_example_runs(capsys):
    """80 GB GPU, a 70B-class model with 4-bit weights, 128K context: fp16 does not fit, 3-bit does."""
    from torch_rkv.__main__ import main

    assert main(["plan", "--model", "llama-3-70b", "--gpu-gb", "80", "--weight-bits", "4", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalpha() and len(line.split()) >= 7}
    assert rows["fp16"][4] == "no" and rows["rkv-3"][4] == "yes"


def test_config_json_of_any_model(tmp_path):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    shape = plan.from_config(str(path), None)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (32, 8, 128)
    assert abs(shape.params / 8.03e9 - 1) < 0.01  # the estimate recovers Llama-3-8B's size


@pytest.mark.parametrize("extra", [{"sliding_window": 4096},  # Mistral-7B v0.1
                                   {"sliding_window": 1024, "layer_types": ["sliding_attention", "full_attention"]}])
def test_sliding_window_configs_are_refused_by_name(tmp_path, extra):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, **extra}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="sliding-window layers"):
        plan.from_config(str(path), None)
    path.write_text(json.dumps({**cfg, "sliding_window": 131072, "use_sliding_window": False,
                                "layer_types": ["full_attention"] * 2}))  # Qwen2.5: a window that is off
    assert plan.from_config(str(path), None).layers == 2


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("context", [1, 300, 1000])
def test_paged_bytes_equal_the_allocated_paged_cache(scheme, context):
    """plan's paged concurrency counts what a PagedQuantizedKVCache holding one sequence allocates."""
    from torch_rkv.paged import PagedQuantizedKVCache

    model = plan.ModelShape("tiny", layers=3, kv_heads=2, head_dim=64, params=1e6)
    want = plan.paged_sequence_bytes(model, scheme, context)
    cache = PagedQuantizedKVCache(scheme, model.layers, model.kv_heads, model.head_dim, 1, 1, dtype=torch.float16,
                                  rope=(torch.zeros(4096, 32), torch.zeros(4096, 32)))
    pages = cache.layout.pages_for(context)
    cache = PagedQuantizedKVCache(scheme, model.layers, model.kv_heads, model.head_dim, pages, 1, dtype=torch.float16,
                                  rope=(torch.zeros(4096, 32), torch.zeros(4096, 32)))
    assert cache.nbytes() == want
    assert plan.paged_sequences(model, scheme, 10 * want + 1, context) == 10
