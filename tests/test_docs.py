"""docs/ops.md's op table stays in step with the op schemas: each op's row lists every argument of its
schema, in order, marked as the schema marks it (! written in place, ? optional, =default)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import torch_rkv  # noqa: F401 (registers the ops)

OPS_MD = Path(__file__).parents[1] / "docs" / "ops.md"
OPS = ("quantize", "dequantize", "pack", "unpack", "rope", "hadamard", "cache_append", "decode_attention",
       "paged_append", "paged_decode_attention", "paged_prefill_attention", "paged_copy")


def schema_arguments(op: str) -> list[str]:
    """The op's arguments as docs/ops.md writes them: name, then ! (written in place), ? (optional) and
    =default."""
    out = []
    for a in getattr(torch.ops.rkv, op).default._schema.arguments:
        name = a.name + ("!" if a.alias_info is not None and a.alias_info.is_write else "")
        name += "?" if isinstance(a.type, torch._C.OptionalType) else ""
        out.append(name + (f"={a.default_value}" if a.has_default_value() else ""))
    return out


def documented_arguments(op: str) -> list[str]:
    rows = [line for line in OPS_MD.read_text().splitlines() if line.startswith(f"| `{op}(")]
    assert len(rows) == 1, f"docs/ops.md has {len(rows)} table rows for {op}"
    return re.match(rf"\| `{op}\((.*?)\) ->", rows[0]).group(1).split(", ")


@pytest.mark.parametrize("op", OPS)
def test_the_op_table_lists_every_schema_argument(op):
    assert documented_arguments(op) == schema_arguments(op)


def test_every_op_is_in_the_table():
    # the dispatcher's list, not dir(torch.ops.rkv): the namespace lists only the ops already looked up
    # in this process, so what it holds depends on which tests ran before on the same worker
    registered = {name.removeprefix("rkv::") for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("rkv::")}
    assert set(OPS) == registered
