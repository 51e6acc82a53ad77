"""The names of the report's rows: which scheme a row measures, and on which text it was scored.

Options and the command line name schemes by strings ("rkv-3", "rkv-alloc-2.5", "rkv-nu-2"); any of them
may end in +<m>: every layer refines its m most important key channels per KV head by 2 bits
(torch_rkv.channels, the ranking calibrated on lcet10 and cached). The report parses each into a
RowName once, works with its fields, and renders it back to the same string where a row is printed or
written to JSON.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FULL = "full precision"  # the rows' name of the unquantized model
ALLOCATED = "rkv-alloc-"  # a per-layer allocation: rkv-alloc-<average code bits>
SPLIT = "rkv-split-"  # every layer the same key + value bits, split by the profile (pages of one size)
SPARSE_ALLOCATED = "rkv-sparse-alloc-"  # rkv-alloc-<bits> with rkv-sparse's outliers in every layer
NON_UNIFORM = "rkv-nu-"  # rkv-<bits> with the model's calibrated levels (torch_rkv.eval.levels)
LEAN_ALLOCATED = "rkv-lean-alloc-"  # rkv-alloc-<bits> with rkv-lean's float8 value metadata in every layer
LEAN_SPARSE_ALLOCATED = "rkv-lean-sparse-alloc-"  # and rkv-sparse's outliers
EDGE_ALLOCATED = "rkv-edge-alloc-"  # the first and last layers at 8 bits, counted in the average (allocate_edges)

# The kinds of row.
PRESET = "preset"
FULL_PRECISION_KIND = "full precision"
ALLOCATION = "allocation"
SPLIT_ALLOCATION = "split allocation"
SPARSE_ALLOCATION = "sparse allocation"
CALIBRATED = "calibrated levels"
LEAN_ALLOCATION = "lean allocation"
LEAN_SPARSE_ALLOCATION = "lean sparse allocation"
EDGE_ALLOCATION = "edge allocation"

PREFIXES = {ALLOCATION: ALLOCATED, SPLIT_ALLOCATION: SPLIT, SPARSE_ALLOCATION: SPARSE_ALLOCATED,
            CALIBRATED: NON_UNIFORM, LEAN_ALLOCATION: LEAN_ALLOCATED, LEAN_SPARSE_ALLOCATION: LEAN_SPARSE_ALLOCATED,
            EDGE_ALLOCATION: EDGE_ALLOCATED}

# The allocation rows whose layers all take a layout beside rkv's (Allocation.with_layout's arguments)
LAYOUTS = {SPARSE_ALLOCATION: dict(sparse=True), LEAN_ALLOCATION: dict(lean=True),
           LEAN_SPARSE_ALLOCATION: dict(sparse=True, lean=True)}

# The texts a row's token losses are scored on.
FIRST = "first text"
SECOND = "second text"


@dataclass(frozen=True)
class RowName:
    """The scheme a row measures.

    kind is one of PRESET, FULL_PRECISION_KIND, ALLOCATION, SPLIT_ALLOCATION, SPARSE_ALLOCATION and
    CALIBRATED. A preset carries the name torch_rkv.scheme.by_name reads ("rkv-3", "kivi-2", "vllm-fp8").
    The allocations carry their average code bits, and the calibrated levels their code width. refine:
    key channels per KV head refined (a +<m> suffix), 0: none.
    """

    kind: str = PRESET
    preset: str = ""
    bits: float = 0.0
    refine: int = 0

    @classmethod
    def parse(cls, name: str) -> RowName:
        """The row a name as the options write it stands for."""
        if name == FULL:
            return FULL_PRECISION
        base, plus, count = name.rpartition("+")
        if plus and base and count.isdigit():
            return dataclasses.replace(cls.parse(base), refine=int(count))
        for kind, prefix in PREFIXES.items():
            if name.startswith(prefix):
                number = name[len(prefix):]
                return cls(kind, bits=int(number) if kind == CALIBRATED else float(number))
        return cls(PRESET, preset=name)

    @classmethod
    def allocation(cls, bits: float) -> RowName:
        """The per-layer allocation at `bits` average code bits."""
        return cls(ALLOCATION, bits=bits)

    @classmethod
    def split(cls, bits: float) -> RowName:
        """The split allocation (every layer the same key + value bits) at `bits` average code bits."""
        return cls(SPLIT_ALLOCATION, bits=bits)

    def __str__(self) -> str:
        suffix = f"+{self.refine}" if self.refine else ""
        if self.kind == PRESET:
            return self.preset + suffix
        if self.kind == FULL_PRECISION_KIND:
            return FULL
        return f"{PREFIXES[self.kind]}{self.bits:g}{suffix}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    @property
    def profiled(self) -> bool:
        """Whether the row is resolved through the model's sensitivity profile (an allocation or a split)."""
        return self.kind in (ALLOCATION, SPLIT_ALLOCATION, EDGE_ALLOCATION, *LAYOUTS)

    @property
    def per_layer(self) -> bool:
        """Whether the row measures or fits every layer's own cache: the profiled rows, the calibrated levels
        and refined key channels."""
        return self.profiled or self.kind == CALIBRATED or self.refine > 0


FULL_PRECISION = RowName(FULL_PRECISION_KIND)


@dataclass(frozen=True)
class TextRow:
    """A row as scored on one text (FIRST or SECOND): the key of its kept token losses."""

    row: RowName
    text: str = FIRST

    def full_precision(self) -> TextRow:
        """The full-precision row of the same text, which this row's losses are compared with."""
        return TextRow(FULL_PRECISION, self.text)


def parse_all(names) -> list[RowName]:
    """RowName.parse of each name."""
    return [RowName.parse(name) for name in names]
