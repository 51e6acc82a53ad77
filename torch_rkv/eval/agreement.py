"""Machine-independent agreement of a model running on a quantized cache with its full-precision self.

Token-for-token equality of greedy generations is not a property of this library: the model's own
matmuls take other code paths on other CPUs (MKL, oneDNN and ATen choose the instruction set at run
time), so the full-precision continuation itself moves wherever two candidates are nearly tied. These
two criteria hold on any machine and still fail on a real bug:

- **Teacher-forced log-probabilities.** The reference tokens go through the cache under test (a prefill,
  then one decode step per token), and at every step the log-probabilities of the reference's top
  candidates stay within `bound` of the full-precision forward's.
- **Greedy agreement up to a near-tie.** Two greedy continuations agree token for token up to the first
  step where the full-precision top-2 margin is below `eps`; past a near-tie either continuation is
  right. With eps = 2 x the teacher-forced bound, no step before it can flip unless the bound is broken.

The bound (`logprob_bound`) follows the quantization step: every cached element is within half a
step, 2^-bits of its group's range, and the log-probabilities move by a model-dependent sensitivity
times the square root of that relative step (measured: SmolLM2-135M at 8 / 4 / 3 bits moves its top
candidates by at most 0.12 / 0.57 / 0.95 nats, 1.9 / 2.3 / 2.7 x sqrt(2^-bits); see
tests/test_transformers.py for each model's stated sensitivity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


def logprob_bound(bits: int, sensitivity: float) -> float:
    """The teacher-forced bound, in nats, for a cache whose coarsest tensor has `bits` bits, on a model
    whose log-probabilities move by `sensitivity` x sqrt(relative step)."""
    return sensitivity * 2.0 ** (-bits / 2)


@dataclass
class Agreement:
    ok: bool
    detail: str

    def __bool__(self) -> bool:
        return self.ok


@torch.no_grad()
def full_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Full-precision log-probabilities (n, vocab) of a single sequence ids (1, n), no cache."""
    return torch.log_softmax(model(ids).logits[0].float(), dim=-1)


@torch.no_grad()
def cached_logprobs(model, ids: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """Log-probabilities (n - prompt_len + 1, vocab) predicting tokens prompt_len .. n (the last one past
    the sequence), with ids[:, :prompt_len] prefilled into `cache` and every later token fed as one
    decode step."""
    logits = [model(ids[:, :prompt_len], cache=cache, use_cache=True).logits[:, -1:]]
    for t in range(prompt_len, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    return torch.log_softmax(torch.cat(logits, dim=1)[0].float(), dim=-1)


def teacher_forced(model, ids: torch.Tensor, prompt_len: int, make_cache: Callable[[], object], bound: float,
                   top: int = 8, reference: Optional[torch.Tensor] = None) -> Agreement:
    """Whether every decode step's log-probabilities of the full-precision top-`top` candidates stay
    within `bound` nats of full precision. reference: full_logprobs(model, ids), if already computed."""
    ref = full_logprobs(model, ids) if reference is None else reference
    ref = ref[prompt_len - 1 :]  # the positions that predict tokens prompt_len ..
    got = cached_logprobs(model, ids, prompt_len, make_cache())[: ref.shape[0]]
    cand = ref.topk(top, dim=-1).indices
    err = (got.gather(-1, cand) - ref.gather(-1, cand)).abs().amax(dim=-1)  # per step
    worst = int(err.argmax())
    detail = f"largest top-{top} log-probability change {err[worst]:.4f} nats at step {worst} (bound {bound:.4f})"
    return Agreement(bool(err.max() <= bound), detail)


def greedy_agrees(reference: torch.Tensor, got: torch.Tensor, ref_logprobs: torch.Tensor, eps: float) -> Agreement:
    """Whether continuation `got` equals `reference` (1-d token tensors of equal length) up to the first
    step whose full-precision top-2 margin is below eps. ref_logprobs: (steps, vocab), step i the
    full-precision log-probabilities that chose reference[i]."""
    top2 = ref_logprobs[: reference.numel()].topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    ties = (margins < eps).nonzero()
    checked = int(ties[0]) if ties.numel() else reference.numel()
    differ = (reference[:checked] != got[:checked]).nonzero()
    if differ.numel():
        i = int(differ[0])
        return Agreement(False, f"token {i} differs ({int(got[i])} != {int(reference[i])}) where the full-precision "
                                f"margin is {margins[i]:.4f} >= eps {eps:.4f}")
    return Agreement(True, f"equal over the first {checked} of {reference.numel()} tokens (then a near-tie)")
