"""The transformers integration: RKVCache + the "rkv" attention on a tiny random Llama (built here, no
download) against transformers' own cache, and the real-model check on SmolLM2-135M-Instruct."""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.cache import QuantizedKVCache  # noqa: E402
from torch_rkv.eval.agreement import full_logprobs, greedy_agrees, logprob_bound, teacher_forced  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402

# Each model's sensitivity (logprob_bound): nats of top-candidate log-probability per sqrt(relative step),
# stated with ~4x headroom over the largest measured with every preset at 2 to 8 bits. A random tiny
# model's attention is nearly uniform, so it is far less sensitive than a trained one.
TINY_SENSITIVITY = 0.2  # measured <= 0.056 (kivi-4: 0.014 nats)
SMOLLM2_SENSITIVITY = 8.0  # measured <= 2.7 (rkv-3: 0.95 nats; quarot-8: 0.12)


def assert_agrees(model, prompt, want, got, scheme, bits, sensitivity, capacity, ref_logprobs=None):
    """The portable criterion (torch_rkv.eval.agreement) for every sequence of a batch: greedy tokens
    equal up to the first full-precision near-tie, and teacher-forced log-probabilities within the bound.
    ref_logprobs: full_logprobs of `want` (batch 1), when the caller has them."""
    bound, n = logprob_bound(bits, sensitivity), prompt.shape[1]
    for b in range(want.shape[0]):
        ref = full_logprobs(model, want[b : b + 1]) if ref_logprobs is None else ref_logprobs
        steps = want.shape[1] - n
        agree = greedy_agrees(want[b, n:], got[b, n:], ref[n - 1 : n - 1 + steps], eps=2 * bound)
        assert agree, f"{scheme.name}, sequence {b}: {agree.detail}"
        forced = teacher_forced(model, want[b : b + 1], n, lambda: RKVCache(model, scheme, capacity=capacity), bound,
                                reference=ref)
        assert forced, f"{scheme.name}, sequence {b}: {forced.detail}"


def tiny_llama(rope_parameters=None, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=160, hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    if rope_parameters is not None:
        cfg.rope_parameters = rope_parameters
    model = LlamaForCausalLM(cfg).eval()
    return model


PRESETS_8BIT = [S.per_token(8), S.kivi(8, block=8, recent=16), S.kvquant(8, block=16), S.quarot(8),
                S.recommended(8).replace(k_block_tokens=16)]


@pytest.mark.parametrize("scheme", PRESETS_8BIT, ids=lambda s: s.name)
def test_generate_at_8_bits_matches_transformers_cache(scheme):
    model = tiny_llama()
    ids = torch.randint(0, 160, (2, 50), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=24, do_sample=False)
    cache = RKVCache(model, scheme, capacity=128, batch=2)
    with warnings.catch_warnings():  # the pre-5.x argument name still works (deprecated in transformers 5)
        warnings.simplefilter("ignore", FutureWarning)
        got = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache)
    assert_agrees(model, ids, want, got, scheme, 8, TINY_SENSITIVITY, 128)
    assert cache.get_seq_length() == 50 + 24 - 1


def test_the_criterion_catches_a_broken_kernel(monkeypatch):
    """The portable criterion still fails on a real bug: attention that misses the newest cached token
    (an off-by-one in the lengths) breaks the teacher-forced bound at 8 bits."""
    model = tiny_llama()
    scheme = S.kivi(8, block=8, recent=16)
    ids = torch.randint(0, 160, (1, 74), generator=torch.Generator().manual_seed(1))
    make = lambda: RKVCache(model, scheme, capacity=128)  # noqa: E731
    bound = logprob_bound(8, TINY_SENSITIVITY)
    assert teacher_forced(model, ids, 50, make, bound)
    attend = QuantizedKVCache.attend

    def off_by_one(self, layer, q, scale=None, split_tokens=0, sink_logits=None):
        lengths = self.lengths[layer].clone()
        self.lengths[layer] -= 1
        try:
            return attend(self, layer, q, scale, split_tokens, sink_logits)
        finally:
            self.lengths[layer] = lengths

    monkeypatch.setattr(QuantizedKVCache, "attend", off_by_one)
    broken = teacher_forced(model, ids, 50, make, bound)
    assert not broken, broken.detail


@pytest.mark.parametrize("scheme", [S.recommended(8).replace(k_block_tokens=16), S.quarot(8)], ids=lambda s: s.name)
def test_forward_with_use_cache_matches_full_forward(scheme):
    """Prefill, one decode step, then a 5-token chunk: logits close to the uncached forward, within
    what 8-bit keys and values allow."""
    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = RKVCache(model, scheme, capacity=128)
        a = model(ids[:, :64], cache=cache, use_cache=True).logits
        b = model(ids[:, 64:65], cache=cache, use_cache=True).logits
        c = model(ids[:, 65:70], cache=cache, use_cache=True).logits
    assert torch.allclose(a, full[:, :64], atol=1e-5)  # prefill: ordinary attention on fresh keys
    got = torch.cat([b, c], dim=1)
    # 8-bit steps are ~0.4% of each group's range; the tiny model's logits move by far less than 0.05
    assert (got - full[:, 64:70]).abs().max() < 0.05
    assert cache.get_seq_length() == 70


def test_a_second_turn_runs_the_prefill_kernel_over_the_quantized_cache(monkeypatch):
    """A second turn (a chunk of several tokens after the prefill) attends through
    rkv::paged_prefill_attention: the cache as stored, the chunk itself in full precision; nothing is
    dequantized. At 8 bits the two-turn generation agrees with transformers' own cache."""
    model = tiny_llama()
    scheme = S.recommended(8).replace(k_block_tokens=16)
    first = torch.randint(0, 160, (1, 40), generator=torch.Generator().manual_seed(6))
    reply = model.generate(first, max_new_tokens=8, do_sample=False)
    second = torch.cat([reply, torch.randint(0, 160, (1, 20), generator=torch.Generator().manual_seed(7))], dim=1)
    want = model.generate(second, max_new_tokens=12, do_sample=False)

    calls = []
    attend_chunk = QuantizedKVCache.attend_chunk  # (the prefill op over the cache, its append apart: KV sharing)
    monkeypatch.setattr(QuantizedKVCache, "attend_chunk",
                        lambda self, *a, **k: calls.append(1) or attend_chunk(self, *a, **k))
    monkeypatch.setattr(QuantizedKVCache, "dequantized", lambda *a: pytest.fail("the chunk path dequantized the cache"))
    cache = RKVCache(model, scheme, capacity=128)
    model.generate(first, max_new_tokens=8, do_sample=False, cache=cache)
    got = model.generate(second, max_new_tokens=12, do_sample=False, cache=cache)  # the new 20 tokens: one chunk
    assert len(calls) == model.config.num_hidden_layers  # one chunk per layer
    assert_agrees(model, second, want, got, scheme, 8, TINY_SENSITIVITY, 128)


@pytest.mark.parametrize("rope_parameters", [{"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                             {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 128}],
                         ids=["linear", "yarn"])
def test_pre_rope_uses_the_models_own_rope_scaling(rope_parameters):
    model = tiny_llama(rope_parameters)
    ids = torch.randint(0, 160, (1, 40), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, max_new_tokens=16, do_sample=False)
    scheme = S.kvquant(8, block=8)
    got = model.generate(ids, max_new_tokens=16, do_sample=False, cache=RKVCache(model, scheme, capacity=64))
    assert_agrees(model, ids, want, got, scheme, 8, TINY_SENSITIVITY, 64)


def test_every_preset_generates_at_low_bits():
    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 30), generator=torch.Generator().manual_seed(4))
    for make in S.SERVED_PRESETS.values():
        scheme = make(2)
        if scheme.k_group_size == 1:
            scheme = scheme.replace(k_block_tokens=8)
        cache = RKVCache(model, scheme, capacity=64)
        out = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
        assert out.shape == (1, 38)


@pytest.mark.parametrize("tokens", [2, 4])
def test_decode_without_the_fused_attention_is_an_error(tokens):
    """Decode steps whose attention is not the fused one saw the new token alone: an error, the last step's
    too (two new tokens: one decode step, whose wrong token no later update would have caught)."""
    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 10))
    cache = RKVCache(model, S.per_token(8), capacity=32)
    model.set_attn_implementation("sdpa")  # the user switched it back: decode would see one key only
    with pytest.raises(RuntimeError, match="did not use the fused attention"):
        model.generate(ids, max_new_tokens=tokens, do_sample=False, cache=cache)
    assert not any(layer.pending for layer in cache.layers)
    if tokens == 2:  # a cache passed by position; chunks no layer attended over: appended, every layer alike
        with pytest.raises(RuntimeError, match="did not use the fused attention"):
            model(torch.randint(0, 160, (1, 1)), None, None, cache)
        from torch_rkv.integrations.transformers import _check_steps_ran

        for layer in cache.layers:
            layer.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32))
        with pytest.raises(RuntimeError, match="the cache holds this forward's tokens"):
            _check_steps_ran(model, (), {"cache": cache}, None)
        assert [layer.get_seq_length() for layer in cache.layers] == [17] * 3


def test_padded_batches_are_refused():
    model = tiny_llama()
    ids = torch.randint(0, 160, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    cache = RKVCache(model, S.per_token(8), capacity=32, batch=2)
    with pytest.raises(RuntimeError, match="position_ids must equal the cache slots|padded batches"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache=cache)


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor data by the host (aten._local_scalar_dense: .item(), bool(t), int(t)),
    each a device synchronization on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_decode_guards_run_on_the_device_without_host_reads():
    """The padding and position guards are device-side checks (torch._assert_async): a decode step reads
    nothing back to the host, so on a GPU they cost no sync and are never skipped, and on CPU this same
    code path still refuses bad input."""
    from torch_rkv.integrations.transformers import rkv_attention

    model = tiny_llama()
    cache = RKVCache(model, S.kivi(8, block=8, recent=4), capacity=32)
    n = 12
    with torch.no_grad():
        model(torch.randint(0, 160, (1, n)), cache=cache, use_cache=True)  # prefill
    layer = cache.layers[0]
    k, v, q = torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 6, 1, 32)
    mask = torch.ones(1, 1, 1, n + 1, dtype=torch.bool)
    with HostReads() as reads:
        key, value = layer.update(k, v, position_ids=torch.tensor([[n]]))
        out, _ = rkv_attention(None, q, key, value, mask, scaling=32**-0.5)
    assert reads.count == 0 and out.shape == (1, 1, 6, 32)
    for layer in cache.layers[1:]:  # the other layers of this step
        layer.update(k, v, position_ids=torch.tensor([[n]]))
        layer.awaiting.clear()
    with pytest.raises(RuntimeError, match="position_ids must equal the cache slots"):
        cache.layers[0].update(k, v, position_ids=torch.tensor([[n + 5]]))
    key, value = cache.layers[0].update(k, v, position_ids=torch.tensor([[n + 1]]))
    mask = torch.ones(1, 1, 1, n + 2, dtype=torch.bool)
    mask[..., 0] = False  # a padded position
    with pytest.raises(RuntimeError, match="padded batches"):
        rkv_attention(None, q, key, value, mask, scaling=32**-0.5)


def test_bad_scheme_for_the_model_and_full_cache():
    model = tiny_llama()
    with pytest.raises(ValueError, match="does not divide head_dim 32"):
        RKVCache(model, S.recommended(4).replace(v_group_size=48), capacity=32)
    cache = RKVCache(model, S.per_token(8), capacity=16)
    with pytest.raises(RuntimeError, match="exceeds the capacity of 16 tokens"):
        model.generate(torch.randint(0, 160, (1, 12)), max_new_tokens=8, do_sample=False, cache=cache)


# --------------------------------------------------------------------------------------------------
# Real model: SmolLM2-135M-Instruct on alice29.txt
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_alice):
    model, tok, text = smollm2_alice
    model.set_attn_implementation("sdpa")
    ids = tok("<|endoftext|>" + text, return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    return model, tok, ids, ref, full_logprobs(model, ref)


@pytest.mark.slow
def test_smollm2_agrees_with_full_precision_at_8_bits_with_every_preset(smollm2):
    model, _, ids, ref, ref_logprobs = smollm2
    for name, make in S.SERVED_PRESETS.items():
        if name == "rkv-mixed":  # keys one step above values: no 8-bit variant
            continue
        cache = RKVCache(model, make(8), capacity=1100)
        out = model.generate(ids, max_new_tokens=32, do_sample=False, cache=cache)
        assert_agrees(model, ids, ref, out, make(8), 8, SMOLLM2_SENSITIVITY, 1100, ref_logprobs)


@pytest.mark.slow
def test_smollm2_stays_coherent_at_4_bits(smollm2):
    """Coherent: the full-precision model finds the 4-bit continuation about as likely as its own
    (perplexity of the 32 generated tokens far below what broken text scores), and the 4-bit cache
    keeps every teacher-forced step within the bound."""
    model, tok, ids, ref, ref_logprobs = smollm2
    scheme = S.recommended(4)
    cache = RKVCache(model, scheme, capacity=1100)
    out = model.generate(ids, max_new_tokens=32, do_sample=False, cache=cache)

    def continuation_ppl(seq):
        with torch.no_grad():
            logits = model(seq).logits[0, 1023:-1]
        return torch.nn.functional.cross_entropy(logits, seq[0, 1024:]).exp().item()

    own, quantized = continuation_ppl(ref), continuation_ppl(out)
    assert quantized < 3 * own + 5, (own, quantized, tok.decode(out[0, 1024:]))
    forced = teacher_forced(model, ref, 1024, lambda: RKVCache(model, scheme, capacity=1100),
                            logprob_bound(4, SMOLLM2_SENSITIVITY), reference=ref_logprobs)
    assert forced, forced.detail
