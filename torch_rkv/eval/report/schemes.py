"""The schemes table: full precision, each family's scheme at each width, and the 8-bit rows beside it,
served as the cache stores them (cache view, fp16 metadata)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ... import scheme as S
from ...scheme import Scheme
from ..progress import forward_units
from .bits import effective_bits_at
from .families import table_rows
from .names import FULL_PRECISION, RowName, TextRow
from .section import Section

if TYPE_CHECKING:
    from .report import Report


class FullPrecision(Section):
    """The unquantized model's perplexity on the text: every other row's reference."""

    key, timing = "full_precision_ppl", "full precision"

    def cost(self, report: Report) -> float:
        return forward_units(report.opts.tokens)

    def run(self, report: Report) -> float:
        ppl = report._simulated(report.ids, None, TextRow(FULL_PRECISION))
        report.log(f"full precision perplexity on {report.opts.tokens} tokens: {ppl:.3f}")
        return ppl


class Schemes(Section):
    """Each family's scheme at each of the options' widths."""

    key, timing = "schemes", "schemes"

    def cost(self, report: Report) -> float:
        return len(table_rows(report.opts.families, report.opts.bits)) * forward_units(report.opts.tokens)

    def run(self, report: Report) -> list[dict]:
        return [scheme_row(report, family, bits, report.family_scheme(family, bits))
                for family, bits in table_rows(report.opts.families, report.opts.bits)]


class EightBits(Section):
    """The eight_bits schemes (vLLM's own fp8 cache, rkv-8), rows like the schemes table's."""

    key, timing = "eight_bits", "8 bits"

    def cost(self, report: Report) -> float:
        return len(report.opts.eight_bits) * forward_units(report.opts.tokens)

    def run(self, report: Report) -> list[dict]:
        return [scheme_row(report, "8 bits", 8, S.by_name(name)) for name in report.opts.eight_bits]


def scheme_row(report: Report, family: str, bits: int, scheme: Scheme) -> dict:
    """One scheme on the text: perplexity, its change, bits, and attention fidelity."""
    fp = report.results["full_precision_ppl"]
    sim = report.simulation(scheme, fidelity_queries=64)
    ppl = report._simulated(report.ids, sim, TextRow(RowName.parse(scheme.name)))
    row = {"family": family, "scheme": scheme.name, "description": scheme.describe(report.head_dim),
           "bits": bits, "ppl": ppl, "delta": ppl - fp, "bits_per_element": scheme.effective_bits(report.head_dim),
           "bits_at_window": effective_bits_at(scheme, report.head_dim, report.opts.tokens),
           "attention_cosine": sim.fidelity.cosine, "top8_recall": sim.fidelity.recall}
    report.log(f"  {scheme.name:14s} ppl {ppl:8.3f} ({ppl - fp:+7.3f})  {row['bits_per_element']:.2f} "
               f"bits  cos {sim.fidelity.cosine:.4f}  top8 {sim.fidelity.recall:.3f}")
    return row
