"""What the ahead-of-time compile check (scripts/triton_compile_check.py) builds: each kernel module lists
the configurations its launchers use, as `CompileSpec`s, in a function `compile_specs(full)`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CompileSpec:
    """One kernel at one configuration: `signature` maps every parameter of the `@triton.jit` function to
    its Triton type ("*u8", "*fp32", "i32", "fp32", ... or "constexpr"), `constexprs` gives the constexpr
    values, `options` the launch options the launcher passes (num_warps, num_stages, enable_fp_fusion)."""

    label: str
    kernel: object
    signature: dict
    constexprs: dict
    options: dict = field(default_factory=dict)


_POINTER = {"torch.uint8": "*u8", "torch.int8": "*i8", "torch.int16": "*i16", "torch.int32": "*i32",
            "torch.int64": "*i64", "torch.float16": "*fp16", "torch.bfloat16": "*bf16", "torch.float32": "*fp32",
            "torch.float64": "*fp64", "torch.bool": "*i1"}


def arg_type(value) -> str:
    """The Triton type a launch gives an argument: a tensor's pointer type, i32 or i64 for an int (as the
    launcher specializes it by size), fp32 for a float."""
    if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
        return _POINTER[str(value.dtype)]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def signature(kernel, types: dict, constexprs: dict) -> dict:
    """A kernel's signature from the types of its pointer (and other non-i32) parameters: every other
    parameter i32, the constexprs "constexpr"."""
    return {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in kernel.arg_names}


def from_args(label: str, kernel, args: list, constexprs: dict, options: dict | None = None) -> CompileSpec:
    """The CompileSpec of a launch `kernel[grid](*args, **constexprs, **options)`: the runtime arguments'
    types from their values (tensors may be on the meta device), the constexprs as given."""
    names = kernel.arg_names
    runtime = [n for n in names if n not in constexprs]
    if len(runtime) != len(args):
        raise ValueError(f"{label}: {kernel.__name__} takes {len(runtime)} runtime arguments, the launch gives {len(args)}")
    signature = {n: arg_type(v) for n, v in zip(runtime, args)}
    signature.update({n: "constexpr" for n in constexprs})
    return CompileSpec(label, kernel, {n: signature[n] for n in names}, dict(constexprs), dict(options or {}))
