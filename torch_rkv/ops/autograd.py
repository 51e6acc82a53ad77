"""Gradients of the rkv ops.

rope and hadamard are orthogonal maps of x, so their gradient is the inverse map of the incoming
gradient (the same op with ``inverse`` flipped). The quantizing ops and the decode kernel are for
inference: their backward raises a clear error instead of PyTorch's default for ops without an
autograd kernel, which warns and returns no gradient at all (a silently wrong result).
"""

from __future__ import annotations

import torch


def _no_tables_grad(op: str, ctx, *indices: int) -> None:
    for i in indices:
        if ctx.needs_input_grad[i]:
            raise RuntimeError(f"rkv.{op}: only x is differentiable; detach the other tensor arguments")


# ------------------------------------------------------------------------------------------------
# rope(x, cos, sin, positions, interleaved, inverse): x -> R x, so dL/dx = R^T g = R^-1 g
# ------------------------------------------------------------------------------------------------
def _rope_setup(ctx, inputs, output):
    _, cos, sin, positions, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.interleaved, ctx.inverse = interleaved, inverse


def _rope_backward(ctx, grad):
    _no_tables_grad("rope", ctx, 1, 2)
    cos, sin, positions = ctx.saved_tensors
    gx = torch.ops.rkv.rope.default(grad.contiguous(), cos, sin, positions, ctx.interleaved, not ctx.inverse)
    return gx, None, None, None, None, None


torch.library.register_autograd("rkv::rope", _rope_backward, setup_context=_rope_setup)


# ------------------------------------------------------------------------------------------------
# hadamard(x, signs, inverse): orthonormal, so dL/dx = H^-1 g
# ------------------------------------------------------------------------------------------------
def _hadamard_setup(ctx, inputs, output):
    _, signs, inverse = inputs
    ctx.save_for_backward(signs)
    ctx.inverse = inverse


def _hadamard_backward(ctx, grad):
    _no_tables_grad("hadamard", ctx, 1)
    (signs,) = ctx.saved_tensors
    return torch.ops.rkv.hadamard.default(grad.contiguous(), signs, not ctx.inverse), None, None


torch.library.register_autograd("rkv::hadamard", _hadamard_backward, setup_context=_hadamard_setup)


# ------------------------------------------------------------------------------------------------
# Inference-only ops
# ------------------------------------------------------------------------------------------------
def _inference_only(op: str):
    def setup(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise RuntimeError(f"rkv.{op} is not differentiable (torch_rkv quantizes the KV cache for inference); "
                           f"run it under torch.no_grad() or detach its inputs")

    torch.library.register_autograd(f"rkv::{op}", backward, setup_context=setup)


for _op in ("quantize", "dequantize", "decode_attention", "paged_decode_attention", "paged_prefill_attention"):
    _inference_only(_op)
