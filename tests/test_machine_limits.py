"""Counts the machine cannot honour, and running out of processes and threads (pipeline/limits.py).

The runs that need a real limit run as a user of their own under ``RLIMIT_NPROC``: the kernel
does not apply that limit to root (CI runs as root), so ``setpriv`` gives the script another
uid, keeping only the capabilities to read and write the test's files (not CAP_SYS_RESOURCE
nor CAP_SYS_ADMIN, which would exempt it again), and ``prlimit`` sets the limit. A huge count
runs under such a limit too, so a regression fails at a few hundred threads instead of
crowding the shared machine. Skipped where neither root nor the two tools are available.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from pipeline.errors import MachineLimit
from pipeline.limits import FLOOR, PER_CPU, _tasks_of, check_counts, most_threads, usable_cpus

from support import PYTHON, REPO, reseal, script_env

CONFIG = REPO / "config.yaml"
SCRIPTS = REPO / "scripts"
# Plenty for a run (its threads, a background save, the hashing pool), little for a machine.
ROOMY = 200


def _own_uid() -> int:
    for uid in range(61000 + os.getpid() % 3000, 65000):
        if _tasks_of(uid) == 0:
            return uid
    pytest.skip("no free uid to run the limited scripts as")


@pytest.fixture
def limited(tmp_path):
    """``limited(nproc, script, *args, env=...)``: ``scripts/<script> --config config.yaml
    *args`` in ``tmp_path``, as a user of its own allowed ``nproc`` processes and threads; its
    processes are all gone when it returns (any left are killed and reported)."""
    tools = [shutil.which("prlimit"), shutil.which("setpriv")]
    if os.geteuid() != 0 or None in tools:
        pytest.skip("needs root, prlimit and setpriv to run a script under RLIMIT_NPROC")
    uid = _own_uid()
    prefix = [
        tools[0],
        "--nproc={n}:{n}",
        tools[1],
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
    ]
    caps = "+dac_override,+dac_read_search"
    prefix += [f"--inh-caps={caps}", f"--ambient-caps={caps}", PYTHON, "-B"]
    probe = subprocess.run(
        [p.format(n=8) for p in prefix]
        + [
            "-c",
            "import threading; e = threading.Event()\n"
            "for _ in range(20): threading.Thread(target=e.wait, daemon=True).start()",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "can't start new thread" not in probe.stderr:
        pytest.skip(f"RLIMIT_NPROC is not enforced here for uid {uid}")

    # matplotlib asks access() whether its folder is writable, which goes by the uid alone and
    # needs every folder above searchable: one in /tmp, the user's own.
    mpl = tempfile.mkdtemp(prefix="mpl-")
    os.chown(mpl, uid, uid)

    def run(nproc: int, script: str, *args: str, env: dict | None = None, timeout: float = 120):
        environment = script_env(OMP_NUM_THREADS="1", HOME=str(tmp_path), MPLCONFIGDIR=mpl, **(env or {}))
        try:
            return subprocess.run(
                [p.format(n=nproc) for p in prefix] + [str(SCRIPTS / script), "--config", str(CONFIG), *args],
                cwd=tmp_path,
                env=environment,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        finally:
            left = _kill_tasks_of(uid)
            assert not left, f"{script} left processes of its user behind: {left}"

    yield run
    shutil.rmtree(mpl, ignore_errors=True)


def _kill_tasks_of(uid: int) -> list[int]:
    """Kill (by pid) the processes the limited run left, and return their pids."""
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and entry.stat().st_uid == uid
                and "State:\tZ" not in (entry / "status").read_text()
            ):
                left.append(int(entry.name))
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue
    return left


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_count_above_the_machines_ceiling_is_refused_and_one_within_it_passes():
    ceiling = most_threads()
    assert ceiling == max(FLOOR, PER_CPU * usable_cpus())
    check_counts(ceiling)  # the room on this machine is far more than a ceiling's worth
    for threads, workers, key in ((ceiling + 1, 0, "training.threads"), (1, ceiling + 1, "data.num_workers")):
        with pytest.raises(MachineLimit) as refused:
            check_counts(threads, workers)
        assert f"{key}={ceiling + 1} is more than this machine can run usefully" in str(refused.value)
        assert f"at most {ceiling} is allowed" in str(refused.value)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "setting",
    [
        "training.threads=100000",
        "training.threads=30000",
        "training.threads=60000",
        "data.num_workers=100000",
    ],
)
def test_a_thread_or_worker_count_the_machine_cannot_run_is_refused_in_one_line(limited, data_dir, setting):
    """What ended in SIGSEGV, a bare libgomp line, or a hang that ignored SIGTERM: one line, exit
    2, before a thread or a worker starts and before any checkpoint."""
    result = limited(ROOMY, "02_train.py", "--set", f"data.dir={data_dir}", "--set", setting, "--quiet")
    key, value = setting.split("=")
    line = one_error_line(result)
    assert line.startswith(f"error: {key}={value} is more than this machine can run usefully: "), line
    assert f"at most {most_threads()} is allowed" in line, line


@pytest.mark.heavy
def test_counts_that_do_not_fit_the_room_left_are_refused_naming_the_limit(limited, data_dir, tmp_path):
    for args in (["--set", "data.num_workers=2"], ["--set", "training.threads=8"]):
        result = limited(12, "02_train.py", "--set", f"data.dir={data_dir}", *args, "--quiet")
        line = one_error_line(result)
        assert " more threads and processes, but only " in line, line
        assert "this user's limit of 12 processes and threads (ulimit -u)" in line, line
    assert not list((tmp_path / "estados_local").glob("step-*"))


@pytest.mark.heavy
@pytest.mark.parametrize("leave", [0, 1, 2, 3])
def test_workers_that_cannot_start_after_the_check_end_the_run_in_one_line(limited, data_dir, leave):
    """Another program takes the room once the counts were checked (the task's data leaves
    ``leave`` threads free): the DataLoader's fork or its queue's thread fails while its workers
    start; the workers that did start are ended, nothing else is printed."""
    result = limited(
        ROOMY,
        "02_train.py",
        "--set",
        f"data.dir={data_dir}",
        "--set",
        "data.num_workers=2",
        "--set",
        "data.factory=limit_factories:build_crowded_data",
        "--quiet",
        env={"CROWD_LEAVE": str(leave)},
    )
    line = one_error_line(result)
    assert line.startswith("error: the DataLoader's workers (data.num_workers=2): a ") and (
        "could not start" in line and "this machine is out of processes and threads" in line
    ), line


@pytest.mark.heavy
@pytest.mark.parametrize("leave", [0, 1])
def test_a_background_save_whose_thread_cannot_start_ends_the_run_instead_of_waiting_for_ever(
    limited, data_dir, tmp_path, leave
):
    """No room for the snapshot's copying helper (``leave`` 0), or for the writer's thread
    once the helper took the one left (1): one line, and the run does not wait for ever on a
    save that never started. The model is widened to a 47 MB state: the helper shares only
    snapshots from 32 MiB on."""
    result = limited(
        ROOMY,
        "02_train.py",
        "--set",
        f"data.dir={data_dir}",
        "--set",
        "model.params.hidden=1400",
        "--set",
        "data.factory=limit_factories:build_crowded_data",
        "--set",
        "checkpoint.async=true",
        "--quiet",
        env={"CROWD_LEAVE": str(leave)},
        timeout=90,
    )
    line = one_error_line(result)
    assert line.startswith("error: a thread could not start: this machine is out of processes and threads"), (
        line
    )
    assert not list((tmp_path / "estados_local").glob("step-*"))


@pytest.mark.heavy
def test_05_out_of_threads_ends_in_one_line(limited, data_dir, tmp_path):
    """05 starts threads of its own (the audit's read, the hashing): where none can start, one line."""
    crowded = ["--set", f"data.dir={data_dir}", "--set", "model.factory=limit_factories:build_crowded_model"]
    trained = subprocess.run(
        [PYTHON, "-B", str(SCRIPTS / "02_train.py"), "--config", str(CONFIG), *crowded, "--quiet"],
        cwd=tmp_path,
        env=script_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr
    result = limited(ROOMY, "05_stage.py", *crowded, "--no-metrics", env={"CROWD_THE_MACHINE": "1"})
    line = one_error_line(result)
    assert line.startswith("error: a thread could not start: this machine is out of processes and threads"), (
        line
    )
    assert not (tmp_path / "hub_stage").exists()


@pytest.mark.heavy
def test_a_checkpoint_recording_more_threads_than_the_machine_allows_is_refused_unless_the_change_is_accepted(
    limited, data_dir, tmp_path
):
    """A run recorded with a count this machine cannot run (a forged, resealed meta.json, or a
    far larger machine): the resume refuses to restore it, in one line, before a thread starts;
    accepting the change resumes with this process's count, recorded."""
    base = ["--set", f"data.dir={data_dir}", "--set", "training.max_steps=2", "--quiet"]
    first = limited(ROOMY, "02_train.py", *base)
    assert first.returncode == 0, first.stderr
    checkpoint = tmp_path / "estados_local" / "step-00000002"
    reseal(checkpoint, lambda meta: meta["environment"].update(intra_op_threads=100000))
    further = ["--resume", "latest", "--extend-to", "3"]
    line = one_error_line(limited(ROOMY, "02_train.py", *base, *further))
    assert "the checkpoint's intra_op_threads=100000 is more than this machine can run usefully" in line, line
    assert line.endswith(
        "or pass --allow-environment-change to resume with this process's 1 (the resume is then not bitwise "
        "exact, and meta.json records it)"
    ), line
    accepted = limited(ROOMY, "02_train.py", *base, *further, "--allow-environment-change")
    assert accepted.returncode == 0, accepted.stderr
    meta = json.loads((tmp_path / "estados_local" / "step-00000003" / "meta.json").read_text())
    assert {"item": "intra_op_threads", "recorded": 100000, "now": 1, "step": 2} in meta["environment"][
        "changes"
    ]
