"""The rotary tables the vLLM plugin un-rotates pre-RoPE keys by, checked against vLLM's own rotary
modules without an engine (torch_rkv/integrations/vllm_rope.py's model_rope_tables): each family's
table and pairing, and the families it refuses by name. Runs in the vLLM venv."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints")  # a submodule: a folder named vllm on sys.path is not vLLM

from tiny_models import PHI3_LONGROPE, SMOLLM3, TINY_FAMILIES, TINY_HYBRIDS  # noqa: E402 (tests/)


@pytest.mark.parametrize("config, kw, refused, half, interleaved", [
    ("LlamaConfig", {}, None, 32, False), ("Qwen3Config", {}, None, 32, False),
    ("MixtralConfig", {}, None, 32, False), ("Qwen2MoeConfig", {}, None, 32, False),
    ("Qwen3MoeConfig", {}, None, 32, False),
    ("GPTJConfig", {"rotary_dim": 16}, None, 8, True),
    ("GPTNeoXConfig", {}, "not 'gpt_neox'", 0, False),  # (vLLM 0.32 has no model code of its own for it)
    ("Gemma3TextConfig", {"head_dim": 64}, None, 32, False),  # (its global table; the local one: the family test)
    ("CohereConfig", {}, None, 32, True), ("GraniteConfig", {}, None, 32, False),
    ("GraniteConfig", {"layer_rope_theta": [1e4] * 32}, "a RoPE base per layer", 0, False),
    ("BloomConfig", {}, "not 'bloom'", 0, False)])  # ALiBi, no rotary
def test_pre_rope_schemes_take_only_the_rotary_layout_they_invert(monkeypatch, config, kw, refused, half,
                                                                   interleaved):
    """The backend un-rotates new keys with the table and pairing vLLM builds for the model (rotate-half or
    GPT-J's interleaved pairs, over the rotary channels); a family whose rotary it cannot reproduce is
    refused by name, not served wrong."""
    from types import SimpleNamespace

    import transformers

    from torch_rkv.integrations.vllm_rope import model_rope_tables

    hf = getattr(transformers, config)(**kw)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, max_model_len=256))
    head = 64
    if refused:
        with pytest.raises(NotImplementedError, match=refused):
            model_rope_tables(vllm_config, head)
    else:
        from vllm.config import VllmConfig, set_current_vllm_config

        with set_current_vllm_config(VllmConfig()):  # (get_rope builds a vLLM custom op)
            cos, sin, pairs = model_rope_tables(vllm_config, head)
        assert cos.shape[1] == sin.shape[1] == half and cos.shape[0] >= 256 and pairs == interleaved
        assert (cos[0] == 1).all() and (sin[0] == 0).all()  # position 0: the identity rotation


@pytest.mark.parametrize("max_len, long", [(256, True), (48, False)])
def test_a_longrope_table_is_the_one_vllm_rotates_by(monkeypatch, max_len, long):
    """vLLM fixes Phi-3's LongRoPE for the engine's life: the long factors at every position when
    max_model_len exceeds original_max_position_embeddings, else the short ones. The backend un-rotates
    by the same table: unit keys rotated by vLLM's own rotary module read it back."""
    from types import SimpleNamespace

    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    from torch_rkv.integrations.vllm_rope import model_rope_tables

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})  # (get_rope caches a module per argument list)
    hf = transformers.Phi3Config(**PHI3_LONGROPE)
    model_config = SimpleNamespace(hf_config=hf, max_model_len=max_len)
    config = VllmConfig()
    object.__setattr__(config, "model_config", model_config)  # (what the rotary reads max_model_len from)
    with set_current_vllm_config(config):
        cos, sin, _ = model_rope_tables(SimpleNamespace(model_config=model_config), 64)
        rotary = rotary_embedding.get_rope(64, max_position=1024, rope_parameters=hf.rope_parameters)
        past = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, max_model_len=2048))
        with pytest.raises(ValueError, match="positions, fewer than max_model_len 2048"):
            model_rope_tables(past, 64)  # (past max_position_embeddings the kernels would read past the table)
    assert rotary.use_long_rope == long
    assert_rotary_reads_back(rotary, cos, sin, max_len, interleaved=False)


@pytest.mark.parametrize("truncate", [True, False, None])
def test_gpt_oss_takes_the_yarn_table_its_model_rotates_by(monkeypatch, truncate):
    """GPT-OSS's model code builds its YaRN rotary from five fields of the config, in float32 whatever the
    model's dtype (vLLM builds the layers under it: bfloat16 here), with truncate True unless the config
    says otherwise: the backend's table is the one its rotary module rotates by (unit keys read it back),
    with YaRN's attention scaling in it, and it is transformers' table for the model
    (GptOssRotaryEmbedding) too."""
    from types import SimpleNamespace

    import torch
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    from torch_rkv.integrations.vllm_rope import model_rope_tables

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    rope = dict(TINY_FAMILIES["gpt_oss"][2]["rope_parameters"])
    if truncate is None:
        del rope["truncate"]  # (the model code's default: True)
    else:
        rope["truncate"] = truncate
    hf = transformers.GptOssConfig(head_dim=64, max_position_embeddings=1024, rope_parameters=rope)
    n = 512
    with set_current_vllm_config(VllmConfig()):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            cos, sin, interleaved = model_rope_tables(SimpleNamespace(model_config=SimpleNamespace(
                hf_config=hf, max_model_len=n)), 64)
        finally:
            torch.set_default_dtype(default)
        rotary = rotary_embedding.get_rope(64, max_position=1024, rope_parameters={
            **rope, "truncate": rope.get("truncate", True)}, is_neox_style=True, dtype=torch.float32)
    assert not interleaved and cos[0, 0] > 1.01  # (YaRN's attention scaling)
    assert_rotary_reads_back(rotary, cos, sin, n, interleaved=False)
    want = GptOssRotaryEmbedding(transformers.GptOssConfig(**{**hf.to_dict(), "rope_parameters": {
        **rope, "truncate": rope.get("truncate", True)}}))(torch.zeros(1), torch.arange(n)[None])
    assert torch.allclose(cos[:n], want[0][0], atol=1e-5) and torch.allclose(sin[:n], want[1][0], atol=1e-5)


def assert_rotary_reads_back(rotary, cos, sin, n: int, interleaved: bool) -> None:
    """Unit keys (1 at each pair's first channel) rotated by vLLM's rotary module over n positions give
    cos at each pair's first channel and sin at its second: the (cos, sin) tables, pair by pair."""
    import torch

    half = cos.shape[1]
    first = slice(0, None, 2) if interleaved else slice(0, half)
    second = slice(1, None, 2) if interleaved else slice(half, None)
    ones = torch.zeros(n, 2 * half)
    ones[:, first] = 1
    _, key = rotary.forward(torch.arange(n), ones.clone(), ones.clone())
    assert torch.allclose(key[:, first], cos[:n], atol=1e-6) and torch.allclose(key[:, second], sin[:n], atol=1e-6)


@pytest.mark.parametrize("config, model_type", [("CohereConfig", "cohere"), ("Cohere2Config", "cohere2"),
                                                 ("Exaone4Config", "exaone4"), ("GraniteConfig", "granite")])
def test_interleaved_and_nope_layers_take_the_table_vllm_rotates_by(monkeypatch, config, model_type):
    """Cohere's interleaved pairs: unit keys rotated by vLLM's own rotary module for the model read the
    table back, pair by pair. Cohere 2's and EXAONE 4's global layers apply no RoPE (vLLM's commandr.py,
    exaone4.py): the identity, so their keys quantize as the attention reads them; their sliding layers
    rotate; and an EXAONE 4 without sliding layers rotates every layer in vLLM, even with a window in its
    config (exaone4.py's apply_rope_all_layers; transformers rotates none there: tests/test_families_windowed.py).
    Granite: rotate-half pairs with its one base (1e6 here), as granite.py builds them."""
    import math
    from types import SimpleNamespace

    import torch
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    from torch_rkv.integrations.vllm_rope import model_rope_tables

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    types = ["sliding_attention", "full_attention"]
    hf = getattr(transformers, config)(**({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
                                          if model_type == "granite" else {} if model_type == "cohere" else {
        "num_hidden_layers": 2, "sliding_window": 64, "layer_types": types}))
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, max_model_len=256))
    n = 256
    with set_current_vllm_config(VllmConfig()):
        cos, sin, interleaved = model_rope_tables(vllm_config, 64, "sliding_attention")
        rotary = rotary_embedding.get_rope(64, max_position=hf.max_position_embeddings,
                                           rope_parameters=hf.rope_parameters, is_neox_style=not interleaved)
        if model_type in ("cohere2", "exaone4"):
            nope = model_rope_tables(vllm_config, 64, "full_attention")
            assert (nope[0] == 1).all() and (nope[1] == 0).all() and nope[0].shape == (n, 32), model_type
        if model_type == "exaone4":  # no sliding layer: every layer rotates
            every = SimpleNamespace(model_config=SimpleNamespace(
                hf_config=transformers.Exaone4Config(num_hidden_layers=2, sliding_window=64,
                                                     layer_types=["full_attention"] * 2),
                max_model_len=n))
            assert not (model_rope_tables(every, 64, "full_attention")[1] == 0).all()
    assert interleaved == model_type.startswith("cohere")
    if model_type == "granite":
        assert math.isclose(cos[1, 1].item(), math.cos(1e6 ** (-2 / 64)), rel_tol=1e-6)
    assert_rotary_reads_back(rotary, cos, sin, n, interleaved)
    assert not torch.allclose(sin[1:], torch.zeros_like(sin[1:]))


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 5e6},
                                  {"rope_type": "yarn", "rope_theta": 5e6, "factor": 2.0,
                                   "original_max_position_embeddings": 512}], ids=["default", "yarn"])
def test_smollm3s_table_is_the_one_transformers_rotates_by(rope):
    """vLLM runs SmolLM3 through its transformers backend, so transformers' rotary rotates its keys: the
    table the backend builds with vLLM's get_rope is that one (YaRN's attention scaling included)."""
    from types import SimpleNamespace

    import torch
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config

    from torch_rkv.integrations import models
    from torch_rkv.integrations.vllm_rope import model_rope_tables

    cfg = transformers.SmolLM3Config(vocab_size=512, **{**SMOLLM3, "head_dim": 64, "rope_parameters": rope})
    model = transformers.SmolLM3ForCausalLM(cfg)
    want = models.rope_tables(model, 1024)
    with set_current_vllm_config(VllmConfig()):
        got = model_rope_tables(SimpleNamespace(model_config=SimpleNamespace(hf_config=cfg, max_model_len=1024)), 64)
    assert not got[2]
    for a, b in zip(got[:2], want):
        assert torch.allclose(a[:1024], b, atol=2e-6), (a[:1024] - b).abs().max()
    dynamic = {**SMOLLM3, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e6, "factor": 2.0}}
    with pytest.raises(NotImplementedError, match="SmolLM3 with a dynamic RoPE"):
        model_rope_tables(SimpleNamespace(model_config=SimpleNamespace(
            hf_config=transformers.SmolLM3Config(vocab_size=512, **dynamic), max_model_len=1024)), 64)


@pytest.mark.parametrize("family", list(TINY_HYBRIDS) + ["granitemoehybrid-nope", "falcon_h1-partial"])
def test_hybrid_attention_layers_take_the_table_vllm_rotates_by(monkeypatch, family):
    """Qwen3-Next's partial table (16 of 64 channels: its rope_parameters' partial_rotary_factor), Falcon-H1's
    and a Granite 4 with RoPE: keys of unit pairs rotated by the rotary module each vLLM model file builds
    (get_rope of the config's rope_parameters) read the table back, and the channels past it stay. Granite 4
    without positions (its default: granitemoehybrid.py builds no rotary) and Nemotron-H: the identity.
    Falcon-H1 with attn_rotary_emb 32 and no rope_theta: falcon_h1.py rotates 32 of 64 channels by a base of
    1e11, which it writes into the config as it builds a layer (the table is read from a config it has not)."""
    import math
    from types import SimpleNamespace

    import torch
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    from torch_rkv.integrations.vllm_rope import model_rope_tables

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    config_cls, _, kw = TINY_HYBRIDS[family.split("-")[0]]
    hf = getattr(transformers, config_cls)(vocab_size=512, **{**kw, **(
        {"position_embedding_type": "nope"} if family.endswith("-nope") else {})})
    n = 256
    if family == "falcon_h1-partial":
        hf.attn_rotary_emb = 32
        hf.rope_parameters = {"rope_type": "default"}
        with set_current_vllm_config(VllmConfig()):
            cos, sin, _ = model_rope_tables(SimpleNamespace(model_config=SimpleNamespace(
                hf_config=hf, max_model_len=n)), 64)
        assert cos.shape[1] == 16 and math.isclose(cos[1, 1].item(), math.cos(1e11 ** (-2 / 32)), rel_tol=1e-6)
        return
    with set_current_vllm_config(VllmConfig()):
        cos, sin, interleaved = model_rope_tables(SimpleNamespace(model_config=SimpleNamespace(
            hf_config=hf, max_model_len=n)), 64)
        if family in ("nemotron_h", "granitemoehybrid-nope"):
            assert (cos == 1).all() and (sin == 0).all() and cos.shape == (n, 32)
            return
        rotary = rotary_embedding.get_rope(64, max_position=hf.max_position_embeddings,
                                           rope_parameters=hf.rope_parameters, is_neox_style=True)
    rot = 16 if family == "qwen3_next" else 64
    cos, sin = cos[:n], sin[:n]
    assert cos.shape == (n, rot // 2) and not interleaved
    keys = torch.zeros(n, 64)
    keys[:, : rot // 2] = 1
    _, got = rotary.forward(torch.arange(n), keys.clone(), keys.clone())
    assert torch.allclose(got[:, : rot // 2], cos, atol=1e-6) and torch.allclose(got[:, rot // 2 : rot], sin, atol=1e-6)
    assert not got[:, rot:].any() and not torch.allclose(sin[1:], torch.zeros_like(sin[1:]))


def test_gemma3s_local_and_global_layers_take_their_own_tables():
    """A layer's table only changes how well its pre-RoPE keys quantize (the kernel re-applies the same
    table it un-rotated with), so the agreement test cannot see it: check the tables themselves, the
    local one with base 1e4 and the global one with 1e6, as vLLM's Gemma 3 builds them."""
    import math
    from types import SimpleNamespace

    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config

    from torch_rkv.integrations.vllm_rope import model_rope_tables

    hf = transformers.Gemma3TextConfig(num_hidden_layers=2, head_dim=64, sliding_window=64,
                                       layer_types=["sliding_attention", "full_attention"])
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, max_model_len=256))
    with set_current_vllm_config(VllmConfig()):
        for layer_type, base in (("sliding_attention", 1e4), ("full_attention", 1e6)):
            cos, _, _ = model_rope_tables(vllm_config, 64, layer_type)
            assert math.isclose(cos[1, 1].item(), math.cos(base ** (-2 / 64)), rel_tol=1e-6), layer_type


def test_gemma4s_global_table_is_partial_over_its_own_head():
    """Gemma 4's global layers (head_dim 256 here) rotate a quarter of their pairs by a "proportional" table
    (frequencies over the whole head_dim, base 1e6) and leave the rest as they are (cos 1, sin 0), as
    vLLM's gemma4_rope.py builds it; its sliding layers (head_dim 64) rotate every pair with base 1e4."""
    import math
    from types import SimpleNamespace

    import torch
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config

    from torch_rkv.integrations.vllm_rope import model_rope_tables

    hf = transformers.Gemma4TextConfig(**TINY_FAMILIES["gemma4"][2])
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, max_model_len=256))
    with set_current_vllm_config(VllmConfig()):
        local, _, _ = model_rope_tables(vllm_config, 64, "sliding_attention")
        glob, glob_sin, interleaved = model_rope_tables(vllm_config, 256, "full_attention")
    assert local.shape[-1] == 32 and glob.shape[-1] == 128 and not interleaved
    assert math.isclose(local[1, 1].item(), math.cos(1e4 ** (-2 / 64)), rel_tol=1e-6)
    assert math.isclose(glob[1, 1].item(), math.cos(1e6 ** (-2 / 256)), rel_tol=1e-6)
    assert torch.equal(glob[:, 32:], torch.ones_like(glob[:, 32:]))
    assert torch.equal(glob_sin[:, 32:], torch.zeros_like(glob_sin[:, 32:]))
    assert not torch.equal(glob[:, :32], torch.ones_like(glob[:, :32]))
