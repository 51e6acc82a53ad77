"""Shared benchmark plumbing: machine info, timing, JSON records."""

from __future__ import annotations

import json
import os
import platform
import sys

import torch
import torch.utils.benchmark as benchmark


def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
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


def emit(record: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(record), flush=True)
    else:
        print("  ".join(f"{k}={_fmt(v)}" for k, v in record.items()), flush=True)


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
