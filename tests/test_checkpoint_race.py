"""Scripts 04 and 05 beside a trainer that saves and prunes every step:
each run succeeds on a complete checkpoint, pinned while it is read, or refuses with one
line; never a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from pipeline.audit import audit_stage
from pipeline.checkpoint import CheckpointStore

from support import PYTHON, REPO, script_env

# Two of each: every run pins the newest checkpoint while the trainer prunes under it; more runs
# sample the same race again at the cost of a script start each.
RUNS_EACH = 2


@pytest.mark.heavy
def test_04_and_05_in_a_loop_against_a_trainer_that_prunes_every_step(trained_run, run_copy, tmp_path):
    run = run_copy(trained_run)
    live = ("--set", "checkpoint.dir=live")
    # A long schedule: a save and a prune every step while 04 and 05 read.
    trainer = subprocess.Popen(
        [
            PYTHON,
            "-B",
            str(REPO / "scripts" / "02_train.py"),
            "--config",
            str(REPO / "config.yaml"),
            *live,
            "--quiet",
            "--max-steps",
            "1000000",
            "--checkpoint-every",
            "1",
            "--keep-last",
            "1",
        ],
        cwd=run.root,
        env=script_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    store = CheckpointStore(run.root / "live")
    outcomes = []
    try:
        deadline = time.monotonic() + 600  # for a trainer that never gets there; busy machines are slow
        while not [s for s in store.committed_steps() if s >= 2]:
            assert trainer.poll() is None and time.monotonic() < deadline, "the trainer committed no step 2"
            time.sleep(0.1)  # the trainer is starting
        for attempt in range(RUNS_EACH):
            for name, args in (
                ("04_evaluate.py", ("--output", f"metrics-{attempt}.json")),
                ("05_stage.py", ("--no-metrics", "--stage", f"stage-{attempt}")),
            ):
                assert trainer.poll() is None, trainer.stderr.read()
                result = run.script(name, *live, *args)
                outcomes.append((name, attempt, result))
    finally:
        trainer.send_signal(signal.SIGTERM)
        _, trainer_err = trainer.communicate(timeout=600)
    assert trainer.returncode == 128 + signal.SIGTERM, trainer_err
    for name, attempt, result in outcomes:
        assert "Traceback" not in result.stderr, f"{name} #{attempt}:\n{result.stderr}"
        if result.returncode == 0:
            continue
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    succeeded = [(name, attempt) for name, attempt, result in outcomes if result.returncode == 0]
    # Pinned, a read never loses its checkpoint: every run succeeds.
    assert len(succeeded) == len(outcomes), [r.stderr for _, _, r in outcomes if r.returncode]
    for attempt in range(RUNS_EACH):
        staged = audit_stage(run.root / f"stage-{attempt}")
        meta = json.loads((run.root / f"stage-{attempt}" / "meta.json").read_text())
        assert staged["modelo.safetensors"].sha256 == meta["files"]["modelo.safetensors"]["sha256"]
        assert meta["step"] >= 2
        record = json.loads((run.root / f"metrics-{attempt}.json").read_text())
        assert record["step"] >= 2 and len(record["modelo_sha256"]) == 64
