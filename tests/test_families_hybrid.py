"""Hybrid models: recurrent layers (gated DeltaNet, Mamba 1 and 2, LFM2's short convolutions) or MLP-only
layers beside attention layers. Only the attention layers keep RKVCache's quantized caches, the others
transformers' own states: their layout and bytes (as the plan counts them), their rotary tables, generation and
decode at 8 bits, a second turn, the report's localization rewinding their states, and the report (less its
per-layer rows) on a hybrid."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from familybuild import (  # noqa: E402
    HYBRID,
    KV_SHARED,
    LINEAR,
    MAMBA2,
    assert_decodes_as_simulated,
    assert_generates_as_transformers_cache,
    assert_rotary_round_trip,
    build,
    prompt,
    windowed,
)
from test_transformers import TINY_SENSITIVITY  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.eval.agreement import logprob_bound  # noqa: E402
from torch_rkv.integrations import models  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402

# which layers attend (the others: (False, True))
HYBRID_ATTENTION = {"nemotron_h": (False, True, False), "qwen3_next": (False, True) * 2, "falcon_h1": (True, True)}
# (rot_dim, interleaved) of the families that rotate (Jamba, Nemotron-H and Granite 4 by default have no positions in
# their attention)
HYBRID_ROTARY = {"qwen3_next": (8, False), "qwen3_5": (8, False), "olmo_hybrid": (32, False), "lfm2": (32, False),
                 "lara_mini": (128, False), "falcon_h1": (32, False)}


def hybrid(name, **changes):
    config_cls, model_cls, kw = HYBRID[name]
    return build(config_cls, model_cls, **{**kw, **changes})


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_models_keep_kv_caches_in_their_attention_layers_alone(name):
    """The attention layers hold RKVCache's quantized caches, their exact bytes; the recurrent and MLP-only
    layers hold what transformers' own cache gives them (their states stay in full precision)."""
    from torch_rkv.layout import CacheLayout, binding_window

    model = hybrid(name)
    att = models.inspect(model)
    attends = HYBRID_ATTENTION.get(name, (False, True))
    assert tuple(att.attends(i) for i in range(att.layers)) == attends
    scheme = S.recommended(4).replace(k_block_tokens=16)
    cache = RKVCache(model, scheme, capacity=128, batch=2)
    own = DynamicCache(config=model.config)
    # (Jamba's: a subclass that refuses several tokens over its state, below)
    mine, theirs = ([layer for layer, a in zip(c.layers, attends) if not a] for c in (cache, own))
    assert len(mine) == len(theirs) and all(isinstance(x, type(y)) for x, y in zip(mine, theirs))
    assert all((type(x) is type(y)) == (name != "jamba") for x, y in zip(mine, theirs))
    kind = "RKVHybridLayer" if name == "falcon_h1" else "RKVLayer"  # (Falcon-H1's keep the mixer's states too)
    assert [type(layer).__name__ for layer, a in zip(cache.layers, attends) if a] == [kind] * sum(attends)
    assert cache.schemes == [scheme if a else None for a in attends]
    want = sum(CacheLayout(scheme, 2, att.layer_kv_heads[i], att.layer_head_dims[i], 128, torch.float32,
                           sliding_window=binding_window(att.windows[i], 128)).nbytes()
               for i in range(att.layers) if attends[i])
    assert cache.nbytes() == want
    assert models.inspect(model).windows == ((0, 16) if name == "lara_mini" else (0,) * att.layers)
    # forgetting a refused step leaves the recurrent states; a reset (a new sequence) clears them
    recurrent = next(i for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states"))
    with torch.no_grad():
        model(prompt(20, batch=2), cache=cache, use_cache=True)
    state = cache.layers[recurrent].conv_states[0].clone()
    assert state.abs().sum() > 0 and cache.has_previous_state(recurrent)
    cache.reset_steps()
    assert torch.equal(cache.layers[recurrent].conv_states[0], state) and cache.has_previous_state(recurrent)
    assert int(cache.layers[recurrent].cumulative_length_linear) == 20 == cache.get_seq_length(attends.index(True))
    cache.reset()
    assert not cache.layers[recurrent].conv_states[0].any() and not cache.has_previous_state(recurrent)
    assert cache.get_seq_length(attends.index(True)) == 0


# hybrid families whose recurrent states the planner counts beyond those above (Mamba 2 groups of 2; their
# recurrent layers' states only, through transformers' own cache)
MORE_STATES = {
    "bamba": ("BambaConfig", "BambaForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [1], "mamba_n_groups": 2,
        **MAMBA2}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, **LINEAR, "linear_conv_kernel_dim": 3}),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_dense_layers": 0}),
}


def held_states(cache) -> int:
    """Bytes of the recurrent layers' states a cache holds (transformers' LinearAttentionLayer's)."""
    return sum(t.nbytes for layer in cache.layers if hasattr(layer, "conv_states")
               for states in (layer.conv_states, layer.recurrent_states) for t in states.values() if t is not None)


@pytest.mark.parametrize("name", list(MORE_STATES))
def test_more_hybrid_families_recurrent_states_are_what_the_plan_counts(name, tmp_path):
    """As below, for the families whose states the planner knows beyond the tested hybrids (Mamba 2 groups of
    two, a kernel of 3, MoE variants), against transformers' own cache."""
    from torch_rkv import plan

    config_cls, model_cls, kw = MORE_STATES[name]
    model = build(config_cls, model_cls, **kw).to(torch.bfloat16)
    model.config.to_json_file(tmp_path / "config.json")
    shape = plan.from_config(str(tmp_path / "config.json"), 1e6)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt(20, batch=2), cache=cache, use_cache=True)
    assert shape.recurrent_layers == 1 and held_states(cache) > 0
    assert 2 * shape.state_bytes(torch.bfloat16) == held_states(cache)


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_models_recurrent_states_are_what_the_plan_counts(name, tmp_path):
    """plan --config counts every recurrent layer's state per sequence (torch_rkv.recurrent: each family's
    mixer dimensions from its config keys), whatever the scheme: exactly the bytes the cache holds after a
    forward of a bfloat16 model (convolution windows in bfloat16, states in float32)."""
    from torch_rkv import plan

    model = hybrid(name).to(torch.bfloat16)
    model.config.to_json_file(tmp_path / "config.json")
    shape = plan.from_config(str(tmp_path / "config.json"), 1e6)
    cache = RKVCache(model, S.recommended(4).replace(k_block_tokens=16), capacity=64, batch=2)
    with torch.no_grad():
        model(prompt(20, batch=2), cache=cache, use_cache=True)
    held = held_states(cache)
    assert shape.recurrent_layers == sum(hasattr(layer, "conv_states") for layer in cache.layers)
    assert held > 0 and 2 * shape.state_bytes(torch.bfloat16) == held
    assert plan.kv_bytes(shape, cache.schemes[HYBRID_ATTENTION.get(name, (False, True)).index(True)], 64, 2,
                         torch.bfloat16) == cache.nbytes() + held


@pytest.mark.parametrize("name", list(HYBRID_ROTARY))
def test_hybrid_models_rotary_table_and_pairing_are_their_own(name):
    """The first attention layer's keys, as test_the_rotary_table_and_pairing_are_the_models_own reads layer 0's
    (the recurrent layer before it reads no positions): the table and pairing inspect reports are the model's."""
    model = hybrid(name, **({"sliding_window": 64} if name == "lara_mini" else {}))  # (every key kept)
    assert_rotary_round_trip(model, HYBRID_ROTARY[name], layer=HYBRID_ATTENTION.get(name, (False, True)).index(True))


@pytest.mark.parametrize("name", list(HYBRID))
@pytest.mark.parametrize("scheme", [S.recommended(8).replace(k_block_tokens=16, recent=16), S.per_token(8)],
                         ids=lambda s: s.name)
def test_hybrid_rkv_cache_at_8_bits_generates_as_transformers_cache(name, scheme):
    """Prefill, decode and teacher-forced decoding with the recurrent layers' states beside the quantized
    caches: the portable criterion against transformers' own cache."""
    assert_generates_as_transformers_cache(hybrid(name), scheme)


@pytest.mark.parametrize("name", ["qwen3_next", "jamba", "falcon_h1"])
def test_hybrid_decode_measures_what_the_simulation_does(name):
    """Token by token through the fused kernel, Qwen3-Next's attention layers (1 and 3, their partial rotary
    table) and Jamba's (no RoPE) decode the simulation's perplexity: the simulation quantizes each attention
    layer as its own, by its model layer's table, not by the index of its module among the attention ones.
    (A sharper random Qwen3-Next, so that the scheme moves its perplexity.)"""
    model = hybrid(name, **({"initializer_range": 0.05} if name == "qwen3_next" else {}))
    assert_decodes_as_simulated(model, S.recommended(2).replace(k_block_tokens=16, recent=8), moves=3e-4)


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "falcon_h1"])
def test_hybrid_models_attend_over_a_second_turn_chunk(name):
    """A chunk after the prefill (a second turn): the attention layer reads its cache and the chunk through
    the fused prefill, the recurrent layer continues its state; the logits within the 8-bit bound of the full
    forward's, and each kind of layer counts 60 tokens."""
    model = hybrid(name)
    ids = prompt(60, batch=2)
    cache = RKVCache(model, S.recommended(8).replace(k_block_tokens=16, recent=16), capacity=128, batch=2)
    with torch.no_grad():
        want = model(ids).logits[:, -1]
        model(ids[:, :40], cache=cache, use_cache=True)
        got = model(ids[:, 40:], cache=cache, use_cache=True).logits[:, -1]
    assert [int(layer.get_seq_length()) for layer in cache.layers] == [60] * len(cache.layers)
    err = (got.log_softmax(-1) - want.log_softmax(-1)).gather(-1, want.topk(8, -1).indices).abs().max()
    assert err <= logprob_bound(8, TINY_SENSITIVITY), err


@pytest.mark.parametrize("name", [name for name in HYBRID if name != "jamba"] + ["gemma3n"])
def test_localization_rewinds_a_hybrids_recurrent_states(name):
    """The report's localization asks every question over one prefill of its document, rolled back after each:
    the attention layers drop the question's keys, and the recurrent layers, whose states cannot be cropped,
    take back the document's. So each question, asked again or after another, sees what it sees after a fresh
    prefill of the document, and what one forward of both sees (LaraMini's sliding layer keeps every key; its
    mask limits it). Gemma 3n's KV-shared layers keep no cache to drop. (Jamba's mixer drops the state here:
    refused, below.)"""
    from torch_rkv.eval import localization

    model = windowed(name) if name in KV_SHARED else hybrid(name)
    doc, questions = prompt(40), [prompt(6, seed=seed) for seed in (2, 3)]

    def after_document(q):
        cache = localization.document_cache(model)
        model(doc, cache=cache, use_cache=True)
        return model(q, cache=cache, use_cache=True).logits[0]

    cache = localization.document_cache(model)
    with torch.no_grad():
        model(doc, cache=cache, use_cache=True)
        states = localization.recurrent_states(cache)
        assert len(states) == sum(hasattr(layer, "conv_states") for layer in cache.layers)
        assert bool(states) == (name not in KV_SHARED)
        for q in questions + questions:
            got = model(q, cache=cache, use_cache=True).logits[0]
            localization.rewind(cache, 40, states)
            torch.testing.assert_close(got, after_document(q), rtol=0, atol=1e-6)
            one = model(torch.cat([doc, q], dim=1)).logits[0, 40:]
            torch.testing.assert_close(got, one, rtol=0, atol=1e-4)


def test_several_tokens_over_jambas_cached_state_are_refused_by_name():
    """transformers' Jamba scans several tokens over a cached Mamba state from a zero state (mamba_scan_forward's
    TODO): a chunk after the first would be silently wrong, 1e-3 off one forward of the whole here. RKVCache
    refuses it by name before any recurrent state changes, and so does the report's localization and chunked
    prefill; a prefill and one token a step read the state (the generation tests)."""
    from torch_rkv.eval.report import Options, Report

    model = hybrid("jamba")
    cache = RKVCache(model, S.recommended(8).replace(k_block_tokens=16), capacity=64)
    with torch.no_grad():
        model(prompt(20), cache=cache, use_cache=True)
        before = [t.clone() for layer in cache.layers if hasattr(layer, "conv_states")
                  for t in (*layer.conv_states.values(), *layer.recurrent_states.values())]
        with pytest.raises(models.UnsupportedModelFeature, match="a forward of 6 tokens over a cached recurrent state"):
            model(prompt(6, seed=2), cache=cache, use_cache=True)
        after = [t for layer in cache.layers if hasattr(layer, "conv_states")
                 for t in (*layer.conv_states.values(), *layer.recurrent_states.values())]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        model(prompt(1, seed=3), cache=cache, use_cache=True)  # (one token a step)
    for opts in (Options(alloc_targets=(), split_targets=(), chunk_sizes=()),
                 Options(alloc_targets=(), split_targets=(), loc_lengths=())):
        with pytest.raises(models.UnsupportedModelFeature, match="the report's localization and chunked prefill"):
            Report(model, None, "", opts)


def test_report_options_without_per_layer_rows():
    """Options.without_per_layer leaves no row that measures or fits every layer's own cache, for the default,
    quick and full options alike, and keeps every uniform scheme."""
    from torch_rkv.eval.report import Options

    for opts in (Options(), Options.quick(), Options.full()):
        assert opts.per_layer() and not opts.without_per_layer().per_layer()
        assert not opts.without_per_layer().uses_profile()
    full = Options.full().without_per_layer()
    assert full.loc_schemes == ("rkv-4", "rkv-2") and "rkv-sparse-2" in full.decode_schemes


@pytest.mark.slow
def test_the_report_runs_on_a_hybrid_model_less_its_per_layer_rows(smollm2_alice, tmp_path, capsys):
    """`report --model` of a hybrid (a tiny Qwen3.5 with SmolLM2's tokenizer) runs every section but the
    per-layer rows, which it leaves out and says why: the localization rewinds the recurrent states, the
    decode protocol and chunked prefill serve it through RKVCache."""
    from torch_rkv.__main__ import main

    _, tok, _ = smollm2_alice
    model = hybrid("qwen3_5", vocab_size=len(tok), max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "report.json"
    assert main(["report", "--model", str(tmp_path / "model"), "--quick", "--tokens", "512", "--out",
                 str(tmp_path / "plots"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "left out: torch_rkv: the report's per-layer rows" in printed
    assert "whose layers [0] keep a recurrent" in printed
    results = json.loads(out.read_text())
    assert results["options"]["alloc_targets"] == [] and results["allocation"] == []
    assert {x["scheme"] for x in results["localization"]} == {"full precision", "per-token-2", "rkv-2"}
    (decoded,) = results["decode_protocol"]
    assert abs(decoded["relative_difference"]) < 1e-4 and results["chunked_prefill"]


def test_per_layer_fits_and_the_report_refuse_hybrid_models_by_name():
    """The sensitivity profile and the calibrated levels measure every layer's cache: a hybrid's recurrent
    layers have none, so they refuse it by name (a uniform scheme serves it). The report asked for its per-layer
    rows refuses it before any row runs, and a model of recurrent layers alone is refused by inspect."""
    from torch_rkv.eval import levels, sensitivity
    from torch_rkv.eval.report import Options, Report

    model = hybrid("qwen3_next")
    for fit in (lambda: sensitivity.load_or_measure(model, None, (2, 3)),
                lambda: levels.calibrate(model, prompt(64)),
                lambda: Report(model, None, "", Options())):
        with pytest.raises(models.UnsupportedModelFeature, match=re.escape("whose layers [0, 2] keep a recurrent")):
            fit()
    falcon = hybrid("falcon_h1")  # (every layer attends, beside a Mamba mixer: refused too, untested there)
    for fit in (lambda: sensitivity.load_or_measure(falcon, None, (2, 3)), lambda: Report(falcon, None, "", Options())):
        with pytest.raises(models.UnsupportedModelFeature, match=re.escape("whose layers [0, 1] keep a recurrent")):
            fit()
    recurrent = build(*HYBRID["lfm2"][:2], **{**HYBRID["lfm2"][2], "layer_types": ["conv", "conv"]})
    with pytest.raises(models.UnsupportedModelFeature, match="a model without attention layers"):
        models.inspect(recurrent)
