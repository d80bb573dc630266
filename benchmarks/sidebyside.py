"""The side-by-side method the benchmarks share: rotated order, medians, paired ratios, targets.

Every repetition runs every candidate, in an order rotated by the repetition, so drift and
other jobs on the machine spread over all of them. A ratio is given two ways: the ratio of
the medians, and the median of the per-repetition ratios (two measurements seconds apart,
so load that drifts between repetitions cancels). A target is **met** when both estimates
meet it, **borderline** when one does, **missed** when neither does.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "rotated",
    "summary",
    "Ratio",
    "ratio",
    "verdict",
    "target_table",
    "loadavg",
    "evict",
    "fsync_tree",
]


def rotated(names: Sequence[str], rep: int) -> list[str]:
    shift = rep % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def loadavg() -> float:
    """The 1-minute load average (other jobs on the machine), recorded beside each repetition."""
    return os.getloadavg()[0]


@dataclass(frozen=True, slots=True)
class Ratio:
    """One ratio against its target: ``of_medians`` and ``median_of_ratios``."""

    label: str
    scope: str
    of_medians: float
    median_of_ratios: float | None
    target: float | None

    @property
    def verdict(self) -> str | None:
        return verdict([v for v in (self.of_medians, self.median_of_ratios) if v is not None], self.target)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "scope": self.scope,
            "of_medians": self.of_medians,
            "median_of_ratios": self.median_of_ratios,
            "target": self.target,
            "verdict": self.verdict,
        }


def ratio(label: str, scope: str, top: list[float], bottom: list[float], target: float | None) -> Ratio:
    """``top`` / ``bottom``, both per repetition (paired by index)."""
    paired = [a / b for a, b in zip(top, bottom) if b > 0]
    return Ratio(
        label,
        scope,
        statistics.median(top) / statistics.median(bottom),
        statistics.median(paired) if paired else None,
        target,
    )


def verdict(estimates: list[float], target: float | None) -> str | None:
    if target is None:
        return None
    passed = [value <= target for value in estimates]
    return "met" if all(passed) else "borderline" if any(passed) else "missed"


def target_table(ratios: list[Ratio]) -> str:
    """The compact table: every ratio with a target, both estimates and the verdict."""
    rows = [
        "| target | scope | ratio of medians | median of ratios | goal | verdict |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in ratios:
        if r.target is None:
            continue
        paired = f"{r.median_of_ratios:.3f}" if r.median_of_ratios is not None else "-"
        rows.append(
            f"| {r.label} | {r.scope} | {r.of_medians:.3f} | {paired} | <= {r.target} | {r.verdict} |"
        )
    return "\n".join(rows)


def fsync_tree(root: Path) -> None:
    """fsync a file, or every file of a folder and the folder: what a baseline owes durability."""
    paths = [root] if root.is_file() else [*sorted(p for p in root.rglob("*") if p.is_file()), root]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(root: Path) -> None:
    """Drop a (fsynced, hence clean) file or folder from the page cache: loads read from the device."""
    for path in [root] if root.is_file() else root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
