"""Measuring a model's per-layer sensitivity (torch_rkv.allocate.Sensitivity) on a calibration text.

For each base level b above the lowest: the next-token distributions with every layer at b bits, then
once per (layer, side) with only that side of that layer at b - 1 (2 x layers simulated forward passes
per base), recording how far they moved (KL divergence, the solver's cost) and the perplexity change. The
calibration text is lcet10.txt by default (the Canterbury corpus's other long prose text), never an
evaluation text. Profiles are cached in the cache directory, keyed by model (its name and a fingerprint of
its config and weights), text, tokens and lowest level.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from ..allocate import SIDES, Allocation, Sensitivity, allocate_average, allocate_split, layer_scheme, split_total
from ..files import write_text_atomic
from ..integrations import models
from . import data, perplexity
from .simulate import Simulation

CALIBRATION_TEXT = "lcet10.txt"
CALIBRATION_TOKENS = 512


def simulations_for(model, positions: int, layer_rope: Optional[dict] = None) -> Callable[..., Simulation]:
    """scheme, **options -> a Simulation of `model` (its RoPE tables for `positions` positions, its pairing).
    layer_rope: those tables when the caller has them (models.layer_rope_tables)."""
    att = models.inspect(model)  # an unsupported model feature stops here, named
    layer_rope = layer_rope or models.layer_rope_tables(model, positions)
    cos, sin = layer_rope[0]

    def make(scheme, **options) -> Simulation:
        return Simulation(scheme, cos, sin, rope_interleaved=att.interleaved, layer_rope=layer_rope, **options)

    return make


def model_key(model) -> str:
    """A file-name key for a model: its name or path, its layer count, and its fingerprint (a fine-tune saved
    under its base model's name, or one whose RoPE scaling was changed, never reads the other's profile)."""
    name = getattr(model.config, "name_or_path", "") or model.config.model_type
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name.rstrip("/")).name or name)
    return f"{name}-{model.config.num_hidden_layers}l-{fingerprint(model)}"


# config entries that name or date a checkpoint rather than describe the model
UNDESCRIPTIVE = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")
SAMPLES = 1024  # weights hashed a tensor, evenly strided


@torch.no_grad()
def fingerprint(model) -> str:
    """12 hex digits of a hash of the model's config and weights: each tensor's name, shape, dtype and SAMPLES
    elements strided over it (a fine-tune moves them all; hashing every byte of an 8B model would take seconds
    on every cache hit). Offloaded (meta) tensors count by their shape."""
    h = hashlib.blake2b(digest_size=6)
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in UNDESCRIPTIVE}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        if p.device.type != "meta" and p.numel():
            flat = p.detach().reshape(-1)
            h.update(flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES].float().cpu().numpy().tobytes())
    return h.hexdigest()


def text_key(text: str) -> str:
    """A file-name key for a calibration text: a corpus text's name, or a file's name and a hash of its bytes
    (an edited file is another text). The same lookup as calibration_ids: a file first."""
    if not Path(text).exists():
        return Path(text).name
    return f"{Path(text).name}-{hashlib.blake2b(Path(text).read_bytes(), digest_size=4).hexdigest()}"


def profile_path(model, text: str, tokens: int, levels: tuple[int, ...]) -> Path:
    """Keyed by the lowest level too: it sets the window every layer_scheme of the profile keeps."""
    return data.cache_dir() / "calibration" / f"{model_key(model)}-{text_key(text)}-{tokens}-from{min(levels)}.json"


@torch.no_grad()
def measure(model, ids: torch.Tensor, levels: tuple[int, ...], simulation: Callable, layers: int,
            profile: Optional[Sensitivity] = None, progress: Callable[[int, int, int], None] = lambda *_: None
            ) -> Sensitivity:
    """The drops at every base of `levels` not yet in `profile` (a new one when None).
    simulation(scheme, layer_schemes=...) builds the model's Simulation (simulations_for);
    progress(base, layer, layers) after each layer's two passes."""
    if profile is None:
        profile = Sensitivity("", "", ids.shape[1], tuple(levels), perplexity.simulated(model, ids, None))
    profile.levels = tuple(sorted(set(profile.levels) | set(levels)))
    for base in levels[1:]:
        if base in profile.drops:
            continue
        uniform = layer_scheme(base, base, levels)
        reference = perplexity.simulated_logprobs(model, ids, simulation(uniform))
        profile.base_ppl[base] = perplexity.perplexity_of(reference, ids)
        kl, ppl = [], []
        for layer in range(layers):
            pair = []
            for side in SIDES:
                lower = layer_scheme(base - 1 if side == "k" else base, base - 1 if side == "v" else base, levels)
                out = perplexity.simulated_logprobs(model, ids, simulation(uniform, layer_schemes={layer: lower}))
                pair.append((perplexity.kl_divergence(reference, out),
                             perplexity.perplexity_of(out, ids) - profile.base_ppl[base]))
            kl.append((pair[0][0], pair[1][0]))
            ppl.append((pair[0][1], pair[1][1]))
            progress(base, layer + 1, layers)
        profile.drops[base], profile.ppl_drops[base] = kl, ppl
    return profile


@torch.no_grad()
def measure_moves(model, ids: torch.Tensor, alloc: Allocation, simulation: Callable,
                  progress: Callable[[int, int], None] = lambda *_: None) -> tuple[float, dict]:
    """(cost, moves) for allocate.refine: cost, the allocation's mean KL from full precision on ids;
    moves[(layer, side, bits)], how much that changes when only that side of that layer moves one level
    up or down from its width (a forward pass each: up to 4 x layers). progress(done, total)."""
    reference = perplexity.simulated_logprobs(model, ids, None)
    schemes = alloc.schemes()

    def cost(layer_schemes) -> float:
        out = perplexity.simulated_logprobs(model, ids, simulation(layer_schemes[0],
                                                                   layer_schemes=dict(enumerate(layer_schemes))))
        return perplexity.kl_divergence(reference, out)

    todo = [(layer, s, b) for layer, kv in enumerate(alloc.bits) for s, side in enumerate(SIDES)
            for b in (kv[s] - 1, kv[s] + 1) if b in alloc.levels]
    base = cost(schemes)
    moves = {}
    for i, (layer, s, b) in enumerate(todo):
        kv = list(alloc.bits[layer])
        kv[s] = b
        moved = list(schemes)
        moved[layer] = layer_scheme(kv[0], kv[1], alloc.levels)
        moves[(layer, SIDES[s], b)] = cost(moved) - base
        progress(i + 1, len(todo))
    return base, moves


def stored_profile(model, levels: tuple[int, ...], text: str, tokens: int) -> Optional[Sensitivity]:
    """What the cache holds of `model`'s profile on `text` (it may not cover `levels`), or None."""
    path = profile_path(model, text, tokens, levels)
    return Sensitivity.from_json(path.read_text()) if path.exists() else None


def calibration_ids(tok, text: str, tokens: int) -> torch.Tensor:
    """The first `tokens` token ids (1, tokens) of the calibration text `text`: a file, or a corpus file's
    name; MissingMaterial when it is shorter."""
    source = Path(text) if Path(text).exists() else data.text_path(text)
    ids = data.encode(tok, data.read_text(str(source)))
    if ids.shape[1] < tokens:
        raise data.MissingMaterial(f"the calibration text {text} has {ids.shape[1]} tokens, fewer than {tokens}")
    return ids[:, :tokens]


def load_or_measure(model, tok, levels: tuple[int, ...], text: str = CALIBRATION_TEXT,
                    tokens: int = CALIBRATION_TOKENS, progress: Callable[[int, int, int], None] = lambda *_: None
                    ) -> Sensitivity:
    """The cached profile of `model` on `text` covering `levels`, measuring (and caching) what is missing."""
    att = models.inspect(model)  # an unsupported model feature stops here, named
    models.refuse_cacheless_layers(att, "a per-layer bit allocation")  # (a shared layer's bits are its source's)
    cached = stored_profile(model, levels, text, tokens)
    if cached is not None and cached.covers(levels):
        return cached.restricted(tuple(levels))
    profile = measure(model, calibration_ids(tok, text, tokens), levels, simulations_for(model, tokens),
                      att.layers, cached, progress)
    profile.model, profile.text = model_key(model), Path(text).name
    path = profile_path(model, text, tokens, levels)
    write_text_atomic(path, profile.to_json())
    return profile.restricted(tuple(levels))


def main(args) -> int:
    """python -m torch_rkv calibrate: measure (or read the cached) profile and print it and its path."""
    levels = tuple(sorted(set(args.levels)))
    if len(levels) < 2 or any(b not in (2, 3, 4) for b in levels) or levels[-1] - levels[0] != len(levels) - 1:
        print("torch_rkv calibrate: --levels must be consecutive widths among 2, 3, 4 (e.g. 2 3 4)", file=sys.stderr)
        return 2
    try:  # before the calibration, which may take minutes
        if args.split is not None:
            split_total(args.split, levels)
        if args.bits is not None and not levels[0] <= args.bits <= levels[-1]:
            raise ValueError(f"{args.bits} bits is outside the levels {levels}")
    except ValueError as e:
        print(f"torch_rkv calibrate: {e}", file=sys.stderr)
        return 2
    try:
        model, tok = data.load_model(args.model, args.gguf)
        profile = load_or_measure(model, tok, levels, args.text, args.tokens,
                                  progress=lambda base, layer, layers: print(
                                      f"\r  from {base} bits: layer {layer}/{layers}", end="", file=sys.stderr,
                                      flush=True))
    except data.MissingMaterial as e:
        print(f"torch_rkv calibrate: {e}", file=sys.stderr)
        return 2
    print(f"\n{profile.model} on {profile.tokens} tokens of {profile.text}: KL (nats/token) and perplexity change "
          "when one layer's keys or values drop a bit")
    for base in levels[1:]:
        print(f"from {base} to {base - 1} bits (all at {base}: perplexity {profile.base_ppl[base]:.3f})")
        for layer, ((kk, kv), (pk, pv)) in enumerate(zip(profile.drops[base], profile.ppl_drops[base])):
            print(f"  layer {layer:3d}  K {kk:.5f} ({pk:+.3f})  V {kv:.5f} ({pv:+.3f})")
    print(profile_path(model, args.text, args.tokens, levels))
    for kind, bits, solve in (("split", args.split, allocate_split), ("allocation", args.bits, allocate_average)):
        if bits is None:
            continue
        alloc = solve(profile, bits).with_layout(sparse=args.sparse, lean=args.lean)
        path = Path(args.out) if args.out else profile_path(model, args.text, args.tokens, levels).with_name(
            f"{kind}-{bits:g}-{model_key(model)}-{Path(args.text).name}-{args.tokens}.json")
        alloc.save(path, model=profile.model, calibration=f"{profile.tokens} tokens of {profile.text}")
        print(f"per-layer {kind} at {bits:g} bits (K/V bits by layer): {alloc.describe()}\n"
              f"TORCH_RKV_ALLOCATION={path}")
    return 0


def allocation_for(model, tok, bits: float, levels: tuple[int, ...] = (2, 3, 4), text: str = CALIBRATION_TEXT,
                   tokens: int = CALIBRATION_TOKENS) -> Allocation:
    """Per-layer K/V bits for `model` at `bits` average code bits (RKVCache(model, alloc.schemes(), ...)),
    from its sensitivity on the calibration text: measured on first use (2 x layers forward passes of
    `tokens` tokens per level above the lowest), then read from the cache."""
    return allocate_average(load_or_measure(model, tok, levels, text, tokens), bits)
