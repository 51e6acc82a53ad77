"""A quantization scheme for the KV cache, named in one line, with presets for the published methods."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from .ops._validate import MAX_REFINED, META_NAMES
from .ops.structs import CacheFormat
from .outliers import outlier_bits
from .reference import REFINE_BITS


@dataclass(frozen=True)
class Scheme:
    """How keys and values are stored.

    A group of k_block_tokens tokens x k_group_size channels shares one scale and zero: per-token keys
    are (1, head_dim), grouped keys (1, g), per-channel keys (T, 1). Values likewise. pre_rope: keys are
    stored before RoPE and rotated inside attention. k_clip / v_clip: each group's range is the
    least-squared-error shrinkage of [min, max] (rkv.quantize's clip; asymmetric only). meta_dtype: the
    scales' and zeros' dtype, k_meta_dtype / v_meta_dtype one side's instead (float8 e4m3 halves a
    group's metadata; inside its range of +-448 the half-step bound holds, beyond it values saturate). k_hadamard / v_hadamard: stored after a random
    Hadamard rotation (keys only post-RoPE). sinks: the first tokens in full precision; recent: at least
    this many newest tokens in full precision (KIVI's residual). levels: "uniform" (a uniform grid in
    each group's range), "calibrated": per-layer, per-side non-uniform code values read from the
    codebook file `codebook` (torch_rkv.codebook; the kernels look codes up in them; asymmetric sides
    below 8 bits), or "gaussian": Lloyd-Max levels of a Gaussian with one norm per token row (the
    TurboQuant-style peer; simulation only, Scheme.check_served), or "fp8": every value an 8-bit float
    (e4m3) with one scale of 1 for the whole tensor, the queries too, as vLLM's own --kv-cache-dtype fp8
    runs without calibrated scales (the report's measure of it; simulation only). outliers: dense-and-sparse, this
    fraction of each block's values of both sides kept as fp16 residuals in a fixed-size side buffer
    (torch_rkv.outliers; the caches, the kernels and the vLLM plugin store them). k_refine: per KV
    head, this many per-channel key channels (the first of the ranking file `channels`) keep their codes
    and add k_refine_bits within each code's cell (torch_rkv.channels; the caches store k_refine_bits 2 to 4).
    """

    name: str = "custom"
    k_bits: int = 4
    v_bits: int = 4
    k_group_size: Optional[int] = None  # None: head_dim
    k_block_tokens: int = 1
    v_group_size: Optional[int] = None
    v_block_tokens: int = 1
    k_symmetric: bool = False
    v_symmetric: bool = False
    k_clip: bool = False
    v_clip: bool = False
    pre_rope: bool = False
    k_hadamard: bool = False
    v_hadamard: bool = False
    hadamard_seed: int = 0
    sinks: int = 0
    recent: int = 0
    meta_dtype: torch.dtype = torch.float16
    k_meta_dtype: Optional[torch.dtype] = None  # None: meta_dtype
    v_meta_dtype: Optional[torch.dtype] = None
    levels: str = "uniform"
    outliers: float = 0.0  # fraction of each block's values kept in fp16 beside the codes (torch_rkv.outliers)
    codebook: Optional[str] = None  # levels="calibrated": the codebook file (torch_rkv.codebook.Codebook)
    k_refine: int = 0  # key channels per KV head refined by k_refine_bits more bits (torch_rkv.channels)
    k_refine_bits: int = 2
    channels: Optional[str] = None  # k_refine > 0: the ranking of each head's key channels (channels.KeyChannels)

    def __post_init__(self):
        for arg in ("k_bits", "v_bits"):
            if getattr(self, arg) not in (2, 3, 4, 8):
                raise ValueError(f"Scheme.{arg} must be 2, 3, 4 or 8 (got {getattr(self, arg)})")
        if self.pre_rope and self.k_hadamard:
            raise ValueError("Scheme: pre_rope and k_hadamard cannot be combined (RoPE does not commute with the "
                             "rotation); use Hadamard on post-RoPE keys or pre-RoPE keys without it")
        for side in ("k", "v"):
            if getattr(self, f"{side}_clip") and getattr(self, f"{side}_symmetric"):
                raise ValueError(f"Scheme: {side}_clip needs asymmetric quantization ({side}_symmetric=False)")
        for arg in ("k_block_tokens", "v_block_tokens"):
            if getattr(self, arg) < 1:
                raise ValueError(f"Scheme.{arg} must be >= 1 (got {getattr(self, arg)})")
        if self.block % self.k_block_tokens or self.block % self.v_block_tokens:
            raise ValueError(f"Scheme: k_block_tokens ({self.k_block_tokens}) and v_block_tokens "
                             f"({self.v_block_tokens}) must divide each other")
        if self.sinks < 0 or self.recent < 0:
            raise ValueError("Scheme: sinks and recent must be >= 0")
        for arg in ("meta_dtype", "k_meta_dtype", "v_meta_dtype"):
            dt = getattr(self, arg)
            if dt not in META_NAMES and not (arg != "meta_dtype" and dt is None):
                raise TypeError(f"Scheme.{arg} must be float16, bfloat16, float32 or float8_e4m3fn (got {dt})")
        if self.levels not in ("uniform", "calibrated", "gaussian", "fp8"):
            raise ValueError(f"Scheme.levels must be 'uniform', 'calibrated', 'gaussian' or 'fp8' (got {self.levels!r})")
        if self.levels == "fp8":
            fixed = {"k_bits": 8, "v_bits": 8, "k_symmetric": True, "v_symmetric": True}
            other = [f.name for f in dataclasses.fields(self) if f.name not in ("name", "levels", "hadamard_seed")
                     and getattr(self, f.name) != fixed.get(f.name, f.default)]
            if other:
                raise ValueError("Scheme: levels='fp8' stores every post-RoPE key and value as an 8-bit float with "
                                 "one scale: 8 symmetric bits on both sides, per token, nothing in full precision "
                                 f"and no metadata options (got {', '.join(other)})")
        if (self.levels == "calibrated") != (self.codebook is not None):
            raise ValueError("Scheme: levels='calibrated' reads its levels from a codebook file: give both, or "
                             f"neither (levels={self.levels!r}, codebook={self.codebook!r})")
        if self.levels == "calibrated":
            for side in ("k", "v"):
                if getattr(self, f"{side}_symmetric") or getattr(self, f"{side}_bits") == 8:
                    raise ValueError(f"Scheme: calibrated levels need asymmetric {side} codes below 8 bits "
                                     f"({side}_symmetric=False, {side}_bits in 2, 3, 4)")
        if not 0.0 <= self.outliers <= 0.1:
            raise ValueError(f"Scheme.outliers must be a fraction in [0, 0.1] (got {self.outliers})")
        if self.outliers and self.levels != "uniform":
            raise ValueError("Scheme: outliers are kept beside uniform codes (levels='uniform')")
        self._check_refine()
        if self.levels == "gaussian" and not (
                self.k_hadamard and self.v_hadamard and self.k_symmetric and self.v_symmetric
                and self.k_group_size is None and self.v_group_size is None and self.block == 1):
            raise ValueError("Scheme: levels='gaussian' codes Hadamard-rotated rows with one norm each: it needs "
                             "k_hadamard, v_hadamard, symmetric per-token groups on both sides")

    def _check_refine(self) -> None:
        if self.k_refine < 0:
            raise ValueError(f"Scheme.k_refine must be >= 0 (got {self.k_refine})")
        if (self.k_refine > 0) != (self.channels is not None):
            raise ValueError("Scheme: k_refine > 0 reads which channels to refine from a ranking file: give both, or "
                             f"neither (k_refine={self.k_refine}, channels={self.channels!r})")
        if not self.k_refine:
            return
        if not 1 <= self.k_refine_bits <= 4:
            raise ValueError(f"Scheme.k_refine_bits must be 1 to 4 (got {self.k_refine_bits})")
        if (self.k_group_size != 1 or self.k_block_tokens == 1 or self.k_symmetric or self.k_bits == 8
                or self.levels != "uniform" or self.outliers or not self.pre_rope or self.k_hadamard):
            raise ValueError("Scheme: k_refine refines per-channel pre-RoPE key codes (the ranking's channels): it "
                             "needs pre_rope, no k_hadamard, k_group_size=1, k_block_tokens > 1, asymmetric uniform "
                             "codes below 8 bits and no outliers")

    @property
    def block(self) -> int:
        """Tokens quantized together when the cache fills a block."""
        return max(self.k_block_tokens, self.v_block_tokens)

    @property
    def format(self) -> CacheFormat:
        """The fields the cache ops take (bits, block, recent window, clipped ranges)."""
        return CacheFormat(self.k_bits, self.v_bits, self.block, self.recent, self.k_clip, self.v_clip)

    def replace(self, **changes) -> "Scheme":
        return dataclasses.replace(self, **changes)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if this scheme cannot store head_dim channels."""
        for side, bits, group, had in (("k", self.k_bits, self.k_group_size, self.k_hadamard),
                                       ("v", self.v_bits, self.v_group_size, self.v_hadamard)):
            g = group or head_dim
            if head_dim % g:
                raise ValueError(f"Scheme {self.name}: {side}_group_size {g} does not divide head_dim {head_dim}")
            if head_dim * bits % 8:
                raise ValueError(f"Scheme {self.name}: head_dim {head_dim} at {bits} bits does not fill whole bytes")
            if had and (head_dim % 2 or head_dim > 8192):
                raise ValueError(f"Scheme {self.name}: Hadamard needs an even head_dim <= 8192 (got {head_dim})")
        if self.k_refine > head_dim:
            raise ValueError(f"Scheme {self.name}: k_refine {self.k_refine} exceeds head_dim {head_dim}")
        if self.outliers and self.block * head_dim > 0xFFFF:  # (include/rkv/outliers.h: kOutlierPositions)
            raise ValueError(f"Scheme {self.name}: outlier positions are 16 bits, so block x head_dim must be <= "
                             f"65535 (got {self.block} x {head_dim}; a smaller block)")

    def check_served(self) -> None:
        """Raise if the caches and kernels cannot store this scheme (the report can still simulate it)."""
        if self.levels == "fp8":
            raise NotImplementedError(f"Scheme {self.name}: fp8 levels are simulated only (the report's measure of "
                                      "vLLM's own cache: serve it with vLLM's --kv-cache-dtype fp8)")
        if self.levels == "gaussian":
            raise NotImplementedError(f"Scheme {self.name}: gaussian levels are simulated only (the report's "
                                      "peer); the cache kernels store codes in each group's range")
        if self.k_refine > MAX_REFINED:
            raise NotImplementedError(f"Scheme {self.name}: the caches refine at most {MAX_REFINED} key channels a "
                                      f"head (got k_refine={self.k_refine})")
        if self.k_refine and (self.k_refine_bits not in REFINE_BITS or self.k_refine * self.k_refine_bits % 8):
            raise NotImplementedError(f"Scheme {self.name}: the caches store refined key channels at k_refine_bits 2, 3 "
                                      f"or 4 in whole bytes a row (got {self.k_refine} channels x {self.k_refine_bits} "
                                      "bits); other widths are simulated only")

    def side_levels(self, layer: int, side: str) -> Optional[torch.Tensor]:
        """The code values side ('k' or 'v') of layer `layer` decodes through, float32 (2^bits,), or None
        (the uniform grid; also for "gaussian" and "fp8", which the simulation applies itself)."""
        if self.levels != "calibrated":
            return None
        from .codebook import load  # noqa: PLC0415  (the file is read once per process)
        return load(self.codebook).levels(layer, side, getattr(self, f"{side}_bits"))

    def side_meta_dtype(self, side: str) -> torch.dtype:
        """The dtype of the scales and zeros of keys ('k') or values ('v')."""
        return getattr(self, f"{side}_meta_dtype") or self.meta_dtype

    def meta_bits(self, head_dim: int, side: str) -> float:
        """Metadata bits per element of keys ('k') or values ('v')."""
        if self.levels == "fp8":
            return 0.0  # one scale for the whole tensor
        group = (self.k_group_size if side == "k" else self.v_group_size) or head_dim
        tokens = self.k_block_tokens if side == "k" else self.v_block_tokens
        symmetric = self.k_symmetric if side == "k" else self.v_symmetric
        per_group = (1 if symmetric else 2) * torch.finfo(self.side_meta_dtype(side)).bits
        return per_group / (group * tokens)

    def bits_parts(self, head_dim: int) -> dict[str, float]:
        """effective_bits' parts, bits per cached element (keys and values): the codes, their metadata and
        the sparse outliers' side buffer."""
        refined = self.k_refine * self.k_refine_bits / head_dim  # (per key element)
        return {"codes": (self.k_bits + refined + self.v_bits) / 2,
                "metadata": (self.meta_bits(head_dim, "k") + self.meta_bits(head_dim, "v")) / 2,
                "outliers": outlier_bits(self.outliers, self.block, head_dim)}

    def effective_bits(self, head_dim: int) -> float:
        """Average bits per cached element (keys and values) including metadata, excluding the
        full-precision sink and recent tokens (their share vanishes as the context grows)."""
        return sum(self.bits_parts(head_dim).values())

    def describe(self, head_dim: int = 128) -> str:
        def side(s):
            bits = getattr(self, f"{s}_bits")
            group = getattr(self, f"{s}_group_size")
            tokens = getattr(self, f"{s}_block_tokens")
            if group == 1 and tokens > 1:
                how = f"per-channel/{tokens}t"
            elif group in (None, head_dim) and tokens == 1:
                how = "per-token"
            else:
                how = f"g{group or head_dim}x{tokens}t"
            extra = ("+sym" if getattr(self, f"{s}_symmetric") else "") + ("+clip" if getattr(self, f"{s}_clip") else "") \
                + ("+H" if getattr(self, f"{s}_hadamard") else "")
            return f"{s.upper()}{bits} {how}{extra}"

        parts = [side("k") + (" pre-RoPE" if self.pre_rope else ""), side("v")]
        if self.levels == "gaussian":
            parts.append("gaussian Lloyd-Max levels + norm")
        elif self.levels == "fp8":  # (nothing else applies: validated above)
            parts = ["Q, K and V fp8 e4m3, one scale of 1 per tensor (vLLM's --kv-cache-dtype fp8)"]
        elif self.levels == "calibrated":
            parts.append("calibrated levels")
        if self.k_refine:
            parts.append(f"{self.k_refine} key channels {self.k_refine_bits} bits finer")
        if self.outliers:
            parts.append(f"{self.outliers:.1%} outliers in fp16")
        if self.sinks:
            parts.append(f"sinks {self.sinks}")
        if self.recent:
            parts.append(f"recent {self.recent}")
        if self.levels != "fp8":
            k_meta, v_meta = (META_NAMES[self.side_meta_dtype(side)] for side in "kv")
            parts.append(f"meta {k_meta}" if k_meta == v_meta else f"meta K {k_meta} V {v_meta}")
        return f"{self.name}: " + ", ".join(parts) + f" = {self.effective_bits(head_dim):.2f} bits/elem at d={head_dim}"

    def __str__(self) -> str:
        return self.describe()


# ------------------------------------------------------------------------------------------------
# Presets: the published methods, as this library stores them
# ------------------------------------------------------------------------------------------------


def per_token(bits: int = 4) -> Scheme:
    """The baseline: one scale per token for post-RoPE keys and for values."""
    return Scheme(name=f"per-token-{bits}", k_bits=bits, v_bits=bits)


def kivi(bits: int = 2, block: int = 32, group: int = 32, recent: int = 128) -> Scheme:
    """KIVI (arXiv 2402.02750): per-channel post-RoPE keys in blocks of 32 tokens, per-token values in
    groups of 32 channels, the newest 128 tokens in full precision."""
    return Scheme(name=f"kivi-{bits}", k_bits=bits, v_bits=bits, k_group_size=1, k_block_tokens=block,
                  v_group_size=group, recent=recent)


def kvquant(bits: int = 3, block: int = 128) -> Scheme:
    """KVQuant-style (arXiv 2401.18079) without calibration: pre-RoPE per-channel keys, per-token values,
    the first token in full precision."""
    return Scheme(name=f"kvquant-{bits}", k_bits=bits, v_bits=bits, k_group_size=1, k_block_tokens=block,
                  pre_rope=True, sinks=1)


def quarot(bits: int = 4) -> Scheme:
    """QuaRot-style (arXiv 2404.00456): random Hadamard rotation, then per-token keys and values."""
    return Scheme(name=f"quarot-{bits}", k_bits=bits, v_bits=bits, k_hadamard=True, v_hadamard=True)


def turboquant(bits: int = 4) -> Scheme:
    """TurboQuant-style (vLLM's TurboQuant presets; arXiv 2504.19874): a random Hadamard rotation, then
    every coordinate of a token's keys and values coded with the Lloyd-Max levels of a Gaussian and one
    fp16 norm per row, rescaled to that norm when read (bits + 16 / head_dim per element). Nothing kept in
    full precision. Simulated only (torch_rkv.codebook)."""
    return Scheme(name=f"turboquant-{bits}", k_bits=bits, v_bits=bits, k_symmetric=True, v_symmetric=True,
                  k_hadamard=True, v_hadamard=True, levels="gaussian")


def vllm_fp8() -> Scheme:
    """vLLM's own fp8 KV cache (--kv-cache-dtype fp8) as it runs on CUDA without calibrated scales:
    post-RoPE keys and values rounded to float8 e4m3 with a scale of 1 (8 bits per element, nothing in
    full precision), and the queries too (FlashAttention reads fp8 queries beside an fp8 cache:
    vLLM's Attention.query_quant). Simulated only (codebook.fp8_round_trip); plan --vllm counts its
    capacity."""
    return Scheme(name="vllm-fp8", k_bits=8, v_bits=8, k_symmetric=True, v_symmetric=True, levels="fp8")


def recommended(bits: int = 4) -> Scheme:
    """The library's default: pre-RoPE per-channel keys (blocks of 128 tokens; at 2 bits with clipped
    ranges), Hadamard-rotated per-token values, the first 4 tokens and the newest 64 (128 at 2 bits) in
    full precision. Chosen from docs/measurements.md: recent tokens and sinks help most,
    values need as much care as keys, pre-RoPE per-channel keys beat every other key layout, and at 2
    bits a least-squares key range cuts the perplexity loss 4x (at 3 and 4 bits it gains nothing and
    costs attention fidelity)."""
    return Scheme(name=f"rkv-{bits}", k_bits=bits, v_bits=bits, k_group_size=1, k_block_tokens=128,
                  k_clip=bits == 2, pre_rope=True, v_hadamard=True, sinks=4, recent=64 if bits >= 3 else 128)


def recommended_mixed(v_bits: int = 2) -> Scheme:
    """Keys one step above values (K3/V2, K4/V3): at low bits the keys, not the values, limit quality,
    and per-channel key metadata is cheap, so a bit spent on keys buys the most."""
    if v_bits not in (2, 3, 4):
        raise ValueError(f"recommended_mixed: v_bits must be 2, 3 or 4 (got {v_bits})")
    k_bits = {2: 3, 3: 4, 4: 8}[v_bits]
    base = recommended(v_bits)
    return base.replace(name=f"rkv-k{k_bits}v{v_bits}", k_bits=k_bits, k_clip=False)


SPARSE_FRACTION = 0.005  # rkv-sparse-<bits>: the share of each block's values kept as sparse outliers


def recommended_sparse(bits: int = 2, fraction: float = SPARSE_FRACTION) -> Scheme:
    """rkv with dense-and-sparse outliers (KVQuant): each 128-token block keeps 0.5% of its values, those
    whose removal shrinks their groups' ranges most, as fp16 residuals beside the codes
    (torch_rkv.outliers, docs/format.md "Sparse outliers"). The caches, kernels and vLLM plugin serve
    it."""
    return sparse(recommended(bits), fraction).replace(name=f"rkv-sparse-{bits}")


def sparse(s: Scheme, fraction: float = SPARSE_FRACTION) -> Scheme:
    """s with rkv-sparse's outliers (named s.name+sparse)."""
    return s.replace(name=f"{s.name}+sparse", outliers=fraction)


def refined(s: Scheme, count: int, channels: str, extra: int = 2) -> Scheme:
    """s with `count` key channels per KV head refined by `extra` bits, the first of the ranking file
    `channels` (torch_rkv.channels; named s.name+<count>); s itself when count is 0."""
    if not count:
        return s
    return s.replace(name=f"{s.name}+{count}", k_refine=count, k_refine_bits=extra, channels=channels)


LEAN_META = torch.float8_e4m3fn  # rkv-lean-<bits>: the values' scales and zeros


def recommended_lean(bits: int = 2) -> Scheme:
    """rkv with the values' scales and zeros in float8 e4m3 (NVFP4 keeps its scales so): a per-token value
    group's metadata drops from 32 to 16 bits, 0.125 bits per element at head_dim 64. Keys keep float16:
    a pre-RoPE key channel sits far from zero, where e4m3's 3 mantissa bits widen its range. Values must
    stay within +-448, e4m3's range, to keep the half-step bound; beyond it they saturate."""
    return lean(recommended(bits)).replace(name=f"rkv-lean-{bits}")


def lean(s: Scheme) -> Scheme:
    """s with rkv-lean's value metadata (named s.name+lean)."""
    return s.replace(name=f"{s.name}+lean", v_meta_dtype=LEAN_META)


SERVED_PRESETS = {"per-token": per_token, "kivi": kivi, "kvquant": kvquant, "quarot": quarot, "rkv": recommended,
                  "rkv-mixed": recommended_mixed, "rkv-sparse": recommended_sparse, "rkv-lean": recommended_lean}  # the caches and kernels store these
# and the report also simulates these
PRESETS = {**SERVED_PRESETS, "turboquant": turboquant}


def per_layer(scheme: Scheme | Sequence[Scheme], layers: int, owner: str, layers_named: str) -> list[Scheme]:
    """One scheme per layer, as a cache takes them: `scheme` for every layer, or the list (a per-layer
    allocation), which must hold one per layer (ValueError from `owner`, the layers named as
    `layers_named`, otherwise)."""
    schemes = [scheme] * layers if isinstance(scheme, Scheme) else list(scheme)
    if len(schemes) != layers:
        raise ValueError(f"{owner}: scheme lists {len(schemes)} schemes for {layers_named}")
    return schemes


NAMED = {"vllm-fp8": vllm_fp8}  # schemes of one width, by their whole name (simulated)


def by_name(spec: str) -> Scheme:
    """A preset from its name as the CLI and the report write it: "rkv-3", "kivi-2", "rkv-mixed-2"; or
    one of NAMED ("vllm-fp8")."""
    if spec in NAMED:
        return NAMED[spec]()
    family, _, bits = spec.rpartition("-")
    if not family or not bits.isdigit():
        raise ValueError(f"scheme {spec!r} is not <preset>-<bits>, e.g. rkv-3, nor one of {sorted(NAMED)}; presets: "
                         f"{sorted(PRESETS)}")
    return preset(family, int(bits))


def preset(name: str, bits: int) -> Scheme:
    if name not in PRESETS:
        raise ValueError(f"unknown scheme preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](bits)
