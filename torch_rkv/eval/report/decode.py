"""Token by token through a real cache: the decode protocol (RKVCache and the fused kernel, against the
simulation on the same window) and the peers (transformers' QuantizedCache backends)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...reference import full_precision_count
from ..progress import decode_units, forward_units
from .names import RowName, parse_all
from .section import Section

if TYPE_CHECKING:
    from .report import Report

PEERS = (("quanto", "optimum.quanto", 4), ("quanto", "optimum.quanto", 2), ("hqq", "hqq", 4))


class DecodeProtocol(Section):
    """Each decode scheme simulated and then served token by token on the first decode_tokens tokens:
    the proof that the served path is the measured one."""

    key, timing = "decode_protocol", "decode protocol"

    def rows(self, report: Report) -> list[RowName]:
        return parse_all(report.opts.decode_schemes)

    def cost(self, report: Report) -> float:
        n, rows = report.opts.decode_tokens, len(self.rows(report))
        return (1 + rows) * forward_units(n) + rows * decode_units(n)

    def run(self, report: Report) -> list[dict]:
        from ...integrations.transformers import RKVCache

        ids = report.ids[:, : report.opts.decode_tokens]
        report.results["decode_window_full_precision_ppl"] = report._simulated(ids, None)
        rows = []
        for row in self.rows(report):
            schemes = report.layer_schemes(row)
            scheme = schemes[0]  # (an allocation's layers share their sinks, window and block)
            sim = report._simulated(ids, report.simulation_of(schemes))
            served = report._decoded(ids, lambda n: RKVCache(report.model, schemes, capacity=n))
            quantized = ids.shape[1] - full_precision_count(ids.shape[1], scheme.sinks, scheme.recent, scheme.block)
            rows.append({"scheme": str(row), "tokens": ids.shape[1], "quantized_tokens": quantized,
                         "simulated_ppl": sim, "decoded_ppl": served, "relative_difference": served / sim - 1})
            report.log(f"  decode protocol {row:20s} simulated {sim:.4f}  token-by-token {served:.4f} "
                       f"({served / sim - 1:+.2e}), {quantized} tokens quantized at the end" +
                       ("" if quantized else ": NOTHING QUANTIZED, not a check"))
        return rows


class Peers(Section):
    """transformers' QuantizedCache (quanto at 4 and 2 bits, HQQ at 4) token by token on the decode
    window, where installed; a peer's own failure is a row, not an error."""

    key, timing = "peers", "peers"

    def runs(self, report: Report) -> bool:
        return report.opts.peers

    def cost(self, report: Report) -> float:
        return len(PEERS) * decode_units(report.opts.decode_tokens)

    def run(self, report: Report) -> list[dict]:
        try:
            from transformers import QuantizedCache
        except ImportError:
            return []
        ids = report.ids[:, : report.opts.decode_tokens]
        rows = []
        for backend, module, bits in PEERS:
            try:
                __import__(module)
            except ImportError:
                report.log(f"  peer QuantizedCache[{backend}] skipped: pip install {module.split('.')[-1]}")
                continue

            def make(n, b=backend, k=bits):
                report.model.set_attn_implementation("sdpa")
                return QuantizedCache(backend=b, config=report.model.config, nbits=k)

            try:
                ppl = report._decoded(ids, make)
            except Exception as e:  # a peer's own limitation, reported rather than fatal
                report.log(f"  peer QuantizedCache[{backend},{bits}b] failed: {type(e).__name__}: {e}")
                rows.append({"peer": f"QuantizedCache[{backend},{bits}b]", "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append({"peer": f"QuantizedCache[{backend},{bits}b]", "tokens": ids.shape[1], "decoded_ppl": ppl})
            report.log(f"  peer QuantizedCache[{backend},{bits}b] token-by-token ppl {ppl:.4f}")
        return rows
