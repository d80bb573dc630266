"""`make mutate`: plant each realistic defect of tests/mutation/*.toml alone and check a test fails.

For every mutation: copy the tree (sources only: no .git, .venv or run outputs) into a scratch
folder, apply its exact search/replace edits, and run the tests it names with this project's
interpreter against the copy (the copy first on PYTHONPATH; tests/conftest.py checks that the
package imported is the copy's). The mutation is *killed* when pytest reports a failure.
Prints each result, the kill rate and the survivors; exits 1 if any mutation survived or
could not be applied (a search string that no longer matches the code is an error, never a
silent skip). Before any mutation, the tests named must pass on an unmutated copy: a test
that already fails would "kill" every mutation naming it. Two mutations run at a time, each
pytest on one thread.

With ``--whole-suite`` each mutation, one at a time, runs the WHOLE suite instead (``-x``, xdist
workers under ``--dist loadgroup``), the tests it names and their files first (the plugin
tests/mutation/suite_order.py), and the first failing test is reported, named or not: a kill by
an unrelated (perhaps flaky) test is visible as such. A survivor has run the whole suite.

    python tests/mutation/mutate.py [--only NAME_SUBSTRING] [--files core,trainer] [--jobs 2] [--list]
    python tests/mutation/mutate.py --whole-suite [--files X | --list-file PATH.toml] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib  # Python >= 3.11; `make mutate` is a developer tool, the package needs 3.10
except ModuleNotFoundError:  # pragma: no cover
    raise SystemExit("error: make mutate needs Python >= 3.11 (tomllib) for tests/mutation/*.toml") from None

REPO = Path(__file__).resolve().parents[2]
# Every *.toml beside this file, one per area of the code, read in name order.
MUTATIONS = REPO / "tests" / "mutation"
# Not part of the tree under test: version control, environments, caches and run outputs.
IGNORED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
    "estados_local",
    "hub_stage",
    "hub_receipts",
    "runs",
    ".localhub",
    ".localhub-demo",
    ".demo",
    "metrics.json",
)
TIMEOUT_S = 900
# One whole-suite run (`make test` takes about 4 minutes on 2 idle cores).
SUITE_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Edit:
    file: str
    search: str
    replace: str


@dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    source: str = ""
    """The toml file it comes from, without ``.toml``."""


def load(folder: Path = MUTATIONS, files: list[Path] | None = None) -> list[Mutation]:
    """The mutations of every *.toml of ``folder``, or of ``files`` only."""
    mutations = []
    for path in sorted(folder.glob("*.toml")) if files is None else files:
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise SystemExit(f"error: cannot read the mutation list {path}: {error}") from None
        for entry in raw["mutation"]:
            edits = tuple(Edit(e["file"], e["search"], e["replace"]) for e in entry["edit"])
            mutations.append(Mutation(entry["name"], entry["area"], edits, tuple(entry["tests"]), path.stem))
    names = [m.name for m in mutations]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SystemExit(f"error: {folder} names a mutation twice: {', '.join(duplicates)}")
    return mutations


def check_applies(mutation: Mutation, root: Path = REPO) -> str | None:
    """None when every edit's search string occurs exactly once in its file; else why not."""
    for edit in mutation.edits:
        path = root / edit.file
        if not path.is_file():
            return f"{edit.file} does not exist"
        count = path.read_text(encoding="utf-8").count(edit.search)
        if count != 1:
            return f"search string found {count} times in {edit.file} (must be exactly once): update the mutation"
        if edit.search == edit.replace:
            return f"the edit of {edit.file} changes nothing"
    for test in mutation.tests:
        # "tests/test_x.py::test_name[param]": a renamed test would otherwise only show up
        # when the baseline run reports it missing.
        path, _, name = test.partition("::")
        function = name.split("[", 1)[0]
        source = root / path
        if not source.is_file():
            return f"it names a test in {path}, which does not exist"
        if not name:
            continue  # a whole file: every test of it runs
        if not re.search(rf"^def {re.escape(function)}\(", source.read_text(encoding="utf-8"), re.MULTILINE):
            return f"it names {function}, which {path} does not define: update the mutation"
    return None


def apply(mutation: Mutation, root: Path) -> None:
    for edit in mutation.edits:
        path = root / edit.file
        path.write_text(
            path.read_text(encoding="utf-8").replace(edit.search, edit.replace, 1), encoding="utf-8"
        )


def _scratch_tree(scratch_parent: Path) -> Path:
    tree = Path(tempfile.mkdtemp(prefix="m-", dir=scratch_parent)) / "tree"
    shutil.copytree(REPO, tree, ignore=IGNORED, symlinks=True)
    return tree


def _pytest(
    tree: Path, *args: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(tree), str(tree / "tests" / "helpers"), str(tree / "tests" / "mutation")]
        ),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def baseline(mutations: list[Mutation], scratch_parent: Path, jobs: int) -> str | None:
    """None when every test the mutations name passes on an unmutated copy; else why not.
    Without it a test already failing would "kill" every mutation that names it."""
    tests = sorted({test for mutation in mutations for test in mutation.tests})
    tree = _scratch_tree(scratch_parent)
    try:
        result = _pytest(tree, "-n", str(max(1, jobs)), "--dist", "loadgroup", *tests, timeout=2 * TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the named tests ran past {2 * TIMEOUT_S}s on the unmutated tree"
    finally:
        shutil.rmtree(tree.parent, ignore_errors=True)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        return f"the named tests fail on the unmutated tree (pytest exit {result.returncode}): {' | '.join(tail)}"
    return None


def run_one(mutation: Mutation, scratch_parent: Path) -> tuple[str, str, float]:
    """(status, detail, seconds); status is killed, survived or error."""
    started = time.monotonic()
    why = check_applies(mutation)
    if why is not None:
        return "error", why, 0.0
    tree = _scratch_tree(scratch_parent)
    try:
        apply(mutation, tree)
        try:
            result = _pytest(tree, "-x", "-rfE", *mutation.tests, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "killed", f"the tests ran past {TIMEOUT_S}s", time.monotonic() - started
        tail = [line for line in result.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
        if result.returncode == 1:
            # The killer's id (a parametrised one may hold spaces), so a campaign's kills can be
            # kept with the test that made them: a failing test, or one whose fixture failed. A
            # test id, not a captured log line at level ERROR ("ERROR    name:file.py:96 ...").
            failed = re.search(r"^(?:FAILED|ERROR) (tests/\S.*?)(?: - .*)?$", result.stdout, re.MULTILINE)
            killer = f"by {failed.group(1)}: " if failed else ""
            return "killed", killer + tail[0], time.monotonic() - started
        if result.returncode == 0:
            return "survived", tail[0], time.monotonic() - started
        detail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        # 2: collection failed (the edit broke an import): killed, but say so.
        status = "killed" if result.returncode == 2 else "error"
        return status, f"pytest exit {result.returncode}: {' | '.join(detail)}", time.monotonic() - started
    finally:
        shutil.rmtree(tree.parent, ignore_errors=True)


def run_whole_suite(mutation: Mutation, scratch_parent: Path, workers: int) -> tuple[str, str, float]:
    """(status, detail, seconds) of the whole suite against one mutation, stopped at its first
    failure; the detail names that test and whether the mutation names it."""
    started = time.monotonic()
    why = check_applies(mutation)
    if why is not None:
        return "error", why, 0.0
    tree = _scratch_tree(scratch_parent)
    record = tree.parent / "first-failure.json"
    try:
        apply(mutation, tree)
        env = {"MUTATE_FIRST": json.dumps(list(mutation.tests)), "MUTATE_RECORD": str(record)}
        args = (
            "-x",
            "-p",
            "suite_order",
            "-n",
            str(workers),
            "--dist",
            "loadgroup",
            "--no-loadscope-reorder",
        )
        try:
            result = _pytest(tree, *args, timeout=SUITE_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            return "killed", f"the suite ran past {SUITE_TIMEOUT_S}s", time.monotonic() - started
        seconds = time.monotonic() - started
        if record.is_file():
            first = json.loads(record.read_text(encoding="utf-8"))
            test = first["test"]
            named = "a test it names" if _names(mutation, test) else "NOT a test it names"
            where = "" if first["when"] == "call" else f" (in {first['when']})"
            return "killed", f"first failure {test}{where}, {named}: {first['message']}", seconds
        tail = [line for line in result.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
        if result.returncode == 0:
            return "survived", f"the whole suite passed: {tail[0]}", seconds
        detail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        return "error", f"pytest exit {result.returncode} with no failing test: {' | '.join(detail)}", seconds
    finally:
        shutil.rmtree(tree.parent, ignore_errors=True)


def _names(mutation: Mutation, test: str) -> bool:
    return any(test == name or test.startswith((name + "[", name + "::")) for name in mutation.tests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only mutations whose name contains this text")
    parser.add_argument("--files", help="run only the mutations of these toml files (comma-separated stems)")
    parser.add_argument(
        "--list-file",
        type=Path,
        action="append",
        help="read the mutations from this toml file (same format; repeatable) instead of tests/mutation/*.toml",
    )
    parser.add_argument(
        "--whole-suite",
        action="store_true",
        help="run the whole suite against each mutation, one at a time, with -x; report the first failing test",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="mutations run at the same time (default 2); with --whole-suite, the suite's xdist workers",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="check that every mutation applies and names tests that exist; run nothing",
    )
    args = parser.parse_args(argv)
    # The suite sends SIGINT to the scripts it starts, as a Ctrl-C would. A runner started in
    # the background (a shell's `&`) is handed SIGINT ignored, which its pytest and every script
    # would inherit (they would keep on, and those tests fail on the unmutated tree); a handled
    # signal is reset to its default across exec, so they start as from a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    files = None if args.files is None else set(args.files.split(","))
    mutations = [
        m
        for m in load(files=args.list_file)
        if (args.only is None or args.only in m.name) and (files is None or m.source in files)
    ]
    if not mutations:
        print(f"error: no mutation matches {args.only!r} in {args.files or 'every file'}", file=sys.stderr)
        return 2
    if args.list:
        errors = [(m, check_applies(m)) for m in mutations]
        for mutation, why in errors:
            print(
                f"{'ok   ' if why is None else 'ERROR'}  [{mutation.area}] {mutation.name}"
                + (f": {why}" if why else "")
            )
        return 1 if any(why for _, why in errors) else 0
    if args.whole_suite:
        return whole_suite(mutations, max(1, args.jobs))
    print(f"{len(mutations)} mutations, {args.jobs} at a time, each in a scratch copy of {REPO}", flush=True)
    results: dict[str, tuple[str, str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        print("first, the tests they name, on the unmutated tree ...", flush=True)
        why = baseline(mutations, Path(scratch), args.jobs)
        if why is not None:
            print(f"error: {why}; a kill would prove nothing: fix the tests first", file=sys.stderr)
            return 1
    with (
        tempfile.TemporaryDirectory(prefix="mutate-") as scratch,
        ThreadPoolExecutor(max(1, args.jobs)) as pool,
    ):
        futures = {m.name: pool.submit(run_one, m, Path(scratch)) for m in mutations}
        for mutation in mutations:
            status, detail, seconds = results[mutation.name] = futures[mutation.name].result()
            print(f"{status:<8} {seconds:6.1f}s  [{mutation.area}] {mutation.name}: {detail}", flush=True)
    return summarize(mutations, results)


def whole_suite(mutations: list[Mutation], workers: int) -> int:
    print(
        f"{len(mutations)} mutations, one at a time, each against the whole suite (-x, {workers} workers) "
        f"in a scratch copy of {REPO}",
        flush=True,
    )
    results: dict[str, tuple[str, str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        print("first, the tests they name, on the unmutated tree ...", flush=True)
        applicable = [m for m in mutations if check_applies(m) is None]
        why = baseline(applicable, Path(scratch), workers) if applicable else None
        if why is not None:
            print(f"error: {why}; a kill would prove nothing: fix the tests first", file=sys.stderr)
            return 1
        for mutation in mutations:
            status, detail, seconds = results[mutation.name] = run_whole_suite(
                mutation, Path(scratch), workers
            )
            print(f"{status:<8} {seconds:6.1f}s  [{mutation.area}] {mutation.name}: {detail}", flush=True)
    return summarize(mutations, results)


def summarize(mutations: list[Mutation], results: dict[str, tuple[str, str, float]]) -> int:
    killed = [n for n, r in results.items() if r[0] == "killed"]
    survived = [n for n, r in results.items() if r[0] == "survived"]
    errors = [n for n, r in results.items() if r[0] == "error"]
    # --whole-suite only: killed, but first by a test the mutation does not name (flaky, or a real
    # catch elsewhere: look before counting on it).
    elsewhere = [n for n in killed if "NOT a test it names" in results[n][1]]
    print(f"\nkill rate: {len(killed)}/{len(mutations)} ({100.0 * len(killed) / len(mutations):.1f}%)")
    areas = sorted({m.area for m in mutations})
    print(f"areas covered: {', '.join(areas)}")
    for title, names in (
        ("survivors", survived),
        ("killed first by a test they do not name", elsewhere),
        ("errors (not applied or not run)", errors),
    ):
        if names:
            print(f"{title}:")
            for name in names:
                print(f"  - {name}")
    return 0 if not survived and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
