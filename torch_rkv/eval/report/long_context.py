"""Perplexity at a long window (--full), where the full-precision tokens are a small share of the cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import perplexity
from ..progress import forward_units
from .names import FULL, RowName, parse_all
from .section import Section

if TYPE_CHECKING:
    from .report import Report


class LongContext(Section):
    """Perplexity at long_tokens: where sinks, recent window and open block are a small share, so the
    bits at the window approach the scheme's own. Each row also splits its bits at the window into
    codes, metadata, outliers and full-precision tokens, measures attention fidelity over the window's
    last 64 queries (the schemes table's measure, at this length), and the mean KL divergence of each
    position's next-token distribution from full precision's (perplexity.token_kl)."""

    key, timing = "long_context", "long context"

    def runs(self, report: Report) -> bool:
        return bool(report.opts.long_tokens)

    def rows(self, report: Report) -> list[RowName]:
        return parse_all(report.opts.long_schemes)

    def cost(self, report: Report) -> float:
        return (1 + len(self.rows(report))) * forward_units(report.opts.long_tokens)

    def run(self, report: Report) -> list[dict]:
        n, ids = report.opts.long_tokens, report.long_ids
        reference = report._logprobs(ids, None)
        fp = perplexity.perplexity_of(reference, ids)
        rows = [{"scheme": FULL, "tokens": n, "ppl": fp, "delta": 0.0, "kl": 0.0, "bits_at_window": 16.0,
                 "bits_parts": {"full_precision": 16.0}, "attention_cosine": 1.0, "top8_recall": 1.0}]
        report.log(f"  long context: full precision perplexity on {n} tokens {fp:.3f}")
        for row in self.rows(report):
            schemes = report.layer_schemes(row)
            sim = report.simulation_of(schemes, fidelity_queries=64)
            logprobs = report._logprobs(ids, sim)
            ppl = perplexity.perplexity_of(logprobs, ids)
            kl = perplexity.token_kl(reference, logprobs).mean().item()
            del logprobs
            parts = report.bits_parts_at(schemes, n)
            rows.append({"scheme": str(row), "tokens": n, "ppl": ppl, "delta": ppl - fp, "kl": kl,
                         "bits_at_window": sum(parts.values()), "bits_parts": parts,
                         "attention_cosine": sim.fidelity.cosine, "top8_recall": sim.fidelity.recall})
            report.log(f"  long context {row:20s} ppl {ppl:8.3f} ({ppl - fp:+.3f}) KL {kl:.4f} at "
                       f"{rows[-1]['bits_at_window']:.2f} bits at the window  top8 {sim.fidelity.recall:.3f}")
        return rows
