"""The per-layer allocation rows: the widths the knapsack picks from the model's sensitivity profile."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..progress import forward_units
from .names import RowName, TextRow
from .section import Section

if TYPE_CHECKING:
    from .report import Report


class Allocation(Section):
    """Per-layer K/V bits (torch_rkv.allocate) at each target average, from the model's sensitivity on
    the calibration text (measured once, cached), measured on this text like the schemes: beside
    the uniform schemes of the same bits (the schemes table), is the allocation worth its bits? The
    split rows keep every layer's key + value bits equal (pages of one size)."""

    key, timing = "allocation", "allocation"

    def runs(self, report: Report) -> bool:
        return bool(self.rows(report))

    def rows(self, report: Report) -> list[RowName]:
        return report.allocated_rows()

    def cost(self, report: Report) -> float:
        return len(self.rows(report)) * forward_units(report.opts.tokens)

    def run(self, report: Report) -> list[dict]:
        profile = report.profile()
        fp = report.results["full_precision_ppl"]
        rows = []
        for row in self.rows(report):
            alloc = report.allocation_of(row)
            schemes = alloc.schemes()
            sim = report.simulation_of(schemes, fidelity_queries=64)
            ppl = report._simulated(report.ids, sim, TextRow(row))
            rows.append({"scheme": str(row), "target_bits": float(row.bits), "bits": alloc.bits,
                         "allocation": alloc.describe(), "predicted_kl": alloc.predicted, "ppl": ppl,
                         "delta": ppl - fp, "bits_per_element": alloc.effective_bits(report.head_dim),
                         "bits_at_window": report.bits_at(schemes, report.opts.tokens),
                         "attention_cosine": sim.fidelity.cosine, "top8_recall": sim.fidelity.recall,
                         "calibration": f"{profile.tokens} tokens of {profile.text}"})
            report.log(f"  {row} ppl {ppl:8.3f} ({ppl - fp:+7.3f})  "
                       f"{rows[-1]['bits_per_element']:.2f} bits  top8 {sim.fidelity.recall:.3f}  "
                       f"K/V bits by layer {alloc.describe()}")
        return rows
