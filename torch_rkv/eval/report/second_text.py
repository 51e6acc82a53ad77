"""The ranking on a second text (--full): the same schemes and allocations, on a text the calibration never saw."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..progress import forward_units
from .names import FIRST, FULL, FULL_PRECISION, SECOND, RowName, TextRow, parse_all
from .section import Section

if TYPE_CHECKING:
    from .report import Report


class SecondText(Section):
    """The schemes and the allocations (calibrated on the calibration text) ranked on a second text: the
    same order, and relative losses within 1.5x of the first text's, say nothing was tuned to one text.
    Both texts are scored on second_windows windows of `tokens` tokens (the first text's first one is
    the schemes table's). Each relative loss carries its 95% block-bootstrap interval
    (perplexity.relative_loss_samples; each text its own draws), and the ratio of the two texts'
    losses one from those draws."""

    key, timing = "second_text", "second text"

    def runs(self, report: Report) -> bool:
        return bool(report.opts.second_text)

    def rows(self, report: Report) -> list[RowName]:
        return parse_all(report.opts.second_schemes) + report.allocated_rows()

    def cost(self, report: Report) -> float:
        # both texts' windows but the first text's first, each with full precision and every row
        o = report.opts
        return (2 * o.second_windows - 1) * (1 + len(self.rows(report))) * forward_units(o.tokens)

    def run(self, report: Report) -> list[dict]:
        o = report.opts
        named = self.resolve(report)
        first = [row for row in named if TextRow(row) in report.losses.nll]  # rows the first text's table has
        for text, rows in ((FIRST, first), (SECOND, list(named))):
            for i, ids in enumerate(report.windows[text]):
                if text == FIRST and i == 0:
                    continue  # scored by the schemes and allocation tables
                report._simulated(ids, None, TextRow(FULL_PRECISION, text))
                for row in rows:
                    ppl = report._simulated(ids, report.simulation_of(named[row]), TextRow(row, text))
                    report.log(f"  {o.second_text if text == SECOND else 'first text'} window "
                               f"{i + 1}/{o.second_windows} {row:14s} ppl {ppl:8.3f}")
        report.losses.reference.clear()  # not needed past here
        return self.summary(report, named, first)

    def resolve(self, report: Report) -> dict:
        """The rows to score, each under the name the first text's tables keep its losses by (a preset:
        its scheme's own name), with its scheme for each layer."""
        named = {}
        for row in self.rows(report):
            schemes = report.layer_schemes(row)
            named[row if row.profiled else RowName.parse(schemes[0].name)] = schemes
        return named

    def summary(self, report: Report, named: dict, first: list[RowName]) -> list[dict]:
        """The section's rows: full precision on the second text, then each row's relative losses."""
        o, losses = report.opts, report.losses
        full = TextRow(FULL_PRECISION, SECOND)
        fp = losses.tokens_of(losses.nll, full).mean().exp().item()
        out = [{"scheme": FULL, "text": o.second_text, "ppl": fp, "relative": 0.0, "first_relative": 0.0,
                "tokens": o.tokens * o.second_windows}]
        for row in named:
            second = TextRow(row, SECOND)
            out.append({"scheme": str(row), "text": o.second_text, "tokens": o.tokens * o.second_windows,
                        "ppl": losses.tokens_of(losses.nll, second).mean().exp().item(),
                        "relative": losses.relative(second),
                        "first_relative": losses.relative(TextRow(row)) if row in first else None,
                        **losses.intervals(row)})
            report.log(f"  {o.second_text} {row:14s} {out[-1]['relative']:+.2%} ({o.second_windows} x "
                       f"{o.tokens} tokens)")
        return out
