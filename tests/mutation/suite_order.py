"""A pytest plugin of `mutate.py --whole-suite`: the tests a mutation names run first, the first
failure is recorded, and one failure stops every worker.

Loaded only by the runner (``-p suite_order``, with tests/mutation/ on ``PYTHONPATH``) and
configured by its environment:

``MUTATE_FIRST``   a JSON list of test ids (``tests/test_x.py::test_y``, a parametrized or a
                   whole-file id too): those tests run first, then the rest of their files, then
                   the suite in its usual order.
``MUTATE_RECORD``  a file: the first failing test (or collection error) written there as JSON,
                   ``{"test": ..., "when": ..., "message": ...}``, by the process that sees every
                   report (the xdist controller, or the only process without xdist). Once it
                   exists, each xdist worker stops after its current test, so a kill does not wait
                   for the other worker's queue.

Run with ``--dist loadgroup --no-loadscope-reorder`` so that xdist hands out the work in the
order set here (a named test's ``xdist_group`` moves first with it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def _named() -> list[str]:
    return list(json.loads(os.environ.get("MUTATE_FIRST") or "[]"))


def _record_path() -> Path | None:
    value = os.environ.get("MUTATE_RECORD")
    return Path(value) if value else None


def bare_id(nodeid: str) -> str:
    """A node id without the ``@group`` suffix pytest-xdist appends under ``--dist loadgroup``
    (xdist's own rule: an ``@`` after the last ``]``)."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def rank(nodeid: str, named: list[str]) -> int:
    """0: a test the mutation names; 1: another test of the same files; 2: any other test."""
    bare = bare_id(nodeid)
    for name in named:
        if bare == name or bare.startswith((name + "[", name + "::")):
            return 0
    files = {name.split("::", 1)[0] for name in named}
    return 1 if bare.split("::", 1)[0] in files else 2


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    # After tests/conftest.py's own order (heavy tests first), which the stable sort keeps within each rank.
    named = _named()
    if named:
        items.sort(key=lambda item: rank(item.nodeid, named))


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _last_line(report) -> str:
    lines = [line for line in str(report.longreprtext or "").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


class _FirstFailure:
    """Writes the first failure to ``MUTATE_RECORD``; on the xdist controller or without xdist."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _record(self, nodeid: str, when: str, message: str) -> None:
        if self.path.exists():
            return
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps({"test": bare_id(nodeid), "when": when, "message": message}))
        temporary.replace(self.path)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self._record(report.nodeid, report.when, _last_line(report))

    @pytest.hookimpl
    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self._record(report.nodeid or "(collection)", "collect", _last_line(report))


@pytest.hookimpl
def pytest_configure(config) -> None:
    path = _record_path()
    if path is not None and not _is_worker(config):
        config.pluginmanager.register(_FirstFailure(path), "suite-order-first-failure")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    path = _record_path()
    if path is not None and _is_worker(item.config) and path.exists():
        item.session.shouldstop = "another worker failed first (mutate.py --whole-suite)"
