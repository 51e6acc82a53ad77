"""The build itself: every op has a CPU kernel, and CUDA kernels exist wherever they could be built."""

import shutil

import pytest
import torch

import torch_rkv

OPS = ["quantize", "dequantize", "pack", "unpack", "rope", "hadamard"]


@pytest.mark.parametrize("op", OPS)
def test_cpu_kernel_registered(op):
    assert torch_rkv.has_kernel(op, "cpu")


@pytest.mark.parametrize("op", OPS)
def test_cuda_kernel_built_when_possible(op):
    """CI has nvcc and a CUDA build of torch but no GPU: the CUDA sources must still have compiled."""
    from torch_rkv import _build_config

    if _build_config.CUDA_MODE == "0":
        pytest.skip("built with RKV_BUILD_CUDA=0: CPU-only build requested")
    if torch.version.cuda is None or shutil.which("nvcc") is None:
        pytest.skip("no CUDA build of torch or no nvcc: the CUDA kernels cannot be built here")
    assert torch_rkv.has_kernel(op, "cuda")


def test_cli_demo_runs(capsys):
    from torch_rkv.__main__ import main

    assert main(["demo", "--tokens", "256", "--dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "pre-RoPE per-channel" in out and "Hadamard + per-token" in out
