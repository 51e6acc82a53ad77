"""Decoders beside a vision encoder: Gemma 4 with its vision tower, and the vision-language models whose
M-RoPE lives in the language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), attending over an image's tokens."""


import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402
from familybuild import COMMON, SENSITIVITY, VOCAB, WINDOWED, assert_rotary_round_trip, prompt  # noqa: E402
from test_transformers import TINY_SENSITIVITY, assert_agrees  # noqa: E402

from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.eval.agreement import greedy_agrees, logprob_bound  # noqa: E402
from torch_rkv.integrations import models  # noqa: E402
from torch_rkv.integrations.transformers import RKVCache  # noqa: E402
from torch_rkv.reference import quantized_count  # noqa: E402


def test_gemma4s_decoder_is_found_beside_its_vision_encoder():
    """Gemma 4 with its vision tower: the vision encoder's attention layers (with their own layer_idx) are
    not the decoder's; a text prompt generates as with transformers' cache at rkv-8."""
    torch.manual_seed(0)
    text = {**COMMON, **WINDOWED["gemma4"][2], "vocab_size": 262144, "vocab_size_per_layer_input": 262144}
    vision = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 32}
    model = T.Gemma4ForConditionalGeneration(T.Gemma4Config(text_config=text, vision_config=vision,
                                                            audio_config=None)).eval()
    att = models.inspect(model)
    assert [m.layer_idx for m in att.modules] == [0, 1] and att.layer_head_dims == (32, 64)
    ids = prompt(40)
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    scheme = S.recommended(8).replace(k_block_tokens=16)
    got = model.generate(ids, max_new_tokens=8, do_sample=False, cache=RKVCache(model, scheme, capacity=64))
    assert_agrees(model, ids, want, got, scheme, 8, SENSITIVITY["gemma4"], 64)


# Vision-language models: the decoder's M-RoPE (Qwen2-VL's sections, Qwen3-VL's interleaved ones) lives in
# the language model; text positions are equal in its three sections, so its table for them is a plain
# rotate-half one. An image's tokens take grid positions and every later token runs behind its cache slot.
VISION_LANGUAGE = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {},
                 {"depth": 1, "embed_dim": 32, "hidden_size": 128, "num_heads": 2, "out_hidden_size": 128}),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {},
                   {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128,
                    "fullatt_block_indexes": [0], "window_size": 56}),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", {"head_dim": 32, "mrope_interleaved": True},
                 {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128,
                  "deepstack_visual_indexes": []}),
}
IMAGE_TOKEN, VISION_START = 5, 6


def vision_language(name):
    """The tiny model, a prompt of 20 text tokens, an image (an 8 x 8 grid of patches: 16 tokens after
    the 2 x 2 merge) and 40 text tokens, and the image's inputs."""
    config_cls, model_cls, text, vision = VISION_LANGUAGE[name]
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6],
            **{k: text.pop(k) for k in ("mrope_interleaved",) if k in text}}
    torch.manual_seed(0)
    cfg = getattr(T, config_cls)(text_config={**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, **text,
                                              "rope_parameters": rope},
                                 vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=7,
                                 vision_start_token_id=VISION_START)
    model = getattr(T, model_cls)(cfg).eval()
    vc, g = cfg.vision_config, torch.Generator().manual_seed(1)
    pixels = torch.randn(64, 3 * vc.temporal_patch_size * vc.patch_size ** 2, generator=g)
    image = torch.tensor([[VISION_START] + [IMAGE_TOKEN] * 16])
    words = lambda n: torch.randint(10, VOCAB, (1, n), generator=g)  # noqa: E731
    ids = torch.cat([words(20), image, words(40)], 1)
    return model, ids, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 8, 8]]),
                        "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}


@pytest.mark.parametrize("name", list(VISION_LANGUAGE))
def test_vision_language_models_take_their_decoders_rotary_table(name):
    """The language model's M-RoPE module is found (not refused as a model without RoPE), and its table
    rotates layer 0's pre-RoPE keys of a text prompt to the model's own."""
    model, _, _ = vision_language(name)
    assert models.inspect(model).rotary is model.model.language_model.rotary_emb
    assert_rotary_round_trip(model, (32, False))


@pytest.mark.parametrize("name", list(VISION_LANGUAGE))
@pytest.mark.parametrize("scheme", [S.recommended(8).replace(k_block_tokens=16, recent=16), S.per_token(8)],
                         ids=lambda s: s.name)
def test_vision_language_models_attend_over_an_image_as_transformers_cache(name, scheme):
    """A prompt with an image, whose tokens (in the quantized blocks: the window is 16 tokens) take M-RoPE
    grid positions, and whose later tokens run behind their cache slots: a pre-RoPE cache un-rotates each
    key by its slot's table and the kernel re-rotates it by the same one, so the attention reads the
    model's own keys whatever the positions. Greedy generation and every step's top-8 log-probabilities
    (while both took the same tokens) within the 8-bit bound of transformers' cache."""
    model, ids, image = vision_language(name)
    bound = logprob_bound(8, TINY_SENSITIVITY)
    run = {"max_new_tokens": 8, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        want = model.generate(ids, **image, **run)
        cache = RKVCache(model, scheme, capacity=128)
        got = model.generate(ids, **image, **run, cache=cache)
    n = ids.shape[1]
    assert quantized_count(n, scheme.recent, scheme.block) >= 37  # the image's tokens (21 to 36) are quantized
    ref, lp = (torch.log_softmax(torch.stack(r.logits)[:, 0].float(), dim=-1) for r in (want, got))
    agree = greedy_agrees(want.sequences[0, n:], got.sequences[0, n:], ref, eps=2 * bound)
    assert agree, agree.detail
    differ = (want.sequences[0, n:] != got.sequences[0, n:]).nonzero()
    steps = int(differ[0]) + 1 if differ.numel() else ref.shape[0]  # (step i's logits follow tokens < i)
    cand = ref[:steps].topk(8, dim=-1).indices
    err = (lp[:steps].gather(-1, cand) - ref[:steps].gather(-1, cand)).abs().max()
    assert 0 < err <= bound, (float(err), bound)
