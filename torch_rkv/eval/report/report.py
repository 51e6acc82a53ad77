"""The report on one model and text: what its sections share (the token ids, the simulations, the
sensitivity profile, the kept token losses, the progress) and the run of its plan."""

from __future__ import annotations

import dataclasses
import time

import torch

from ... import scheme as S
from ...allocate import Allocation, Sensitivity, allocate_average, allocate_edges, allocate_split
from ...scheme import Scheme
from .. import channels, data, levels, perplexity, sensitivity
from ..progress import Progress, decode_units, forward_units
from ..simulate import Simulation
from .bits import bits_parts_at
from .decode import DecodeProtocol
from .families import CALIBRATED_LEVELS, FAMILIES
from .localization import Localization
from .long_context import LongContext
from .losses import TokenLosses
from .names import ALLOCATION, CALIBRATED, EDGE_ALLOCATION, FIRST, LAYOUTS, SECOND, SPLIT_ALLOCATION, RowName, TextRow
from .options import Options
from .plan import SECTIONS, Plan
from .schemes import Schemes


class Report:
    """The measured rows of `opts` on a model and a text. run() runs the planned sections in order;
    log receives each progress line."""

    def __init__(self, model, tok, text: str, opts: Options, log=print):
        self.model, self.tok, self.opts, self.log = model, tok, opts, log
        from ...integrations import models

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
            self.windows = {FIRST: self.text_windows(all_ids, "the text"),
                            SECOND: self.text_windows(second, opts.second_text)}
        positions = max([opts.tokens, opts.long_tokens, opts.decode_tokens + 8] + [n + 64 for n in opts.loc_lengths])
        self.long_ids = all_ids[:, : opts.long_tokens]
        if opts.long_tokens and all_ids.shape[1] < opts.long_tokens:
            raise data.MissingMaterial(f"the text has {all_ids.shape[1]} tokens, fewer than {opts.long_tokens}")
        # each layer's RoPE table (Gemma 3: local and global ones), for the simulations and the key plot
        self.layer_rope = models.layer_rope_tables(model, positions)
        self.simulation = sensitivity.simulations_for(model, positions, self.layer_rope)
        self.results: dict = {}
        self.losses = TokenLosses()
        self._profile: Sensitivity | None = None
        self.plan = Plan.of(self)
        self.progress = Progress(self.plan.cost)
        self.log = lambda line: log(f"{self.progress.prefix()} {line}")

    def text_windows(self, ids: torch.Tensor, name: str) -> list[torch.Tensor]:
        """The second-text check's windows of a text: its first second_windows runs of `tokens` tokens."""
        n, w = self.opts.tokens, self.opts.second_windows
        if ids.shape[1] < n * w:
            raise data.MissingMaterial(f"{name} has {ids.shape[1]} tokens, fewer than second_windows {w} x --tokens {n}")
        return [ids[:, i * n : (i + 1) * n] for i in range(w)]

    # Measuring, each call advancing the progress by its cost.

    def _logprobs(self, ids, sim) -> torch.Tensor:
        """Each next token's log-probabilities over ids under sim (perplexity.simulated_logprobs)."""
        logprobs = perplexity.simulated_logprobs(self.model, ids, sim)
        self.progress.advance(forward_units(ids.shape[1]))
        return logprobs

    def _simulated(self, ids, sim, keep: TextRow | None = None) -> float:
        """Perplexity of ids under sim; keep: also keep each token's loss under that row (TokenLosses.keep;
        the first text's rows, for the second text's intervals)."""
        logprobs = self._logprobs(ids, sim)
        if keep is not None:
            self.losses.keep(keep, logprobs, ids, reference=bool(self.opts.second_text))
        return perplexity.perplexity_of(logprobs, ids)

    def _decoded(self, ids, make) -> float:
        out = perplexity.decoded(self.model, ids, make)
        self.progress.advance(decode_units(ids.shape[1]))
        return out

    def _chunked(self, ids, make, chunk) -> float:
        out = perplexity.chunked(self.model, ids, make, chunk)
        self.progress.advance(forward_units(ids.shape[1]))
        return out

    # The run.

    def run(self) -> dict:
        """Every section in order: each section of the plan runs and is timed, each other leaves an empty list."""
        planned = self.plan.sections
        for section in SECTIONS:
            self.results[section.key] = self._timed(section) if section in planned else []
        return self.results

    def _timed(self, section):
        """Run a section, its seconds kept in the options' timings under its name."""
        start = time.time()
        out = section.run(self)
        self.opts.timings[section.timing] = round(time.time() - start, 1)
        return out

    def schemes(self) -> list[dict]:
        """The schemes table alone."""
        return Schemes().run(self)

    def long_context(self) -> list[dict]:
        """The long-context rows alone (scripts/long_context.py)."""
        return LongContext().run(self)

    def localization(self) -> list[dict]:
        """The localization rows alone (scripts/localization.py)."""
        return Localization().run(self)

    def decode_protocol(self) -> list[dict]:
        """The decode protocol's rows alone."""
        return DecodeProtocol().run(self)

    # Resolving the rows' schemes.

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

    def profile_cost(self) -> float:
        """Measuring the sensitivity profile in progress units: none when it is stored for these widths."""
        o, widths = self.opts, tuple(self.opts.alloc_levels)
        stored = sensitivity.stored_profile(self.model, widths, sensitivity.CALIBRATION_TEXT, o.alloc_tokens)
        if stored is not None and stored.covers(widths):
            return 0
        return (len(widths) - 1) * (2 * self.attention.layers + 1) * forward_units(o.alloc_tokens)

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

    def key_channels(self):
        """The path of this model's key-channel ranking on the calibration text (calibrated on first use,
        then cached: torch_rkv.eval.channels)."""
        return channels.load_or_calibrate(self.model, self.tok)

    def layer_schemes(self, name: RowName | str) -> list[Scheme]:
        """A row's scheme for each layer; name: a RowName or the string it renders to. A preset ("rkv-3",
        "rkv-mixed-2") in every layer; rkv-alloc-<bits>, the per-layer allocation at that average code
        bits, and rkv-split-<bits> the split one; rkv-sparse-alloc-<bits>, that allocation with sparse
        outliers (rkv-sparse's share) in every layer, rkv-lean-alloc-<bits> with rkv-lean's value
        metadata, rkv-lean-sparse-alloc-<bits> with both; rkv-edge-alloc-<bits>, the first and last
        layers at 8 bits and the rest allocated; rkv-nu-<bits>, rkv with the model's calibrated levels. Any
        of them +<m>: m key channels per KV head refined (key_channels)."""
        row = name if isinstance(name, RowName) else RowName.parse(name)
        if row.refine:
            plain = self.layer_schemes(dataclasses.replace(row, refine=0))
            return [S.refined(s, row.refine, str(self.key_channels())) for s in plain]
        if row.kind in (ALLOCATION, SPLIT_ALLOCATION, EDGE_ALLOCATION):
            return self.allocation_of(row).schemes()
        if row.kind in LAYOUTS:
            return self.allocation_of(RowName.allocation(row.bits)).with_layout(**LAYOUTS[row.kind]).schemes()
        if row.kind == CALIBRATED:
            return [self.calibrated_levels(int(row.bits))] * self.attention.layers
        return [S.by_name(str(row))] * self.attention.layers

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

    def allocated_rows(self) -> list[RowName]:
        """The allocation rows: rkv-alloc-<bits> and rkv-split-<bits> at each target."""
        o = self.opts
        return [RowName.allocation(t) for t in o.alloc_targets] + [RowName.split(t) for t in o.split_targets]

    def allocation_of(self, row: RowName) -> Allocation:
        """rkv-alloc-<bits>: allocate_average; rkv-split-<bits>: allocate_split; rkv-edge-alloc-<bits>:
        allocate_edges (on the profile)."""
        if row.kind == SPLIT_ALLOCATION:
            return allocate_split(self.profile(), float(row.bits))
        if row.kind == EDGE_ALLOCATION:
            return allocate_edges(self.profile(), float(row.bits))
        return allocate_average(self.profile(), float(row.bits))
