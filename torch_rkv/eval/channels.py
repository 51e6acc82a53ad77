"""Calibrating which key channels a model's cache refines (torch_rkv.channels.KeyChannels).

One full-precision pass over the calibration text records each layer's pre-RoPE keys over the region the
cache quantizes, and how much attention reads each of them (levels.attention_weights: the token's
received attention times its channel's query energy). A channel's importance is the sum over tokens of
that weight times the squared step of the channel's block at `bits` (the sinks left out): the expected
squared score error its code leaves. Each KV head ranks its channels by it. The calibration text is
lcet10.txt by default, never an evaluation text; rankings are cached like codebooks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..channels import KeyChannels, block_params
from ..integrations import models
from ..scheme import recommended
from . import data, levels
from .sensitivity import CALIBRATION_TEXT, CALIBRATION_TOKENS, calibration_ids, model_key, text_key


@torch.no_grad()
def calibrate(model, ids: torch.Tensor, bits: int = 2) -> KeyChannels:
    """The key-channel ranking of `model` from one full-precision pass over ids (1, N), its steps those of
    rkv-<bits>'s blocks."""
    att = models.inspect(model)
    models.refuse_cacheless_layers(att, "refined key channels")
    s = recommended(bits)
    rec = levels.record(model, ids, s, weighted=True)
    ranks = []
    for layer in range(att.layers):
        if (layer, "k") not in rec.seen:
            raise ValueError(f"calibrate: layer {layer} quantized nothing on {ids.shape[1]} tokens; use a longer "
                             "text")
        x = rec.seen[(layer, "k")]
        weight = rec.weights[(layer, "k")][..., : x.shape[-2], :]
        # (the sinks are encoded in the first block but read in full precision)
        score = (weight * block_params(x, s, s.sinks)[0].pow(2))[..., s.sinks:, :].sum(dim=(0, 2))  # (heads, D)
        ranks.append(score.argsort(dim=-1, descending=True, stable=True).tolist())
    return KeyChannels(ranks, model_key(model))


def channels_path(model, text: str, tokens: int) -> Path:
    return data.cache_dir() / "calibration" / f"key-channels-{model_key(model)}-{text_key(text)}-{tokens}.json"


def load_or_calibrate(model, tok, text: str = CALIBRATION_TEXT, tokens: int = CALIBRATION_TOKENS) -> Path:
    """The path of `model`'s cached key-channel ranking on `tokens` tokens of `text`, calibrating it on
    first use."""
    path = channels_path(model, text, tokens)
    if path.exists():
        return path
    ranking = calibrate(model, calibration_ids(tok, text, tokens))
    ranking.calibration = f"{tokens} tokens of {Path(text).name}, attention-weighted squared steps"
    ranking.save(path)
    return path
