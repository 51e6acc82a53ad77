"""The report's sections in the order they run, and the plan of a run: the sections that run, each with
its cost. The progress ETA is the plan's cost and Report.run runs the plan's sections, so the two cannot
disagree about which sections run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .allocation import Allocation
from .chunked import ChunkedPrefill
from .decode import DecodeProtocol, Peers
from .figures import Plots
from .localization import Localization
from .long_context import LongContext
from .reproduction import Reproduction
from .schemes import EightBits, FullPrecision, Schemes
from .second_text import SecondText
from .section import Section

if TYPE_CHECKING:
    from .report import Report

# Every section, in the order the report runs and lists them.
SECTIONS: tuple[Section, ...] = (FullPrecision(), Reproduction(), Schemes(), EightBits(), LongContext(), Allocation(),
                                 SecondText(), Localization(), DecodeProtocol(), ChunkedPrefill(), Peers(), Plots())


@dataclass(frozen=True)
class Plan:
    """The sections a report runs, in order, each with its cost in progress units.

    The sensitivity profile is measured on first use, so its cost (none when it is stored) is carried
    by the first section that needs it.
    """

    steps: tuple[tuple[Section, float], ...]

    @classmethod
    def of(cls, report: Report, sections: tuple[Section, ...] = SECTIONS) -> Plan:
        """The plan of the sections whose options ask for them."""
        steps, profile_counted = [], False
        for section in sections:
            if not section.runs(report):
                continue
            cost = section.cost(report)
            if not profile_counted and section.needs_profile(report):
                cost += report.profile_cost()
                profile_counted = True
            steps.append((section, cost))
        return cls(tuple(steps))

    @property
    def sections(self) -> tuple[Section, ...]:
        """The sections that run, in order."""
        return tuple(section for section, _ in self.steps)

    @property
    def cost(self) -> float:
        """The whole run in progress units: the sum of the costs of the sections that run."""
        return sum(cost for _, cost in self.steps)
