"""Running a PlanRequest: run_plan counts each scheme's row (the ledger's, or a vLLM engine's), plans the
per-layer allocation a sensitivity profile asks for, and, with an engine, how to serve each row. It prints
nothing; report.py prints what it returns."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..allocate import Allocation, Sensitivity
from ..integrations.vllm import PRE_ROPE_MODELS
from .budget import allocation_for_budget, split_for_budget
from .ledger import ledger_rows
from .request import PlanRequest, refusals
from .serve import ALLOCATION_PLACEHOLDER, serve_command
from .vllm import vllm_row, vllm_rows


@dataclass(frozen=True)
class PlanResult:
    """What a plan found: a row per scheme (with an engine, each with its serve command), and with
    --sensitivity the per-layer allocation (allocation_for_budget's tuple), its profile, whether it keeps
    one total in every layer (split), and with an engine its vLLM row (serving)."""

    rows: list[dict]
    allocation: tuple[Allocation, int, list[int]] | None = None
    profile: Sensitivity | None = None
    split: bool = False
    serving: dict | None = None


def run_plan(request: PlanRequest) -> PlanResult:
    """The rows, allocation and serve commands of a request; a refusal ends the command with its message."""
    model, engine = request.model, request.engine
    with refusals((ValueError, NotImplementedError)):
        if engine is not None:
            rows = vllm_rows(model, engine, request.budget, request.context, request.batch, request.schemes)
        else:
            rows = ledger_rows(model, request.budget, request.context, request.batch, request.schemes)
    # vLLM pads a hybrid model's unequal pages to the largest: one total in every layer fits more there
    split = request.split or (engine is not None and engine.pads_unequal_pages(model))
    profile, allocation = planned_allocation(request, split)
    return PlanResult(rows, allocation, profile, split, serve_rows(request, rows, allocation))


def planned_allocation(request: PlanRequest, split: bool
                       ) -> tuple[Sensitivity | None, tuple[Allocation, int, list[int]] | None]:
    """(the profile, the allocation) --sensitivity asks for (None, None without it), written to --out where
    given; refuses the options that choose one without a profile, and allocations the plugin would not serve."""
    model, engine = request.model, request.engine
    if (request.split or request.out) and not request.sensitivity:
        raise SystemExit("torch_rkv plan: --split and --out choose a per-layer allocation, which needs --sensitivity")
    if request.sensitivity and request.unrotated:
        raise SystemExit(f"torch_rkv plan: --sensitivity with --vllm plans an allocation of pre-RoPE schemes, which "
                         f"the plugin does not serve for {model.family!r} (only {', '.join(PRE_ROPE_MODELS)})")
    if request.sensitivity and engine is not None and model.recurrent_hybrid:
        raise SystemExit(f"torch_rkv plan: --sensitivity with --vllm plans a per-layer allocation, which the plugin "
                         f"does not serve on a hybrid model ({model.name}: vLLM pads its pages to one size)")
    if not request.sensitivity:
        return None, None
    try:
        with open(request.sensitivity) as f:
            profile = Sensitivity.from_json(f.read())
    except (OSError, ValueError) as e:
        raise SystemExit(f"torch_rkv plan: --sensitivity {request.sensitivity}: {e}")
    with refusals():
        solver = split_for_budget if split else allocation_for_budget
        allocation = solver(model, profile, request.budget, request.context, request.batch, engine=engine)
    if request.out:
        allocation[0].save(request.out, model=model.name, calibration=f"{profile.model} on {profile.text}")
    return profile, allocation


def serve_rows(request: PlanRequest, rows: list[dict], allocation) -> dict | None:
    """With an engine, how to serve each row (its "serve": serve_command), and the allocation's own row with
    its command (returned; None without an allocation or an engine)."""
    model, engine = request.model, request.engine
    if engine is None:
        return None

    def serve(row, file=None):
        return serve_command(model, engine, row, request.context, request.dtype, request.explicit_batched_tokens,
                             file)

    for row in rows:
        row["serve"] = serve(row)
    if not allocation:
        return None
    serving = vllm_row(model, engine, request.budget, request.context, request.batch, "allocation",
                       allocation[0].schemes())
    serving["serve"] = serve(serving, os.path.abspath(request.out) if request.out else ALLOCATION_PLACEHOLDER)
    return serving
