"""Per-layer bit allocation: which layers' keys and values get more bits under a memory budget.

Layers are not equally sensitive to quantization (KVQuant, arXiv 2401.18079, and the mixed-precision KV
literature): some layers' keys decide where attention goes, others barely matter. A `Sensitivity`
profile holds, for each layer and side (keys, values), what it costs when only that layer's side drops
one bit below a uniform base (measured on a calibration text by eval/sensitivity.py, never on an
evaluation text): the perplexity change, and the KL divergence of the next-token distribution from the
base's, which is the solver's cost. On a calibration window of 512 tokens a single layer's perplexity
change is a small difference of two noisy numbers (27 of SmolLM2's 60 drops from 3 to 2 bits measured
negative), while the KL divergence is never negative and is the expected log-likelihood loss on text
the model itself would write; allocations solved on it measured better on alice29 (levels 2 and 3 at
2.5 bits: +0.36 against +0.51).

`allocate` solves a multiple-choice knapsack: one bit width per (layer, side) from the profile's
levels, total cost (the measured drops, summed along the chain from the top level) minimal, total code
bytes within the budget. Costs are assumed additive across layers: the report
measures how far that holds by evaluating the allocation it picks.

Every layer of an allocation stores the library's recommended layout (`layer_scheme`); only the bit
widths differ, so the bytes a choice costs are its code bytes and the rest of the cache is fixed.

`allocate_split` is the allocation an engine with one page size for every layer can hold: every layer
keeps the same key + value bits, and only how it splits them between its keys and values follows the
profile. A page's metadata does not depend on the widths, so equal totals mean equal pages. An
allocation is saved as a small JSON file (`save` / `load`; docs/format.md) that the vLLM plugin reads
(TORCH_RKV_ALLOCATION; each layer's pages at its own bytes, split or not).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from functools import reduce
from pathlib import Path

import numpy as np

from .files import write_text_atomic
from .scheme import Scheme, lean, recommended, sparse

SIDES = ("k", "v")


def layer_scheme(k_bits: int, v_bits: int, levels: tuple[int, ...]) -> Scheme:
    """One layer of an allocation over `levels`: rkv's layout at these widths (clipped key ranges at 2
    bits, as rkv-2). Sinks, recent window and block come from the lowest level's preset, the same for
    every layer, so that bit widths are the only thing a choice changes."""
    base = recommended(min(levels))
    return base.replace(name=f"rkv-k{k_bits}v{v_bits}", k_bits=k_bits, v_bits=v_bits, k_clip=k_bits == 2)


@dataclass
class Sensitivity:
    """drops[base][layer] = (keys, values): the mean KL divergence (nats per token) of the next-token
    distribution when only that layer's side is stored at base - 1 bits, from every layer at `base`
    (layer_scheme(base, base, levels)); ppl_drops: the perplexity change of the same runs; base_ppl[base]:
    all layers at base. Measured on `tokens` tokens of `text` with `model`."""

    model: str
    text: str
    tokens: int
    levels: tuple[int, ...]
    full_precision_ppl: float
    base_ppl: dict[int, float] = field(default_factory=dict)
    drops: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    ppl_drops: dict[int, list[tuple[float, float]]] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return len(next(iter(self.drops.values())))

    def cost(self, layer: int, side: str, bits: int) -> float:
        """Predicted cost (nats per token) of storing (layer, side) at `bits` rather than the top level."""
        if bits not in self.levels:
            raise ValueError(f"Sensitivity: {bits} bits is not one of the profile's levels {self.levels}")
        s = SIDES.index(side)
        return sum(self.drops[b][layer][s] for b in self.levels if bits < b)

    def covers(self, levels: tuple[int, ...]) -> bool:
        """Whether the drops of every base of `levels` were measured."""
        return all(b in self.drops for b in levels[1:])

    def check(self) -> None:
        if not self.covers(self.levels):
            missing = [b for b in self.levels[1:] if b not in self.drops]
            raise ValueError(f"Sensitivity: no drops measured at base {missing} for levels {self.levels}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Sensitivity":
        """A profile from to_json's text; ValueError naming what is wrong with any other text."""
        try:
            d = json.loads(text)
            d["levels"] = tuple(d["levels"])
            d["base_ppl"] = {int(k): v for k, v in d["base_ppl"].items()}
            for name in ("drops", "ppl_drops"):
                d[name] = {int(k): [tuple(x) for x in v] for k, v in d[name].items()}
            return cls(**d)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"Sensitivity: not a sensitivity profile (python -m torch_rkv calibrate writes one): "
                             f"{type(e).__name__}: {e}") from e

    def restricted(self, levels: tuple[int, ...]) -> "Sensitivity":
        """The same profile over a sub-chain of levels (consecutive ones of this profile)."""
        out = Sensitivity(self.model, self.text, self.tokens, tuple(levels), self.full_precision_ppl,
                          {b: self.base_ppl[b] for b in levels[1:] if b in self.base_ppl},
                          {b: self.drops[b] for b in levels[1:] if b in self.drops},
                          {b: self.ppl_drops[b] for b in levels[1:] if b in self.ppl_drops})
        out.check()
        return out


@dataclass(frozen=True)
class Allocation:
    """bits[layer] = (key bits, value bits) over `levels`; predicted: the profile's summed cost (nats).
    Every layer the same layout beside its bits: rkv's (layer_scheme), with rkv-sparse's outliers
    (sparse) and rkv-lean's float8 value metadata (lean) when set."""

    bits: tuple[tuple[int, int], ...]
    levels: tuple[int, ...]
    predicted: float
    sparse: bool = False
    lean: bool = False

    def schemes(self) -> list[Scheme]:
        out = []
        for k, v in self.bits:
            s = layer_scheme(k, v, self.levels)
            if self.sparse:
                s = sparse(s)
            if self.lean:
                s = lean(s)
            out.append(s)
        return out

    def with_layout(self, sparse: bool = False, lean: bool = False) -> Allocation:
        """The same widths with rkv-sparse's outliers and / or rkv-lean's value metadata in every layer."""
        return dataclasses.replace(self, sparse=sparse, lean=lean)

    def average_bits(self, weights=None) -> float:
        """Code bits per element, averaged over layers (weighted by the tokens each holds) and sides."""
        w = weights or [1] * len(self.bits)
        return sum(wi * (k + v) for wi, (k, v) in zip(w, self.bits)) / (2 * sum(w))

    def effective_bits(self, head_dim: int, weights=None) -> float:
        """Bits per element with metadata (Scheme.effective_bits, averaged like average_bits)."""
        w = weights or [1] * len(self.bits)
        return sum(wi * s.effective_bits(head_dim) for wi, s in zip(w, self.schemes())) / sum(w)

    def describe(self) -> str:
        return " ".join(f"{k}{v}" for k, v in self.bits)

    def layer_totals(self) -> list[int]:
        return [k + v for k, v in self.bits]

    def save(self, path, model: str = "", calibration: str = "") -> None:
        d = {"format": FILE_FORMAT, "version": FILE_VERSION, "model": model, "calibration": calibration,
             "levels": list(self.levels), "bits": [list(b) for b in self.bits], "predicted": self.predicted,
             **{name: True for name in ("sparse", "lean") if getattr(self, name)}}
        write_text_atomic(path, json.dumps(d, indent=1))

    @classmethod
    def load(cls, path) -> Allocation:
        """An allocation file (save), checked: its format, and every width one of its levels."""
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"allocation file {path}: cannot be read as JSON ({e})") from e
        if not isinstance(d, dict) or d.get("format") != FILE_FORMAT or d.get("version") != FILE_VERSION:
            raise ValueError(f"allocation file {path}: not a {FILE_FORMAT} file of version {FILE_VERSION}")
        try:
            levels = tuple(int(x) for x in d["levels"])
            bits = tuple(tuple(int(x) for x in b) for b in d["bits"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"allocation file {path}: needs 'levels' (widths) and 'bits' ((key, value) widths per "
                             f"layer) ({e!r})") from e
        for layer, b in enumerate(bits):
            if len(b) != 2 or any(x not in levels for x in b):
                raise ValueError(f"allocation file {path}: layer {layer}'s bits {list(b)} are not a (key, value) "
                                 f"pair of its levels {list(levels)}")
        if not bits:
            raise ValueError(f"allocation file {path}: no layers")
        layout = {name: d.get(name, False) for name in ("sparse", "lean")}
        for name, value in layout.items():
            if not isinstance(value, bool):
                raise ValueError(f"allocation file {path}: '{name}' must be true or false (got {value!r})")
        return cls(bits, levels, float(d.get("predicted", 0.0)), **layout)


FILE_FORMAT = "torch_rkv.allocation"
FILE_VERSION = 1


def solve(groups: list[list[tuple[int, float]]], capacity: int) -> list[int]:
    """Multiple-choice knapsack: one (weight, cost) choice per group, total weight <= capacity, total cost
    minimal. Exact dynamic programming over integer weights; returns the chosen index per group. Among
    equal costs it takes the later choice and the heavier total: bits the budget allows are spent."""
    if capacity < 0:
        raise ValueError("allocate: the budget does not hold even the lowest level everywhere")
    best = np.full(capacity + 1, math.inf)
    best[0] = 0.0
    picks = []
    for choices in groups:
        new = np.full(capacity + 1, math.inf)
        pick = np.full(capacity + 1, -1, dtype=np.int64)
        for i, (w, c) in enumerate(choices):
            if w > capacity:
                continue
            cand = np.full(capacity + 1, math.inf)
            cand[w:] = best[: capacity + 1 - w] + c
            better = cand <= new
            new[better], pick[better] = cand[better], i
        best = new
        picks.append(pick)
    if not np.isfinite(best).any():
        raise ValueError("allocate: the budget does not hold even the lowest level everywhere")
    at = capacity - int(np.argmin(best[::-1]))
    out = []
    for pick in reversed(picks):  # walk back from the cheapest reachable total
        i = int(pick[at])
        out.append(i)
        at -= groups[len(groups) - len(out)][i][0]
    return out[::-1]


def solve_widths(choices: list[list[tuple[int, float]]], budget_units: int, weights, who: str, subject: str
                 ) -> tuple[tuple[tuple[int, int], ...], float]:
    """One (bits, cost) of choices[2 * layer + side] per (layer, side) whose code size, sum of
    weight[layer] x bits, fits in budget_units, total cost minimal: ((key bits, value bits) per layer,
    that cost). weights: integers proportional to the token rows each layer stores (1 each when every
    layer holds the whole context; a sliding layer's ring holds fewer); who and subject name the caller
    and what it solves for in errors."""
    layers = len(choices) // 2
    w = list(weights or [1] * layers)
    if len(w) != layers:
        raise ValueError(f"{who}: {len(w)} layer weights for {subject} of {layers} layers")
    g = reduce(math.gcd, w)
    w = [x // g for x in w]
    picks = solve([[(w[j // 2] * b, c) for b, c in options] for j, options in enumerate(choices)], budget_units // g)
    chosen = [choices[j][i] for j, i in enumerate(picks)]
    bits = tuple((chosen[2 * i][0], chosen[2 * i + 1][0]) for i in range(layers))
    return bits, sum(c for _, c in chosen)


def profile_choices(profile: Sensitivity, layers) -> list[list[tuple[int, float]]]:
    """solve_widths' choices for `layers` (an iterable of layer indices): per (layer, side), each of the
    profile's levels with its predicted cost."""
    return [[(b, profile.cost(layer, side, b)) for b in profile.levels] for layer in layers for side in SIDES]


def allocate(profile: Sensitivity, budget_units: int, weights=None) -> Allocation:
    """The allocation of least predicted cost whose code size sum over (layer, side) of weight[layer] x
    bits fits in budget_units (solve_widths)."""
    profile.check()
    choices = profile_choices(profile, range(profile.layers))
    bits, predicted = solve_widths(choices, budget_units, weights, "allocate", "a profile")
    return Allocation(bits, profile.levels, predicted)


def refine(alloc: Allocation, base_cost: float, moves: dict[tuple[int, str, int], float], weights=None
           ) -> Allocation:
    """One step of local search measured in place: moves[(layer, side, bits)] is how much the cost
    (measured, e.g. KL from full precision) changes when only that side of that layer moves from its
    width in `alloc` to `bits`, every other side as allocated (sensitivity.measure_moves). The profile's
    single-layer drops are measured from a uniform base and do not add up once many layers sit below it;
    these are measured at the allocation itself. The knapsack then picks at most one move per side, the
    code size within alloc's own; staying costs 0, so the result is predicted no worse (predicted:
    base_cost plus the chosen moves)."""
    for layer, side, bits in moves:
        if not (0 <= layer < len(alloc.bits) and side in SIDES and bits in alloc.levels):
            raise ValueError(f"refine: move {(layer, side, bits)} is not (layer, 'k' or 'v', one of {alloc.levels})")
    choices = []
    for layer, kv in enumerate(alloc.bits):
        for s, side in enumerate(SIDES):
            choices.append([(kv[s], 0.0)] + [(b, moves[(layer, side, b)]) for b in alloc.levels
                                             if (layer, side, b) in moves and b != kv[s]])
    # alloc's own code size (a weight count that does not match is refused by solve_widths)
    budget = sum(wl * (k + v) for wl, (k, v) in zip(weights or [1] * len(alloc.bits), alloc.bits))
    bits, gain = solve_widths(choices, budget, weights, "refine", "an allocation")
    return Allocation(bits, alloc.levels, base_cost + gain)


def allocate_average(profile: Sensitivity, target_bits: float) -> Allocation:
    """Per-layer K/V bits whose average code bits (every layer holding the same tokens) is at most
    target_bits, at least predicted cost."""
    if not min(profile.levels) <= target_bits <= max(profile.levels):
        raise ValueError(f"allocate: target {target_bits} bits is outside the profile's levels {profile.levels}")
    return allocate(profile, math.floor(target_bits * 2 * profile.layers + 1e-9))


EDGE_BITS = 8  # allocate_edges: the width of the first and last layers


def allocate_edges(profile: Sensitivity, target_bits: float, edge_bits: int = EDGE_BITS) -> Allocation:
    """vLLM's habit of leaving the first and last layers unquantized, as a choice inside the budget: those
    two layers' keys and values at edge_bits, counted in the average code bits (every layer holding the
    same tokens, as allocate_average), and the other layers allocated from the profile under what is
    left. predicted counts the other layers only (the profile has no drop at edge_bits)."""
    profile.check()
    layers = profile.layers
    if layers < 3:
        raise ValueError(f"allocate_edges: a model of {layers} layers has no layers between its edges")
    units = math.floor(target_bits * 2 * layers + 1e-9) - 2 * 2 * edge_bits
    middle = range(1, layers - 1)
    if units < 2 * min(profile.levels) * len(middle):
        raise ValueError(f"allocate_edges: {target_bits} bits cannot hold two layers at {edge_bits} bits and "
                         f"{len(middle)} at {min(profile.levels)}")
    bits, predicted = solve_widths(profile_choices(profile, middle), units, None, "allocate_edges", "a profile")
    edge = ((edge_bits, edge_bits),)
    return Allocation(edge + bits + edge, tuple(sorted({*profile.levels, edge_bits})), predicted)


def split_total(target_bits: float, levels: tuple[int, ...]) -> int:
    """The key + value bits every layer of allocate_split keeps at target_bits average code bits: a
    multiple of 0.5 between the lowest and highest of `levels` (checked before any calibration runs)."""
    total = target_bits * 2
    if total != int(total) or not 2 * min(levels) <= total <= 2 * max(levels):
        raise ValueError(f"allocate_split: target {target_bits} bits must be a multiple of 0.5 within the profile's "
                         f"levels {tuple(levels)}")
    return int(total)


def allocate_split(profile: Sensitivity, target_bits: float) -> Allocation:
    """Every layer at 2 x target_bits key + value code bits (so every layer's page has the same bytes),
    each layer's split between keys and values the one of least predicted cost. target_bits: a multiple
    of 0.5 between the profile's lowest and highest level."""
    profile.check()
    total = split_total(target_bits, profile.levels)

    def cost(layer: int, kv: tuple[int, int]) -> float:
        return profile.cost(layer, "k", kv[0]) + profile.cost(layer, "v", kv[1])

    splits = [(k, total - k) for k in profile.levels if total - k in profile.levels]
    if not splits:
        raise ValueError(f"allocate_split: {total} key + value bits have no split into the profile's levels "
                         f"{tuple(profile.levels)}")
    # (ties go to more key bits: keys decide where attention goes)
    bits = tuple(min(splits, key=lambda kv: (cost(layer, kv), -kv[0])) for layer in range(profile.layers))
    return Allocation(bits, profile.levels, sum(cost(layer, kv) for layer, kv in enumerate(bits)))
