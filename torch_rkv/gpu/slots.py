"""The append's staging-slot table on the GPU: gpu/cache.py's plan kernel (step 1) writes one int64 row of
SLOT_COLUMNS per staging slot, (page, first row, sink rows, written, sequence, first token, side slot,
unused), and the later steps read the block each slot holds from it."""

from __future__ import annotations

import triton
import triton.language as tl

SLOT_COLUMNS = tl.constexpr(8)


@triton.jit
def slot_block(table, j):
    """(whether it is written, page, first row, sink rows) of the block staging slot j holds."""
    row = table + j.to(tl.int64) * SLOT_COLUMNS
    return tl.load(row + 3) != 0, tl.load(row), tl.load(row + 1), tl.load(row + 2)
