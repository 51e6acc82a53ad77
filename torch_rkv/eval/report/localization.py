"""Localization: the penalty rate of Article k asked of long documents, at several depths and lengths."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import localization as needles
from ..progress import forward_units
from .names import FULL_PRECISION, RowName, parse_all
from .section import Section

if TYPE_CHECKING:
    from .report import Report


class Localization(Section):
    """Every needle of loc_documents documents a length, answered in full precision and under each of
    loc_schemes."""

    key, timing = "localization", "localization"

    def runs(self, report: Report) -> bool:
        return bool(report.opts.loc_lengths)

    def rows(self, report: Report) -> list[RowName]:
        return parse_all(report.opts.loc_schemes)

    def cost(self, report: Report) -> float:
        o = report.opts
        documents = sum(forward_units(length + 64) * o.loc_documents for length in o.loc_lengths)
        return (1 + len(self.rows(report))) * documents

    def run(self, report: Report) -> list[dict]:
        rows = []
        docs = [d for n in report.opts.loc_lengths
                for d in needles.build_documents(report.tok, report.text, n, report.opts.loc_documents)]
        for row in [FULL_PRECISION] + self.rows(report):
            # every question re-reads its document's blocks: quantize them once
            sim = None if row == FULL_PRECISION else \
                report.simulation_of(report.layer_schemes(row), reuse_blocks=True)
            for doc in docs:
                for rec in needles.evaluate(report.model, report.tok, doc, sim):
                    rows.append({"scheme": str(row), **rec})
                report.progress.advance(forward_units(doc.ids.shape[1]))
            mine = [x for x in rows if x["scheme"] == str(row)]
            report.log(f"  localization {row:16s} exact {sum(x['exact'] for x in mine)}/{len(mine)}  "
                       f"mean log p {sum(x['logprob'] for x in mine) / len(mine):.2f}")
        return rows
