"""Each step of the pipeline on the command line: its flags, its one call into ``pipeline``, its
report. One module per step, each with ``main(argv, prog)``, which the numbered script and
``python -m pipeline STEP`` both run: ``prepare`` (01), ``train`` (02), ``verify_resume`` (03),
``evaluate`` (04), ``stage`` (05), ``publish`` (06); ``dispatch`` picks the step of ``python -m
pipeline`` and the console command. Torch-free here; a step's module imports what it calls."""

from __future__ import annotations

import argparse
import re

from ..commands import STEPS

__all__ = ["step_parser"]

_SCRIPT = re.compile(r"scripts/(0\d_\w+\.py)")


def step_parser(doc: str | None, prog: str | None) -> argparse.ArgumentParser:
    """The parser of a step: its module's docstring as the description, under ``prog``; with a
    ``prog`` (``python -m pipeline STEP``) the docstring's ``scripts/0N_*.py`` read in that form,
    without one the script's own name and text. No abbreviations: a printed command repeats the
    flags as given."""
    if prog is not None and doc is not None:
        doc = "\n".join(map(_as_module, doc.split("\n")))
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )


def _as_module(line: str) -> str:
    """``line`` with each numbered script named as ``python -m pipeline STEP`` (``-m pipeline
    STEP`` where an interpreter or torchrun already runs it)."""

    def named(match: re.Match[str]) -> str:
        head = line[: match.start()]
        run = head.endswith(("python ", "-B ")) or "torchrun " in head
        step = next((step for step, script in STEPS.items() if script == match.group(1)), None)
        return match.group(0) if step is None else f"{'' if run else 'python '}-m pipeline {step}"

    return _SCRIPT.sub(named, line)
