"""The families of the schemes table: each family's scheme at a number of bits."""

from __future__ import annotations

from ... import scheme as S
from ...scheme import Scheme

FAMILIES = {  # name -> bits -> scheme (None: no such row)
    "per-token (baseline)": S.per_token,
    "grouped g32": lambda b: Scheme(name=f"grouped32-{b}", k_bits=b, v_bits=b, k_group_size=32, v_group_size=32),
    "KIVI (per-channel post-RoPE)": S.kivi,
    "KVQuant-style (pre-RoPE per-channel)": S.kvquant,
    "QuaRot-style (Hadamard)": S.quarot,
    "rkv (recommended)": S.recommended,
    "rkv mixed (K one step above V)": lambda b: S.recommended_mixed(b) if b in (2, 3) else None,
    "TurboQuant-style (Hadamard + Lloyd-Max + norm)": S.turboquant,
    "rkv + 0.5% sparse outliers": S.recommended_sparse,
    # per-layer codebooks fitted on the calibration text: the report resolves them (Report.family_scheme)
    "rkv + calibrated levels": lambda b: None,
}
CALIBRATED_LEVELS = "rkv + calibrated levels"

FULL_FAMILIES = tuple(FAMILIES)
DEFAULT_FAMILIES = tuple(f for f in FAMILIES if f not in ("grouped g32", "rkv + 0.5% sparse outliers",
                                                          CALIBRATED_LEVELS))


def has_row(family: str, bits: int) -> bool:
    """Whether the schemes table has a row of `family` at `bits`, without building its scheme (the
    calibrated levels are fitted on first use, so they are not built to be counted)."""
    return family == CALIBRATED_LEVELS or FAMILIES[family](bits) is not None


def table_rows(families, bits) -> list[tuple[str, int]]:
    """The schemes table's (family, bits) rows, in the order the table lists them."""
    return [(family, b) for family in families for b in bits if has_row(family, b)]
