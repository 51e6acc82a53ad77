"""The reproduction of the reference fake-quant measurements: every position quantized, fp32 metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...scheme import Scheme
from ..progress import forward_units
from .section import Section

if TYPE_CHECKING:
    from .report import Report

# The reference perplexities of the fake-quant protocol, by key treatment and bits. They were measured on
# the default model and text at 2048 tokens; docs/measurements.md ("The noise floor") gives their source.
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


class Reproduction(Section):
    """Every reference row at each of the options' widths, beside its reference at 2048 tokens. With
    Options.noise, a row off its reference is measured again with eager attention; those reruns depend on
    the results, so the plan does not count them."""

    key, timing = "reproduction", "reproduction"

    def cost(self, report: Report) -> float:
        n = report.opts.tokens
        return len(REFERENCE) * len(report.opts.bits) * forward_units(n) if n % 128 == 0 else 0

    def run(self, report: Report) -> list[dict]:
        rows = []
        if report.opts.tokens % 128:
            report.log("reproduction skipped: --tokens must be a multiple of 128 for per-channel blocks")
            return rows
        for row, ref in REFERENCE.items():
            for bits in report.opts.bits:
                rows.append(self.measure(report, row, ref, bits))
        return rows

    @staticmethod
    def measure(report: Report, row: str, ref: dict, bits: int) -> dict:
        """One reference row at `bits` bits."""
        scheme, keys = reference_scheme(row, bits)
        sim = report.simulation(scheme, view="all", quantize_keys=keys)
        ppl = report._simulated(report.ids, sim)
        rec = {"row": row, "bits": bits, "ppl": ppl, "reference": ref[bits] if report.opts.tokens == 2048 else None}
        if rec["reference"]:
            rec["deviation"] = ppl / rec["reference"] - 1
            rec["within_tolerance"] = abs(rec["deviation"]) <= TOLERANCE[bits]
            if report.opts.noise and not rec["within_tolerance"]:
                # the same quantization with another, equally exact attention kernel: low-bit
                # perplexity amplifies fp32 rounding differences, this shows by how much
                rec["ppl_eager"] = report._simulated(report.ids, report.simulation(
                    scheme, view="all", quantize_keys=keys, kernel="eager"))
        report.log(f"  reproduction {row:34s} {bits}b  ppl {ppl:8.3f}" +
                   (f"  reference {rec['reference']:7.2f} ({rec['deviation']:+.1%})" if rec["reference"] else ""))
        return rec
