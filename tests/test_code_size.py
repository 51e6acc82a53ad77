"""The package stays readable in pieces: no module over 600 lines (reference.py, the spec, aside) and no
function over 80 lines (Triton kernels, whose bodies are one program, aside). Read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).parents[1] / "torch_rkv"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def long_functions(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, lines) of every function over MAX_FUNCTION_LINES, but @triton.jit kernels."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any("jit" in ast.unparse(d) for d in node.decorator_list):
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
            out.append((node.name, lines))
    return out


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if p.name != "reference.py" and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_function_is_over_80_lines():
    long = {f"{p.relative_to(PKG)}:{name}": n for p in PKG.rglob("*.py")
            for name, n in long_functions(ast.parse(p.read_text()))}
    assert not long, long


def test_the_function_check_sees_a_long_function_and_skips_a_kernel():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"def f():\n{body}\n\n@triton.jit\ndef k():\n{body}\n"
    assert long_functions(ast.parse(source)) == [("f", MAX_FUNCTION_LINES + 1)]
