"""The cache ops' call sites read as what they pass: outside torch_rkv/ops/, a call to an op wrapper
passes the named structures (CacheSide, CacheFormat, AttentionOptions) and at most 8 positional
arguments, spreads nothing but a cache's two sides, and the rotations are built in one place.

Read from the source (AST), over the package, bench/ and scripts/. The reference (torch_rkv/reference.py,
the spec) and the Triton implementations (torch_rkv/gpu/) take the ops' flat schema by design, and
tests/ call the flat ops on purpose, so they are not checked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
WRAPPERS = {"decode_attention", "cache_append", "paged_append", "paged_decode_attention", "paged_prefill_attention",
            "paged_copy"}
FLAT = {"ref", "reference", "R"}  # receivers whose functions of these names take the flat schema (the spec)
MAX_POSITIONAL = 8


def checked_files() -> list[Path]:
    pkg = ROOT / "torch_rkv"
    files = [p for p in pkg.rglob("*.py") if not p.is_relative_to(pkg / "ops") and not p.is_relative_to(pkg / "gpu")
             and p != pkg / "reference.py"]
    return sorted(files + list((ROOT / "bench").glob("*.py")) + list((ROOT / "scripts").glob("*.py")))


def wrapper_calls(tree: ast.AST):
    """(line, name, call) of every call to a function named as an op wrapper, but the reference's and the
    ops' own (torch.ops.rkv.X, torch.ops.rkv.X.default)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in WRAPPERS:
            yield node.lineno, f.id, node
        elif isinstance(f, ast.Attribute) and f.attr in WRAPPERS:
            receiver = ast.unparse(f.value)
            if receiver.split(".")[-1] in FLAT or receiver.startswith(("torch.ops", "gpu")):
                continue
            yield node.lineno, f.attr, node


def call_problems(call: ast.Call) -> list[str]:
    """What is wrong with one wrapper call: too many positional arguments, or a spread of anything but a
    cache's sides (`*cache.sides(layer)`, `*sides(...)`, `*split_sides(...)`, which give two)."""
    problems, positional = [], 0
    for arg in call.args:
        if isinstance(arg, ast.Starred):
            target = arg.value
            name = target.func.attr if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) else \
                target.func.id if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) else None
            if name not in ("sides", "split_sides"):
                problems.append(f"spreads *{ast.unparse(target)}")
            positional += 2
        else:
            positional += 1
    if positional > MAX_POSITIONAL:
        problems.append(f"{positional} positional arguments (at most {MAX_POSITIONAL})")
    return problems


def test_op_wrapper_calls_pass_structures_and_few_positional_arguments():
    found, bad = 0, []
    for path in checked_files():
        for line, name, call in wrapper_calls(ast.parse(path.read_text())):
            found += 1
            bad += [f"{path.relative_to(ROOT)}:{line} {name}: {p}" for p in call_problems(call)]
    assert found >= 10, f"only {found} wrapper calls found: the search no longer sees them"
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, problem", [
    ("decode_attention(q, *cache.layer_buffers(0), n, 4, 4, 128, 64)", "spreads *cache.layer_buffers(0)"),
    ("paged_append(k, v, a, b, c, d, e, f, g)", "9 positional arguments"),
    ("paged_copy(*cache.sides(0), a, b, c, d, e, f, g)", "9 positional arguments"),
])
def test_the_check_catches_the_old_call_forms(source, problem):
    ((_, _, call),) = wrapper_calls(ast.parse(source))
    assert any(problem in p for p in call_problems(call))


def test_the_reference_and_the_flat_ops_are_not_wrapper_calls():
    source = "ref.decode_attention(*a)\ntorch.ops.rkv.paged_copy.default(*a)\ngpu_cache.paged_append(*a)"
    assert list(wrapper_calls(ast.parse(source))) == []


def test_rotations_are_built_in_one_place():
    """hadamard_signs for a cache's sides and the RoPE tables' float32 copy: torch_rkv/rotations.py alone
    (the simulation in eval/ draws the same signs through the scheme's seed for its own tensors)."""
    pkg = ROOT / "torch_rkv"
    callers = set()
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "hadamard_signs":
                callers.add(str(path.relative_to(pkg)))
    assert callers <= {"rotations.py", "eval/simulate.py", "demo.py"}, callers
