"""The build itself: every registered op has a CPU kernel, CUDA kernels exist wherever they could be
built, and the CPU kernels are chosen at run time from the CPU, never from the build machine."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import torch_rkv
from torch_rkv import _C

from conftest import RKV_OPS


def test_the_op_list_comes_from_the_registered_schemas():
    assert {"quantize", "dequantize", "pack", "unpack", "rope", "hadamard", "cache_append", "decode_attention",
            "paged_append", "paged_decode_attention", "paged_prefill_attention", "paged_copy"} <= set(RKV_OPS)


@pytest.mark.parametrize("op", RKV_OPS)
def test_cpu_kernel_registered(op):
    assert torch_rkv.has_kernel(op, "cpu")


@pytest.mark.parametrize("op", RKV_OPS)
def test_cuda_kernel_built_when_possible(op):
    """CI has nvcc and a CUDA build of torch but no GPU: the CUDA sources must still have compiled."""
    if _C.build["cuda_request"] == "0":
        pytest.skip("built with RKV_BUILD_CUDA=0: CPU-only build requested")
    if torch.version.cuda is None or shutil.which("nvcc") is None:
        pytest.skip("no CUDA build of torch or no nvcc: the CUDA kernels cannot be built here")
    assert _C.build["cuda_kernels"] and torch_rkv.has_kernel(op, "cuda")


def _capability_in_subprocess(value):
    env = dict(os.environ, RKV_CPU_CAPABILITY=value)
    return subprocess.run([sys.executable, "-c", "import torch_rkv; print(torch_rkv.cpu_capability())"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_cpu_capability_is_chosen_at_run_time_and_can_be_forced():
    levels = _C.cpu_capabilities()
    assert levels[0] == "default" and torch_rkv.cpu_capability() in levels
    if "RKV_CPU_CAPABILITY" not in os.environ:
        assert torch_rkv.cpu_capability() == levels[-1]  # the best this CPU runs
    forced = _capability_in_subprocess("default")
    assert forced.returncode == 0 and forced.stdout.strip() == "default", forced.stderr


def test_bad_cpu_capability_is_a_clear_error():
    bad = _capability_in_subprocess("avx9000")
    assert bad.returncode != 0 and "RKV_CPU_CAPABILITY=avx9000" in bad.stderr
    assert "frame #" not in bad.stderr  # the message, not a C++ backtrace
    if "avx2" not in _C.cpu_capabilities():  # a CPU without AVX2 refuses the forced level
        refused = _capability_in_subprocess("avx2")
        assert refused.returncode != 0 and "cannot run the avx2 kernels" in refused.stderr


def test_no_generated_files_in_the_source_tree():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert not os.path.exists(os.path.join(root, "torch_rkv", "_build_config.py"))


def test_one_version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        assert version("torch_rkv") == torch_rkv.__version__
    except PackageNotFoundError:
        pytest.skip("torch_rkv is imported from a checkout that pip did not install")


def test_cli_demo_runs(capsys):
    from torch_rkv.__main__ import main

    assert main(["demo", "--tokens", "256", "--dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "pre-RoPE per-channel" in out and "Hadamard + per-token" in out
