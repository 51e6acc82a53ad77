"""Shared test setup: hypothesis profiles, the device parameter and kernel-presence skips."""

import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# The Triton kernels run interpreted where there is no GPU (read when they are imported); not in the vLLM
# venv, which runs tests/in_vllm only, with engines that must see the process's own Triton settings.
if not torch.cuda.is_available() and importlib.util.find_spec("vllm") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers (make test runs two): one torch thread each, so two workers share the cores
# instead of each spreading over both
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import torch_rkv  # noqa: E402
from torch_rkv.gpu import registry as gpu_registry  # noqa: E402

# "ci" (default): derandomized and small, what .ci/run runs. "dev": many more examples, random seeds.
# "sanitizer": a few derandomized examples, for runs under compute-sanitizer (scripts/gpu_check.sh).
settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=300, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "sanitizer", derandomize=True, max_examples=4, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def device_params(op: str = "quantize"):
    """cpu always; triton: CPU tensors through the op's Triton kernel under the interpreter (the GPU code
    path, run here; see pytest_runtest_call); cuda skipped, with the reason, when no GPU."""
    cuda_mark = []
    if not torch.cuda.is_available():
        cuda_mark = [pytest.mark.skip(reason="no CUDA device on this machine")]
    elif not torch_rkv.has_kernel(op, "cuda"):
        cuda_mark = [pytest.mark.skip(reason="no CUDA kernel registered")]
    triton_marks = [pytest.mark.triton]
    if not gpu_registry.available():
        triton_marks.append(pytest.mark.skip(reason="triton is not installed"))
    elif op not in gpu_registry.launchers():
        triton_marks.append(pytest.mark.skip(reason=f"rkv.{op} has no Triton kernel"))
    return [pytest.param("cpu", id="cpu"), pytest.param("cpu", id="triton", marks=triton_marks),
            pytest.param("cuda", id="cuda", marks=cuda_mark)]


# hypothesis examples of a test run through the Triton interpreter (RKV_TRITON_EXAMPLES; the interpreter
# runs a kernel's programs one by one in Python, so far fewer than the CPU kernels get)
TRITON_EXAMPLES = int(os.environ.get("RKV_TRITON_EXAMPLES", "3"))
# RKV_TRITON_ALL=1: every triton case; by default a test function's first one (its other parameters are
# the same kernels on other presets or sizes), and opcheck's apart (scripts/triton_on_cpu.py runs them all
# in CI): the interpreter costs seconds a case, and all of them take 13 minutes on 2 cores
TRITON_ALL = os.environ.get("RKV_TRITON_ALL", "0") == "1"


# fixtures that load the real model: their tests take the longest, so they run first (under pytest-xdist
# they then overlap the others instead of ending the run alone)
REAL_MODEL_FIXTURES = ("smollm2", "smollm2_alice")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not set(getattr(item, "fixturenames", ())) & set(REAL_MODEL_FIXTURES))
    if TRITON_ALL:
        return
    seen, keep, drop = set(), [], []
    for item in items:
        if item.get_closest_marker("triton") is None or item.get_closest_marker("skip") is not None:
            keep.append(item)
            continue
        fn = item.nodeid.split("[")[0]
        if fn in seen or fn.endswith("::test_opcheck"):
            drop.append(item)
        else:
            seen.add(fn)
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test marked triton runs with every rkv op that has a Triton kernel sent there on CPU tensors,
    and with at most TRITON_EXAMPLES hypothesis examples."""
    if item.get_closest_marker("triton") is None:
        yield
        return
    fn = item.obj
    old = getattr(fn, "_hypothesis_internal_use_settings", None)
    if old is not None:
        fn._hypothesis_internal_use_settings = settings(old, max_examples=min(old.max_examples, TRITON_EXAMPLES))
    try:
        with gpu_registry.on_cpu():
            yield
    finally:
        if old is not None:
            fn._hypothesis_internal_use_settings = old


DEVICES = device_params()

# Every op of the rkv library, from the registered schemas (not a hand-written list that can fall behind).
RKV_OPS = sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("rkv::"))


def noncontiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values as x in a non-contiguous view (every other element of a wider buffer)."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    view = wide[..., ::2]
    assert not view.is_contiguous() or x.numel() <= 1
    return view


@pytest.fixture(scope="session")
def smollm2_alice():
    """SmolLM2-135M-Instruct, its tokenizer and alice29.txt, loaded once per session (about 35 s), or a
    skip when the evaluation material is not installed. Each user sets the attention it needs: the
    report's simulation and RKVCache both select their own."""
    from torch_rkv.eval import data

    try:
        data.model_gguf(fetch=False)
        text = data.read_text(str(data.text_path()))
    except data.MissingMaterial as e:
        pytest.skip(f"evaluation material unavailable: {e}")
    model, tok = data.load_model()
    return model, tok, text
