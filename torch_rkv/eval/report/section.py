"""A section of the report: a part that knows whether it runs, what it costs and how to run it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .names import RowName

if TYPE_CHECKING:
    from .report import Report


class Section:
    """One part of the report.

    key is the section's entry in the results (and in --json), timing its name in the run's timings.
    A section that does not run leaves an empty list under its key. cost is in progress units
    (torch_rkv.eval.progress), planned before anything runs; rows names the schemes the section resolves,
    which tells whether it needs the model's sensitivity profile.
    """

    key: str = ""
    timing: str = ""

    def runs(self, report: Report) -> bool:
        """Whether the options ask for this section."""
        return True

    def rows(self, report: Report) -> list[RowName]:
        """The named schemes this section resolves through Report.layer_schemes."""
        return []

    def needs_profile(self, report: Report) -> bool:
        """Whether this section resolves a row through the sensitivity profile."""
        return any(row.profiled for row in self.rows(report))

    def cost(self, report: Report) -> float:
        """The section's work in progress units, from the options alone."""
        raise NotImplementedError

    def run(self, report: Report) -> Any:
        """Measure the section's rows on the report's model and text; returns its results entry."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<section {self.timing}>"
