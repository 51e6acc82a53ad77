"""Chunked prefill: the text fed in chunks through RKVCache, against token by token."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..progress import forward_units
from .names import RowName, parse_all
from .section import Section

if TYPE_CHECKING:
    from .report import Report


class ChunkedPrefill(Section):
    """The text fed in chunks through RKVCache (rkv::paged_prefill_attention for every chunk after the
    first): the quality a server delivers when it ingests a long prompt in chunks, against the
    token-by-token figure of the same scheme (the schemes table). Goal: at most that plus 10% of it."""

    key, timing = "chunked_prefill", "chunked prefill"

    def runs(self, report: Report) -> bool:
        return bool(report.opts.chunk_sizes)

    def rows(self, report: Report) -> list[RowName]:
        return parse_all(report.opts.chunk_schemes)

    def cost(self, report: Report) -> float:
        # each chunk size, and a simulated row for a scheme the schemes table lacks (counted for every scheme)
        return len(self.rows(report)) * (len(report.opts.chunk_sizes) + 1) * forward_units(report.opts.tokens)

    def run(self, report: Report) -> list[dict]:
        from ...integrations.transformers import RKVCache

        fp = report.results["full_precision_ppl"]
        token_by_token = {x["scheme"]: x["delta"] for x in report.results.get("schemes", [])}
        rows = []
        for row in self.rows(report):
            name, schemes = str(row), report.layer_schemes(row)
            if name not in token_by_token:
                token_by_token[name] = report._simulated(report.ids, report.simulation_of(schemes)) - fp
            for chunk in report.opts.chunk_sizes:
                ppl = report._chunked(report.ids, lambda n: RKVCache(report.model, schemes, capacity=n), chunk)
                tbt = token_by_token[name]
                rows.append({"scheme": name, "chunk": chunk, "ppl": ppl, "delta": ppl - fp, "token_by_token": tbt,
                             "within_goal": ppl - fp <= tbt + 0.1 * abs(tbt)})
                report.log(f"  chunked prefill {row:8s} chunks of {chunk:5d}: ppl {ppl:.3f} ({ppl - fp:+.3f}), "
                           f"token by token {tbt:+.3f}")
        return rows
