"""Crash every commit protocol at each of its file-system calls, in real processes.

``python tests/helpers/crash_child.py PROTOCOL WORKDIR [SOURCE]`` (run by tests/test_crash_points.py)
sets up the protocol's previous committed state in a pristine folder, then:

1. runs the protocol once in a forked process under :class:`oprecorder.Recorder`, which
   records every mkdir, create, fsync, rename, unlink and rmtree under the folder, and
   checks their order (:func:`oprecorder.ordering_problems`);
2. for each crash point N (:func:`crash_points`: every call, except that the calls inside a
   temporary folder not yet renamed into place are reduced to the first and last of each
   kind), and each way of failing (``exit``: the process ends with ``os._exit`` right before
   call N, as a crash or SIGKILL would; ``raise``: call N raises ``OSError(EIO)`` and the
   code's own cleanup runs), runs the protocol on a fresh copy of
   the pristine folder in a forked process, then checks the recovery invariants: before
   and after the next start's cleanup, the previous committed state verifies or the new
   one does, complete; nothing foreign was deleted; after the cleanup nothing temporary
   is left.

It prints one JSON object: the recorded calls, and every problem found (empty: passed).
The real code runs unchanged; only the calls are intercepted, from this test-owned process.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch
from absent import as_if_absent
from oprecorder import CRASH_EXIT, Recorder, ordering_problems

from support import save_parts

REPO = Path(__file__).resolve().parents[2]
FOREIGN = {"notes.txt": b"not ours\n", "step-00000007.bak/precious.bin": b"\x00keep"}


def _plant_foreign(folder: Path) -> None:
    for name, data in FOREIGN.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def _foreign_problems(folder: Path) -> list[str]:
    return [
        f"foreign file {name} was deleted or changed"
        for name, data in FOREIGN.items()
        if not (folder / name).is_file() or (folder / name).read_bytes() != data
    ]


def _leftovers(folder: Path, *prefixes: str) -> list[str]:
    return [
        f"{entry.name} left behind after the next start"
        for entry in sorted(folder.iterdir())
        if entry.name.startswith(prefixes)
    ]


class Protocol:
    """``setup(base)`` builds the previous committed state; ``run(base)`` is the commit;
    ``check(base, recovered)`` lists broken invariants; ``recover(base)`` is the next start."""

    def setup(self, base: Path) -> None: ...

    def run(self, base: Path) -> None: ...

    def check(self, base: Path, recovered: bool) -> list[str]: ...

    def recover(self, base: Path) -> None: ...

    def learn(self, base: Path) -> None:
        """Note what the new committed state looks like, from a run that completed."""


# -- checkpoint save and prune ---------------------------------------------------------------

META = save_parts({"best": 0.5})


def _tensors(step: int) -> tuple[dict, dict]:
    return {"w": torch.full((256,), float(step))}, {"s": torch.arange(step + 1, dtype=torch.float64)}


class CheckpointSave(Protocol):
    def __init__(self, keep_last: int, before: list[int]) -> None:
        self.keep_last, self.before, self.new = keep_last, before, max(before) + 1

    def _store(self, base: Path, keep_last: int | None = None):
        from pipeline.checkpoint import CheckpointStore

        return CheckpointStore(base / "estados_local", keep_last=keep_last or self.keep_last)

    def setup(self, base: Path) -> None:
        with self._store(base, 100) as store:
            for step in self.before:
                store.save(step, *_tensors(step), META)
        _plant_foreign(base / "estados_local")

    def run(self, base: Path) -> None:
        with self._store(base) as store:
            store.save(self.new, *_tensors(self.new), META)

    def recover(self, base: Path) -> None:
        with self._store(base) as store:
            store.clean_stale()

    def check(self, base: Path, recovered: bool) -> list[str]:
        from pipeline.checkpoint import LoadMode, load_checkpoint, read_tensors, step_dir_name

        root = base / "estados_local"
        problems = _foreign_problems(root)
        committed = self._store(base).committed_steps()
        for step in committed:
            folder = root / step_dir_name(step)
            try:
                load_checkpoint(folder, mode=LoadMode.VERIFY)
                if not torch.equal(read_tensors(folder / "modelo.safetensors")["w"], _tensors(step)[0]["w"]):
                    problems.append(f"{folder.name} holds another step's weights")
            except Exception as exc:  # noqa: BLE001 - any failure to verify is the finding
                problems.append(f"committed {folder.name} does not verify: {exc}")
        everything = self.before + [self.new]
        if self.new in committed:
            needed = set(everything[-self.keep_last :])
            if not needed <= set(committed) or not set(committed) <= set(everything):
                problems.append(
                    f"after the commit of step {self.new} the folder holds {committed}, "
                    f"expected at least {sorted(needed)}"
                )
        elif committed != self.before:
            problems.append(
                f"step {self.new} is absent but the previous checkpoints {self.before} became {committed}"
            )
        if recovered:
            problems += _leftovers(root, ".tmp-", ".deleting-", ".old-")
        return problems


# -- data preparation ----------------------------------------------------------------------


class DataPreparation(Protocol):
    def _config(self, base: Path):
        from pipeline.config import load_config

        return load_config(REPO / "config.yaml", {"data.dir": str(base / "data")})

    def setup(self, base: Path) -> None:
        _plant_foreign(base)

    def run(self, base: Path) -> None:
        from pipeline.data import prepare_data

        prepare_data(self._config(base))

    def recover(self, base: Path) -> None:
        self.run(base)  # the next start is script 01 again

    def check(self, base: Path, recovered: bool) -> list[str]:
        from pipeline.data import load_manifest

        problems = _foreign_problems(base)
        if (base / "data").exists() or recovered:
            try:
                load_manifest(self._config(base))
            except Exception as exc:  # noqa: BLE001
                problems.append(f"data/ exists but does not verify: {exc}")
        if recovered:
            problems += _leftovers(base, ".tmp-", ".old-")
        return problems


# -- stage swap ----------------------------------------------------------------------------


class StageSwap(Protocol):
    """Replace an existing stage (built with metrics) by a new one (without)."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.manifests: dict[str, bytes] = {}

    def _config(self, base: Path):
        from pipeline.config import load_config

        return load_config(
            REPO / "config.yaml",
            {"checkpoint.dir": str(base / "estados_local"), "data.dir": str(base / "data")},
        )

    def setup(self, base: Path) -> None:
        shutil.copytree(self.source / "estados_local", base / "estados_local")
        shutil.copytree(self.source / "hub_stage", base / "hub_stage")
        _plant_foreign(base)
        self.manifests["old"] = (base / "hub_stage" / "MANIFEST.sha256").read_bytes()

    def run(self, base: Path) -> None:
        from pipeline.stage import build_stage

        build_stage(self._config(base), stage_dir=base / "hub_stage", with_metrics=False)

    def learn(self, base: Path) -> None:
        self.manifests["new"] = (base / "hub_stage" / "MANIFEST.sha256").read_bytes()

    def recover(self, base: Path) -> None:
        from pipeline.audit import stage_lock
        from pipeline.durable import recover

        with stage_lock(base / "hub_stage"):
            recover(base / "hub_stage")

    def check(self, base: Path, recovered: bool) -> list[str]:
        from pipeline.audit import audit_stage
        from pipeline.checkpoint import LoadMode, load_checkpoint

        problems = _foreign_problems(base)
        stage = base / "hub_stage"
        moved_aside = [p for p in base.iterdir() if p.name.startswith(".old-hub_stage-")]
        if stage.exists() or recovered or not moved_aside:
            try:
                audit_stage(stage)
                manifest = (stage / "MANIFEST.sha256").read_bytes()
                if manifest not in self.manifests.values():
                    problems.append("hub_stage/ is neither the previous stage nor the new one")
            except Exception as exc:  # noqa: BLE001
                problems.append(f"hub_stage/ does not audit: {exc}")
        try:
            load_checkpoint("latest", base / "estados_local", mode=LoadMode.VERIFY)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"the source checkpoint no longer verifies: {exc}")
        if recovered:
            problems += _leftovers(base, ".tmp-", ".old-")
        return problems


# -- receipts ------------------------------------------------------------------------------


class ReceiptWrite(Protocol):
    """Overwrite a receipt (the same commit verified again) atomically."""

    COMMIT = "c0ffee" * 6 + "abcd"

    def _write(self, base: Path, step: int) -> Path:
        from pipeline.publishing.verify import Receipt, write_receipt

        return write_receipt(
            base / "hub_receipts",
            Receipt(
                endpoint="http://127.0.0.1:1",
                repo_id="alice/model",
                revision="main",
                path_in_repo="",
                commit=self.COMMIT,
                commit_url="http://x/commit",
                parent=None,
                status="published",
                step=step,
                files=[],
                problems=[],
            ),
        )

    def setup(self, base: Path) -> None:
        self._write(base, 1)
        _plant_foreign(base / "hub_receipts")

    def run(self, base: Path) -> None:
        self._write(base, 2)

    def recover(self, base: Path) -> None:
        self.run(base)  # a rerun of 06 writes the receipt again

    def check(self, base: Path, recovered: bool) -> list[str]:
        folder = base / "hub_receipts"
        problems = _foreign_problems(folder)
        receipts = [p for p in folder.glob("*.json")]
        try:
            [receipt] = receipts
            step = json.loads(receipt.read_bytes())["step"]
            if step not in ((2,) if recovered else (1, 2)):
                problems.append(f"the receipt records step {step}")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"no single readable receipt ({[p.name for p in receipts]}): {exc}")
        if recovered:
            problems += _leftovers(folder, ".")
        return problems


# -- the driver ----------------------------------------------------------------------------


def _in_fork(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked process; its return value is the exit status."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = body()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _fresh(pristine: Path, case: Path) -> Path:
    if case.exists():
        shutil.rmtree(case)
    shutil.copytree(pristine, case, symlinks=True)
    return case


def crash_points(ops: list) -> list[int]:
    """The indices of the calls to fail: every call, except that of the calls made inside a
    temporary folder not yet renamed into place, only the first and last of each kind are kept.

    Until its rename, a temporary folder is invisible to every reader and removed whole by the
    next start, so failing at its 3rd or its 30th file write leaves the same state to recover
    from (a stage writes one file per exported source file: 128 calls, nearly all alike). The
    calls that change what a reader can see (renames, removals, the lock, the parent's fsync)
    are all kept.
    """

    def temp_root(op) -> str | None:
        parts = Path(op.path).parts
        for depth, part in enumerate(parts):
            if part.startswith(".tmp-") and op.kind != "rename":
                return str(Path(*parts[: depth + 1]))
        return None

    kept: dict[tuple, list[int]] = {}
    chosen = []
    for index, op in enumerate(ops):
        root = temp_root(op)
        if root is None:
            chosen.append(index)
        else:
            kept.setdefault((root, op.kind, op.is_dir), []).append(index)
    for indices in kept.values():
        chosen += sorted({indices[0], indices[-1]})
    return sorted(chosen)


def explore(protocol: Protocol, work: Path) -> dict:
    pristine = work / "pristine"
    pristine.mkdir(parents=True)
    protocol.setup(pristine)
    problems: list[str] = [f"before any crash: {p}" for p in protocol.check(pristine, recovered=False)]
    record = work / "ops.json"

    def recorded_run() -> int:
        with Recorder(case) as recorder:
            protocol.run(case)
        record.write_text(json.dumps([op.to_dict() for op in recorder.ops]))
        return 0

    case = _fresh(pristine, work / "case")
    if _in_fork(recorded_run) != 0:
        return {"ops": [], "problems": ["the protocol fails without any injected failure"]}
    from oprecorder import Op

    ops = [Op(**op) for op in json.loads(record.read_text())]
    problems += [f"order: {p}" for p in ordering_problems(ops)]
    protocol.learn(case)
    problems += [f"after a complete run: {p}" for p in protocol.check(case, recovered=True)]
    for index in crash_points(ops):
        op = ops[index]
        for how in ("exit", "raise"):
            where = f"{how} before #{index} {op.kind} {os.path.relpath(op.path, case)}"

            def failing_run() -> int:
                with Recorder(case, fail_at=index, how=how) as recorder:
                    try:
                        protocol.run(case)
                    except OSError:
                        pass
                return 0 if len(recorder.ops) > index else 3

            case = _fresh(pristine, work / "case")
            code = _in_fork(failing_run)
            if code not in ((CRASH_EXIT,) if how == "exit" else (0,)):
                problems.append(f"{where}: the run ended with status {code}, not at the crash point")
                continue
            problems += [f"{where}: {p}" for p in protocol.check(case, recovered=False)]
            try:
                protocol.recover(case)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{where}: the next start failed: {exc}")
                continue
            problems += [f"{where}, after the next start: {p}" for p in protocol.check(case, recovered=True)]
    return {
        "ops": [str(op).replace(str(case), "") for op in ops],
        "crashed_at": crash_points(ops),
        "problems": problems,
    }


def protocol_named(name: str, source: Path | None) -> Protocol:
    if name.startswith("checkpoint-keep"):
        keep_last, before = {
            "checkpoint-keep1": (1, [1]),
            "checkpoint-keep2": (2, [1, 2]),
            "checkpoint-keep2-noprune": (2, [1]),
        }[name]
        return CheckpointSave(keep_last, before)
    return {"data": DataPreparation, "receipt": ReceiptWrite}.get(name, lambda: StageSwap(source))()


if __name__ == "__main__":
    torch.set_num_threads(1)
    name, work = sys.argv[1], Path(sys.argv[2])
    source = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    if name == "stage":
        # Without the optional matplotlib the stage has no curve: the same commit protocol,
        # and each of the many forked cases skips a plot.
        as_if_absent("matplotlib")
        # Imported once here, not in every forked case: the package imports its builder
        # lazily, on first use, which costs each case more than its own build.
        from pipeline.stage import build_stage  # noqa: F401
    print(json.dumps(explore(protocol_named(name, source), work)))
