"""The transformers integration: RKVCache + the "rkv" attention on a tiny random Llama (built here, no
download) against transformers' own cache, and the real-model check on SmolLM2-135M-Instruct."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache, enable  # noqa: E402


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
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 50 + 24 - 1


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


@pytest.mark.parametrize("rope_parameters", [{"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                             {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 128}],
                         ids=["linear", "yarn"])
def test_pre_rope_uses_the_models_own_rope_scaling(rope_parameters):
    model = tiny_llama(rope_parameters)
    ids = torch.randint(0, 160, (1, 40), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, max_new_tokens=16, do_sample=False)
    cache = RKVCache(model, S.kvquant(8, block=8), capacity=64)
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache), want)


def test_every_preset_generates_at_low_bits():
    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 30), generator=torch.Generator().manual_seed(4))
    for make in S.PRESETS.values():
        scheme = make(2)
        if scheme.k_group_size == 1:
            scheme = scheme.replace(k_block_tokens=8)
        cache = RKVCache(model, scheme, capacity=64)
        out = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
        assert out.shape == (1, 38)


def test_decode_without_the_fused_attention_is_an_error():
    model = tiny_llama()
    ids = torch.randint(0, 160, (1, 10))
    cache = RKVCache(model, S.per_token(8), capacity=32)
    model.set_attn_implementation("sdpa")  # the user switched it back: decode would see one key only
    with pytest.raises(RuntimeError, match="did not use the fused attention"):
        model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)


def test_padded_batches_are_refused():
    model = tiny_llama()
    ids = torch.randint(0, 160, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    cache = RKVCache(model, S.per_token(8), capacity=32, batch=2)
    with pytest.raises(NotImplementedError, match="position_ids must equal the cache slots|padded batches"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache=cache)


def test_bad_scheme_for_the_model_and_full_cache():
    model = tiny_llama()
    with pytest.raises(ValueError, match="does not divide head_dim 32"):
        RKVCache(model, S.recommended(4).replace(v_group_size=48), capacity=32)
    cache = RKVCache(model, S.per_token(8), capacity=16)
    with pytest.raises(ValueError, match="exceeds the capacity of 16 tokens"):
        model.generate(torch.randint(0, 160, (1, 12)), max_new_tokens=8, do_sample=False, cache=cache)


# --------------------------------------------------------------------------------------------------
# Real model: SmolLM2-135M-Instruct on alice29.txt
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from torch_rkv.eval import data

    try:
        data.model_gguf(fetch=False)
    except data.MissingMaterial as e:
        pytest.skip(f"SmolLM2 model package not installed ({e})")
    try:
        text = data.read_text(str(data.text_path()))
    except data.MissingMaterial as e:
        pytest.skip(f"alice29.txt unavailable: {e}")
    model, tok = data.load_model()
    ids = tok("<|endoftext|>" + text, return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    return model, tok, ids, ref


@pytest.mark.slow
def test_smollm2_matches_full_precision_at_8_bits_with_every_preset(smollm2):
    model, _, ids, ref = smollm2
    for name, make in S.PRESETS.items():
        if name == "rkv-mixed":  # keys one step above values: no 8-bit variant
            continue
        cache = RKVCache(model, make(8), capacity=1100)
        out = model.generate(ids, max_new_tokens=32, do_sample=False, cache=cache)
        assert torch.equal(out[0, 1024:], ref[0, 1024:]), make(8).name


@pytest.mark.slow
def test_smollm2_stays_coherent_at_4_bits(smollm2):
    """Coherent: the full-precision model finds the 4-bit continuation about as likely as its own
    (perplexity of the 32 generated tokens far below what broken text scores)."""
    model, tok, ids, ref = smollm2
    cache = RKVCache(model, S.recommended(4), capacity=1100)
    out = model.generate(ids, max_new_tokens=32, do_sample=False, cache=cache)

    def continuation_ppl(seq):
        with torch.no_grad():
            logits = model(seq).logits[0, 1023:-1]
        return torch.nn.functional.cross_entropy(logits, seq[0, 1024:]).exp().item()

    own, quantized = continuation_ppl(ref), continuation_ppl(out)
    assert quantized < 3 * own + 5, (own, quantized, tok.decode(out[0, 1024:]))
    assert torch.equal(out[0, 1024:1028], ref[0, 1024:1028])  # the first words agree
