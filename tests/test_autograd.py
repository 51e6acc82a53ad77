"""Gradients: rope and hadamard backpropagate exactly as their pure-PyTorch references; the
inference-only ops raise a clear error instead of silently returning no gradient."""

import pytest
import torch
from conftest import DEVICES

import torch_rkv
from torch_rkv import reference as ref

EPS32 = torch.finfo(torch.float32).eps


def grads(fn, x, g):
    x = x.detach().requires_grad_(True)
    (gx,) = torch.autograd.grad(fn(x), x, g)
    return gx


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inverse", [False, True])
def test_hadamard_gradient_matches_reference(device, inverse):
    x, g = torch.randn(2, 8, 64, device=device), torch.randn(2, 8, 64, device=device)
    signs = torch_rkv.hadamard_signs(64, device=device)
    got = grads(lambda t: torch_rkv.hadamard(t, signs, inverse), x, g)
    want = grads(lambda t: ref.hadamard(t, signs.cpu(), inverse), x.cpu(), g.cpu())
    # both are the orthonormal inverse map of g: each output sums 64 terms of |g| / 8
    assert (got.cpu() - want).abs().max() <= 64 * EPS32 * g.abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_gradient_matches_reference(device, interleaved, inverse):
    x, g = torch.randn(2, 3, 16, 64, device=device), torch.randn(2, 3, 16, 64, device=device)
    cos, sin = (t.to(device) for t in torch_rkv.rope_tables(64, 64, rot_dim=32))
    pos = torch.arange(16, device=device) + 5
    got = grads(lambda t: torch_rkv.rope(t, cos, sin, pos, interleaved, inverse), x, g)
    want = grads(lambda t: ref.rope(t, cos.cpu(), sin.cpu(), pos.cpu(), interleaved, inverse), x.cpu(), g.cpu())
    # a rotation of each pair: two products and a sum per element, each rounded once
    assert (got.cpu() - want).abs().max() <= 4 * EPS32 * g.abs().max()


def test_gradient_through_a_chain_of_ops_and_compile():
    """hadamard then rope then the inverses is the identity: the gradient is the incoming one."""
    x, g = torch.randn(4, 16, 64), torch.randn(4, 16, 64)
    cos, sin = torch_rkv.rope_tables(64, 64)
    signs = torch_rkv.hadamard_signs(64)
    pos = torch.arange(16)

    def chain(t):
        t = torch_rkv.rope(torch_rkv.hadamard(t, signs), cos, sin, pos)
        return torch_rkv.hadamard(torch_rkv.rope(t, cos, sin, pos, False, True), signs, True)

    for fn in (chain, torch.compile(chain, fullgraph=True)):
        assert (grads(fn, x, g) - g).abs().max() <= 256 * EPS32 * g.abs().max()


def test_table_gradients_are_refused():
    x = torch.randn(2, 8, 64, requires_grad=True)
    cos, sin = torch_rkv.rope_tables(64, 64)
    cos.requires_grad_(True)
    y = torch_rkv.rope(x, cos, sin, torch.arange(8))
    with pytest.raises(RuntimeError, match="rkv.rope: only x is differentiable"):
        y.sum().backward()


def test_inference_ops_refuse_backward_by_name():
    x = torch.randn(1, 2, 128, 64, requires_grad=True)
    q = torch_rkv.quantize(x, 4)
    with pytest.raises(RuntimeError, match="rkv.quantize is not differentiable"):
        q.scale.float().sum().backward()
    scale = q.scale.float().detach().requires_grad_(True)
    out = torch_rkv.dequantize(q._replace(scale=scale, zero=q.zero.float()))
    with pytest.raises(RuntimeError, match="rkv.dequantize is not differentiable"):
        out.sum().backward()
    with torch.no_grad():  # the documented way: no error, no graph
        assert not torch_rkv.quantize(x, 4).scale.requires_grad


@pytest.mark.filterwarnings("ignore:Error detected in")  # torch's anomaly trace of the expected error
def test_compiled_inference_ops_need_no_grad():
    """Under torch.compile the refusal comes when AOTAutograd traces the backward, with the same message;
    under no_grad the same function compiles and runs."""
    torch._dynamo.reset()
    x = torch.randn(1, 2, 128, 64, requires_grad=True)
    fn = torch.compile(lambda t: torch_rkv.quantize(t, 4).scale, fullgraph=True)
    with pytest.raises(Exception, match="rkv.quantize is not differentiable"):
        fn(x)
    with torch.no_grad():
        assert torch.equal(fn(x), torch_rkv.quantize(x.detach(), 4).scale)
