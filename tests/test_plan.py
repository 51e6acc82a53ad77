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
