"""`python -m torch_rkv report`: measured quality of every KV-cache scheme on a real model and real text.

1. reproduction of the reference fake-quant measurements (every position quantized, fp32 metadata);
2. the schemes as served (cache view, fp16 metadata): perplexity, its change, effective bits, and
   attention fidelity (output cosine, top-8 recall) against full precision; and at 8 bits vLLM's own
   fp8 cache beside rkv-8;
3. localization: the penalty rate of Article k in long documents, several depths and lengths;
4. the decode protocol: token by token through the real cache and fused kernel, against the
   simulation on the same window (the proof that the served path is the measured one);
5. per-layer bit allocation: a sensitivity profile measured on a calibration text (lcet10.txt, cached),
   the allocation the knapsack picks at each target, measured here like the schemes;
6. --full: peers when installed (transformers' QuantizedCache, quanto and HQQ, token by token on that
   window), perplexity at 8192 tokens, 24 needles a length, and the ranking on a second text
   (asyoulik.txt, 8 windows of 2048 tokens on each text);
7. plots (PNG) and every number in --json. Progress and an ETA on the terminal as it runs.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from .. import scheme as S
from ..allocate import Allocation, Sensitivity, allocate_average, allocate_split
from ..reference import full_precision_count
from ..scheme import Scheme
from . import data, levels, localization, perplexity, plots, sensitivity
from .progress import Progress, decode_units, forward_units
from .simulate import Simulation, install

# the reference points of the fake-quant protocol (SmolLM2-135M-Instruct, alice29, 2048 tokens, fp 19.874)
REFERENCE = {
    "post-RoPE per-token": {4: 23.08, 3: 40.08, 2: 500.5},
    "post-RoPE per-channel": {4: 20.55, 3: 23.59, 2: 76.2},
    "pre-RoPE per-channel": {4: 20.17, 3: 22.85, 2: 45.4},
    "Hadamard + per-token": {4: 21.64, 3: 27.98, 2: 167.1},
    "keys full precision, values only": {4: 20.22, 3: 20.73, 2: 26.23},
}
TOLERANCE = {4: 0.02, 3: 0.02, 2: 0.05}


def reference_scheme(row: str, bits: int) -> tuple[Scheme, bool]:
    """(scheme, quantize_keys) of a reference row: values per-token (group 64 = head_dim of the model),
    per-channel blocks of 128 tokens, asymmetric, fp32 metadata."""
    base = dict(name=row, k_bits=bits, v_bits=bits, meta_dtype=torch.float32)
    extra = {
        "post-RoPE per-token": {},
        "post-RoPE per-channel": dict(k_group_size=1, k_block_tokens=128),
        "pre-RoPE per-channel": dict(k_group_size=1, k_block_tokens=128, pre_rope=True),
        "Hadamard + per-token": dict(k_hadamard=True),
        "keys full precision, values only": {},
    }[row]
    return Scheme(**base, **extra), row != "keys full precision, values only"


FAMILIES = {  # name -> bits -> scheme (None: no such row)
    "per-token (baseline)": S.per_token,
    "grouped g32": lambda b: Scheme(name=f"grouped32-{b}", k_bits=b, v_bits=b, k_group_size=32, v_group_size=32),
    "KIVI (per-channel post-RoPE)": S.kivi,
    "KVQuant-style (pre-RoPE per-channel)": S.kvquant,
    "QuaRot-style (Hadamard)": S.quarot,
    "rkv (recommended)": S.recommended,
    "rkv mixed (K one step above V)": lambda b: S.recommended_mixed(b) if b in (2, 3) else None,
    "TurboQuant-style (Hadamard + Lloyd-Max + norm)": S.turboquant,
    "rkv + 0.5% sparse outliers": S.recommended_sparse,
    # per-layer codebooks fitted on the calibration text: the report resolves them (Report.family_scheme)
    "rkv + calibrated levels": lambda b: None,
}
CALIBRATED_LEVELS = "rkv + calibrated levels"


FULL_FAMILIES = tuple(FAMILIES)
DEFAULT_FAMILIES = tuple(f for f in FAMILIES if f not in ("grouped g32", "rkv + 0.5% sparse outliers",
                                                          CALIBRATED_LEVELS))
ALLOCATED = "rkv-alloc-"  # the report's name of a per-layer allocation: rkv-alloc-<average code bits>
SPLIT = "rkv-split-"  # every layer the same key + value bits, split by the profile (pages of one size)
SPARSE_ALLOCATED = "rkv-sparse-alloc-"  # rkv-alloc-<bits> with rkv-sparse's outliers in every layer
PER_LAYER = (ALLOCATED, SPLIT, SPARSE_ALLOCATED)  # names that layer_schemes resolves through the profile
FULL = "full precision"  # the rows' name of the unquantized model
SECOND = "second text: "  # Report.token_nll's prefix for the second text's rows
NON_UNIFORM = "rkv-nu-"  # rkv-<bits> with the model's calibrated levels (torch_rkv.eval.levels)


@dataclass
class Options:
    tokens: int = 2048
    bits: tuple = (4, 3, 2)
    families: tuple = DEFAULT_FAMILIES
    noise: bool = False  # rows off their reference are rerun with eager attention: how much the kernel moves them
    loc_lengths: tuple = (1024, 2048)  # (--full: to 8192; 6 needles a length are a smoke test, 24 measure)
    loc_schemes: tuple = ("per-token-3", "rkv-3", "rkv-2")
    loc_documents: int = 1  # per length, 6 needles each (--full: 4, 24 needles a length; 3.5 minutes a scheme)
    long_tokens: int = 0  # > 0 (--full): a long-context perplexity row at this many tokens
    long_schemes: tuple = ("rkv-4", "rkv-3", "rkv-2", "turboquant-4")
    decode_tokens: int = 384  # long enough that every decode scheme quantizes a block
    decode_schemes: tuple = ("rkv-4", "kivi-2")  # pre-RoPE and post-RoPE keys (--full: more)
    chunk_sizes: tuple = (256,)  # chunked prefill over the whole text, served through RKVCache (--full: 1024 too)
    chunk_schemes: tuple = ("rkv-4", "rkv-3", "rkv-2")
    alloc_levels: tuple = (2, 3, 4)  # per-layer allocation: widths to choose among, and average code bits
    alloc_targets: tuple = (2.5, 3.0)
    split_targets: tuple = (3.0,)  # allocate_split: average code bits (multiples of 0.5)
    alloc_tokens: int = sensitivity.CALIBRATION_TOKENS  # of the calibration text
    second_text: str = ""  # --full: asyoulik.txt, the same schemes ranked on a text the calibration never saw
    # windows of `tokens` tokens per text the second-text check scores (the first text's first is the
    # schemes table's). One window of 2048 tokens leaves a 1% loss about as uncertain as the loss itself
    # (--full: 8, 16384 tokens a text)
    second_windows: int = 1
    second_schemes: tuple = ("rkv-4", "rkv-3", "rkv-mixed-2", "rkv-2")
    # at 8 bits: vLLM's own fp8 cache (its default, scale 1) beside rkv-8, measured like the schemes
    eight_bits: tuple = ("vllm-fp8", "rkv-8")
    peers: bool = False
    out_dir: str = "out/report"
    timings: dict = field(default_factory=dict)

    @classmethod
    def full(cls) -> "Options":
        """The heavy rows too: perplexity at 8192 tokens (SmolLM2's window, where the full-precision
        tokens cost little), localization at 8192 with 24 needles a length, the eager reruns, the grouped
        family, more localization and decode schemes, the peers and the second text."""
        return cls(long_tokens=8192, loc_lengths=(1024, 2048, 4096, 8192), loc_documents=4, noise=True,
                   families=FULL_FAMILIES,
                   # one scheme near each of 4.4, 3.4 and 2.4 bits (docs/guide.md, localization); half the run
                   loc_schemes=("rkv-4", "rkv-sparse-alloc-2.5", "rkv-2"),
                   decode_schemes=("rkv-4", "rkv-3", "rkv-2", "kivi-2", "rkv-alloc-2.5", "rkv-sparse-2",
                                   "rkv-sparse-alloc-2.5"),
                   # rkv-sparse-alloc-2.2: the 2-bit frontier's best row (docs/guide.md, "The 2.4-bit goal")
                   long_schemes=("rkv-4", "rkv-3", "rkv-2", "rkv-alloc-2.5", "rkv-sparse-alloc-2.5", "rkv-sparse-3",
                                 "rkv-sparse-2", "rkv-sparse-alloc-2.2", "turboquant-4"),
                   alloc_targets=(2.5, 3.0, 3.5), split_targets=(3.0, 3.5), chunk_sizes=(256, 1024),
                   second_text="asyoulik.txt", second_windows=8, peers=True)

    def named_schemes(self) -> tuple:
        """Every scheme a row names beside the families' (localization, long context, decode, chunks, second text)."""
        return self.loc_schemes + self.long_schemes + self.decode_schemes + self.chunk_schemes + self.second_schemes

    def uses_profile(self) -> bool:
        """Whether a row needs the model's per-layer sensitivity profile (an allocation, a split)."""
        return bool(self.alloc_targets or self.split_targets
                    or any(name.startswith(PER_LAYER) for name in self.named_schemes()))

    def per_layer(self) -> bool:
        """Whether a row measures or fits every layer's own cache: the profile's rows and the calibrated levels."""
        return self.uses_profile() or CALIBRATED_LEVELS in self.families or \
            any(name.startswith(NON_UNIFORM) for name in self.named_schemes())

    def without_per_layer(self) -> "Options":
        """These options less the per_layer rows (for a model whose layers do not all keep a KV cache)."""
        def uniform(names):
            return tuple(n for n in names if not n.startswith(PER_LAYER + (NON_UNIFORM,)))

        return replace(self, alloc_targets=(), split_targets=(),
                       families=tuple(f for f in self.families if f != CALIBRATED_LEVELS),
                       **{k: uniform(getattr(self, k)) for k in ("loc_schemes", "long_schemes", "decode_schemes",
                                                                  "chunk_schemes", "second_schemes")})

    def without_chunks(self) -> "Options":
        """These options less the rows that put several tokens over a filled cache (localization, chunks)."""
        return replace(self, loc_lengths=(), chunk_sizes=())

    def unrunnable(self, attention) -> list:
        """(refusal, the options without those rows) for each group of rows the model of `attention` (its
        models.ModelAttention) cannot run: the per-layer rows of a model some of whose layers keep no KV cache
        of their own; the rows that put several tokens over a recurrent state its mixer would drop (Jamba's)."""
        from ..integrations import models

        def per_layer():
            models.refuse_cacheless_layers(attention, "the report's per-layer rows (alloc_targets, split_targets, "
                                                      "calibrated levels)")

        def chunks():  # (each question, each chunk: several tokens over the cache)
            models.refuse_chunks_over_state(attention.model_type, "the report's localization and chunked prefill "
                                                                  "rows (loc_lengths, chunk_sizes)")

        checks = ((self.per_layer(), Options.without_per_layer, per_layer),
                  (self.loc_lengths or self.chunk_sizes, Options.without_chunks, chunks))
        out = []
        for wanted, without, refuse in checks:
            try:
                if wanted:
                    refuse()
            except models.UnsupportedModelFeature as e:
                out.append((e, without))
        return out

    @classmethod
    def quick(cls) -> "Options":
        return cls(tokens=1024, bits=(4, 2), families=("per-token (baseline)", "KIVI (per-channel post-RoPE)",
                                                      "QuaRot-style (Hadamard)", "rkv (recommended)",
                                                      "TurboQuant-style (Hadamard + Lloyd-Max + norm)"),
                   noise=False, loc_lengths=(1024,), loc_schemes=("per-token-2", "rkv-2"), loc_documents=1,
                   decode_tokens=96,
                   decode_schemes=("per-token-4",), chunk_sizes=(256,), chunk_schemes=("rkv-2",), peers=False)


def bits_parts_at(scheme: Scheme, head_dim: int, tokens: int) -> dict[str, float]:
    """effective_bits_at's parts, bits per element of the whole cache: the quantized tokens' codes, their
    metadata and their sparse outliers' side buffer (Scheme.bits_parts), and the full-precision sinks,
    recent window and partial block at 16 bits (an fp16 cache). What the format spends beside the codes is
    all but "codes"."""
    fp = full_precision_count(tokens, scheme.sinks, scheme.recent, scheme.block)
    share = (tokens - fp) / tokens
    return {**{k: share * v for k, v in scheme.bits_parts(head_dim).items()}, "full_precision": fp * 16 / tokens}


def effective_bits_at(scheme: Scheme, head_dim: int, tokens: int) -> float:
    """Bits per element at `tokens` tokens, counting the full-precision sinks, recent window and partial
    block at 16 bits (an fp16 cache), as a cache of that length holds them."""
    return sum(bits_parts_at(scheme, head_dim, tokens).values())


class Report:
    def __init__(self, model, tok, text: str, opts: Options, log=print):
        self.model, self.tok, self.opts, self.log = model, tok, opts, log
        from ..integrations import models

        self.attention = models.inspect(model)  # an unsupported model feature stops here, named
        # rows the model cannot run are refused before any row runs, rather than an hour into the run (main
        # leaves them out, and says so)
        for refusal, _ in opts.unrunnable(self.attention)[:1]:
            raise refusal
        self.head_dim = self.attention.head_dim
        self.text = text
        all_ids = data.encode(tok, text)
        if all_ids.shape[1] < opts.tokens:
            raise data.MissingMaterial(f"the text has {all_ids.shape[1]} tokens, fewer than --tokens {opts.tokens}")
        self.ids = all_ids[:, : opts.tokens]
        if opts.second_windows < 1:
            raise ValueError(f"Options.second_windows must be >= 1 (got {opts.second_windows})")
        if opts.second_text:  # both texts' windows, checked before a long run rather than after it
            second = data.encode(tok, data.read_text(str(data.text_path(opts.second_text))))
            self.windows = {"": self.text_windows(all_ids, "the text"),
                            SECOND: self.text_windows(second, opts.second_text)}
        positions = max([opts.tokens, opts.long_tokens, opts.decode_tokens + 8] + [n + 64 for n in opts.loc_lengths])
        self.long_ids = all_ids[:, : opts.long_tokens]
        if opts.long_tokens and all_ids.shape[1] < opts.long_tokens:
            raise data.MissingMaterial(f"the text has {all_ids.shape[1]} tokens, fewer than {opts.long_tokens}")
        # each layer's RoPE table (Gemma 3: local and global ones), for the simulations and the key plot
        self.layer_rope = models.layer_rope_tables(model, positions)
        self.simulation = sensitivity.simulations_for(model, positions, self.layer_rope)
        self.results: dict = {}
        # name -> each token's loss, one tensor per window scored (_simulated's keep)
        self.token_nll: dict[str, list[torch.Tensor]] = {}
        self.token_kl: dict[str, list[torch.Tensor]] = {}  # name -> each position's KL from full precision (the same)
        # text prefix ("" or SECOND) -> full precision's on the window being scored
        self.fp_logprobs: dict[str, torch.Tensor] = {}
        self._profile: Sensitivity | None = None
        self.progress = Progress(self.planned_work())
        self.log = lambda line: log(f"{self.progress.prefix()} {line}")

    def text_windows(self, ids: torch.Tensor, name: str) -> list[torch.Tensor]:
        """The second-text check's windows of a text: its first second_windows runs of `tokens` tokens."""
        n, w = self.opts.tokens, self.opts.second_windows
        if ids.shape[1] < n * w:
            raise data.MissingMaterial(f"{name} has {ids.shape[1]} tokens, fewer than second_windows {w} x --tokens {n}")
        return [ids[:, i * n : (i + 1) * n] for i in range(w)]

    def _simulated(self, ids, sim, keep: str | None = None) -> float:
        """Perplexity of ids under sim; keep: also append each token's loss under that name (the main
        text's rows, for the second text's intervals) and, with a second text, each position's KL from
        full precision (whose log-probabilities the FULL row of each window keeps, scored before the
        window's other rows: 0.4 GB at 2048 tokens)."""
        logprobs = perplexity.simulated_logprobs(self.model, ids, sim)
        self.progress.advance(forward_units(ids.shape[1]))
        if keep is not None:
            self.token_nll.setdefault(keep, []).append(perplexity.token_nll(logprobs, ids))
            text = SECOND if keep.startswith(SECOND) else ""
            if keep == text + FULL and self.opts.second_text:
                self.fp_logprobs[text] = logprobs
            elif text in self.fp_logprobs:
                self.token_kl.setdefault(keep, []).append(perplexity.token_kl(self.fp_logprobs[text], logprobs))
        return perplexity.perplexity_of(logprobs, ids)

    def _decoded(self, ids, make) -> float:
        out = perplexity.decoded(self.model, ids, make)
        self.progress.advance(decode_units(ids.shape[1]))
        return out

    def _chunked(self, ids, make, chunk) -> float:
        out = perplexity.chunked(self.model, ids, make, chunk)
        self.progress.advance(forward_units(ids.shape[1]))
        return out

    def planned_work(self) -> float:
        """The whole run in progress units, from the options (the eager reruns, which depend on results,
        excepted)."""
        o = self.opts
        fwd, n = forward_units, o.tokens
        rows = sum(FAMILIES[f](b) is not None or f == CALIBRATED_LEVELS for f in o.families for b in o.bits)
        levels = tuple(o.alloc_levels)
        stored = sensitivity.stored_profile(self.model, levels, sensitivity.CALIBRATION_TEXT, o.alloc_tokens)
        cached = stored is not None and stored.covers(levels)
        calibration = 0 if cached or not o.uses_profile() else \
            (len(levels) - 1) * (2 * self.attention.layers + 1) * fwd(o.alloc_tokens)
        loc_docs = sum(fwd(length + 64) * o.loc_documents for length in o.loc_lengths)
        work = [fwd(n),
                len(REFERENCE) * len(o.bits) * fwd(n) if n % 128 == 0 else 0,
                (rows + len(o.eight_bits)) * fwd(n),
                calibration + len(self.allocated_names()) * fwd(n),
                # both texts' windows but the first text's first, each with full precision and every row
                (2 * o.second_windows - 1) * (1 + len(o.second_schemes) + len(self.allocated_names())) * fwd(n)
                if o.second_text else 0,
                (1 + len(o.long_schemes)) * fwd(o.long_tokens) if o.long_tokens else 0,
                (1 + len(o.loc_schemes)) * loc_docs,
                (1 + len(o.decode_schemes)) * fwd(o.decode_tokens) +
                len(o.decode_schemes) * decode_units(o.decode_tokens),
                len(o.chunk_schemes) * (len(o.chunk_sizes) + 1) * fwd(n),
                3 * decode_units(o.decode_tokens) if o.peers else 0,
                fwd(min(512, n))]  # the plots' key capture
        return sum(work)

    def _timed(self, name, fn):
        start = time.time()
        out = fn()
        self.opts.timings[name] = round(time.time() - start, 1)
        return out

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        o = self.opts
        r = self.results
        r["full_precision_ppl"] = self._timed("full precision", lambda: self._simulated(self.ids, None, FULL))
        self.log(f"full precision perplexity on {o.tokens} tokens: {r['full_precision_ppl']:.3f}")
        r["reproduction"] = self._timed("reproduction", self.reproduction)
        r["schemes"] = self._timed("schemes", self.schemes)
        r["eight_bits"] = self._timed("8 bits", self.eight_bit_rows)
        r["long_context"] = self._timed("long context", self.long_context) if o.long_tokens else []
        r["allocation"] = self._timed("allocation", self.allocation) if self.allocated_names() else []
        r["second_text"] = self._timed("second text", self.second_text) if o.second_text else []
        r["localization"] = self._timed("localization", self.localization) if o.loc_lengths else []
        r["decode_protocol"] = self._timed("decode protocol", self.decode_protocol)
        r["chunked_prefill"] = self._timed("chunked prefill", self.chunked_prefill) if o.chunk_sizes else []
        r["peers"] = self._timed("peers", self.peers) if o.peers else []
        r["plots"] = self._timed("plots", self.plots)
        return r

    def reproduction(self) -> list[dict]:
        rows = []
        if self.opts.tokens % 128:
            self.log("reproduction skipped: --tokens must be a multiple of 128 for per-channel blocks")
            return rows
        for row, ref in REFERENCE.items():
            for bits in self.opts.bits:
                scheme, keys = reference_scheme(row, bits)
                sim = self.simulation(scheme, view="all", quantize_keys=keys)
                ppl = self._simulated(self.ids, sim)
                rec = {"row": row, "bits": bits, "ppl": ppl, "reference": ref[bits] if self.opts.tokens == 2048 else None}
                if rec["reference"]:
                    rec["deviation"] = ppl / rec["reference"] - 1
                    rec["within_tolerance"] = abs(rec["deviation"]) <= TOLERANCE[bits]
                    if self.opts.noise and not rec["within_tolerance"]:
                        # the same quantization with another, equally exact attention kernel: low-bit
                        # perplexity amplifies fp32 rounding differences, this shows by how much
                        rec["ppl_eager"] = self._simulated(self.ids, self.simulation(
                            scheme, view="all", quantize_keys=keys, kernel="eager"))
                rows.append(rec)
                self.log(f"  reproduction {row:34s} {bits}b  ppl {ppl:8.3f}" +
                         (f"  reference {rec['reference']:7.2f} ({rec['deviation']:+.1%})" if rec["reference"] else ""))
        return rows

    def schemes(self) -> list[dict]:
        return [self.scheme_row(family, bits, scheme) for family in self.opts.families for bits in self.opts.bits
                if (scheme := self.family_scheme(family, bits)) is not None]

    def eight_bit_rows(self) -> list[dict]:
        """The eight_bits schemes (vLLM's own fp8 cache, rkv-8), rows like the schemes table's."""
        return [self.scheme_row("8 bits", 8, S.by_name(name)) for name in self.opts.eight_bits]

    def scheme_row(self, family: str, bits: int, scheme: Scheme) -> dict:
        """One scheme on the text: perplexity, its change, bits, and attention fidelity."""
        fp = self.results["full_precision_ppl"]
        sim = self.simulation(scheme, fidelity_queries=64)
        ppl = self._simulated(self.ids, sim, scheme.name)
        row = {"family": family, "scheme": scheme.name, "description": scheme.describe(self.head_dim),
               "bits": bits, "ppl": ppl, "delta": ppl - fp, "bits_per_element": scheme.effective_bits(self.head_dim),
               "bits_at_window": effective_bits_at(scheme, self.head_dim, self.opts.tokens),
               "attention_cosine": sim.fidelity.cosine, "top8_recall": sim.fidelity.recall}
        self.log(f"  {scheme.name:14s} ppl {ppl:8.3f} ({ppl - fp:+7.3f})  {row['bits_per_element']:.2f} "
                 f"bits  cos {sim.fidelity.cosine:.4f}  top8 {sim.fidelity.recall:.3f}")
        return row

    def profile(self) -> Sensitivity:
        """The model's sensitivity profile on the calibration text (measured on first use, then cached)."""
        if self._profile is None:
            o = self.opts

            def step(base, layer, layers):
                self.progress.advance(2 * forward_units(o.alloc_tokens))
                if layer % 10 == 0 or layer == layers:
                    self.log(f"  sensitivity on the calibration text, from {base} bits: layer {layer}/{layers}")

            self._profile = sensitivity.load_or_measure(self.model, self.tok, tuple(o.alloc_levels),
                                                        tokens=o.alloc_tokens, progress=step)
        return self._profile

    def family_scheme(self, family: str, bits: int) -> Scheme | None:
        """The schemes table's row of `family` at `bits` (None: no such row)."""
        if family == CALIBRATED_LEVELS:
            return self.calibrated_levels(bits)
        return FAMILIES[family](bits)

    def calibrated_levels(self, bits: int) -> Scheme:
        """rkv-<bits> with this model's per-layer codebook fitted on the calibration text (calibrated on
        first use, then cached)."""
        path = levels.load_or_calibrate(self.model, self.tok, tokens=self.opts.alloc_tokens)
        return levels.calibrated(bits, path)

    def layer_schemes(self, name: str) -> list[Scheme]:
        """A scheme as the report names it -> one per layer: a preset ("rkv-3", "rkv-mixed-2") in every
        layer, "rkv-alloc-<bits>", the per-layer allocation at that average code bits,
        "rkv-sparse-alloc-<bits>", that allocation with sparse outliers (rkv-sparse's share) in every layer,
        or "rkv-nu-<bits>", rkv with the model's calibrated levels."""
        if name.startswith((ALLOCATED, SPLIT)):
            return self.allocation_named(name).schemes()
        if name.startswith(SPARSE_ALLOCATED):
            return [s.replace(name=f"{s.name}+sparse", outliers=S.SPARSE_FRACTION)
                    for s in self.allocation_named(ALLOCATED + name[len(SPARSE_ALLOCATED):]).schemes()]
        if name.startswith(NON_UNIFORM):
            return [self.calibrated_levels(int(name[len(NON_UNIFORM):]))] * self.attention.layers
        return [S.by_name(name)] * self.attention.layers

    def simulation_of(self, schemes: list[Scheme], **options) -> Simulation:
        if len(set(schemes)) == 1:
            return self.simulation(schemes[0], **options)
        return self.simulation(schemes[0], layer_schemes=dict(enumerate(schemes)), **options)

    def bits_at(self, schemes: list[Scheme], tokens: int) -> float:
        """effective_bits_at, averaged over the layers."""
        return sum(self.bits_parts_at(schemes, tokens).values())

    def bits_parts_at(self, schemes: list[Scheme], tokens: int) -> dict[str, float]:
        """bits_parts_at, each part averaged over the layers."""
        parts = [bits_parts_at(s, self.head_dim, tokens) for s in schemes]
        return {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}

    def allocated_names(self) -> list[str]:
        """The allocation rows: rkv-alloc-<bits> and rkv-split-<bits> at each target."""
        o = self.opts
        return [f"{ALLOCATED}{t:g}" for t in o.alloc_targets] + [f"{SPLIT}{t:g}" for t in o.split_targets]

    def allocation_named(self, name: str) -> Allocation:
        """rkv-alloc-<bits>: allocate_average; rkv-split-<bits>: allocate_split (on the profile)."""
        if name.startswith(SPLIT):
            return allocate_split(self.profile(), float(name[len(SPLIT):]))
        return allocate_average(self.profile(), float(name[len(ALLOCATED):]))

    def allocation(self) -> list[dict]:
        """Per-layer K/V bits (torch_rkv.allocate) at each target average, from the model's sensitivity on
        the calibration text (measured once, cached), measured on this text like the schemes: beside
        the uniform schemes of the same bits (the schemes table), is the allocation worth its bits? The
        split rows keep every layer's key + value bits equal (pages of one size)."""
        profile = self.profile()
        fp = self.results["full_precision_ppl"]
        rows = []
        for name in self.allocated_names():
            alloc = self.allocation_named(name)
            target = float(name.rsplit("-", 1)[1])
            schemes = alloc.schemes()
            sim = self.simulation_of(schemes, fidelity_queries=64)
            ppl = self._simulated(self.ids, sim, name)
            rows.append({"scheme": name, "target_bits": target, "bits": alloc.bits,
                         "allocation": alloc.describe(), "predicted_kl": alloc.predicted, "ppl": ppl,
                         "delta": ppl - fp, "bits_per_element": alloc.effective_bits(self.head_dim),
                         "bits_at_window": self.bits_at(schemes, self.opts.tokens), "attention_cosine": sim.fidelity.cosine,
                         "top8_recall": sim.fidelity.recall,
                         "calibration": f"{profile.tokens} tokens of {profile.text}"})
            self.log(f"  {name} ppl {ppl:8.3f} ({ppl - fp:+7.3f})  "
                     f"{rows[-1]['bits_per_element']:.2f} bits  top8 {sim.fidelity.recall:.3f}  "
                     f"K/V bits by layer {alloc.describe()}")
        return rows

    def second_text(self) -> list[dict]:
        """The schemes and the allocations (calibrated on lcet10.txt) ranked on a second text: the same
        order, and relative losses within 1.5x of the first text's, say nothing was tuned to one text.
        Both texts are scored on second_windows windows of `tokens` tokens (the first text's first one is
        the schemes table's). Each relative loss carries its 95% block-bootstrap interval
        (perplexity.relative_loss_samples; each text its own draws), and the ratio of the two texts'
        losses one from those draws."""
        o = self.opts
        names = {}  # the schemes table's name (the token losses' key) -> one scheme per layer
        for name in list(o.second_schemes) + self.allocated_names():
            schemes = self.layer_schemes(name)
            names[name if name.startswith(PER_LAYER) else schemes[0].name] = schemes
        first = [name for name in names if name in self.token_nll]  # rows the first text's table has
        for text, rows in (("", first), (SECOND, list(names))):
            for i, ids in enumerate(self.windows[text]):
                if text == "" and i == 0:
                    continue  # scored by the schemes and allocation tables
                self._simulated(ids, None, text + FULL)
                for name in rows:
                    ppl = self._simulated(ids, self.simulation_of(names[name]), text + name)
                    self.log(f"  {o.second_text if text else 'first text'} window {i + 1}/{o.second_windows} "
                             f"{name:14s} ppl {ppl:8.3f}")
        self.fp_logprobs.clear()  # 0.4 GB a text at 2048 tokens, not needed past here
        fp = self.tokens_of(self.token_nll, SECOND + FULL).mean().exp().item()
        out = [{"scheme": FULL, "text": o.second_text, "ppl": fp, "relative": 0.0, "first_relative": 0.0,
                "tokens": o.tokens * o.second_windows}]
        for name in names:
            out.append({"scheme": name, "text": o.second_text, "tokens": o.tokens * o.second_windows,
                        "ppl": self.tokens_of(self.token_nll, SECOND + name).mean().exp().item(),
                        "relative": self.relative(SECOND + name),
                        "first_relative": self.relative(name) if name in first else None,
                        **self.loss_intervals(name)})
            self.log(f"  {o.second_text} {name:14s} {out[-1]['relative']:+.2%} ({o.second_windows} x {o.tokens} "
                     "tokens)")
        return out

    @staticmethod
    def tokens_of(kept: dict, name: str) -> torch.Tensor:
        """Every window's per-token values kept under `name`, in one tensor."""
        return torch.cat(kept[name])

    def relative(self, name: str) -> float:
        """The relative perplexity change of the row kept as `name` over the windows it was scored on."""
        full = (SECOND if name.startswith(SECOND) else "") + FULL
        return (self.tokens_of(self.token_nll, name).mean() - self.tokens_of(self.token_nll, full).mean()).exp().item() - 1

    def loss_intervals(self, name: str) -> dict:
        """95% intervals of `name`'s relative loss on each text and of their ratio (first / second), from
        the kept token losses, and the same for its mean KL from full precision; none where a text is
        too short for two runs of 128 tokens, or the first text has no such row."""
        nll, kl = self.token_nll, self.token_kl
        if name not in nll or self.tokens_of(nll, FULL).numel() <= 128:
            return {}

        def intervals(measure: str, second: torch.Tensor, first: torch.Tensor) -> dict:
            return {f"{measure}_interval": perplexity.interval(second),
                    f"first_{measure}_interval": perplexity.interval(first),
                    f"{measure}_ratio_interval": perplexity.ratio_interval(first, second)}

        cat = self.tokens_of
        # independent texts, independent draws (seeds 1 and 0)
        out = intervals("relative",
                        perplexity.relative_loss_samples(cat(nll, SECOND + name), cat(nll, SECOND + FULL), seed=1),
                        perplexity.relative_loss_samples(cat(nll, name), cat(nll, FULL), seed=0))
        if name in kl and SECOND + name in kl:
            second_kl, first_kl = cat(kl, SECOND + name), cat(kl, name)
            out.update(kl=second_kl.mean().item(), first_kl=first_kl.mean().item(),
                       **intervals("kl", perplexity.block_means(second_kl, seed=1),
                                   perplexity.block_means(first_kl, seed=0)))
        return out

    def long_context(self) -> list[dict]:
        """Perplexity at long_tokens (--full): where sinks, recent window and open block are a small share,
        so the bits at the window approach the scheme's own. Each row also splits its bits at the window
        into codes, metadata, outliers and full-precision tokens, and measures attention fidelity over the
        window's last 64 queries (the schemes table's measure, at this length)."""
        n = self.opts.long_tokens
        fp = self._simulated(self.long_ids, None)
        rows = [{"scheme": FULL, "tokens": n, "ppl": fp, "delta": 0.0, "bits_at_window": 16.0,
                 "bits_parts": {"full_precision": 16.0}, "attention_cosine": 1.0, "top8_recall": 1.0}]
        self.log(f"  long context: full precision perplexity on {n} tokens {fp:.3f}")
        for name in self.opts.long_schemes:
            schemes = self.layer_schemes(name)
            sim = self.simulation_of(schemes, fidelity_queries=64)
            ppl = self._simulated(self.long_ids, sim)
            parts = self.bits_parts_at(schemes, n)
            rows.append({"scheme": name, "tokens": n, "ppl": ppl, "delta": ppl - fp,
                         "bits_at_window": sum(parts.values()), "bits_parts": parts,
                         "attention_cosine": sim.fidelity.cosine, "top8_recall": sim.fidelity.recall})
            self.log(f"  long context {name:20s} ppl {ppl:8.3f} ({ppl - fp:+.3f}) at {rows[-1]['bits_at_window']:.2f} "
                     f"bits at the window  top8 {sim.fidelity.recall:.3f}")
        return rows

    def localization(self) -> list[dict]:
        rows = []
        docs = [d for n in self.opts.loc_lengths
                for d in localization.build_documents(self.tok, self.text, n, self.opts.loc_documents)]
        for name in (FULL,) + tuple(self.opts.loc_schemes):
            # every question re-reads its document's blocks: quantize them once
            sim = None if name == FULL else self.simulation_of(self.layer_schemes(name), reuse_blocks=True)
            for doc in docs:
                for rec in localization.evaluate(self.model, self.tok, doc, sim):
                    rows.append({"scheme": name, **rec})
                self.progress.advance(forward_units(doc.ids.shape[1]))
            mine = [x for x in rows if x["scheme"] == name]
            self.log(f"  localization {name:16s} exact {sum(x['exact'] for x in mine)}/{len(mine)}  "
                     f"mean log p {sum(x['logprob'] for x in mine) / len(mine):.2f}")
        return rows

    def decode_protocol(self) -> list[dict]:
        from ..integrations.transformers import RKVCache

        ids = self.ids[:, : self.opts.decode_tokens]
        self.results["decode_window_full_precision_ppl"] = self._simulated(ids, None)
        rows = []
        for name in self.opts.decode_schemes:
            schemes = self.layer_schemes(name)
            scheme = schemes[0]  # (an allocation's layers share their sinks, window and block)
            sim = self._simulated(ids, self.simulation_of(schemes))
            served = self._decoded(ids, lambda n: RKVCache(self.model, schemes, capacity=n))
            quantized = ids.shape[1] - full_precision_count(ids.shape[1], scheme.sinks, scheme.recent, scheme.block)
            rows.append({"scheme": name, "tokens": ids.shape[1], "quantized_tokens": quantized, "simulated_ppl": sim,
                         "decoded_ppl": served, "relative_difference": served / sim - 1})
            self.log(f"  decode protocol {name:20s} simulated {sim:.4f}  token-by-token {served:.4f} "
                     f"({served / sim - 1:+.2e}), {quantized} tokens quantized at the end" +
                     ("" if quantized else ": NOTHING QUANTIZED, not a check"))
        return rows

    def chunked_prefill(self) -> list[dict]:
        """The text fed in chunks through RKVCache (rkv::paged_prefill_attention for every chunk after the
        first): the quality a server delivers when it ingests a long prompt in chunks, against the
        token-by-token figure of the same scheme (the schemes table). Goal: at most that plus 10% of it."""
        from ..integrations.transformers import RKVCache

        fp = self.results["full_precision_ppl"]
        token_by_token = {x["scheme"]: x["delta"] for x in self.results.get("schemes", [])}
        rows = []
        for name in self.opts.chunk_schemes:
            schemes = self.layer_schemes(name)
            if name not in token_by_token:
                token_by_token[name] = self._simulated(self.ids, self.simulation_of(schemes)) - fp
            for chunk in self.opts.chunk_sizes:
                ppl = self._chunked(self.ids, lambda n: RKVCache(self.model, schemes, capacity=n), chunk)
                tbt = token_by_token[name]
                rows.append({"scheme": name, "chunk": chunk, "ppl": ppl, "delta": ppl - fp, "token_by_token": tbt,
                             "within_goal": ppl - fp <= tbt + 0.1 * abs(tbt)})
                self.log(f"  chunked prefill {name:8s} chunks of {chunk:5d}: ppl {ppl:.3f} ({ppl - fp:+.3f}), token by "
                         f"token {tbt:+.3f}")
        return rows

    def peers(self) -> list[dict]:
        try:
            from transformers import QuantizedCache
        except ImportError:
            return []
        ids = self.ids[:, : self.opts.decode_tokens]
        rows = []
        for backend, module, bits in (("quanto", "optimum.quanto", 4), ("quanto", "optimum.quanto", 2),
                                      ("hqq", "hqq", 4)):
            try:
                __import__(module)
            except ImportError:
                self.log(f"  peer QuantizedCache[{backend}] skipped: pip install {module.split('.')[-1]}")
                continue

            def make(n, b=backend, k=bits):
                self.model.set_attn_implementation("sdpa")
                return QuantizedCache(backend=b, config=self.model.config, nbits=k)

            try:
                ppl = self._decoded(ids, make)
            except Exception as e:  # a peer's own limitation, reported rather than fatal
                self.log(f"  peer QuantizedCache[{backend},{bits}b] failed: {type(e).__name__}: {e}")
                rows.append({"peer": f"QuantizedCache[{backend},{bits}b]", "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append({"peer": f"QuantizedCache[{backend},{bits}b]", "tokens": ids.shape[1], "decoded_ppl": ppl})
            self.log(f"  peer QuantizedCache[{backend},{bits}b] token-by-token ppl {ppl:.4f}")
        return rows

    def plots(self) -> dict:
        out = plots.ensure_dir(self.opts.out_dir)
        paths = {}
        if self.results["schemes"]:
            paths["ppl_vs_bits"] = plots.ppl_vs_bits(self.results["schemes"], self.results["full_precision_ppl"],
                                                     os.path.join(out, "ppl_vs_bits.png"))
        if self.results["localization"]:
            paths["localization"] = plots.localization_vs_length(self.results["localization"],
                                                                 os.path.join(out, "localization.png"))
        paths["key_magnitudes"] = plots.key_magnitudes(self.capture_keys(), os.path.join(out, "key_magnitudes.png"))
        return paths

    @torch.no_grad()
    def capture_keys(self, layers=(0, None, -1)) -> dict:
        """Pre- and post-RoPE keys of KV head 0 for the first, middle and last attention layer (full precision)."""
        att = self.attention  # (a hybrid's attention layers alone hold keys)
        attending = [i for i in range(att.layers) if att.attends(i)]
        chosen = sorted({attending[len(attending) // 2 if i is None else i] for i in layers})
        store = {}

        exact = Simulation(S.per_token(8), quantize_keys=False, quantize_values=False)  # the model's own attention

        class Capture:
            def __init__(self, idx):
                self.idx = idx

            def attention(self, query, key, value, *args, **kwargs):  # Simulation.attention's arguments
                store[self.idx] = key[0, 0].float().clone()
                return exact.attention(query, key, value, *args, **kwargs)

        install(self.model, None)
        for i, module in enumerate(self.attention.modules):
            if module is not None:
                module.rkv_simulation = Capture(i) if i in chosen else None
        n = min(512, self.ids.shape[1])
        self.model(self.ids[:, :n])
        install(self.model, None)
        from ..ops.rope import rope

        pos = torch.arange(n)
        return {i: (rope(store[i], *self.layer_rope[i], pos, self.attention.interleaved, inverse=True), store[i])
                for i in chosen}


# ----------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------


def format_second_text(second: list[dict]) -> str:
    """The second text's tables, relative perplexity change and then mean KL from full precision: each
    on both texts with its 95% interval, their ratio, and the issue's two checks (same ranking; every
    value within 1.5x of the other text's), judged on the measured values and, for the 1.5x, also on
    whether the ratio's interval overlaps [1/1.5, 1.5] (consistent with the bar) or lies inside it."""
    rows = [x for x in second if x["scheme"] != FULL]
    lines = [(f"\nA second text ({rows[0]['text']}, full precision {second[0]['ppl']:.3f}; {second[0]['tokens']} "
              "tokens a text): relative perplexity change [95% block-bootstrap interval, runs of 128 tokens] beside "
              "the first text's, and their ratio (first / second)")]
    lines += second_text_table(rows, "relative", lambda v: f"{v:+.2%}")
    if any("kl" in x for x in rows):
        lines.append("\nThe same rows' mean KL divergence from full precision's next-token distribution (nats per "
                     "token; it does not depend on which token came next, so it varies less between texts)")
        lines += second_text_table([x for x in rows if "kl" in x], "kl", lambda v: f"{v:.4f}")
    return "\n".join(lines)


def second_text_table(rows: list[dict], measure: str, fmt) -> list[str]:
    """format_second_text's table of one measure, whose row keys (Report.loss_intervals) are <measure>
    and first_<measure> (the value on each text), <measure>_interval, first_<measure>_interval and
    <measure>_ratio_interval; fmt prints one value."""
    value, first_value = measure, f"first_{measure}"
    iv, first_iv, ratio_iv = f"{measure}_interval", f"first_{measure}_interval", f"{measure}_ratio_interval"

    def span(bounds):
        return f"[{fmt(bounds[0])},{fmt(bounds[1])}]" if bounds else ""

    lines = [f"{'scheme':20s} {'second text':>28s} {'first text':>28s}  ratio"]
    for x in rows:
        first = x[first_value]
        cells = f"{x['scheme']:20s} {fmt(x[value]):>8s} {span(x.get(iv)):>19s}"
        if first is not None:
            ratio = x.get(ratio_iv)
            cells += (f" {fmt(first):>8s} {span(x.get(first_iv)):>19s}  "
                      + (f"{first / x[value]:.2f}" if x[value] > 0 else "-")
                      + (f" [{ratio[0]:.2f},{ratio[1]:.2f}]" if ratio else
                         " [second text's interval reaches 0]" if iv in x else ""))
        lines.append(cells)
    known = [x for x in rows if x[first_value] is not None]
    same = [x["scheme"] for x in sorted(known, key=lambda x: x[value])] == \
        [x["scheme"] for x in sorted(known, key=lambda x: x[first_value])]
    # a row lost nothing on both texts (every token in full precision) says nothing either way; a loss on
    # one text and a gain or nothing on the other is as far from 1.5x as can be
    within = all(0 < min(a, b) and max(a, b) <= 1.5 * min(a, b)
                 for a, b in ((x[value], x[first_value]) for x in known) if a != 0 or b != 0)
    verdict = (f"same ranking: {'yes' if same else 'NO'}; every value within 1.5x of the first text's: "
               f"{'yes' if within else 'NO'}")
    bounded = [x for x in known if x.get(ratio_iv)]
    if bounded:
        # overlapping the band: consistent with the bar; inside it: the bar shown to hold
        apart = [x["scheme"] for x in bounded if x[ratio_iv][1] < 1 / 1.5 or x[ratio_iv][0] > 1.5]
        inside = sum(1 / 1.5 <= x[ratio_iv][0] and x[ratio_iv][1] <= 1.5 for x in bounded)
        verdict += (f"; ratio intervals overlapping [0.67, 1.5]: {len(bounded) - len(apart)} of {len(bounded)}"
                    + (f" (not: {', '.join(apart)})" if apart else "") + f", inside it: {inside}")
    elif any(iv in x for x in known):
        verdict += "; no ratio is bounded (every second-text interval reaches 0)"
    return lines + [verdict]


def format_long_context(rows: list[dict]) -> str:
    """The long-context rows: bits at the window and what they are spent on, perplexity, top-8 recall."""
    lines = [f"\nLong context ({rows[0]['tokens']} tokens; bits at the window = codes + metadata + outliers + the "
             "full-precision sinks, recent window and open block at 16 bits)",
             f"{'scheme':22s} {'bits':>5s} {'codes':>6s} {'meta':>5s} {'outl':>5s} {'fp16':>5s} {'ppl':>9s} "
             f"{'delta':>8s} {'top-8':>6s}"]
    for x in rows:
        parts = x["bits_parts"]
        cells = " ".join(f"{parts.get(k, 0.0):{w}.2f}" for k, w in
                         (("codes", 6), ("metadata", 5), ("outliers", 5), ("full_precision", 5)))
        lines.append(f"{x['scheme']:22s} {x['bits_at_window']:5.2f} {cells} {x['ppl']:9.3f} {x['delta']:+8.3f} "
                     f"{x['top8_recall']:6.3f}")
    return "\n".join(lines)


def format_localization(results: list[dict]) -> str:
    """The localization table: per scheme and length, exact answers with their 95% Wilson interval, mean
    log p(right rate) and its change from full precision."""
    lines = [("Localization (penalty rate of Article k): exact answers with their 95% Wilson interval, "
              "mean log p(right rate) and its change from full precision (nats)")]
    lengths = sorted({x["length"] for x in results})
    lines.append(f"{'scheme':16s} " + " ".join(f"{n:>30d}" for n in lengths))
    mean = lambda xs: sum(x["logprob"] for x in xs) / len(xs)  # noqa: E731
    rows = lambda name, n: [x for x in results if x["scheme"] == name and x["length"] == n]  # noqa: E731
    for name in dict.fromkeys(x["scheme"] for x in results):
        cells = []
        for n in lengths:
            xs, fp = rows(name, n), rows(FULL, n)
            k = sum(x["exact"] for x in xs)
            lo, hi = localization.wilson(k, len(xs))
            cells.append(f"{k:2d}/{len(xs)} [{lo:.2f},{hi:.2f}] {mean(xs):6.2f} {mean(xs) - mean(fp):+5.2f}")
        lines.append(f"{name:16s} " + " ".join(f"{c:>30s}" for c in cells))
    return "\n".join(lines)


def format_tables(r: dict) -> str:
    lines = [f"\nfull precision perplexity: {r['full_precision_ppl']:.3f}"]
    if r["reproduction"]:
        lines.append("\nReproduction of the reference fake-quant protocol (every position quantized, fp32 metadata)")
        lines.append(f"{'keys':34s} {'bits':>4s} {'ppl':>9s} {'reference':>9s} {'dev':>7s} {'ok':>3s} "
                     f"{'eager attention (rows off the reference)':>9s}")
        for x in r["reproduction"]:
            ref = x.get("reference")
            line = (f"{x['row']:34s} {x['bits']:4d} {x['ppl']:9.3f} " +
                    (f"{ref:9.2f} {x['deviation']:+7.1%} {'yes' if x['within_tolerance'] else 'NO':>3s}" if ref
                     else f"{'-':>9s} {'-':>7s} {'-':>3s}"))
            if "ppl_eager" in x:
                line += f" {x['ppl_eager']:9.3f} ({x['ppl_eager'] / x['reference'] - 1:+.1%})"
            lines.append(line)
    lines.append("\nSchemes as served (cache view, fp16 metadata)")
    lines.append(f"{'scheme':14s} {'bits/el':>7s} {'@window':>7s} {'ppl':>9s} {'delta':>8s} {'cos':>7s} {'top8':>6s}  layout")

    def measured(x, layout=None):  # a row of the schemes table (and of the allocations below it)
        if layout is None:  # the scheme's, as its description names it
            layout = x["description"].split(": ", 1)[1].split(" = ")[0]
        return (f"{x['scheme']:14s} {x['bits_per_element']:7.2f} {x['bits_at_window']:7.2f} {x['ppl']:9.3f} "
                f"{x['delta']:+8.3f} {x['attention_cosine']:7.4f} {x['top8_recall']:6.3f}  {layout}")

    lines += [measured(x) for x in r["schemes"]]
    if r.get("eight_bits"):
        lines.append("\nAt 8 bits: vLLM's own fp8 cache as it runs without calibrated scales (--kv-cache-dtype fp8)")
        lines += [measured(x) for x in r["eight_bits"]]
    if r.get("allocation"):
        lines.append(f"\nPer-layer allocation (K/V bits by layer, solved on the sensitivity measured on "
                     f"{r['allocation'][0]['calibration']}; rkv's layout at every layer; rkv-split: every layer the same "
                     "key + value bits, pages of one size)")
        for x in r["allocation"]:
            lines.append(measured(x, x["allocation"]))
    if r.get("second_text"):
        lines.append(format_second_text(r["second_text"]))
    if r.get("long_context"):
        lines.append(format_long_context(r["long_context"]))
    if r["localization"]:
        lines.append("\n" + format_localization(r["localization"]))
    if r["decode_protocol"]:
        lines.append("\nDecode protocol (token by token through the real cache and fused kernel) vs simulation; "
                     f"full precision on this window: {r['decode_window_full_precision_ppl']:.4f}")
        for x in r["decode_protocol"]:
            lines.append(f"{x['scheme']:20s} {x['tokens']:5d} tokens ({x['quantized_tokens']:4d} quantized at the end)  "
                         f"simulated {x['simulated_ppl']:9.4f}  decoded {x['decoded_ppl']:9.4f}  "
                         f"({x['relative_difference']:+.2e})")
    if r.get("chunked_prefill"):
        lines.append("\nChunked prefill (the text fed in chunks through RKVCache; later chunks read the quantized "
                     "cache, themselves in full precision) against token by token")
        lines.append(f"{'scheme':10s} {'chunk':>6s} {'ppl':>9s} {'delta':>8s} {'token by token':>15s} "
                     f"{'goal (+10%)':>11s}")
        for x in r["chunked_prefill"]:
            lines.append(f"{x['scheme']:10s} {x['chunk']:6d} {x['ppl']:9.3f} {x['delta']:+8.3f} "
                         f"{x['token_by_token']:+15.3f} {'met' if x['within_goal'] else 'NOT MET':>11s}")
    for x in r.get("peers", []):
        lines.append(f"peer {x['peer']:26s} " + (f"decoded ppl {x['decoded_ppl']:9.4f} on {x['tokens']} tokens"
                                                  if "decoded_ppl" in x else x["error"]))
    return "\n".join(lines)


def main(args) -> int:
    opts = Options.quick() if args.quick else Options.full() if getattr(args, "full", False) else Options()
    if args.tokens:
        opts.tokens = args.tokens
    opts.out_dir = args.out
    start = time.time()
    try:
        model, tok = data.load_model(args.model, args.gguf)
        text = data.read_text(args.text)
    except data.MissingMaterial as e:
        print(f"torch_rkv report: {e}", file=sys.stderr)
        return 2
    if opts.long_tokens > model.config.max_position_embeddings:  # the long row at the model's own window
        opts.long_tokens = model.config.max_position_embeddings
        opts.loc_lengths = tuple(min(n, opts.long_tokens) for n in opts.loc_lengths)
    if opts.tokens > model.config.max_position_embeddings:
        print(f"torch_rkv report: --tokens {opts.tokens} exceeds the model's {model.config.max_position_embeddings}",
              file=sys.stderr)
        return 2
    # rows a model cannot run are left out, each named, and the others run (Options.unrunnable)
    from ..integrations import models

    left_out = []
    for refusal, without in opts.unrunnable(models.inspect(model)):
        opts = without(opts)
        left_out.append(f"left out: {refusal}")
        print(f"torch_rkv report: {left_out[-1]}", flush=True)
    torch.manual_seed(0)
    report = Report(model, tok, text, opts, log=lambda s: print(s, flush=True))
    results = report.run()
    if left_out:
        results["left_out"] = left_out
    results["options"] = {k: v for k, v in asdict(opts).items() if k != "timings"}
    results["timings_s"] = {**opts.timings, "total": round(time.time() - start, 1)}
    results["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "threads": torch.get_num_threads()}
    print(format_tables(results))
    if left_out:
        print("\n" + "\n".join(left_out))
    print(f"\nplots: {', '.join(results['plots'].values())}")
    print(f"total {results['timings_s']['total']:.0f} s: " +
          ", ".join(f"{k} {v:.0f} s" for k, v in opts.timings.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"json: {args.json}")
    return 0
