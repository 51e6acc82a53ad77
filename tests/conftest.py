"""Shared test setup: hypothesis profiles, the device parameter and kernel-presence skips."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import torch_rkv

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
    """cpu always; cuda skipped, with the reason, when no GPU or no CUDA kernels."""
    cuda_mark = []
    if not torch.cuda.is_available():
        cuda_mark = [pytest.mark.skip(reason="no CUDA device on this machine")]
    elif not torch_rkv.has_kernel(op, "cuda"):
        cuda_mark = [pytest.mark.skip(reason="CUDA kernels not built (CPU-only build)")]
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=cuda_mark)]


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
