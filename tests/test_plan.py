"""The memory ledger: byte counts equal what a real cache allocates; fit and longest-context arithmetic."""

import dataclasses
import json

import pytest
import torch

from torch_rkv import plan, weights
from torch_rkv import scheme as S
from torch_rkv.cache import BUFFERS, QuantizedKVCache
from torch_rkv.layout import binding_window

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


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_planned_sliding_bytes_equal_the_allocated_cache(scheme):
    """A sliding layer's planned bytes are what a QuantizedKVCache with that window allocates, at any context
    (as RKVCache builds it: below the window, every token and no ring; binding_window)."""
    model = plan.ModelShape("tiny", layers=3, kv_heads=2, head_dim=64, params=1e6, sliding_layers=3, sliding_window=300)
    for context, window in ((100, 0), (1000, 300)):
        assert binding_window(300, context) == window
        cache = QuantizedKVCache(scheme, model.layers, 1, model.kv_heads, model.head_dim, context, dtype=torch.float16,
                                 rope=(torch.zeros(4096, 32), torch.zeros(4096, 32)), sliding_window=window)
        allocated = sum(t.numel() * t.element_size() for name, t in cache.named_buffers() if name in BUFFERS)
        assert plan.kv_bytes(model, scheme, context, 1) == cache.nbytes() == allocated


def test_gemma_3_sliding_layers_hold_only_their_ring():
    """Gemma-3-27B at 128K with rkv-4, counted by hand: 10 full layers of the whole context, 52 sliding
    layers of exactly the ring. rkv-4: sinks 4, recent 64, blocks of 128 tokens; 16 KV heads, d=128."""
    model = plan.MODELS["gemma-3-27b"]
    assert (model.layers, model.sliding_layers, model.full_layers, model.sliding_window) == (62, 52, 10, 1024)
    # one sliding layer: ring rows = round_up(1024 - 64, 128) = 1024
    #   codes    2 sides x 16 heads x 1024 rows x 64 bytes                  = 2097152
    #   K meta   16 heads x 8 blocks x 128 channels x (scale+zero) x 2 B    = 65536
    #   V meta   16 heads x 1024 rows x 1 group x (scale+zero) x 2 B        = 65536
    #   window   2 sides x 16 heads x (64 + 128 - 1) rows x 128 x 2 B       = 1564672
    #   sinks    2 sides x 16 heads x 4 x 128 x 2 B                         = 32768
    sliding = 2097152 + 65536 + 65536 + 1564672 + 32768
    # one full layer at 131072 tokens: codes 2 x 16 x 131072 x 64, K meta 16 x 1024 blocks x 128 x 2 x 2,
    # V meta 16 x 131072 x 2 x 2, the same window and sinks
    full = 2 * 16 * 131072 * 64 + 16 * 1024 * 128 * 4 + 16 * 131072 * 4 + 1564672 + 32768
    assert (sliding, full) == (3825664, 286810112)
    assert plan.kv_bytes(model, S.recommended(4), 131072, 1) == 10 * full + 52 * sliding == 3067035648
    # fp16: a full layer keeps 128K tokens, a sliding one 1024
    assert plan.kv_bytes(model, None, 131072, 1) == 10 * 2 * 16 * 131072 * 128 * 2 + 52 * 2 * 16 * 1024 * 128 * 2


@pytest.mark.parametrize("scheme", [None, S.recommended(4), S.kivi(2), S.per_token(8)],
                         ids=lambda s: getattr(s, "name", "fp16"))
def test_sliding_layers_do_not_grow_with_the_context(scheme):
    gemma = plan.MODELS["gemma-3-27b"]
    full_only = plan.ModelShape("the 10 full layers", 10, 16, 128, 1e9)
    for ctx in (65536, 131072):  # past the window, what grows is the full layers' share
        assert plan.kv_bytes(gemma, scheme, ctx, 1) - plan.kv_bytes(full_only, scheme, ctx, 1) == \
            plan.kv_bytes(gemma, scheme, 65536, 1) - plan.kv_bytes(full_only, scheme, 65536, 1)
    assert plan.bytes_per_token(gemma, scheme) == plan.bytes_per_token(full_only, scheme)
    # paged: at most ceil((1024 + P) / P) pages per sliding layer, whatever the context
    assert plan.paged_sequence_bytes(gemma, scheme, 131072) - plan.paged_sequence_bytes(gemma, scheme, 65536) == \
        plan.paged_sequence_bytes(full_only, scheme, 131072) - plan.paged_sequence_bytes(full_only, scheme, 65536)


def test_all_sliding_model_has_no_context_limit():
    v01 = plan.MODELS["mistral-7b-v0.1"]
    assert plan.MODELS["mistral-7b"].sliding_layers == 0 and v01.sliding_layers == v01.layers == 32
    assert plan.longest_context(v01, S.recommended(4), 1e9) is None
    assert plan.longest_context(v01, S.recommended(4), 1e3) == 0
    budget = plan.kv_bytes(v01, None, 1000, 1)  # fp16 below the window still grows token by token
    assert plan.longest_context(v01, None, budget) == 1000


GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
          "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024}


@pytest.mark.parametrize("extra, named", [
    ({"global_head_dim": 512, "num_global_key_value_heads": 4}, "global_head_dim"),
    ({"kv_lora_rank": 512, "v_head_dim": 128}, "multi-head latent attention"),
    ({"v_head_dim": 128}, "v_head_dim")])
def test_configs_of_layers_of_other_shapes_are_refused_by_name(tmp_path, extra, named):
    """Global layers of their own head_dim and KV heads outside Gemma 4, MLA, and values of their own head_dim:
    the planner's one shape per layer would misstate the bytes, so it names the field instead."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 4096,
                                "head_dim": 256, "num_hidden_layers": 30, **extra}))
    with pytest.raises(ValueError, match=named):
        plan.from_config(str(path), None)


@pytest.mark.parametrize("extra", [
    {"layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]},
    {"sliding_window_pattern": 6},
    {},  # gemma3_text's default pattern
], ids=["layer_types", "pattern", "default"])
def test_gemma_3_config_gives_the_preset(tmp_path, extra):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": {**GEMMA3, **extra}}))
    shape, preset = plan.from_config(str(path), 27.4e9), plan.MODELS["gemma-3-27b"]
    fields = ("layers", "kv_heads", "head_dim", "params", "sliding_layers", "sliding_window")
    assert [getattr(shape, f) for f in fields] == [getattr(preset, f) for f in fields]



def test_gemma_4_31b_config_gives_the_preset(tmp_path):
    """Gemma 4 31B's config.json (its text_config): 50 sliding layers of 16 KV heads x 256 over 1,024 tokens
    beside 10 global ones of 4 x 512 (keys also their values), every sixth; 30.7B weights counted."""
    pytest.importorskip("transformers")
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(60)]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                                "text_config": {
        "model_type": "gemma4_text", "hidden_size": 5376, "num_hidden_layers": 60, "intermediate_size": 21504,
        "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4, "head_dim": 256,
        "global_head_dim": 512, "vocab_size": 262144, "max_position_embeddings": 262144, "sliding_window": 1024,
        "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "attention_k_eq_v": True,
        "tie_word_embeddings": True, "layer_types": types}}))
    shape, preset = plan.from_config(str(path), None), plan.MODELS["gemma-4-31b"]
    fields = ("layers", "kv_heads", "head_dim", "sliding_layers", "sliding_window", "sliding", "global_shape")
    assert [getattr(shape, f) for f in fields] == [getattr(preset, f) for f in fields]
    assert abs(shape.params / preset.params - 1) < 0.001

def test_phi_3_5_mini_config_gives_the_preset(tmp_path):
    """Phi-3.5-mini-instruct's config.json (LongRoPE; no GQA): the preset, its 262144-token window on every
    layer included."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "tie_word_embeddings": False,
        "sliding_window": 262144, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48}}))
    shape, preset = plan.from_config(str(path), None), plan.MODELS["phi-3.5-mini"]
    fields = ("layers", "kv_heads", "head_dim", "sliding_layers", "sliding_window")
    assert [getattr(shape, f) for f in fields] == [getattr(preset, f) for f in fields]
    assert abs(shape.params / preset.params - 1) < 0.01
    # its window never binds below 262144 tokens: a 128K cache keeps every token, not a ring of the window
    rkv3 = S.by_name("rkv-3")
    full = plan.CacheLayout(rkv3, 1, 32, 96, 131072, torch.float16).nbytes()
    assert plan.kv_bytes(preset, rkv3, 131072, 1) == 32 * full
    assert plan.bytes_per_token(preset, None) == 32 * 2 * 32 * 96 * 2  # 384 KiB a token in fp16


def test_gpt_oss_config_gives_the_preset(tmp_path):
    """gpt-oss-20b's config.json: 8 KV heads of 64 channels, every even layer a 128-token ring (its
    layer_types); the sinks cost no cache byte. At 128K tokens the sliding half of the layers holds 128
    tokens each, so the cache is about half a dense model's."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
        "num_local_experts": 32, "experts_per_token": 4, "sliding_window": 128, "max_position_embeddings": 131072,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)]}))
    shape, preset = plan.from_config(str(path), None), plan.MODELS["gpt-oss-20b"]
    fields = ("layers", "kv_heads", "head_dim", "sliding_layers", "sliding_window", "sliding")
    assert [getattr(shape, f) for f in fields] == [getattr(preset, f) for f in fields]
    assert abs(shape.params / preset.params - 1) < 0.001 and shape.params_how == "counted by transformers"  # experts
    rkv3 = S.by_name("rkv-3")
    dense = plan.ModelShape("dense", 24, 8, 64, 20.9e9)
    assert 0.5 < plan.kv_bytes(preset, rkv3, 131072, 1) / plan.kv_bytes(dense, rkv3, 131072, 1) < 0.51


MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2, "tie_word_embeddings": False}


def test_a_mixture_of_experts_counts_every_expert(tmp_path, capsys):
    """Mixtral-8x7B's config: every expert's weights sit in GPU memory, 46.7B of them (its model card), not the
    7.2B of one MLP a layer that a dense estimate gives; at 4-bit weights on 80 GB, that is 20 GB more of
    weights and so fewer sequences."""
    from torch_rkv.__main__ import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL))
    shape = plan.from_config(str(path), None)
    assert abs(shape.params / 46.7e9 - 1) < 0.001
    assert main(["plan", "--config", str(path), "--schemes", "rkv-3"]) == 0
    out = capsys.readouterr().out
    assert "46.70B weights (counted by transformers) = 23.4 GB" in out
    budget = 80 * plan.GB - shape.weight_bytes(4) - 4 * plan.GB
    row = next(line.split() for line in out.splitlines() if line.startswith("rkv-3"))
    assert row[6] == f"{plan.most_sequences(shape, S.by_name('rkv-3'), budget, 131072):,d}"  # (seqs @ ctx)


def test_weights_are_the_checkpoints_bytes_beside_the_config(tmp_path, capsys):
    """With --config in a checkpoint's folder, the weights take what an engine loads from it (an fp8 checkpoint
    of Mixtral: 47 GB, not the 23 GB of 4-bit weights): its safetensors shards' 8-bit and integer tensors as
    saved, floats at --dtype (a Trainer's float32 save); else (a shard missing) its index's total_size, scaled
    from the config's dtype. A Trainer's optimizer.bin and PyTorch's files beside safetensors ones do not
    count, an unreadable shard (a Git LFS pointer) or index is refused by name, and a Hugging Face snapshot's
    config.json, a link into blobs/, is read in its own folder. --weight-bits and --weight-gb override it;
    without a checkpoint the default 4 bits hold, and the output names which."""
    safetensors = pytest.importorskip("safetensors.torch")
    from torch_rkv.__main__ import main

    folder = tmp_path / "snapshots" / "abc"
    folder.mkdir(parents=True)
    config = folder / "config.json"

    def rows(*extra):
        assert main(["plan", "--config", str(config), "--schemes", "rkv-3", *extra]) == 0
        out = capsys.readouterr().out
        return out.splitlines()[0], [line for line in out.splitlines() if line.startswith(("fp16", "rkv-3"))]

    (tmp_path / "blob").write_text(json.dumps(MIXTRAL))
    config.symlink_to(tmp_path / "blob")
    head, default = rows()
    assert "= 23.4 GB (4-bit; --weight-bits sets it)" in head and default == rows("--weight-bits", "4")[1]
    fp8 = 46_702_792_704 + 1_000_000  # (scales)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": fp8},
                                                                     "weight_map": {}}))
    head, indexed = rows()
    assert f"= {fp8 / 1e9:.1f} GB (the checkpoint's model.safetensors.index.json)" in head
    assert indexed == rows("--weight-gb", str(fp8 / 1e9))[1] != default
    assert rows("--weight-bits", "4")[1] == default
    (tmp_path / "blob").write_text(json.dumps({**MIXTRAL, "dtype": "float32"}))  # (a float32 save, indexed)
    assert weights.checkpoint_weight_bytes(str(config)) == (fp8 // 2, "model.safetensors.index.json, 32-bit "
                                                                   "floats held in bfloat16")
    (tmp_path / "blob").write_text(json.dumps({**MIXTRAL, "dtype": "bfloat16"}))  # (served in float32: doubled)
    assert weights.checkpoint_weight_bytes(str(config), torch.float32)[0] == fp8 * 2
    (tmp_path / "blob").write_text(json.dumps(MIXTRAL))
    # shards: an fp8-like uint8 tensor as saved, a float32 one (1000 weights) at --dtype's 2 bytes, a float16 one
    safetensors.save_file({"a": torch.zeros(3000, dtype=torch.uint8), "b": torch.zeros(1000)},
                          str(folder / "model-00001-of-00002.safetensors"))
    safetensors.save_file({"c": torch.zeros(500, dtype=torch.float16)},
                          str(folder / "model-00002-of-00002.safetensors"))
    (folder / "optimizer.bin").write_bytes(b"\0" * 10**6)
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 10**6)
    assert weights.checkpoint_weight_bytes(str(config)) == (3000 + 2000 + 1000, "model-00001-of-00002.safetensors, "
                                                                             "model-00002-of-00002.safetensors")
    assert weights.checkpoint_weight_bytes(str(config), torch.float32)[0] == 3000 + 4000 + 2000
    assert "= 0.0 GB (the checkpoint's model-00001-of-00002.safetensors, model-00002" in rows()[0]
    # the index names a shard that is not there (a partial download): its total_size, and where it is said
    (folder / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": fp8}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                        "z": "model-00003-of-00003.safetensors"}}))
    assert weights.checkpoint_weight_bytes(str(config)) == (fp8, "model.safetensors.index.json (1 shards not here)")
    (folder / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match="model.safetensors.index.json is not a checkpoint index"):
        weights.checkpoint_weight_bytes(str(config))
    (folder / "model.safetensors.index.json").unlink()
    for broken in (b"", b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 5\n"):  # (an LFS pointer)
        (folder / "model-00002-of-00002.safetensors").write_bytes(broken)
        with pytest.raises(ValueError, match="model-00002-of-00002.safetensors has no readable safetensors header"):
            weights.checkpoint_weight_bytes(str(config))
    with pytest.raises(SystemExit, match="has no readable safetensors header"):
        rows()
    assert main(["plan", "--config", str(config), "--budget-gb", "2", "--schemes", "rkv-3"]) == 0  # (unread)


@pytest.mark.parametrize("extra, named", [({"num_local_experts": 8}, "experts"),
                                          ({"vision_config": {}}, "vision_config")])
def test_weights_a_dense_estimate_would_miss_are_refused_by_name(tmp_path, extra, named):
    """Where transformers cannot build the config (here an unknown model_type), the plan estimates a dense
    decoder's weights; a mixture of experts or a vision tower would be missed, so it asks for --params."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MIXTRAL, "model_type": "not_a_model", **extra}))
    with pytest.raises(ValueError, match=f"{named}.*give --params"):
        plan.from_config(str(path), None)
    assert plan.from_config(str(path), 46.7e9).params_how == "--params"
    path.write_text(json.dumps({**MIXTRAL, "model_type": "not_a_model", "num_local_experts": 1}))
    assert plan.from_config(str(path), None).params_how.startswith("estimated")


def test_smollm3_config_gives_the_preset(tmp_path):
    """SmolLM3-3B's config.json (NoPE every 4th layer, which changes no byte; tied embeddings)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
        "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 128256, "tie_word_embeddings": True,
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)], "use_sliding_window": False,
        "sliding_window": None, "max_position_embeddings": 65536}))
    shape, preset = plan.from_config(str(path), None), plan.MODELS["smollm3-3b"]
    fields = ("layers", "kv_heads", "head_dim", "sliding_layers")
    assert [getattr(shape, f) for f in fields] == [getattr(preset, f) for f in fields]
    assert abs(shape.params / preset.params - 1) < 0.01


@pytest.mark.parametrize("extra,sliding", [
    ({"sliding_window": 4096}, 32),  # Mistral-7B v0.1: every layer
    ({"sliding_window": None}, 0),  # v0.3
    ({"sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28}, 0),  # Qwen2.5
    ({"sliding_window": 131072, "use_sliding_window": False, "layer_types": ["full_attention"] * 32}, 0),
    ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 28}, 4),  # Qwen2: i >= 28
    ({"sliding_window": 4096, "model_type": "gemma2"}, 16),  # Gemma 2: every other layer
    ({"sliding_window": 4096, "model_type": "cohere2"}, 24),  # Command R7B / A: every 4th layer global
    ({"sliding_window": 4096, "model_type": "exaone4", "sliding_window_pattern": "LLLG"}, 24),  # EXAONE 4
])
def test_config_sliding_layers(tmp_path, extra, sliding):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, **extra}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    shape = plan.from_config(str(path), None)
    assert (shape.layers, shape.sliding_layers) == (32, sliding)
    assert shape.sliding_window == (extra["sliding_window"] if sliding else None)
    if sliding == 32:
        v01 = plan.MODELS["mistral-7b-v0.1"]
        assert plan.kv_bytes(shape, S.recommended(3), 131072, 1) == plan.kv_bytes(v01, S.recommended(3), 131072, 1)


@pytest.mark.parametrize("config, pattern, period", [("Cohere2Config", None, 4), ("Exaone4Config", "LLLG", 4),
                                                     ("Exaone4Config", 3, 3), ("Exaone4Config", None, 4)])
def test_sliding_patterns_are_the_layers_transformers_builds(config, pattern, period):
    """A config.json that gives its pattern (or its family's default), not its layer_types: the layers
    transformers makes slide. With layer_types that list no sliding layer, none slides."""
    transformers = pytest.importorskip("transformers")
    cfg = {"model_type": config[:-6].lower(), "num_hidden_layers": 12, "sliding_window": 4096}
    want = getattr(transformers, config)(**{**cfg, "sliding_window_pattern": period}).layer_types
    if pattern is not None:
        cfg["sliding_window_pattern"] = pattern
    assert plan.sliding_layers_of(cfg) == [t == "sliding_attention" for t in want]
    assert plan.sliding_layers_of({**cfg, "layer_types": ["full_attention"] * 12}) == [False] * 12
    with pytest.raises(ValueError, match="sliding_window_pattern 'LLXG'"):
        plan.sliding_layers_of({**cfg, "sliding_window_pattern": "LLXG"})


def test_gemma_4s_default_layers_are_the_ones_transformers_builds():
    """A Gemma 4 config.json without layer_types: every 6th layer global, and the last one (transformers
    forces it global)."""
    transformers = pytest.importorskip("transformers")
    want = transformers.Gemma4TextConfig(num_hidden_layers=13).layer_types
    got = plan.sliding_layers_of({"model_type": "gemma4_text", "num_hidden_layers": 13, "sliding_window": 512})
    assert got == [t == "sliding_attention" for t in want] and not got[-1] and not got[5]
    # layer_types given: they alone say which layers slide (none here, whatever the window)
    assert plan.sliding_layers_of({"model_type": "gemma4_text", "num_hidden_layers": 3, "sliding_window": 512,
                                   "layer_types": ["full_attention"] * 3}) == [False] * 3


def test_gemma_4s_global_kv_heads_follow_attention_k_eq_v(tmp_path):
    """num_global_key_value_heads sets the global layers' KV heads only where their keys are also their
    values (attention_k_eq_v, False by default), as Gemma4TextConfig builds the layers."""
    transformers = pytest.importorskip("transformers")
    base = {"model_type": "gemma4_text", "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 1, "hidden_size": 512,
            "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
    for extra in ({}, {"attention_k_eq_v": True}):
        cfg = {**base, **extra}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        want = transformers.Gemma4TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"}).per_layer_config[1]
        assert plan.from_config(str(tmp_path / "config.json"), 1e6).global_shape == (want.num_key_value_heads,
                                                                                     want.head_dim)


def test_the_table_names_the_sliding_layers(capsys):
    from torch_rkv.__main__ import main

    assert main(["plan", "--model", "gemma-3-27b", "--schemes", "rkv-4"]) == 0
    assert "52 of 62 layers slide" in capsys.readouterr().out
    assert main(["plan", "--model", "mistral-7b-v0.1", "--schemes", "rkv-4"]) == 0
    assert "unbounded" in capsys.readouterr().out


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


@pytest.mark.parametrize("scheme", [S.recommended(4), S.recommended(2), None], ids=lambda s: s.name if s else "fp16")
def test_gemma_4_config_counts_each_kind_of_layer_at_its_shape(tmp_path, scheme):
    """A Gemma 4 config.json (global layers of their own head_dim and, keys shared with values, KV heads):
    plan's contiguous bytes are what RKVCache allocates for the model, each kind of layer at its shape;
    the paged count adds each kind's pages; a vLLM pool keeps each layer's shape; a per-layer allocation (one
    shape for every layer) is refused by name."""
    transformers = pytest.importorskip("transformers")
    from torch_rkv.integrations.transformers import RKVCache

    cfg = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=16,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, num_hidden_layers=6,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"])
    cfg.to_json_file(tmp_path / "config.json")
    shape = plan.from_config(str(tmp_path / "config.json"), 1e6)
    assert (shape.kv_heads, shape.head_dim, shape.global_shape, shape.sliding_layers) == (2, 32, (1, 128), 4)
    published = {**{k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items()
                     if k != "per_layer_config"}, "global_head_dim": 128, "num_global_key_value_heads": 1}
    (tmp_path / "published.json").write_text(json.dumps(published))  # (the form a release's config.json takes)
    assert dataclasses.replace(plan.from_config(str(tmp_path / "published.json"), 1e6), name=shape.name) == shape
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    for context in (8, 300):
        if scheme is None:  # 2 sides x batch 2 x heads x tokens x head_dim x 2 bytes, by hand
            want = 2 * 2 * 2 * (4 * 2 * min(context, 16) * 32 + 2 * 1 * context * 128)
            assert plan.kv_bytes(shape, None, context, 2) == want
            continue
        cache = RKVCache(model, scheme, capacity=context, batch=2, dtype=torch.float16)
        assert plan.kv_bytes(shape, scheme, context, 2) == cache.nbytes()
    if scheme is not None:
        per_kind = [plan.paged_sequence_bytes(plan.ModelShape("k", n, kv, d, 1e6, *w), scheme, 300)
                    for n, kv, d, w in ((2, 1, 128, ()), (4, 2, 32, (4, 16)))]
        assert plan.paged_sequence_bytes(shape, scheme, 300) == sum(per_kind)
        pool = plan.VllmEngine().pool(shape, [scheme] * 6)  # (vLLM's pages of each shape: test_vllm_pool.py)
        assert pool.shapes == ((2, 32),) * 2 + ((1, 128),) + ((2, 32),) * 2 + ((1, 128),)
        for allocate in (plan.allocation_for_budget, plan.split_for_budget):  # (split: a sliding model's in vLLM)
            with pytest.raises(ValueError, match="global layers have 1 x 128"):
                allocate(shape, None, 1e9, 300, 2, engine=plan.VllmEngine())


def test_kv_shared_layers_keep_no_cache_in_the_plan(tmp_path):
    """Gemma 4's small models (num_kv_shared_layers): the shared layers count no bytes, so plan's contiguous
    bytes are what RKVCache allocates (its cache layers only); vLLM's pool gives them no pages and the plugin no
    side slots; a per-layer allocation, whose profile measures every layer, refuses the model by name."""
    transformers = pytest.importorskip("transformers")
    from torch_rkv.integrations.transformers import RKVCache

    cfg = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, global_head_dim=64, sliding_window=16, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128, num_hidden_layers=6, num_kv_shared_layers=2,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"])
    cfg.to_json_file(tmp_path / "config.json")
    shape = plan.from_config(str(tmp_path / "config.json"), 1e6)
    assert (shape.layers, shape.sliding_layers, shape.kv_shared_layers, shape.global_shape) == (4, 3, 2, (2, 64))
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    for scheme in (S.recommended(4), S.recommended(2)):
        for context in (8, 300):
            cache = RKVCache(model, scheme, capacity=context, batch=2, dtype=torch.float16)
            assert plan.kv_bytes(shape, scheme, context, 2) == cache.nbytes()
    unshared = dataclasses.replace(plan.from_config(str(tmp_path / "config.json"), 1e6), layers=6, sliding_layers=4,
                                   sliding=(True, True, False, True, True, False), kv_shared_layers=0)
    assert plan.kv_bytes(unshared, S.recommended(4), 300, 2) > plan.kv_bytes(shape, S.recommended(4), 300, 2)
    pool = plan.VllmEngine().pool(shape, [S.recommended(4)] * 4)  # (vLLM gives the shared layers no pages)
    assert pool.layers == 4 and pool.slot_bytes == sum(
        plan.VllmEngine().pool(plan.ModelShape("k", n, kv, d, 1e6), [S.recommended(4)] * n).slot_bytes
        for n, kv, d in ((3, 2, 32), (1, 2, 64)))  # (3 sliding layers and a global one keep caches)
    flat = dataclasses.replace(shape, global_shape=None)  # (past the one-shape refusal)
    with pytest.raises(ValueError, match="does not count KV caches shared between layers"):
        plan.allocation_for_budget(flat, None, 1e9, 300, 2, engine=plan.VllmEngine())
    cfg.num_kv_shared_layers = 6
    cfg.to_json_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="num_kv_shared_layers 6 of 6 layers"):
        plan.from_config(str(tmp_path / "config.json"), 1e6)


def test_a_hybrids_recurrent_layers_keep_no_cache_in_the_plan(tmp_path, monkeypatch, capsys):
    """Hybrid models name their recurrent layers in keys of their own family's (as published, no layer_types):
    only the attention layers count KV bytes, so plan's contiguous bytes are what RKVCache allocates (Qwen3-Next's
    full_attention_interval, LFM2's layer_types) plus the recurrent states; the vLLM pool's arithmetic and a
    per-layer allocation, which do not count recurrent states, refuse it by name. Without transformers' config
    class, a config's own layer_types are read (Granite 4's "mamba" too) and its states are not counted, and
    family keys are refused rather than counted as attention."""
    transformers = pytest.importorskip("transformers")
    from torch_rkv.__main__ import main
    from torch_rkv.integrations.transformers import RKVCache

    path = tmp_path / "config.json"
    common = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 128,
              "intermediate_size": 192, "vocab_size": 128, "num_hidden_layers": 8}
    for published, attention in (
            ({"model_type": "qwen3_next", "full_attention_interval": 4, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16}, 2),
            ({"model_type": "jamba", "attn_layer_period": 4, "attn_layer_offset": 2, "num_experts": 2}, 2),
            ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-M*E", "mamba_num_heads": 4,
              "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1}, 2),
            ({"model_type": "falcon_h1", "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
              "mamba_d_state": 16}, 8),  # (attention beside a Mamba mixer in every layer)
            ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"] * 4}, 4)):
        path.write_text(json.dumps({**common, **published}))
        shape = plan.from_config(str(path), 1e6)
        # (Nemotron-H's "-" and "E" layers hold an MLP alone; Falcon-H1's hold attention and a mixer)
        recurrent = {"nemotron_h": 3, "falcon_h1": 8}.get(published["model_type"], 8 - attention)
        assert (shape.layers, shape.kv_free_layers, shape.recurrent_layers) == (attention, 8 - attention, recurrent), \
            published["model_type"]
        if published["model_type"] in ("qwen3_next", "falcon_h1", "lfm2"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
            for scheme in (S.recommended(4), S.per_token(2)):
                for context in (8, 300):
                    cache = RKVCache(model.eval(), scheme, capacity=context, batch=2, dtype=torch.float16)
                    # (the recurrent states: checked against a forward's in tests/test_families_hybrid.py)
                    assert plan.kv_bytes(shape, scheme, context, 2) == cache.nbytes() + 2 * shape.state_bytes()
        assert shape.state_bytes() > 0
        stateless = dataclasses.replace(shape, state=None)  # (a paged cache holds them once a sequence too)
        assert plan.paged_sequence_bytes(shape, S.recommended(4), 300) == \
            plan.paged_sequence_bytes(stateless, S.recommended(4), 300) + shape.state_bytes()
        assert main(["plan", "--config", str(path), "--params", "1e6", "--schemes", "rkv-2", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["model"]["state_bytes"] == shape.state_bytes() and out["rows"][1]["kv_bytes"] == \
            plan.kv_bytes(shape, S.recommended(2), 131072, 1)
        assert main(["plan", "--config", str(path), "--params", "1e6", "--schemes", "rkv-2"]) == 0
        assert f"{shape.state_bytes() / 2**20:.1f} MiB a sequence" in capsys.readouterr().out
    with pytest.raises(ValueError, match="a hybrid of family 'lfm2'; the plugin serves qwen3_next"):
        plan.VllmEngine().pool(shape, [S.recommended(4)] * 4)
    with pytest.raises(ValueError, match="does not count a hybrid model's recurrent layers"):
        plan.allocation_for_budget(shape, None, 1e9, 1024)
    path.write_text(json.dumps({**common, "model_type": "lfm2", "layer_types": ["conv"] * 8}))
    with pytest.raises(ValueError, match="has no attention layer"):
        plan.from_config(str(path), 1e6)

    def unknown(*args, **kwargs):
        raise ValueError("Unrecognized model")

    monkeypatch.setattr(transformers.AutoConfig, "for_model", unknown)
    path.write_text(json.dumps({**common, "model_type": "granitemoehybrid", "layer_types": ["mamba", "attention"] * 4}))
    shape = plan.from_config(str(path), 1e6)
    assert (shape.layers, shape.kv_free_layers, shape.recurrent_layers) == (4, 4, 4)
    assert shape.state is None and shape.state_bytes() == 0  # (its mixer's defaults are the config class's)
    path.write_text(json.dumps({**common, "model_type": "granitemoehybrid", "layer_types": ["mamba", "attention"] * 4,
                                "per_layer_config": {"2": {"mamba_d_state": 32}}}))
    with pytest.raises(ValueError, match=r"overrides \['mamba_d_state'\] per layer"):
        plan.from_config(str(path), 1e6)
    path.write_text(json.dumps({**common, "model_type": "jamba", "attn_layer_period": 4, "attn_layer_offset": 2}))
    with pytest.raises(ValueError, match=r"names a hybrid's layers in \['attn_layer_period'\]"):
        plan.from_config(str(path), 1e6)
    path.write_text(json.dumps({**common, "model_type": "falcon_h1", "mamba_d_ssm": 64}))  # (no layer keys at all)
    with pytest.raises(ValueError, match=r"names a hybrid's layers in \['mamba_d_ssm'\]"):
        plan.from_config(str(path), 1e6)


def test_gpt_2_style_configs_and_multi_query_attention(tmp_path):
    """StarCoder's config.json (GPT-BigCode): GPT-2's names for the shape (n_layer, n_head, n_embd) and
    multi-query attention as a flag, one KV head where num_key_value_heads is absent; Falcon's flags read
    as transformers' config reads them."""
    path = tmp_path / "config.json"
    starcoder = {"model_type": "gpt_bigcode", "n_layer": 40, "n_head": 48, "n_embd": 6144, "n_inner": 24576,
                 "multi_query": True, "vocab_size": 49152}
    path.write_text(json.dumps(starcoder))
    shape = plan.from_config(str(path), None)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (40, 1, 128)
    path.write_text(json.dumps({**starcoder, "multi_query": False}))
    assert plan.from_config(str(path), None).kv_heads == 48
    # Falcon: one KV head by default (7B), its num_kv_heads with the new decoder architecture (40B, 180B)
    transformers = pytest.importorskip("transformers")
    for extra, want in (({}, 1), ({"multi_query": False}, 4), ({"new_decoder_architecture": True, "num_kv_heads": 2}, 2)):
        cfg = transformers.FalconConfig(num_attention_heads=4, hidden_size=128, num_hidden_layers=2, **extra)
        path.write_text(json.dumps({k: v for k, v in cfg.to_dict().items() if k != "num_key_value_heads"}))
        assert cfg.num_key_value_heads == want == plan.from_config(str(path), None).kv_heads, extra


@pytest.mark.parametrize("model_type, kind", [("llama4_text", "chunked_attention"),
                                              ("qwen4_exp_text", "indexed_attention")])
def test_layer_types_the_planner_does_not_model_are_refused_by_name(tmp_path, model_type, kind):
    """Llama 4's chunked local attention (each layer keeps only its current chunk) and indexed sparse attention
    (an indexer's keys beside the cache): counted as full attention, their bytes would be wrong."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"layers of type \\['{kind}'\\], whose caches the planner does not model"):
        plan.from_config(str(tmp_path / "config.json"), 1e6)


def test_mtp_layers_are_not_counted_among_the_served_weights(tmp_path):
    """A checkpoint's multi-token-prediction layers, which vLLM loads only for MTP speculative decoding (its
    load_weights skip them): left out of the bytes its safetensors headers give, and said so; a decoder layer
    past num_hidden_layers (DeepSeek-V3's, GLM-4.5's) is one, a vision tower's layer is not. An index's
    total_size, read where a shard is missing, includes them, and the output says so."""
    safetensors = pytest.importorskip("safetensors.torch")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MIXTRAL))  # (32 layers)
    u8 = {"dtype": torch.uint8}
    safetensors.save_file({"model.layers.31.w": torch.zeros(1000, **u8), "model.layers.32.w": torch.zeros(500, **u8),
                           "mtp.fc.weight": torch.zeros(250, **u8),
                           "model.vision_tower.encoder.layers.40.w": torch.zeros(60, **u8),
                           "vision_model.model.layers.40.w": torch.zeros(40, **u8)},
                          str(tmp_path / "model.safetensors"))
    held, where = weights.checkpoint_weight_bytes(str(config))
    assert held == 1100 and where.startswith("model.safetensors less 0.0 GB of MTP layers, which vLLM loads only")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 1850}, "weight_map": {"model.layers.31.w": "model.safetensors",
                                                         "mtp.fc.weight": "model-2.safetensors"}}))
    assert weights.checkpoint_weight_bytes(str(config)) == (1850, "model.safetensors.index.json (1 shards not here), "
                                                                  "MTP layers included (vLLM loads them only for MTP "
                                                                  "speculative decoding)")
