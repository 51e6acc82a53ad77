"""Calibrating non-uniform levels (torch_rkv.codebook.Codebook) for a model on a calibration text.

One full-precision forward pass over the calibration text records every layer's keys and values in the
rkv storage space (pre-RoPE keys, Hadamard-rotated values: the space the cache quantizes) over the region
the cache quantizes. For each width and side, every value is placed in its group's range in code units,
u = (x - zero) / scale, with the group parameters the cache would choose (rkv's layout: per-channel keys
in 128-token blocks, clipped at 2 bits; per-token values), and Lloyd's iteration fits the levels that
minimize the squared error weighted by scale^2 (the error in the data's own units) and, by default, by
how much attention reads each value (attention_weights). Two rounds: the second recomputes the clipped
ranges with the first round's levels, as the cache will. The calibration
text is lcet10.txt by default, never an evaluation text; codebooks are cached like sensitivity profiles.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from ..codebook import SIDES, Codebook, lloyd, load
from ..integrations import models
from ..ops.quant import quantize
from ..reference import expand_meta, rope_pairs
from ..scheme import Scheme, recommended
from . import data, perplexity
from .sensitivity import CALIBRATION_TEXT, CALIBRATION_TOKENS, calibration_ids, model_key, simulations_for, text_key
from .simulate import Simulation

WIDTHS = (2, 3, 4)


class Recorder(Simulation):
    """A full-precision Simulation that keeps what each layer's cache would quantize, in the storage space,
    and (attention weighting) how much attention reads each of its values."""

    def __post_init__(self):
        super().__post_init__()
        self.seen: dict[tuple[int, str], torch.Tensor] = {}
        self.weights: dict[tuple[int, str], torch.Tensor] = {}
        self.weighted = False

    def round_trip(self, x: torch.Tensor, side: str, s: Scheme, layer: Optional[int] = None,
                   sinks: int = 0) -> torch.Tensor:
        self.seen[(layer, side)] = x.detach().float().clone()
        return x.float()

    def attention(self, query, key, value, scaling: float, attention_mask=None, softcap: float = 0.0,
                  layer: Optional[int] = None) -> torch.Tensor:
        out = super().attention(query, key, value, scaling, attention_mask, softcap, layer)
        if self.weighted:
            cos, sin = (self.layer_rope or {}).get(layer, (self.rope_cos, self.rope_sin))
            half = cos.shape[-1] if sin.any() else 0  # (a NoPE layer's identity table pairs no channels)
            k, v = attention_weights(query.float(), key.float(), scaling, softcap, half, self.rope_interleaved)
            self.weights[(layer, "k")], self.weights[(layer, "v")] = k, v
        return out


def attention_weights(q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float, half: int,
                      interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """How much an error in each cached value moves attention, (B, Hkv, N, D) for keys and for values, from
    the full-precision causal attention of queries q (B, Hq, N, D) over keys k (B, Hkv, N, D).

    A key error e moves a score by q . e: its channel c weighs E[q_c^2] (in the pre-RoPE space a rotated
    pair's energy, the mean of the pair's, which RoPE keeps), and the token weighs the attention it
    receives. A value error moves the output by p_t e: the token weighs sum of p_t^2 over the queries.
    (KVQuant weighs its levels by Fisher information for the same reason.)"""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, n, d)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(scores.masked_fill(~causal, -torch.inf), dim=-1)
    received, squared = p.sum(dim=(2, 3)), p.pow(2).sum(dim=(2, 3))  # (B, Hkv, N)
    energy = qg.pow(2).mean(dim=(2, 3))  # (B, Hkv, D)
    if half:  # each rotated pair (reference.rope_pairs) gets its members' mean
        e0, e1 = rope_pairs(energy, half, interleaved)
        mean = (e0 + e1) / 2
        e0.copy_(mean)
        e1.copy_(mean)
    keys = received[..., None] * energy[..., None, :]
    values = squared[..., None].expand(b, hkv, n, d)
    return keys / keys.mean(), values / values.mean()


def samples(x: torch.Tensor, side: str, s: Scheme, lv: Optional[torch.Tensor] = None,
            weight: Optional[torch.Tensor] = None):
    """(u, w): x's values (B, H, n, D) in code units of their group's range as the cache quantizes them
    under scheme s (and levels lv for the clip search), and their weights scale^2 (times `weight`, of x's
    tokens or more, when given); the sinks (encoded, but not in the range) left out."""
    bits, tokens = getattr(s, f"{side}_bits"), getattr(s, f"{side}_block_tokens")
    group = getattr(s, f"{side}_group_size") or x.shape[-1]
    q = quantize(x, bits, group, tokens, False, s.side_meta_dtype(side), getattr(s, f"{side}_clip"), s.sinks, lv)
    sc, zr = expand_meta(q.scale, tokens, group), expand_meta(q.zero, tokens, group)
    keep = slice(s.sinks, None)
    sc, zr, xs = sc[..., keep, :], zr[..., keep, :], x[..., keep, :]
    w = sc * sc
    if weight is not None:
        w = w * weight[..., : x.shape[-2], :][..., keep, :]
    ok = sc > 0
    return ((xs - zr) / sc.clamp_min(1e-30))[ok], w[ok]


@torch.no_grad()
def record(model, ids: torch.Tensor, scheme: Scheme, weighted: bool) -> Recorder:
    """One full-precision pass of `model` over ids (1, N): what each layer's cache would quantize under
    `scheme`'s region (Recorder.seen) and, if weighted, how much attention reads each value
    (Recorder.weights)."""
    probe = simulations_for(model, ids.shape[1])(scheme)
    recorder = Recorder(probe.scheme, probe.rope_cos, probe.rope_sin, probe.rope_interleaved, probe.layer_rope)
    recorder.weighted = weighted
    perplexity.simulated_logprobs(model, ids, recorder)
    return recorder


@torch.no_grad()
def calibrate(model, ids: torch.Tensor, widths: tuple[int, ...] = WIDTHS, pin_ends: bool = False,
              rounds: int = 2, weighting: str = "attention") -> Codebook:
    """The codebook of `model` from one full-precision pass over ids (1, N), for the rkv layout at each
    width (recommended(bits): its clipping and sinks). weighting: "mse" (each value by its group's
    scale^2: squared error in the data's units) or "attention" (times attention_weights: what attention
    reads of each value)."""
    if weighting not in ("mse", "attention"):
        raise ValueError(f"calibrate: weighting must be 'mse' or 'attention' (got {weighting!r})")
    att = models.inspect(model)
    models.refuse_cacheless_layers(att, "per-layer levels")  # (a shared layer's are its source's, fitted to its reads)
    layers = att.layers
    recorder = record(model, ids, recommended(min(widths)), weighting == "attention")
    table = [{side: {} for side in SIDES} for _ in range(layers)]
    for bits in widths:
        s = recommended(bits)
        for (layer, side), x in recorder.seen.items():
            lv = None
            for _ in range(rounds):
                u, w = samples(x, side, s, lv, recorder.weights.get((layer, side)))
                lv = lloyd(u, w, bits, pin_ends, init=lv)
            table[layer][side][str(bits)] = [float(v) for v in lv]
    missing = [i for i, t in enumerate(table) if not t["k"]]
    if missing:
        raise ValueError(f"calibrate: layers {missing} quantized nothing on {ids.shape[1]} tokens; use a longer text")
    return Codebook(table, model_key(model), "rkv layout (recommended)", "")


def codebook_path(model, text: str, tokens: int, pin_ends: bool, weighting: str = "attention") -> Path:
    return (data.cache_dir() / "calibration" / f"levels-{model_key(model)}-{text_key(text)}-{tokens}-{weighting}"
            f"{'-pinned' if pin_ends else ''}.json")


def load_or_calibrate(model, tok, text: str = CALIBRATION_TEXT, tokens: int = CALIBRATION_TOKENS,
                      pin_ends: bool = False, weighting: str = "attention") -> Path:
    """The path of `model`'s cached codebook on `tokens` tokens of `text`, calibrating it on first use."""
    path = codebook_path(model, text, tokens, pin_ends, weighting)
    if path.exists():
        return path
    book = calibrate(model, calibration_ids(tok, text, tokens), pin_ends=pin_ends, weighting=weighting)
    book.calibration = (f"{tokens} tokens of {Path(text).name}, {weighting}-weighted"
                        f"{', ends pinned' if pin_ends else ''}")
    book.save(path)
    return path


def calibrated(bits: int, path, name: Optional[str] = None) -> Scheme:
    """rkv-<bits> with the calibrated levels of the codebook at `path` ("rkv-nu-<bits>")."""
    return recommended(bits).replace(name=name or f"rkv-nu-{bits}", levels="calibrated", codebook=str(path))


def main(args) -> int:
    """python -m torch_rkv calibrate-levels: calibrate (or read the cached) codebook, print it and its path."""
    try:
        model, tok = data.load_model(args.model, args.gguf)
        path = load_or_calibrate(model, tok, args.text, args.tokens, args.pin_ends, args.weighting)
    except data.MissingMaterial as e:
        print(f"torch_rkv calibrate-levels: {e}", file=sys.stderr)
        return 2
    book = load(str(path))
    print(f"{book.model}: levels in code units per layer and side ({book.calibration})")
    for i, layer in enumerate(book.layers):
        for side in SIDES:
            cells = "  ".join(f"{b}b " + ",".join(f"{v:.2f}" for v in layer[side][b]) for b in sorted(layer[side])
                              if int(b) < 4)
            print(f"  layer {i:3d} {side.upper()}  {cells}")
    print(path)
    return 0
