"""The token losses the report keeps per row and text, and the relative losses and intervals drawn from them."""

from __future__ import annotations

import torch

from .. import perplexity
from .names import FIRST, SECOND, RowName, TextRow


class TokenLosses:
    """Each row's per-token losses, one tensor per window scored, under its TextRow; with a second text,
    each position's KL from full precision too.

    reference holds full precision's log-probabilities on the window being scored, per text: the FULL
    row of each window is scored before the window's other rows, which keep their KL from it. It holds
    a vocabulary's worth of floats per position, so the second-text section clears it when done.
    """

    def __init__(self):
        self.nll: dict[TextRow, list[torch.Tensor]] = {}
        self.kl: dict[TextRow, list[torch.Tensor]] = {}
        self.reference: dict[str, torch.Tensor] = {}

    def keep(self, key: TextRow, logprobs: torch.Tensor, ids: torch.Tensor, reference: bool) -> None:
        """Keep each token's loss under `key`; reference: full precision's log-probabilities are kept to
        measure the other rows' KL from (a second text is asked for)."""
        self.nll.setdefault(key, []).append(perplexity.token_nll(logprobs, ids))
        if key == key.full_precision() and reference:
            self.reference[key.text] = logprobs
        elif key.text in self.reference:
            self.kl.setdefault(key, []).append(perplexity.token_kl(self.reference[key.text], logprobs))

    @staticmethod
    def tokens_of(kept: dict, key: TextRow) -> torch.Tensor:
        """Every window's per-token values kept under `key`, in one tensor."""
        return torch.cat(kept[key])

    def relative(self, key: TextRow) -> float:
        """The relative perplexity change of the row kept as `key` over the windows it was scored on."""
        nll = self.nll
        return (self.tokens_of(nll, key).mean() - self.tokens_of(nll, key.full_precision()).mean()).exp().item() - 1

    def intervals(self, row: RowName) -> dict:
        """95% intervals of `row`'s relative loss on each text and of their ratio (first / second), from
        the kept token losses, and the same for its mean KL from full precision; none where a text is
        too short for two runs of 128 tokens, or the first text has no such row."""
        nll, kl, cat = self.nll, self.kl, self.tokens_of
        first, second = TextRow(row, FIRST), TextRow(row, SECOND)
        if first not in nll or cat(nll, first.full_precision()).numel() <= 128:
            return {}

        def intervals(measure: str, second: torch.Tensor, first: torch.Tensor) -> dict:
            return {f"{measure}_interval": perplexity.interval(second),
                    f"first_{measure}_interval": perplexity.interval(first),
                    f"{measure}_ratio_interval": perplexity.ratio_interval(first, second)}

        # independent texts, independent draws (seeds 1 and 0)
        out = intervals("relative",
                        perplexity.relative_loss_samples(cat(nll, second), cat(nll, second.full_precision()), seed=1),
                        perplexity.relative_loss_samples(cat(nll, first), cat(nll, first.full_precision()), seed=0))
        if first in kl and second in kl:
            second_kl, first_kl = cat(kl, second), cat(kl, first)
            out.update(kl=second_kl.mean().item(), first_kl=first_kl.mean().item(),
                       **intervals("kl", perplexity.block_means(second_kl, seed=1),
                                   perplexity.block_means(first_kl, seed=0)))
        return out
