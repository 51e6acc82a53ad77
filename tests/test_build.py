"""The build itself: every registered op has a CPU kernel and a Triton kernel for CUDA, and the CPU kernels
are chosen at run time from the CPU, never from the build machine."""

import os
import subprocess
import sys

import pytest

import torch_rkv
from torch_rkv import _C
from torch_rkv.gpu import registry as gpu_registry

from conftest import RKV_OPS


def test_the_op_list_comes_from_the_registered_schemas():
    assert {"quantize", "dequantize", "pack", "unpack", "rope", "hadamard", "cache_append", "decode_attention",
            "paged_append", "paged_decode_attention", "paged_prefill_attention", "paged_copy"} <= set(RKV_OPS)


@pytest.mark.parametrize("op", RKV_OPS)
def test_cpu_kernel_registered(op):
    assert torch_rkv.has_kernel(op, "cpu")


@pytest.mark.parametrize("op", RKV_OPS)
def test_every_op_has_a_triton_kernel_for_cuda(op):
    """The extension is CPU C++ only: each op's CUDA implementation is its Triton launcher."""
    assert op in gpu_registry.launchers()
    assert torch_rkv.has_kernel(op, "cuda")


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


def _switch_run(value):
    """A process that packs codes on CPU with TORCH_RKV_TRITON_ON_CPU=value: how many times the Triton pack
    kernel ran, or the error."""
    code = ("import torch, torch_rkv\n"
            "from torch_rkv.gpu import pack\n"
            "calls = []\n"
            "kernel = pack._pack_kernel\n"
            "class Probe:\n"
            "    def __getitem__(self, grid):\n"
            "        calls.append(grid)\n"
            "        return kernel[grid]\n"
            "pack._pack_kernel = Probe()\n"
            "c = torch.randint(0, 8, (4, 16), dtype=torch.uint8)\n"
            "assert torch.equal(torch.ops.rkv.pack(c, 3), torch_rkv.reference.pack(c, 3))\n"
            "print(len(calls))\n")
    env = dict(os.environ, TORCH_RKV_TRITON_ON_CPU=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_switch_sends_cpu_tensors_through_the_triton_kernels():
    on, off = _switch_run("1"), _switch_run("0")
    assert on.returncode == 0 and int(on.stdout.split()[-1]) == 1, on.stderr[-2000:]
    assert off.returncode == 0 and int(off.stdout.split()[-1]) == 0, off.stderr[-2000:]
    bad = _switch_run("yes")
    assert bad.returncode != 0 and "TORCH_RKV_TRITON_ON_CPU must be 0 or 1 (got 'yes')" in bad.stderr
