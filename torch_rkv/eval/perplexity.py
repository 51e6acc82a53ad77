"""Perplexity under the two protocols: simulated (one forward pass, every attention reading quantized
keys and values) and decode (token by token through a real cache: torch_rkv's fused kernel, or a peer)."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .simulate import Simulation, install


def nll_to_ppl(nll: float) -> float:
    return math.exp(nll)


@torch.no_grad()
def simulated(model, ids: torch.Tensor, simulation: Optional[Simulation]) -> float:
    """Perplexity of ids (1, N) with every attention layer routed through `simulation` (None: full
    precision through the same SDPA path)."""
    return perplexity_of(simulated_logprobs(model, ids, simulation), ids)


@torch.no_grad()
def simulated_logprobs(model, ids: torch.Tensor, simulation: Optional[Simulation]) -> torch.Tensor:
    """(N - 1, vocab) float32 log-probabilities of each next token of ids (1, N) under `simulation`."""
    install(model, simulation)
    return F.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)


def perplexity_of(logprobs: torch.Tensor, ids: torch.Tensor) -> float:
    return nll_to_ppl(-logprobs.gather(1, ids[0, 1:, None]).mean().item())


def token_nll(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(N - 1,) float64: each next token's negative log-probability (perplexity = exp of their mean)."""
    return -logprobs.gather(1, ids[0, 1:, None])[:, 0].double()


def block_means(values: torch.Tensor, block: int = 128, samples: int = 2000, seed: int = 0) -> torch.Tensor:
    """(samples,) block-bootstrap draws of the mean of per-token values (N,): runs of `block` consecutive
    tokens (the last one shorter when N is not a multiple) resampled with replacement, each draw the
    token-weighted mean of its runs. Neighbouring tokens' values are correlated, so single tokens would
    understate the spread; runs at different positions are treated as exchangeable although a loss grows
    with context, which widens the interval. Independent texts need independent seeds."""
    runs = -(-values.numel() // block)
    if values.dim() != 1 or runs < 2:
        raise ValueError(f"block bootstrap: {tuple(values.shape)} values make fewer than 2 runs of {block} tokens")
    values = values.double()
    sums = torch.zeros(runs, dtype=torch.float64).index_add_(0, torch.arange(values.numel()) // block, values)
    counts = torch.full((runs,), float(block), dtype=torch.float64)
    counts[-1] = values.numel() - block * (runs - 1)
    pick = torch.randint(0, runs, (samples, runs), generator=torch.Generator().manual_seed(seed))
    return sums[pick].sum(1) / counts[pick].sum(1)


def relative_loss_samples(nll: torch.Tensor, reference: torch.Tensor, block: int = 128, samples: int = 2000,
                          seed: int = 0) -> torch.Tensor:
    """(samples,) block-bootstrap draws (block_means) of perplexity / reference perplexity - 1 over the
    same tokens. Their 2.5 and 97.5 percentiles are a 95% interval for what one text's relative loss
    could have been with other passages of the same kind."""
    if nll.shape != reference.shape or nll.dim() != 1:
        raise ValueError(f"relative_loss_samples: nll {tuple(nll.shape)} and reference {tuple(reference.shape)} "
                         "must be equal 1-D shapes")
    return block_means(nll.double() - reference.double(), block, samples, seed).exp() - 1


def interval(draws: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap draws (their percentiles)."""
    lo, hi = draws.quantile(torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=draws.dtype)).tolist()
    return lo, hi


def ratio_interval(first: torch.Tensor, second: torch.Tensor, level: float = 0.95) -> tuple[float, float] | None:
    """Interval of first / second from two texts' independent bootstrap draws (relative_loss_samples,
    block_means), paired draw by draw; None when the second's own interval reaches 0, where the ratio
    has no bound."""
    if interval(second, level)[0] <= 0:
        return None
    return interval(first / second, level)


def token_kl(reference: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """(positions,) float64 KL(reference || logprobs) at each position, nats: how far a quantized model's
    next-token distribution moved from the reference's (never negative, unlike a perplexity difference,
    and with far less spread between texts, since it does not depend on which token came next)."""
    if reference.shape != logprobs.shape:
        raise ValueError(f"token_kl: reference {tuple(reference.shape)} and logprobs {tuple(logprobs.shape)} differ")
    ref, lp = reference.reshape(-1, reference.shape[-1]), logprobs.reshape(-1, logprobs.shape[-1])
    out = torch.empty(ref.shape[0], dtype=torch.float64)
    for i in range(0, ref.shape[0], 256):  # in chunks: three temporaries of (positions, vocab) otherwise
        r, q = ref[i : i + 256], lp[i : i + 256]
        out[i : i + 256] = (r.exp() * (r - q)).sum(-1).double()
    return out.reshape(reference.shape[:-1])


def kl_divergence(reference: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean token_kl, nats per position."""
    return token_kl(reference, logprobs).mean().item()


@torch.no_grad()
def decoded(model, ids: torch.Tensor, make_cache: Callable[[int], object]) -> float:
    """Perplexity of ids (1, N) fed one token at a time through cache = make_cache(N): the served path."""
    cache = make_cache(ids.shape[1])
    nll = 0.0
    for i in range(ids.shape[1] - 1):
        logits = model(ids[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1].float()
        nll += F.cross_entropy(logits[None], ids[0, i + 1 : i + 2]).item()
    return nll_to_ppl(nll / (ids.shape[1] - 1))


@torch.no_grad()
def chunked(model, ids: torch.Tensor, make_cache: Callable[[int], object], chunk: int) -> float:
    """Perplexity of ids (1, N) fed `chunk` tokens at a time through cache = make_cache(N): the first chunk
    is a prefill, every later one attends over the cache as stored and over itself in full precision
    (chunked prefill, the way a server ingests a long prompt)."""
    cache = make_cache(ids.shape[1])
    nll, count = 0.0, 0
    for start in range(0, ids.shape[1], chunk):
        part = ids[:, start : start + chunk]
        logits = model(part, cache=cache, use_cache=True).logits[0].float()
        targets = ids[0, start + 1 : start + 1 + part.shape[1]]
        nll += F.cross_entropy(logits[: targets.shape[0]], targets, reduction="sum").item()
        count += targets.shape[0]
    return nll_to_ppl(nll / count)
