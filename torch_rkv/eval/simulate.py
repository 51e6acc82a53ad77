"""The simulation protocol: run a transformers model with every attention reading keys and values quantized
the way a scheme's cache stores them, through the library's own ops (KVQuant / QuaRot protocol).

Two views of "quantized":
* "cache" (default): exactly what the QuantizedKVCache holds when the query at position i runs: sinks
  and the newest tokens (recent window, partial block) in full precision, whole blocks quantized. The
  decode protocol (token by token through the real cache and fused kernel) must reproduce it.
* "all": every position quantized, partial blocks included (block stats over the whole block, future
  tokens too): the plain fake-quant protocol of the reference measurements.

Also collects attention fidelity against full precision on the same inputs: cosine of the attention
outputs and recall of the top-8 attended keys, over the last `fidelity_queries` queries of each call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .. import channels, outliers, reference
from ..codebook import fp8_round_trip, gaussian_round_trip
from ..integrations.models import UnsupportedModelFeature, attention_modules, inspect, learned_sinks
from ..ops.hadamard import hadamard, hadamard_signs
from ..ops.quant import dequantize, quantize
from ..ops.rope import rope
from ..reference import quantized_count
from ..scheme import Scheme

ATTENTION = "rkv_simulate"


@dataclass
class Fidelity:
    cosine_sum: float = 0.0
    recall_sum: float = 0.0
    count: int = 0

    def add(self, cos: float, recall: float) -> None:
        self.cosine_sum += cos
        self.recall_sum += recall
        self.count += 1

    @property
    def cosine(self) -> float:
        return self.cosine_sum / max(self.count, 1)

    @property
    def recall(self) -> float:
        return self.recall_sum / max(self.count, 1)


@dataclass
class Simulation:
    """One scheme applied to every attention layer of a model."""

    scheme: Scheme
    rope_cos: Optional[torch.Tensor] = None  # the model's table (positions, rot/2), for pre-RoPE keys
    rope_sin: Optional[torch.Tensor] = None
    rope_interleaved: bool = False  # the model's pairing (interleaved pairs: GPT-J, Cohere; else rotate-half)
    # per layer index, its own (cos, sin) where layers differ (Gemma 3's local and global tables); the
    # others use rope_cos / rope_sin
    layer_rope: Optional[dict] = None
    # per layer index, its own scheme where layers differ (a per-layer bit allocation, allocate.py); the
    # others use `scheme`
    layer_schemes: Optional[dict] = None
    view: str = "cache"
    quantize_keys: bool = True  # False: keys stay in full precision (the "values only" rows)
    quantize_values: bool = True
    kernel: str = "sdpa"  # or "eager": matmul + softmax, like transformers' eager attention
    fidelity_queries: int = 0
    fidelity: Fidelity = field(default_factory=Fidelity)
    # view "cache": keep each layer's last quantized blocks and reuse them when the next call's keys or
    # values start with the same tokens (a cache's blocks never change once full): questions asked of one
    # cached document then quantize only their own new blocks. Holds two copies of every layer's blocks.
    reuse_blocks: bool = False

    def __post_init__(self):
        self._signs: dict[tuple[int, int], torch.Tensor] = {}
        self._blocks: dict[tuple[Optional[int], str], tuple[torch.Tensor, torch.Tensor]] = {}
        if self.reuse_blocks and self.view != "cache":
            raise ValueError(f"Simulation: reuse_blocks needs view 'cache' (got {self.view!r}): 'all' quantizes "
                             "partial blocks, which later tokens change")
        schemes = [self.scheme, *(self.layer_schemes or {}).values()]
        if any(s.pre_rope for s in schemes) and self.rope_cos is None:
            raise ValueError("Simulation: a pre-RoPE scheme needs the model's rope tables")

    def scheme_at(self, layer: Optional[int]) -> Scheme:
        return (self.layer_schemes or {}).get(layer, self.scheme)

    def signs(self, dim: int, side: str, s: Scheme, device) -> torch.Tensor:
        key = (dim, s.hadamard_seed + (0 if side == "k" else 1))
        if key not in self._signs:
            self._signs[key] = hadamard_signs(dim, key[1], device)  # the cache's signs
        return self._signs[key]

    # ------------------------------------------------------------------------------------------
    def quantized_region(self, n: int, s: Scheme) -> tuple[int, int]:
        """[0, end): the tokens whose blocks are quantized for the longest query of n tokens (the sinks
        among them are read in full precision, see quantized_pairs)."""
        if self.view == "all":
            return 0, n
        return 0, quantized_count(n, s.recent, s.block)

    def fake_quantize(self, x: torch.Tensor, side: str, layer: Optional[int] = None) -> torch.Tensor:
        """x (B, H, n, D) in the model's space (of layer `layer`) -> the same tokens after the cache's
        store/load round trip, float32; tokens outside the quantized region unchanged."""
        s = self.scheme_at(layer)
        n, d = x.shape[-2], x.shape[-1]
        lo, hi = self.quantized_region(n, s)
        out = x.float().clone()
        if hi <= lo or not (self.quantize_keys if side == "k" else self.quantize_values):
            return out
        if self.reuse_blocks:
            lo = self._reuse(x, out, side, layer, hi, s.block)
            if lo == hi:
                return out
        part = out[:, :, lo:hi]
        pos = torch.arange(lo, hi, device=x.device)
        cos, sin = (self.layer_rope or {}).get(layer, (self.rope_cos, self.rope_sin))
        if side == "k" and s.pre_rope:
            part = rope(part, cos, sin, pos, self.rope_interleaved, inverse=True)
        rotated = s.k_hadamard if side == "k" else s.v_hadamard
        if rotated:
            part = hadamard(part, self.signs(d, side, s, x.device))
        tokens = getattr(s, f"{side}_block_tokens")
        if self.view == "all" and (hi - lo) % tokens:
            raise ValueError(f"simulation view 'all': {hi - lo} tokens are not whole blocks of {tokens}")
        # the cache's sinks are encoded in block 0 but do not set its ranges (view "all": no sinks)
        back = self.round_trip(part, side, s, layer, sinks=max(0, s.sinks - lo) if self.view == "cache" else 0)
        if rotated:
            back = hadamard(back, self.signs(d, side, s, x.device), inverse=True)
        if side == "k" and s.pre_rope:
            back = rope(back, cos, sin, pos, self.rope_interleaved)
        out[:, :, lo:hi] = back
        if self.reuse_blocks:
            self._blocks[(layer, side)] = (x[:, :, :hi].clone(), out[:, :, :hi].clone())
        return out

    def _reuse(self, x: torch.Tensor, out: torch.Tensor, side: str, layer: Optional[int], hi: int, block: int) -> int:
        """Copies into `out` the blocks of the last call on (layer, side) that x starts with, up to the first
        block holding a different token; returns where quantizing must start (0: nothing reused). Blocks
        are independent (ranges, outliers and the Hadamard are per block or per token), so this is what
        quantizing [0, hi) gives."""
        kept = self._blocks.get((layer, side))
        if kept is None or kept[0].shape[:2] != x.shape[:2] or kept[0].shape[3] != x.shape[3]:
            return 0
        seen, done = kept
        m = min(seen.shape[2], hi)
        differs = (seen[:, :, :m] != x[:, :, :m]).any(-1).any(0).any(0).nonzero()  # NaN differs too
        if len(differs):
            m = block * (int(differs[0]) // block)
        out[:, :, :m] = done[:, :, :m]
        return m

    def round_trip(self, x: torch.Tensor, side: str, s: Scheme, layer: Optional[int] = None,
                   sinks: int = 0) -> torch.Tensor:
        """x (B, H, n, D) in the storage space (pre-RoPE / rotated) of layer `layer`, starting at a block
        boundary -> quantized and dequantized, float32. sinks: x's first rows that are encoded but do not
        set their group's ranges (the cache's sinks)."""
        bits = getattr(s, f"{side}_bits")
        if s.levels == "gaussian":
            return gaussian_round_trip(x, bits, s.meta_dtype)
        if s.levels == "fp8":
            return fp8_round_trip(x)
        group = getattr(s, f"{side}_group_size") or x.shape[-1]
        tokens = getattr(s, f"{side}_block_tokens")
        lv = None if layer is None else s.side_levels(layer, side)
        if lv is None and s.levels == "calibrated":
            raise ValueError(f"Simulation: scheme {s.name} has per-layer levels; round_trip needs the layer")
        args = (bits, group, tokens, getattr(s, f"{side}_symmetric"), s.side_meta_dtype(side),
                getattr(s, f"{side}_clip"))
        if s.outliers:  # the reference quantizer: the kernels' op takes no excluded values (the append does)
            mask = outliers.select(x, s.outliers, s.block, group, tokens, sinks)
            packed, scale, zero = reference.quantize(x, *args, sink_rows=sinks, levels=lv, excluded=mask)
            back = reference.dequantize(packed, scale, None if getattr(s, f"{side}_symmetric") else zero, bits,
                                        levels=lv)
            return outliers.merge(back, x, mask)
        back = dequantize(quantize(x, *args, sinks, lv), torch.float32)
        if side == "k" and s.k_refine:
            if layer is None:
                raise ValueError(f"Simulation: scheme {s.name} refines each layer's own key channels; round_trip "
                                 "needs the layer")
            back = channels.round_trip(x, back, s, layer, sinks)
        return back

    def quantized_pairs(self, q_pos: torch.Tensor, n: int, s: Scheme) -> torch.Tensor:
        """(Nq, n) bool: whether query at position q_pos[i] sees key t in its quantized form."""
        t = torch.arange(n, device=q_pos.device)
        if self.view == "all":
            return torch.ones(len(q_pos), n, dtype=torch.bool, device=q_pos.device)
        visible = q_pos + 1  # the cache holds tokens 0..pos when the query at pos runs
        over = (visible - s.recent).clamp(min=0)
        q_end = s.block * torch.div(over, s.block, rounding_mode="floor")
        return (t[None, :] >= s.sinks) & (t[None, :] < q_end[:, None])

    # ------------------------------------------------------------------------------------------
    def attention(self, query, key, value, scaling: float, attention_mask=None, softcap: float = 0.0,
                  layer: Optional[int] = None) -> torch.Tensor:
        """Causal attention (B, N, Hq, D) of the last N positions, with quantized pairs reading the
        fake-quantized keys and values. Keys are laid out twice, [quantized | full precision], and a
        mask picks one copy per (query, key): one fused SDPA call. attention_mask: the model's mask
        for this layer (bool, True = attend, or additive), honoured on top of causality: a
        sliding-window layer sees its window, a padded position nothing. softcap > 0: Gemma 2's
        soft-capped scores. layer: the layer's index (its RoPE table, layer_rope)."""
        nq, n = query.shape[2], key.shape[2]
        kq, vq = self.fake_quantize(key, "k", layer), self.fake_quantize(value, "v", layer)
        pos = n - nq + torch.arange(nq, device=query.device)
        causal = torch.arange(n, device=query.device)[None, :] <= pos[:, None]
        if attention_mask is not None:
            causal = causal & model_mask(attention_mask, nq, n)
        s = self.scheme_at(layer)
        pairs = self.quantized_pairs(pos, n, s)
        q = query.float()
        # vLLM's fp8 attention reads the queries in fp8 too (FlashAttention on CUDA: Attention.query_quant,
        # scale 1); fidelity measures against q itself
        qa = fp8_round_trip(q) if s.levels == "fp8" else q
        if bool(pairs[causal].all()):  # every visible key is quantized (view "all", per-token caches)
            out = self._attend(qa, kq, vq, causal, scaling, softcap)
        else:
            # queries that see the same quantized range form groups (one per block of queries): one
            # SDPA call per group over keys spliced from both copies; too many groups: keys laid out
            # twice, [quantized | full precision], with a mask choosing one copy per pair
            # every row's quantized range starts at the sinks, so equal counts mean equal rows
            _, counts = torch.unique_consecutive(pairs.sum(dim=1), return_counts=True)
            if len(counts) <= 64:
                out = torch.empty_like(q)
                start = 0
                for count in counts.tolist():
                    row = pairs[start]
                    keys = torch.where(row[:, None], kq, key.float())
                    values = torch.where(row[:, None], vq, value.float())
                    rows = slice(start, start + count)
                    out[:, :, rows] = self._attend(qa[:, :, rows], keys, values, causal[rows], scaling, softcap)
                    start += count
            else:
                keys = torch.cat([kq, key.float()], dim=2)
                values = torch.cat([vq, value.float()], dim=2)
                out = self._attend(qa, keys, values, torch.cat([causal & pairs, causal & ~pairs], dim=1), scaling,
                                   softcap)
        if self.fidelity_queries:
            self._measure(q, key.float(), value.float(), kq, vq, causal, pairs, scaling, out, qa)
        return out.transpose(1, 2).to(query.dtype)

    def _attend(self, q, k, v, mask, scaling, softcap=0.0):
        if self.kernel == "sdpa" and not softcap:  # (SDPA cannot soft-cap)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scores = q @ k.transpose(-1, -2) * scaling
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, -math.inf)
        return torch.softmax(scores, dim=-1) @ v

    def _measure(self, q, kf, vf, kq, vq, causal, pairs, scaling, out, q_read) -> None:
        """Fidelity of the last queries of this call against full precision on the same inputs (q_read:
        the queries as the quantized attention read them)."""
        m = min(self.fidelity_queries, q.shape[2])
        b, hq, _, d = q.shape
        hkv = kf.shape[1]
        qm = q[:, :, -m:].reshape(b, hkv, hq // hkv, m, d)
        qr = q_read[:, :, -m:].reshape(b, hkv, hq // hkv, m, d)
        mask = causal[-m:]
        s_fp = torch.einsum("bhgqd,bhkd->bhgqk", qm, kf) * scaling
        s_read = s_fp if q_read is q else torch.einsum("bhgqd,bhkd->bhgqk", qr, kf) * scaling  # (fp8 queries)
        s_q = torch.where(pairs[-m:], torch.einsum("bhgqd,bhkd->bhgqk", qr, kq) * scaling, s_read)
        p_fp = torch.softmax(s_fp.masked_fill(~mask, -math.inf), dim=-1)
        p_q = torch.softmax(s_q.masked_fill(~mask, -math.inf), dim=-1)
        o_fp = torch.einsum("bhgqk,bhkd->bhgqd", p_fp, vf).reshape(b, hq, m, d)
        cos = F.cosine_similarity(out[:, :, -m:], o_fp, dim=-1).mean().item()
        k = min(8, p_fp.shape[-1])
        top_fp, top_q = p_fp.topk(k, dim=-1).indices, p_q.topk(k, dim=-1).indices
        recall = (top_fp[..., :, None] == top_q[..., None, :]).any(-1).float().mean().item()
        self.fidelity.add(cos, recall)


def simulated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: the module's Simulation, or SDPA when it has none."""
    sim = getattr(module, "rkv_simulation", None)
    if sim is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return sim.attention(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5,
                         attention_mask, kwargs.get("softcap") or 0.0, getattr(module, "rkv_source", None)), None


def model_mask(mask: torch.Tensor, nq: int, n: int) -> torch.Tensor:
    """(nq, n) bool, True = attend, from the model's mask for a layer ((B or 1, 1, nq, n), bool or
    additive); one mask for the whole batch (the protocol's batches share their positions)."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed[..., -nq:, -n:].reshape(-1, nq, n)
    if not bool((allowed == allowed[:1]).all()):
        raise ValueError("simulation: the attention mask differs within the batch (padding); run one sequence "
                         "at a time")
    return allowed[0]


def install(model, simulation: Optional[Simulation]) -> None:
    """Route every attention layer of `model` through `simulation` (None: plain SDPA)."""
    AttentionInterface.register(ATTENTION, simulated_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    modules = attention_modules(model)
    if learned_sinks(modules):  # (SDPA, the plain path, cannot add them either)
        raise UnsupportedModelFeature("torch_rkv: learned attention sinks (GPT-OSS) are not supported in the report's "
                                      "simulations (RKVCache and the quantized cache ops serve them)")
    model.set_attn_implementation(ATTENTION)
    # a KV-shared layer (Gemma 3n) quantizes as the layer whose cache it reads: its keys and values, scheme and
    # levels; each by its model layer's index (a hybrid's attention modules are not its every layer)
    sources = inspect(model).kv_sources if simulation is not None else ()
    for module in modules:
        module.rkv_simulation = simulation
        module.rkv_source = sources[module.layer_idx] if sources else module.layer_idx
