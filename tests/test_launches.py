"""One run, any launch: a run moves between one process and torchrun with --reshard (both
ways, and from DDP to FSDP2) and on through later resumes and moves, is extended and
warm-started under torchrun as in one process, trains across two torchrun agents
(multi-node on loopback), and its ranks end when their agent dies. A refusal under torchrun
is one line, named by torchrun's own report; the commands it prints resume the run.

The distributed trainings share one launch of two torchrun agents (``--nnodes 2``, c10d
rendezvous on loopback, one process each: tests/helpers/dist_leg.py); the single-process
ones run in this process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from pipeline.checkpoint import LoadMode, load_checkpoint
from pipeline.checkpoint.dist_restore import read_rank_rng
from pipeline.config import load_config
from pipeline.errors import LaunchMismatch, NoCheckpoint, StateMismatch
from pipeline.layout import rank_rng_file
from pipeline.stage import build_stage
from pipeline.train import train

from support import HELPERS, REPO, reseal, run_script, script_env

CONFIG = REPO / "config.yaml"
LAUNCHES = pytest.mark.xdist_group("two-agents")
# Dropout draws from per-rank streams (re-derived by a move); the data order and the
# augmentation noise (seeded per sample) are the same at any world size, so they stay on.
QUIET = {"model.params.dropout": 0.0}


def _runs_this_interpreter(command: str, cwd: Path) -> bool:
    """``command`` starts with the interpreter the ranks ran (as printed in ``cwd``)."""
    return (cwd / shlex.split(command)[0]).resolve() == Path(sys.executable).resolve()


def two_agents(root: Path, runs: list[dict]) -> tuple[list[dict], str]:
    """``runs`` in one launch of two torchrun agents of one process each, rendezvousing over
    c10d on loopback as two nodes would; (rank 0's results, both agents' standard error,
    where progress and messages go)."""
    plan = root / "plan.json"
    plan.write_text(json.dumps({"config": str(CONFIG), "results": str(root / "results.json"), "runs": runs}))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-B",
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=launches",
                f"--rdzv-conf=is_host={'true' if host else 'false'}",
                str(HELPERS / "dist_leg.py"),
                str(plan),
            ],
            cwd=root,
            env=script_env(OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in (True, False)
    ]
    outputs = []
    try:
        outputs = [agent.communicate(timeout=300) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    return json.loads((root / "results.json").read_text()), "".join(err for _, err in outputs)


@pytest.fixture(scope="module")
def moves(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("launches")
    quiet = {"data.dir": str(data_dir), **QUIET}
    train(
        load_config(CONFIG, {**quiet, "checkpoint.dir": str(root / "single_cut")}), stop_at=6, progress=False
    )
    train(load_config(CONFIG, {**quiet, "checkpoint.dir": str(root / "single_full")}), progress=False)
    single_cut = str(root / "single_cut" / "step-00000006")
    ddp = {"data.dir": str(data_dir), "training.parallel": "ddp"}
    # A round trip through every kind of move and a resume of what each wrote: one process to
    # step 2, then under torchrun DDP (training.parallel auto) to 4 and resumed to 6, FSDP2 to
    # 8, and one process again to 10 (test_a_run_moved_again_and_again_...).
    trip = {**quiet, "checkpoint.dir": str(root / "trip"), "checkpoint.keep_last": 10}
    train(load_config(CONFIG, trip), stop_at=2, progress=False)
    # A DDP checkpoint resumed with the other bucket setting: refused, then moved.
    unused = {
        **ddp,
        **QUIET,
        "checkpoint.dir": str(root / "unused"),
        "training.ddp_find_unused_parameters": True,
    }
    results, output = two_agents(
        root,
        [
            {"overrides": {**ddp, "checkpoint.dir": str(root / "straight")}},
            {"overrides": {**ddp, "checkpoint.dir": str(root / "extended"), "training.max_steps": 6}},
            {
                "overrides": {**ddp, "checkpoint.dir": str(root / "extended"), "training.max_steps": 6},
                "resume": "latest",
                "extend_to": 10,
                "progress": True,
            },
            {"overrides": {**ddp, **QUIET, "checkpoint.dir": str(root / "up")}, "resume": single_cut},
            {
                "overrides": {**ddp, **QUIET, "checkpoint.dir": str(root / "up")},
                "resume": single_cut,
                "reshard": True,
                "progress": True,
            },
            {
                "overrides": {**ddp, **QUIET, "checkpoint.dir": str(root / "warm"), "training.max_steps": 2},
                "init_from": str(root / "single_full" / "step-00000010"),
                "progress": True,
            },
            {"overrides": {**ddp, **QUIET, "checkpoint.dir": str(root / "quiet_cut")}, "stop_at": 6},
            {
                "overrides": {
                    **ddp,
                    **QUIET,
                    "training.parallel": "fsdp2",
                    "checkpoint.dir": str(root / "to_fsdp2"),
                },
                "resume": str(root / "quiet_cut" / "step-00000006"),
                "reshard": True,
            },
            {"overrides": trip, "resume": "latest", "reshard": True, "stop_at": 4},
            {"overrides": trip, "resume": "latest", "stop_at": 6},
            {
                "overrides": {**trip, "training.parallel": "fsdp2"},
                "resume": "latest",
                "reshard": True,
                "stop_at": 8,
            },
            {"overrides": unused, "resume": str(root / "quiet_cut" / "step-00000006")},
            {
                "overrides": unused,
                "resume": str(root / "quiet_cut" / "step-00000006"),
                "reshard": True,
                "stop_at": 7,
            },
        ],
    )
    return root, results, output


def weights(folder: Path) -> dict:
    return load_checkpoint(folder, mode=LoadMode.WEIGHTS).model_tensors


def worst_difference(a: Path, b: Path) -> float:
    left, right = weights(a), weights(b)
    assert sorted(left) == sorted(right)
    return max((left[name] - right[name]).abs().max().item() for name in left)


def staged_bytes(checkpoint: Path, out: Path) -> bytes:
    build_stage(load_config(CONFIG), checkpoint=checkpoint, stage_dir=out, with_metrics=False)
    return (out / "modelo.safetensors").read_bytes()


@LAUNCHES
def test_two_agents_extend_a_run_bitwise_as_in_one_process(moves, tmp_path):
    """Two torchrun agents on loopback (the multi-node launch) train, and a 6-step run
    extended to 10 under torchrun is bitwise the straight 10-step run, with the lineage and
    the report of one process."""
    root, results, output = moves
    straight, first, extended = results[:3]
    assert (first["step"], extended["step"], straight["step"]) == (6, 10, 10)
    assert extended["loss"] == straight["loss"]
    assert staged_bytes(root / "extended" / "step-00000010", tmp_path / "a") == staged_bytes(
        root / "straight" / "step-00000010", tmp_path / "b"
    )
    meta = load_checkpoint(root / "extended" / "step-00000010", mode=LoadMode.VERIFY).meta
    assert meta["lineage"] == [{"from_max_steps": 6, "at_step": 6, "to_max_steps": 10}]
    assert meta["config"]["training"]["max_steps"] == 10 and meta["parallel"]["world_size"] == 2
    assert f"resumed from {root / 'extended' / 'step-00000006'} at step 6 (2 processes, ddp)" in output
    assert "extended from max_steps 6 to 10 (recorded in meta.json lineage)" in output


@LAUNCHES
def test_a_launch_prints_each_runs_messages_and_progress_once(moves):
    """Only rank 0 reports: the two agents' output holds the start lines and progress of each
    run that shows its progress (the extension, the move from one process, the warm start),
    each line once, in the order the runs trained, and nothing else but torch's own warnings."""
    root, results, output = moves
    extended, moved, warm = results[2], results[4], results[5]
    batch = "effective batch: 4 rows per optimizer step (1 micro-batch of 4, each split over 2 processes)"

    def steps(result: dict, total: int, rates: list[str]) -> list[str]:
        losses = result["loss"][-len(rates) :]
        first = total - len(rates) + 1
        return [
            f"step {step}/{total}  loss {loss:.6g}  lr {lr}"
            for step, loss, lr in zip(range(first, total + 1), losses, rates)
        ]

    halved = ["0.005", "0.005", "0.0025", "0.0025"]
    # Ignored: torch's own lines, its Python warnings ("[rankN]: ...") and its C++ log
    # ("[W1206 06:57:32.602 TCPStore.cpp:115] ...", when an agent's store closes under a peer).
    torchs = re.compile(r"\[rank\d+\]:|\[?[IWEF]\d{4} \d\d:\d\d:\d\d")
    assert [line for line in output.splitlines() if not torchs.match(line)] == [
        f"resumed from {root / 'extended' / 'step-00000006'} at step 6 (2 processes, ddp)",
        "extended from max_steps 6 to 10 (recorded in meta.json lineage)",
        batch,
        *steps(extended, 10, halved),
        f"resumed from {root / 'single_cut' / 'step-00000006'} at step 6 (2 processes, ddp)",
        "moved from one process (training.parallel none) to 2 processes (training.parallel ddp, "
        "ddp_find_unused_parameters false) at step 6; the result is no longer bitwise that of the first launch "
        "(recorded in meta.json)",
        batch,
        *steps(moved, 10, halved),
        f"init-from {root / 'single_full' / 'step-00000010' / 'modelo.safetensors'}: loaded 6, skipped 0, new 0",
        batch,
        *steps(warm, 2, ["0.01", "0.01"]),
    ]


@LAUNCHES
def test_a_single_process_run_continues_under_torchrun_only_with_reshard(moves):
    root, results, output = moves
    refused, moved = results[3:5]
    assert refused["error"] == "LaunchMismatch" and refused["exit_codes"] == [2, 2], refused
    assert (
        "was written by one process (training.parallel none), this run is 2 processes (training.parallel ddp"
        in refused["message"]
        and "pass --reshard" in refused["message"]
    ), refused
    # The command it names resumes that checkpoint in one process: this interpreter, the config
    # and checkpoint folder of the run, the launch's key once, with the value that launch needs.
    hint = refused["message"].split("as it was launched (")[1].split("), or pass")[0]
    assert _runs_this_interpreter(hint, root) and "torch.distributed.run" not in hint, hint
    assert f"--config {CONFIG}" in hint and f"--set checkpoint.dir={root / 'up'}" in hint, hint
    assert hint.count("training.parallel=") == 1 and "--set training.parallel=none" in hint, hint
    assert hint.endswith(f"--resume {root / 'single_cut' / 'step-00000006'}"), hint
    # training.parallel auto: a single-process checkpoint records the mode it ran, never auto.
    single = load_checkpoint(root / "single_cut" / "step-00000006", mode=LoadMode.VERIFY).meta
    assert single["config"]["training"]["parallel"] == "none"
    assert moved["step"] == 10, moved
    worst = worst_difference(root / "up" / "step-00000010", root / "single_full" / "step-00000010")
    assert worst <= 1e-9, worst
    meta = load_checkpoint(root / "up" / "step-00000010", mode=LoadMode.VERIFY).meta
    assert meta["parallel"]["mode"] == "ddp" and meta["resharded_from"] == 1
    assert meta["environment"]["changes"] == [
        {
            "item": "launch",
            "step": 6,
            "recorded": {"parallel": "none", "world_size": 1, "ddp_find_unused_parameters": None},
            "now": {"parallel": "ddp", "world_size": 2, "ddp_find_unused_parameters": False},
        }
    ]
    assert "moved from one process (training.parallel none) to 2 processes (training.parallel ddp" in output
    # Each rank drew from streams of its own after the move (derived from seed, step and rank),
    # not both from the one process's: only the data order's Generator is shared.
    (first, first_tensors), (second, second_tensors) = (
        read_rank_rng(root / "up" / "step-00000010" / rank_rng_file(rank)) for rank in (0, 1)
    )
    assert first["numpy_generator"] == second["numpy_generator"]
    assert first["python"] != second["python"]
    for name in ("rng/torch_cpu", "rng/numpy_legacy/state/key"):
        assert not torch.equal(first_tensors[name], second_tensors[name]), name


@LAUNCHES
def test_init_from_a_single_process_checkpoint_starts_a_two_process_run(moves, data_dir, tmp_path):
    root, results, output = moves
    assert results[5]["step"] == 2, results[5]
    source = root / "single_full" / "step-00000010"
    assert f"init-from {source / 'modelo.safetensors'}: loaded 6, skipped 0, new 0" in output
    alone = load_config(
        CONFIG,
        {
            "data.dir": str(data_dir),
            **QUIET,
            "checkpoint.dir": str(tmp_path / "warm"),
            "training.max_steps": 2,
        },
    )
    train(alone, init_from=source, progress=False)
    worst = worst_difference(root / "warm" / "step-00000002", tmp_path / "warm" / "step-00000002")
    assert worst <= 1e-9, worst
    meta = load_checkpoint(root / "warm" / "step-00000002", mode=LoadMode.VERIFY).meta
    assert meta["lineage"] == [] and meta["environment"]["changes"] == [] and meta["resharded_from"] is None


@LAUNCHES
def test_a_torchrun_run_continues_in_one_process_or_under_fsdp2_only_with_reshard(moves, data_dir, tmp_path):
    """2 processes (DDP) cut at 6, continued in one process: refused without --reshard, a
    forged state refused by the validated restore, then within 1e-9 of the uninterrupted
    single-process run; the same cut continued under FSDP2 too."""
    root, results, _ = moves
    assert results[6]["step"] == 6 and results[7]["step"] == 10, results[6:]
    worst = worst_difference(root / "to_fsdp2" / "step-00000010", root / "single_full" / "step-00000010")
    assert worst <= 1e-9, worst
    meta = load_checkpoint(root / "to_fsdp2" / "step-00000010", mode=LoadMode.VERIFY).meta
    assert (
        meta["parallel"]["mode"] == "fsdp2"
        and meta["environment"]["changes"][0]["recorded"]["parallel"] == "ddp"
    )

    cut = tmp_path / "cut"
    shutil.copytree(root / "quiet_cut", cut)
    config = load_config(CONFIG, {"data.dir": str(data_dir), **QUIET, "checkpoint.dir": str(cut)})
    with pytest.raises(
        LaunchMismatch,
        match=r"was written by 2 processes \(training.parallel ddp, "
        r"ddp_find_unused_parameters false\), this run is one process",
    ):
        train(config, resume="latest", progress=False)
    forged = tmp_path / "forged" / "step-00000006"
    shutil.copytree(cut / "step-00000006", forged)
    reseal(forged, lambda meta: meta["training_state"]["scheduler"].update(last_epoch=5))
    with pytest.raises(StateMismatch, match="scheduler.last_epoch is 5"):
        train(config, resume=str(forged), reshard=True, progress=False)
    result = train(config, resume="latest", reshard=True, progress=False)
    assert (result.resumed_from, result.step) == (6, 10)
    worst = worst_difference(cut / "step-00000010", root / "single_full" / "step-00000010")
    assert worst <= 1e-9, worst
    meta = load_checkpoint(cut / "step-00000010", mode=LoadMode.VERIFY).meta
    assert "parallel" not in meta and meta["environment"]["changes"][0]["now"]["parallel"] == "none"
    assert meta["schema"] == "pipeline.checkpoint/3" and meta["lineage"] == []


def _ranks(launcher: subprocess.Popen) -> list[int]:
    return [
        int(pid) for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    ]


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.heavy
def test_ranks_stop_with_a_checkpoint_when_their_torchrun_agent_is_killed(data_dir, tmp_path):
    log, checkpoints = tmp_path / "log.txt", tmp_path / "ck"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-B",
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(REPO / "scripts" / "02_train.py"),
            "--config",
            str(CONFIG),
            "--set",
            f"data.dir={data_dir}",
            "--set",
            "training.parallel=ddp",
            "--checkpoint-dir",
            str(checkpoints),
            "--max-steps",
            "1000000",
            "--checkpoint-every",
            "1000000",
            "--set",
            "training.log_every=2",
        ],
        cwd=tmp_path,
        env=script_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while "step 4/" not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        ranks = _ranks(launcher)
        assert len(ranks) == 2
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        # Each rank ends on its own within a second or so (its watchdog polls its parent); the
        # deadline is only for one that never does, generous for a machine busy with other work.
        deadline = time.monotonic() + 180
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks), "a rank outlived its agent by 180 s"
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    # One report of the stop (rank 0's), a stop and not an error.
    text = log.read_text()
    lines = [line for line in text.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(lines) == 1 and lines[0].startswith("stopped by") and "error:" not in text, text[-3000:]
    committed = sorted(checkpoints.glob("step-*"))
    assert len(committed) == 1 and committed[0].name in lines[0]
    load_checkpoint(committed[0], mode=LoadMode.VERIFY)
    # No torchrun report follows an agent killed: the command is in the line and in RESUME.
    command = (checkpoints / "RESUME").read_text().removesuffix("\n")
    assert lines[0].endswith(f"Resume with: {command} (saved in {checkpoints / 'RESUME'})"), lines[0]


@contextlib.contextmanager
def _launcher_killed_under(rank: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """Start ``rank`` (Python that prints 'ready') from a launcher process, SIGKILL the
    launcher once the rank is ready, and yield (launcher, the rank's pid). The launcher's
    stdout is the rank's too; its stderr goes to tmp_path/err.txt. A rank still alive on
    the way out is killed."""
    launcher = (
        "import subprocess, sys\n"
        f"rank = subprocess.Popen([sys.executable, '-c', {rank!r}], stdout=sys.stdout, stderr=sys.stderr)\n"
        "print(rank.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", launcher],
        env=script_env(OMP_NUM_THREADS="1"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "err.txt").open("w"),
        text=True,
    )
    pid = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "ready", (tmp_path / "err.txt").read_text()[-3000:]
        parent.kill()
        parent.wait()
        yield parent, pid
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _ends_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_rank_that_does_not_stop_after_its_agent_died_is_ended(tmp_path):
    """The watchdog's last resort: a rank still running ``grace`` seconds after its
    launcher died (here one that ignores SIGTERM, as one stuck in a collective would) is
    ended, with one line saying why."""
    rank = (
        "import signal, sys, time\n"
        "from pipeline.distributed.world import end_with_launcher\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "end_with_launcher(grace=0.5)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"  # past the wait below: only the watchdog ends it in time
    )
    with _launcher_killed_under(rank, tmp_path) as (_, pid):
        assert _ends_within(pid, 180), "the rank outlived its launcher"
    assert "error: the torchrun agent" in (tmp_path / "err.txt").read_text()


def test_a_rank_whose_agent_died_before_its_watchdog_started_is_ended(tmp_path):
    """An agent killed while its ranks still start up (importing, joining the store) left
    them waiting on its store for minutes: the watchdog took the parent of the moment it
    started, by then already the new one. It watches the process that started the rank."""
    rank = (
        "import os, sys, time\n"
        "from pipeline.distributed.world import end_with_launcher\n"
        "launcher = os.getppid()\n"
        "print('ready', flush=True)\n"
        "while os.getppid() == launcher:\n"
        "    time.sleep(0.02)\n"
        "end_with_launcher(grace=30)\n"
        "time.sleep(60)\n"
        "print('still running', flush=True)\n"
    )
    with _launcher_killed_under(rank, tmp_path) as (_, pid):
        assert _ends_within(pid, 180), "a rank whose agent died before its watchdog started was never stopped"
    errors = [line for line in (tmp_path / "err.txt").read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "gone before this rank started training" in errors[0], errors


def test_a_rank_whose_stop_is_already_agreed_is_not_signalled_when_its_agent_dies(tmp_path):
    """A peer's signal can stop this rank before its own watchdog noticed the dead agent:
    a SIGTERM sent after the loop restored the default handler would kill it before it
    reports the stop (its checkpoint committed, its line and exit code lost)."""
    rank = (
        "import time\n"
        "import torch, torch.distributed as dist\n"
        "from pipeline.distributed.world import LaunchWorld, end_with_launcher\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "world = LaunchWorld(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device('cpu'),\n"
        "              mode='ddp')\n"
        "assert world.agree_signal(15) == 15\n"
        "end_with_launcher(grace=30)\n"
        "print('ready', flush=True)\n"
        "time.sleep(2)  # several watchdog polls after the launcher is gone\n"
        "print('reported its stop', flush=True)\n"
    )
    with _launcher_killed_under(rank, tmp_path) as (launcher, _):
        assert launcher.stdout.readline().strip() == "reported its stop", (
            "the watchdog killed a stopping rank"
        )


def test_a_rank_whose_launch_store_dies_while_it_joins_stops_with_one_line(data_dir, tmp_path):
    """The agent's store gone while a rank joins the process group (the agent killed as its
    ranks start): one line and exit 2, not torch's traceback."""
    host = (
        "import sys, time\n"
        "import torch.distributed as dist\n"
        "store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        "print(store.port, flush=True)\n"
        "while store.num_keys() < 2:  # the joining rank has written its own keys\n"
        "    time.sleep(0.05)\n"
        "print('joined', flush=True)\n"
        "time.sleep(120)\n"
    )
    store = subprocess.Popen(
        [sys.executable, "-c", host], env=script_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(store.stdout.readline())
        rank = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "scripts" / "02_train.py"),
                "--config",
                str(CONFIG),
                "--set",
                f"data.dir={data_dir}",
                "--set",
                "training.parallel=ddp",
                "--checkpoint-dir",
                str(tmp_path / "ck"),
            ],
            cwd=tmp_path,
            env=script_env(
                OMP_NUM_THREADS="1",
                RANK="1",
                WORLD_SIZE="2",
                LOCAL_RANK="1",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert store.stdout.readline().strip() == "joined"
            store.kill()
            _, stderr = rank.communicate(timeout=60)
        finally:
            rank.kill()
    finally:
        store.kill()
    assert rank.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not join the launch's process group" in errors[0], stderr[-3000:]


def test_a_single_process_run_never_imports_the_distributed_checkpoint_stack(data_dir, tmp_path):
    """torch.distributed.checkpoint costs a second or more to import: a run in one process,
    fresh then resumed and extended, leaves it alone."""
    probe = (
        "import sys\n"
        "from pipeline.config import load_config\n"
        "from pipeline.train import train\n"
        "config = load_config(sys.argv[1], {'data.dir': sys.argv[2], 'checkpoint.dir': sys.argv[3],\n"
        "                                   'training.max_steps': 2})\n"
        "train(config, progress=False)\n"
        "train(config, resume='latest', extend_to=3, progress=False)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(CONFIG), str(data_dir), str(tmp_path / "ck")],
        env=script_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _state(folder: Path) -> tuple[dict, dict]:
    """A single-process checkpoint's (model and state tensors, JSON training state)."""
    loaded = load_checkpoint(folder, mode=LoadMode.FULL)
    return {**loaded.model_tensors, **loaded.state_tensors}, loaded.meta["training_state"]


@LAUNCHES
def test_a_run_moved_again_and_again_resumes_after_every_move_and_ends_where_one_process_does(
    moves, data_dir
):
    """1 process -> 2 DDP (--reshard) -> resumed -> FSDP2 (--reshard) -> 1 process (--reshard):
    every leg resumes the checkpoint the previous one wrote after a move. Without per-rank
    randomness (dropout 0; the augmentation noise is seeded per sample), the end equals the
    uninterrupted single-process run within 1e-9: every weight, optimizer moment and history
    value compared as float64, the data order and every JSON field (optimizer hyperparameters
    with their tuples, scheduler, sampler, step) exactly; only the RNG streams, re-derived by
    each move, differ."""
    root, results, _ = moves
    assert [r.get("step") for r in results[8:11]] == [4, 6, 8], results[8:11]
    trip = {
        "data.dir": str(data_dir),
        **QUIET,
        "checkpoint.dir": str(root / "trip"),
        "checkpoint.keep_last": 10,
    }
    config = load_config(CONFIG, trip)
    result = train(config, resume="latest", reshard=True, progress=False)
    assert (result.resumed_from, result.step) == (8, 10)
    end, end_state = _state(root / "trip" / "step-00000010")
    full, full_state = _state(root / "single_full" / "step-00000010")
    compared = [name for name in full if not name.startswith("rng/")]
    assert sorted(compared) == sorted(name for name in end if not name.startswith("rng/"))
    for name in compared:
        if full[name].is_floating_point():
            worst = (end[name].double() - full[name].double()).abs().max().item()
            assert worst <= 1e-9, (name, worst)
        else:
            assert torch.equal(end[name], full[name]), name
    assert {k: v for k, v in end_state.items() if k != "rng"} == {
        k: v for k, v in full_state.items() if k != "rng"
    }
    meta = load_checkpoint(root / "trip" / "step-00000010", mode=LoadMode.VERIFY).meta
    moves_made = [
        (c["recorded"]["parallel"], c["now"]["parallel"], c["step"]) for c in meta["environment"]["changes"]
    ]
    assert moves_made == [("none", "ddp", 2), ("ddp", "fsdp2", 6), ("fsdp2", "none", 8)], moves_made
    ddp_leg = load_checkpoint(root / "trip" / "step-00000006", mode=LoadMode.VERIFY).meta
    assert ddp_leg["config"]["training"]["parallel"] == "ddp"  # auto, as the launch ran it


@LAUNCHES
def test_a_flipped_ddp_bucket_setting_is_refused_then_recorded_as_a_move(moves):
    """ddp_find_unused_parameters changes DDP's reduction order: resuming a checkpoint with the
    other setting is another launch, refused without --reshard (naming the command with the
    recorded setting), recorded in meta.json with it."""
    root, results, _ = moves
    refused, moved = results[11:13]
    assert refused["error"] == "LaunchMismatch" and refused["exit_codes"] == [2, 2], refused
    assert (
        "was written by 2 processes (training.parallel ddp, ddp_find_unused_parameters false), this run "
        "is 2 processes (training.parallel ddp, ddp_find_unused_parameters true)" in refused["message"]
    ), refused
    hint = refused["message"].split("as it was launched (")[1].split("), or pass")[0]
    assert _runs_this_interpreter(hint, root), hint
    assert " -m torch.distributed.run --standalone --nproc-per-node=2 " in hint, hint
    assert hint.count("ddp_find_unused_parameters") == 1, hint
    assert "--set training.ddp_find_unused_parameters=false" in hint, hint
    assert moved["step"] == 7, moved
    meta = load_checkpoint(root / "unused" / "step-00000007", mode=LoadMode.VERIFY).meta
    assert meta["parallel"]["ddp_find_unused_parameters"] is True
    assert meta["environment"]["changes"] == [
        {
            "item": "launch",
            "step": 6,
            "recorded": {"parallel": "ddp", "world_size": 2, "ddp_find_unused_parameters": False},
            "now": {"parallel": "ddp", "world_size": 2, "ddp_find_unused_parameters": True},
        }
    ]


def _as_an_older_version_wrote_it(folder: Path) -> None:
    """meta.json's AdamW betas as a list, resealed: what a checkpoint written after a move
    held before torch's loaders' lists were given back their tuples."""

    def as_a_list(meta: dict) -> None:
        group = meta["training_state"]["optimizer"]["param_groups"][0]
        group["betas"] = group["betas"]["__tuple__"]

    reseal(folder, as_a_list)


@pytest.mark.heavy
def test_a_refusal_under_torchrun_is_one_line_and_torchruns_report_names_it(data_dir, tmp_path):
    """A sealed checkpoint this code cannot continue is refused as not fitting (never as
    damaged: its seal and hashes verify), by every rank alike but printed once, and torchrun's
    failure report, the last thing it prints, names that line as its root cause (the error
    file of torchelastic) rather than "To enable traceback see ...". The default config
    under torchrun with no --set is a DDP run (training.parallel auto)."""
    checkpoints = tmp_path / "ck"
    config = load_config(CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(checkpoints)})
    train(config, stop_at=2, progress=False)
    _as_an_older_version_wrote_it(checkpoints / "step-00000002")
    with pytest.raises(StateMismatch) as refused:
        train(config, resume="latest", progress=False)
    assert "betas is not a tuple of 2 items" in str(refused.value), refused.value
    assert "does not fit this code" in str(refused.value) and "damaged" not in str(refused.value)
    launch = subprocess.run(
        [
            sys.executable,
            "-B",
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(REPO / "scripts" / "02_train.py"),
            "--config",
            str(CONFIG),
            "--set",
            f"data.dir={data_dir}",
            "--checkpoint-dir",
            str(checkpoints),
            "--resume",
            "latest",
            "--reshard",
        ],
        cwd=tmp_path,
        env=script_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert launch.returncode == 1, launch.stderr[-3000:]
    errors = [line for line in launch.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, launch.stderr[-3000:]
    assert "betas is not a tuple of 2 items" in errors[0] and "does not fit this code" in errors[0], errors
    assert "damaged" not in launch.stderr and "Traceback" not in errors[0]
    root_cause = launch.stderr.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {errors[0]}" in root_cause, root_cause
    assert "To enable traceback" not in launch.stderr, launch.stderr[-3000:]
    assert "exitcode  : 2" in root_cause, launch.stderr[-3000:]


def test_training_parallel_ddp_in_one_process_is_one_line_naming_the_launch(data_dir, tmp_path):
    result = run_script(
        "02_train.py",
        "--config",
        str(CONFIG),
        "--set",
        f"data.dir={data_dir}",
        "--set",
        "training.parallel=ddp",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {CONFIG} (with command-line"), result.stderr
    assert "training.parallel is 'ddp', which trains under torchrun" in lines[0], lines
    assert "-m torch.distributed.run --standalone --nproc-per-node=N" in lines[0], lines
    assert lines[0].count("training.parallel=ddp") == 1 and "training.parallel to auto" in lines[0], lines
    assert not (tmp_path / "ck").exists()


def test_a_stopped_runs_resume_note_stays_until_the_run_continues(data_dir, tmp_path):
    """``RESUME`` (written by rank 0 of a stopped torchrun launch) names a launch of the past
    once the run trains again: a start that is refused keeps it, one that resumes removes it."""
    checkpoints = tmp_path / "ck"
    config = load_config(CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(checkpoints)})
    train(config, stop_at=1, progress=False)
    note = checkpoints / "RESUME"
    note.write_text("python -m torch.distributed.run ... --resume latest\n")
    with pytest.raises(NoCheckpoint):
        train(config, resume=str(tmp_path / "nowhere"), progress=False)
    assert note.is_file(), "a refused start removed the note of the stopped run"
    train(config, resume="latest", stop_at=2, progress=False)
    assert not note.exists(), "the note outlived the stop it was written for"
