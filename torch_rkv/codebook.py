"""Non-uniform quantization levels.

Two kinds live here:

* Calibrated per-layer codebooks (`Codebook`), which the kernels serve. A side's codebook is 2^b code
  values in code units, ascending within [0, 2^b - 1]: a code decodes to levels[code] * scale + zero
  with the group's usual scale and zero, so only the grid inside each group's range moves (the uniform
  grid is 0, 1, ..., 2^b - 1). torch_rkv.eval.levels calibrates them; the file format is below and in
  docs/format.md.
* The Lloyd-Max codebook of a standard Gaussian, and the TurboQuant-style round trip that uses it (the
  report's peer; vLLM's TurboQuant presets store keys and values this way). Simulated only.
* The 8-bit float grid (e4m3) of vLLM's own fp8 cache (fp8_round_trip; the report's measure of it).

After a random Hadamard rotation each coordinate of a token's head vector x (D channels) is close to
N(0, |x|^2 / D), whatever the channel it came from. So one codebook serves every row: store |x| (the
per-row metadata, in the scheme's meta dtype) and, per channel, the index of the Lloyd-Max level nearest
to x_i sqrt(D) / |x|; read back the levels scaled so that the row's norm is |x| again (norm correction:
the levels' own rounding would shrink it). Simulation only for now: the cache kernels store uniform
codes, and the caches refuse a scheme with these levels (Scheme.check_served).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from .files import write_text_atomic
from .reference import check_levels

FORMAT = "torch_rkv.codebook/1"
SIDES = ("k", "v")


@dataclass
class Codebook:
    """Per-layer, per-side code values for each width: levels[layer][side][bits] is a list of 2^bits
    floats, strictly ascending within [0, 2^bits - 1]. Stored as a small JSON file:

        {"format": "torch_rkv.codebook/1", "model": ..., "scheme": ..., "calibration": ...,
         "layers": [{"k": {"2": [4 floats], "3": [8 floats]}, "v": {...}}, ...]}

    A width missing from a layer's side is an error when a scheme asks for it, never a silent fallback
    to the uniform grid."""

    layers: list = field(default_factory=list)
    model: str = ""
    scheme: str = ""
    calibration: str = ""

    def __post_init__(self):
        for i, layer in enumerate(self.layers):
            for side in SIDES:
                for bits, values in layer.get(side, {}).items():  # the ops' own rule (reference.check_levels)
                    check_levels("codebook", f"layer {i} side {side}", torch.tensor(values, dtype=torch.float32),
                                 int(bits), symmetric=False)

    def levels(self, layer: int, side: str, bits: int) -> torch.Tensor:
        """The code values of `side` ('k' or 'v') of `layer` at `bits`, float32 (2^bits,)."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"Codebook ({self.model or 'unnamed'}): layer {layer} is out of range for "
                             f"{len(self.layers)} layers")
        table = self.layers[layer].get(side, {})
        if str(bits) not in table:
            raise ValueError(f"Codebook ({self.model or 'unnamed'}): layer {layer} side {side} has no {bits}-bit "
                             f"levels (it has {sorted(table) or 'none'}); calibrate that width")
        return torch.tensor(table[str(bits)], dtype=torch.float32)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "model": self.model, "scheme": self.scheme,
                           "calibration": self.calibration, "layers": self.layers})

    @classmethod
    def from_json(cls, text: str, where: str = "codebook") -> "Codebook":
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"{where}: not a torch_rkv codebook (format {d.get('format')!r}, expected {FORMAT!r})")
        return cls(d["layers"], d.get("model", ""), d.get("scheme", ""), d.get("calibration", ""))

    def save(self, path) -> None:
        write_text_atomic(path, self.to_json())


@lru_cache(maxsize=16)
def load(path: str) -> Codebook:
    """The codebook file at `path` (read once per process)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"codebook file {path} does not exist (python -m torch_rkv calibrate-levels writes "
                                "one)")
    return Codebook.from_json(p.read_text(), str(path))


def level_buffers(scheme, num_layers: int, model_layers, device, owner: str) -> dict:
    """{"k_levels", "v_levels"}: a cache's per-layer tables, each a (num_layers, 2^bits) float32 stack of the
    scheme's code values for the model's layers `model_layers` (row i for the cache's layer i; None: 0..
    num_layers-1), or None (the uniform grid). owner names the cache in errors."""
    model_layers = list(range(num_layers)) if model_layers is None else list(model_layers)
    if len(model_layers) != num_layers:
        raise ValueError(f"{owner}: model_layers names {len(model_layers)} layers for num_layers={num_layers}")
    if scheme.levels != "calibrated":
        return {"k_levels": None, "v_levels": None}
    return {f"{side}_levels": torch.stack([scheme.side_levels(i, side) for i in model_layers]).to(device)
            for side in SIDES}


def layer_levels(cache, layer: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(k_levels, v_levels) of a cache's layer (the rows of its level_buffers), or None each (uniform)."""
    return tuple(None if t is None else t[layer] for t in (cache.k_levels, cache.v_levels))


def lloyd(u: torch.Tensor, w: torch.Tensor, bits: int, pin_ends: bool = True, iterations: int = 60,
          init: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Levels (2^bits,) minimizing sum w (u - level(u))^2 over samples u (code units, within [0, 2^bits -
    1]) with weights w (a group's scale^2: the error in the data's own units): Lloyd's iteration, each
    level the weighted mean of its cell. pin_ends: the first and last level stay at 0 and 2^bits - 1, so
    every group's min and max are still represented exactly (the extreme tokens of a channel are the ones
    attention singles out). A cell left empty keeps its level; levels stay strictly ascending."""
    n = 1 << bits
    top = float(n - 1)
    u = u.double().clamp(0, top).flatten()
    w = w.double().flatten()
    lv = (torch.arange(n, dtype=torch.float64) if init is None else init.double().clone())
    for _ in range(iterations):
        mids = (lv[1:] + lv[:-1]) * 0.5
        cell = torch.bucketize(u, mids)  # the count of midpoints below u: encode's rule
        mass = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w)
        moment = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w * u)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), lv)
        if pin_ends:
            new[0], new[-1] = 0.0, top
        lv = new
    lv = lv.float().clamp(0, top)
    for i in range(1, n):  # strictly ascending in float32 (cells never cross, but two may meet)
        if lv[i] <= lv[i - 1]:
            lv[i] = torch.nextafter(lv[i - 1], torch.tensor(math.inf))
    return lv


def _pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@lru_cache(maxsize=None)
def _levels(bits: int) -> tuple[float, ...]:
    # Lloyd's iteration on the density itself: boundaries halfway between levels, each level the mean of
    # N(0, 1) between its boundaries, E[X | a < X < b] = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a))
    n = 1 << bits
    levels = [-3 + 6 * (i + 0.5) / n for i in range(n)]
    for _ in range(500):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        levels = [(_pdf(a) - _pdf(b)) / (_cdf(b) - _cdf(a)) for a, b in zip(edges, edges[1:])]
    return tuple(levels)


def gaussian_levels(bits: int) -> torch.Tensor:
    """The 2^bits Lloyd-Max levels of N(0, 1), ascending, float32 (minimum mean squared error)."""
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"gaussian_levels: bits must be 1, 2, 3, 4 or 8 (got {bits})")
    return torch.tensor(_levels(bits), dtype=torch.float32)


def gaussian_round_trip(x: torch.Tensor, bits: int, meta_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """x (..., D), already rotated -> what the TurboQuant-style store and load give back, float32: each
    row's norm kept in meta_dtype, its direction coded with the Gaussian levels, the row rescaled to the
    kept norm."""
    x = x.float()
    d = x.shape[-1]
    levels = gaussian_levels(bits).to(x.device)
    norm = x.norm(dim=-1, keepdim=True).to(meta_dtype).float()
    unit = x * (math.sqrt(d) / x.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    edges = (levels[1:] + levels[:-1]) / 2
    back = levels[torch.bucketize(unit, edges)]
    return back * (norm / back.norm(dim=-1, keepdim=True).clamp_min(1e-30))


FP8_MAX = 448.0  # e4m3's largest finite value


def fp8_round_trip(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x -> what vLLM's fp8 KV cache (--kv-cache-dtype fp8, e4m3) stores and reads back on CUDA, float32:
    x / scale rounded to the nearest e4m3 value, saturated at +-448, times scale (vLLM's scale is 1
    unless the checkpoint carries calibrated ones). 3 mantissa bits: steps of 2^(e - 3) in
    [2^e, 2^(e + 1)), 2^-9 below 2^-6. (vLLM's CPU kernels truncate instead, csrc/cpu/cpu_attn_fp8.hpp,
    and lose more: docs/measurements.md, "Peers".)"""
    y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).float() * scale
