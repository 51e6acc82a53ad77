"""The report's plots (PNG): perplexity against bits, localization against length, and key magnitudes."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from ... import scheme as S
from .. import plots
from ..progress import forward_units
from ..simulate import Simulation, install
from .section import Section

if TYPE_CHECKING:
    from .report import Report


class Plots(Section):
    """The plots of the results so far, written under out_dir; the key-magnitude plot captures the keys
    of one forward pass over up to 512 tokens."""

    key, timing = "plots", "plots"

    def cost(self, report: Report) -> float:
        return forward_units(min(512, report.opts.tokens))

    def run(self, report: Report) -> dict:
        out = plots.ensure_dir(report.opts.out_dir)
        results = report.results
        paths = {}
        if results["schemes"]:
            paths["ppl_vs_bits"] = plots.ppl_vs_bits(results["schemes"], results["full_precision_ppl"],
                                                     os.path.join(out, "ppl_vs_bits.png"))
        if results["localization"]:
            paths["localization"] = plots.localization_vs_length(results["localization"],
                                                                 os.path.join(out, "localization.png"))
        paths["key_magnitudes"] = plots.key_magnitudes(capture_keys(report), os.path.join(out, "key_magnitudes.png"))
        return paths


@torch.no_grad()
def capture_keys(report: Report, layers=(0, None, -1)) -> dict:
    """Pre- and post-RoPE keys of KV head 0 for the first, middle and last attention layer (full precision)."""
    att = report.attention  # (a hybrid's attention layers alone hold keys)
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

    install(report.model, None)
    for i, module in enumerate(report.attention.modules):
        if module is not None:
            module.rkv_simulation = Capture(i) if i in chosen else None
    n = min(512, report.ids.shape[1])
    report.model(report.ids[:, :n])
    install(report.model, None)
    from ...ops.rope import rope

    pos = torch.arange(n)
    return {i: (rope(store[i], *report.layer_rope[i], pos, report.attention.interleaved, inverse=True), store[i])
            for i in chosen}
