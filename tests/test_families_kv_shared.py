"""KV-shared layers (Gemma 3n's, and Gemma 4's small models'): layers that keep no cache of their own and
attend over an earlier layer's, token by token, over a chunk after the prefill and over a prompt's last queries."""


import pytest
import torch

transformers = pytest.importorskip("transformers")
from familybuild import KV_SHARED, SENSITIVITY, WINDOWED, assert_decodes_as_simulated, build, prompt, windowed  # noqa: E402

from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.eval.agreement import logprob_bound  # noqa: E402
from torch_rkv.integrations import models  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402


def test_kv_shared_layers_store_nothing_and_decode_what_the_simulation_measures():
    """Gemma 3n's KV-shared layers 2 and 3 hold no cache (half the bytes of a model that does not share) and,
    token by token through the fused kernel, attend over layers 0's and 1's quantized keys and values: the
    simulation's perplexity, in which each quantizes its source's keys as its source does."""
    model = windowed("gemma3n")
    scheme = S.recommended(4).replace(k_block_tokens=16, recent=8)
    cache = RKVCache(model, scheme, capacity=96)
    assert [type(layer).__name__ for layer in cache.layers] == ["RKVLayer", "RKVLayer", "DummyLayer", "DummyLayer"]
    unshared = RKVCache(build(*WINDOWED["gemma3n"][:2], **{**WINDOWED["gemma3n"][2], "num_kv_shared_layers": 0}),
                        scheme, capacity=96)
    assert 2 * cache.nbytes() == unshared.nbytes() and cache.schemes == [scheme] * 4
    assert_decodes_as_simulated(model, scheme, moves=1e-3)
    with pytest.raises(ValueError, match="layer 2 attends over layer 0's keys and values"):
        RKVCache(model, [scheme, scheme, S.per_token(4), scheme], capacity=96)
    # per-layer fits, which would take a shared layer's reads for a cache of its own, refuse the model by name
    from torch_rkv.eval import levels, sensitivity

    for fit in (lambda: sensitivity.load_or_measure(model, None, (2, 3)),
                lambda: levels.calibrate(model, prompt(96, seed=5))):
        with pytest.raises(models.UnsupportedModelFeature, match="whose layers share KV caches"):
            fit()


@pytest.mark.parametrize("name", KV_SHARED)
def test_kv_shared_layers_attend_over_a_chunk_before_it_is_appended_once(name, monkeypatch):
    """A chunk after the prefill (a second turn), its KV-shared layers keeping its last query only (Gemma's
    logits_to_keep): every reader of a cache attends over it as it stood before the chunk, plus the chunk,
    and the last one appends the chunk once; the logits stay within the 8-bit bound of transformers' cache."""
    from torch_rkv.cache import QuantizedKVCache

    model = windowed(name)
    ids = prompt(60, batch=2)
    calls = []
    attend_chunk = QuantizedKVCache.attend_chunk

    def recorded(self, layer, q, ks, vs, *args, **kwargs):
        calls.append((id(self), layer, int(self.lengths[layer][0]), q.shape[2], ks.shape[2]))
        return attend_chunk(self, layer, q, ks, vs, *args, **kwargs)

    monkeypatch.setattr(QuantizedKVCache, "attend_chunk", recorded)
    scheme = S.per_token(8)
    cache = RKVCache(model, scheme, capacity=128, batch=2)
    with torch.no_grad():
        want = model(ids, logits_to_keep=1).logits[:, -1]
        model(ids[:, :40], cache=cache, use_cache=True)
        got = model(ids[:, 40:], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    # layer 0's cache read by layers 0 and 2, layer 1's by 1 and 3 (a chunk of 20 over 40 cached tokens; the
    # shared layers' one query padded to the chunk)
    assert [c[2:] for c in calls] == [(40, 20, 20)] * 4, calls
    assert calls[0][:2] == calls[2][:2] and calls[1][:2] == calls[3][:2] and calls[0][:2] != calls[1][:2]
    assert [cache.layers[i].get_seq_length() for i in (0, 1)] == [60, 60]
    bound = logprob_bound(8, SENSITIVITY[name])
    err = (got.log_softmax(-1) - want.log_softmax(-1)).gather(-1, want.topk(8, -1).indices).abs().max()
    assert err <= bound, (err, bound)


def test_kv_shared_layers_keep_the_last_queries_of_a_prompt_causal():
    """Gemma 4's KV-shared layers keep only a prompt's last logits_to_keep queries, and the mask function
    leaves a short prompt's mask to SDPA's is_causal, which would align them with the first keys: the
    "rkv" attention masks them as the last ones, with the cache and without (the full forward's logits)."""
    model = windowed("gemma4_shared")
    ids = prompt(12)  # (shorter than the 16-token window: no mask on any layer)
    with torch.no_grad():
        want = model(ids).logits[:, -4:]
        cache = RKVCache(model, S.per_token(8), capacity=64)
        for got in (model(ids, logits_to_keep=4).logits, model(ids, cache=cache, logits_to_keep=4).logits):
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
