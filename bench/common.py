"""Shared benchmark plumbing: machine info, timing, JSON records."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys

import torch
import torch.utils.benchmark as benchmark


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_tile", "asimd", "sve")


def machine() -> dict:
    """Where a number came from: the CPU model, its SIMD features, the torch_rkv CPU kernels in use, and
    ATen's own CPU level (each bench prints this in its header)."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "simd": "",
        "threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith("model name") and info["cpu"] in ("", platform.machine(), platform.processor()):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                info["simd"] = "+".join(f for f in SIMD_FLAGS if f in have)
                break
    except OSError:
        pass
    try:
        import torch_rkv

        info["rkv_cpu"] = torch_rkv.cpu_capability()
    except ImportError:
        pass
    info["aten_cpu"] = torch.backends.cpu.get_cpu_capability()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_machine(stream=sys.stderr) -> None:
    print("# " + ", ".join(f"{k}={v}" for k, v in machine().items()), file=stream)


def time_ms(fn, min_run_time: float = 1.0) -> float:
    """Median wall time of fn() in milliseconds (CUDA: synchronized around each block)."""
    if torch.cuda.is_available():
        fn()
        torch.cuda.synchronize()
    # Timer defaults to one thread; measure with every thread torch would use
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def device_ms(fn, calls: int = 50) -> float:
    """CUDA: the GPU time of one fn() call in milliseconds, the summed durations of the kernels (and
    memsets) it launches, averaged over `calls` calls (torch.profiler). A decode step of a few
    microseconds is shorter than the Python that launches it, so wall time (time_ms) measures the host
    there; an engine that replays CUDA graphs pays this."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total_us / calls / 1e3


def time_ratio(fn, base, min_run_time: float = 1.0, rounds: int = 5) -> tuple[float, float]:
    """(ms of fn, median over rounds of fn's time / base's): the two timed in alternation, so that a
    shared machine's drift between two separate measurements does not land in the ratio, and in turns
    first (ABBA), so that neither always finds the caches the other left."""
    ms, ratios = [], []
    for i in range(rounds):
        if i % 2:
            b, a = time_ms(base, min_run_time / rounds), time_ms(fn, min_run_time / rounds)
        else:
            a, b = time_ms(fn, min_run_time / rounds), time_ms(base, min_run_time / rounds)
        ms.append(a)
        ratios.append(a / b)
    return statistics.median(ms), statistics.median(ratios)


def emit(record: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(record), flush=True)
    else:
        print("  ".join(f"{k}={_fmt(v)}" for k, v in record.items()), flush=True)


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
