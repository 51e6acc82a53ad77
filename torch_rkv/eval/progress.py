"""Progress and an ETA for a long evaluation on the terminal.

Work is counted in estimated units (a simulated forward pass of n tokens costs n (1 + n / 4096): the
linear layers, and attention growing with the context), planned up front from the options; the ETA
rescales what remains by the pace measured so far, so a slower machine gets a longer, still honest ETA.
"""

from __future__ import annotations

import time


def forward_units(tokens: int) -> float:
    """A simulated forward pass over `tokens` tokens."""
    return tokens * (1 + tokens / 4096)


def decode_units(tokens: int) -> float:
    """Token by token through a cache: one model call per token, about 25 times a prefill token's cost."""
    return 25.0 * tokens


def clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


class Progress:
    def __init__(self, total: float):
        self.total = max(total, 1.0)
        self.done = 0.0
        self.start = time.time()

    def advance(self, units: float) -> None:
        self.done += units

    def prefix(self) -> str:
        """[percent done, elapsed, ETA]"""
        elapsed = time.time() - self.start
        if self.done <= 0:
            return f"[  0% {clock(elapsed)}]"
        left = max(self.total - self.done, 0.0) * elapsed / self.done
        return f"[{min(99.0, 100 * self.done / self.total):3.0f}% {clock(elapsed)} ETA {clock(left)}]"
