"""SIGTERM and SIGINT at every phase of a numbered script: one line that tells the truth,
exit 128 + N, nothing left behind (pipeline/stops.py, scripts/_bootstrap.py, pipeline.cli.run_main).

The signal lands where the test wants it: ``tests/helpers/signalled_script.py`` runs the real
script and has it signal itself right before a chosen call (an atomic-folder step, a function,
the exit); the import phase is caught by a real exec whose handlers are read from /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_hostile_folders import leftovers, tiny_folder

from support import HELPERS, PYTHON, REPO, one_line_error, run_python, run_script, script_env

STOPS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]
UNDONE = "what was being staged was removed; an earlier stage is as it was"


def built(target: Path) -> str:
    return (
        f"the stage was built into {target}/ before the stop; check it with: "
        f"cd {target} && sha256sum -c MANIFEST.sha256"
    )


def signalled(signum: int, when: str, script: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    return run_python(
        [HELPERS / "signalled_script.py", signal.Signals(signum).name, when, script, *map(str, args)],
        cwd=cwd,
        env=script_env(),
        timeout=120,
    )


@pytest.fixture
def restaged(tmp_path):
    """A folder staged once, then changed: the next stage replaces the first."""
    folder = tiny_folder(tmp_path / "model")
    target = tmp_path / "stage"
    first = run_script("05_stage.py", "--from-folder", str(folder), "--stage", str(target), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": {"hello": 0, "again": 1}}))
    return folder, target


@pytest.mark.parametrize("signum", STOPS)
@pytest.mark.parametrize("step", ["move_aside", "rename", "fsync_parent", "remove_old"])
def test_a_stop_as_the_new_stage_is_committed_waits_for_it_and_says_it_is_in_place(
    tmp_path, restaged, signum, step
):
    """Cut between the move aside and the old stage's removal, 05 said the new stage was removed
    and the old one as it was, while the new one was in place and the old one left beside it."""
    folder, target = restaged
    result = signalled(
        signum, f"step:{step}", "05_stage.py", "--from-folder", folder, "--stage", target, cwd=tmp_path
    )
    assert result.returncode == 128 + signum, result.stdout + result.stderr
    assert one_line_error(result) == f"error: stopped by {signal.Signals(signum).name}; {built(target)}"
    assert leftovers(tmp_path) == []
    assert json.loads((target / "tokenizer.json").read_text())["vocab"] == {"hello": 0, "again": 1}
    checked = subprocess.run(["sha256sum", "-c", "MANIFEST.sha256"], cwd=target, capture_output=True)
    assert checked.returncode == 0, checked.stdout


@pytest.mark.parametrize("signum", STOPS)
def test_a_stop_before_the_commit_still_undoes_the_stage_and_keeps_the_earlier_one(
    tmp_path, restaged, signum
):
    folder, target = restaged
    result = signalled(
        signum, "step:fsync_temp", "05_stage.py", "--from-folder", folder, "--stage", target, cwd=tmp_path
    )
    assert result.returncode == 128 + signum, result.stdout + result.stderr
    assert one_line_error(result) == f"error: stopped by {signal.Signals(signum).name}; {UNDONE}"
    assert leftovers(tmp_path) == []
    assert json.loads((target / "tokenizer.json").read_text())["vocab"] == {"hello": 0, "world": 1}


@pytest.mark.parametrize("signum", STOPS)
def test_a_stop_after_the_stage_is_built_says_it_was_built(tmp_path, signum):
    """While 05 records its command and prints its table: SIGTERM killed it without a word,
    SIGINT said "interrupted" of a stage fully built."""
    folder = tiny_folder(tmp_path / "model")
    target = tmp_path / "stage"
    when = "call:pipeline.commands:record_stage_command"
    result = signalled(signum, when, "05_stage.py", "--from-folder", folder, "--stage", target, cwd=tmp_path)
    assert result.returncode == 128 + signum, result.stdout + result.stderr
    assert one_line_error(result) == f"error: stopped by {signal.Signals(signum).name}; {built(target)}"
    assert (target / "MANIFEST.sha256").is_file() and leftovers(tmp_path) == []


@pytest.mark.parametrize("signum", STOPS)
def test_a_stop_as_a_script_exits_ends_it_in_one_line_after_what_it_printed(tmp_path, signum):
    folder = tiny_folder(tmp_path / "model")
    target = tmp_path / "stage"
    result = signalled(
        signum, "exit", "05_stage.py", "--from-folder", folder, "--stage", target, cwd=tmp_path
    )
    assert result.returncode == 128 + signum, result.stdout + result.stderr
    name = signal.Signals(signum).name
    assert one_line_error(result) == f"error: stopped by {name} as it exited; what it printed above stands"
    assert f"into {target}/ (without metrics)" in result.stdout  # its report, printed in full before


@pytest.mark.parametrize("signum", STOPS)
def test_a_stop_before_a_script_runs_its_work_says_what_it_left(tmp_path, signum):
    """Outside any block of its own (01 reading its config): no silent death, no traceback."""
    config = tmp_path / "config.yaml"
    config.write_text((REPO / "config.yaml").read_text())
    result = signalled(
        signum, "call:pipeline.cli:config_from_args", "01_prepare_data.py", "--config", config, cwd=tmp_path
    )
    assert result.returncode == 128 + signum, result.stdout + result.stderr
    name = signal.Signals(signum).name
    assert one_line_error(result) == f"error: stopped by {name}; anything half-written was removed"


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (/proc/PID/status SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", STOPS)
@pytest.mark.parametrize("script", ["02_train.py", "05_stage.py", "-m pipeline train"])
def test_a_stop_while_a_script_imports_ends_it_in_one_line_with_nothing_done(tmp_path, signum, script):
    """A real start (no fork server: the imports are the point): SIGTERM killed the script without
    a word, SIGINT printed a KeyboardInterrupt traceback, or was swallowed by torch's import and
    the script ran on. The project's imports (torch) take a second or more; the signal is sent
    as soon as the script's first handler is in place. The installed command alike."""
    env = script_env()
    program = script.split() if script.startswith("-m ") else [str(REPO / "scripts" / script)]
    process = subprocess.Popen(
        [PYTHON, "-B", *program, "--help"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while (
        not _catches(process.pid, signal.SIGTERM) and process.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.001)
    os.kill(process.pid, signum)
    out, err = process.communicate(timeout=120)
    result = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    assert result.returncode == 128 + signum, out + err
    assert (
        one_line_error(result)
        == f"error: stopped by {signal.Signals(signum).name} while starting; nothing was done"
    )
    assert out == ""  # --help was never printed: it never got that far


@pytest.mark.parametrize("signum", STOPS)
def test_a_second_signal_during_the_clean_up_of_a_stop_is_ignored(signum):
    """A user who presses Ctrl-C twice, or a supervisor that sends SIGTERM again, must not cut
    short the removal of what the first stop left half-written."""
    from pipeline.errors import Stopped
    from pipeline.stops import stopping

    cleaned = []
    before = [signal.getsignal(each) for each in (signal.SIGTERM, signal.SIGINT)]
    with stopping("the scratch copy was removed"):
        with pytest.raises(Stopped) as stopped:
            try:
                os.kill(os.getpid(), signum)
                time.sleep(5)  # the handler raises at once; never slept through
            finally:
                os.kill(os.getpid(), signum)  # the second one, while cleaning up
                cleaned.append("the scratch copy")
    assert cleaned == ["the scratch copy"]
    assert str(stopped.value) == f"stopped by {signal.Signals(signum).name}; the scratch copy was removed"
    assert [signal.getsignal(each) for each in (signal.SIGTERM, signal.SIGINT)] == before  # put back


def _handlers() -> dict:
    """This process's SIGTERM and SIGINT handlers."""
    return {each: signal.getsignal(each) for each in (signal.SIGTERM, signal.SIGINT)}


@contextlib.contextmanager
def _handlers_put_back():
    """The test process's handlers as they were, whatever the block set."""
    saved = _handlers()
    try:
        yield
    finally:
        for each, handler in saved.items():
            signal.signal(each, handler)


@pytest.mark.parametrize("until_run_main", [True, False], ids=["until-run-main", "on-its-own"])
def test_the_import_time_handler_stays_for_run_main_or_goes_with_its_block(until_run_main):
    """The numbered scripts keep the import-time handler until run_main installs its own (no
    instant without one); a script that does not end through run_main (scripts/demo.py) gets its
    previous handlers back, so a stop while it runs is not 'stopped while starting; nothing was done'."""
    from pipeline.stops import is_installed, starting

    with _handlers_put_back():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with starting(until_run_main=until_run_main):
            during = _handlers()
        after = _handlers()
    assert during[signal.SIGTERM] is during[signal.SIGINT]
    assert during[signal.SIGTERM] not in (signal.SIG_DFL, signal.default_int_handler, signal.SIG_IGN)
    assert not is_installed(during[signal.SIGTERM])
    if until_run_main:
        assert after == during
    else:
        assert after == {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}


@pytest.mark.parametrize("before", ["nohup", "run-main"])
def test_the_import_time_handler_leaves_an_ignored_signal_and_run_mains_handler_alone(before):
    """A script started ignoring SIGTERM (``nohup``) keeps ignoring it while it imports, and a
    second ``starting`` block (a step run from another one) keeps run_main's handler, so a stop
    there is still cleaned up, not 'stopped while starting; nothing was done'."""
    from pipeline.stops import install, is_installed, starting

    with _handlers_put_back():
        signal.signal(signal.SIGTERM, signal.SIG_IGN if before == "nohup" else signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if before == "run-main":
            install()
        with starting(until_run_main=False):
            during = _handlers()
        after = _handlers()
    if before == "nohup":
        assert during[signal.SIGTERM] is signal.SIG_IGN
        assert during[signal.SIGINT] not in (signal.SIG_IGN, signal.default_int_handler)
        assert not is_installed(during[signal.SIGINT])
        assert after == {signal.SIGTERM: signal.SIG_IGN, signal.SIGINT: signal.default_int_handler}
    else:
        assert during == after and all(is_installed(during[each]) for each in during)


def test_a_stop_after_an_inner_stopping_block_ended_says_what_the_outer_one_leaves():
    """Once a block ends, its outcome goes with it: a stop later in the enclosing block says
    what that one leaves, not what the finished inner work would have."""
    from pipeline.errors import Stopped
    from pipeline.stops import stopping

    with stopping("the new stage was undone"):
        with stopping("the scratch copy was removed"):
            pass
        with pytest.raises(Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at once; never slept through
    assert str(stopped.value) == "stopped by SIGTERM; the new stage was undone"


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "not-committed"])
def test_stops_during_a_held_commit_wait_for_its_end_and_the_first_is_raised(committed):
    """Two signals in a held block: the block runs to its end, then the first signal is
    raised, saying what the commit left (in place, or the block's plain outcome)."""
    from pipeline.errors import Stopped
    from pipeline.stops import held, stopping

    done = []
    with stopping("the new stage was undone", committed="the new stage is in place"):
        with pytest.raises(Stopped) as stopped:
            with held() as hold:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)
                done.append("renamed")
                hold.committed = committed
    assert done == ["renamed"] and stopped.value.signum == signal.SIGTERM
    outcome = "the new stage is in place" if committed else "the new stage was undone"
    assert str(stopped.value) == f"stopped by SIGTERM; {outcome}"


def test_a_stop_in_a_held_block_inside_another_waits_for_the_outer_ones_end():
    """A commit held inside another (a stage's rename within its publish): a stop in the inner
    block waits for the outer block's end too, then says what the outer one left."""
    from pipeline.errors import Stopped
    from pipeline.stops import held, stopping

    done = []
    with stopping("the new stage was undone", committed="the new stage is in place"):
        with pytest.raises(Stopped) as stopped:
            with held() as outer:
                with held():
                    os.kill(os.getpid(), signal.SIGTERM)
                    done.append("inner")
                done.append("outer")
                outer.committed = True
    assert done == ["inner", "outer"] and stopped.value.signum == signal.SIGTERM
    assert str(stopped.value) == "stopped by SIGTERM; the new stage is in place"


@pytest.mark.parametrize("ignored", STOPS)
def test_a_signal_the_script_was_started_ignoring_stays_ignored_once_its_main_runs(ignored):
    """A background job of a shell (``&`` ignores SIGINT) or a wrapper that ignores SIGTERM hands
    the script a signal it must not stop on: run_main's handler leaves that one ignored and
    takes the other, which still stops in one line."""
    from pipeline.errors import Stopped
    from pipeline.stops import install, is_installed

    live = signal.SIGINT if ignored == signal.SIGTERM else signal.SIGTERM
    before = {each: signal.getsignal(each) for each in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(ignored, signal.SIG_IGN)
        signal.signal(live, signal.SIG_DFL)
        install()
        assert signal.getsignal(ignored) is signal.SIG_IGN and is_installed(signal.getsignal(live))
        with pytest.raises(Stopped) as stopped:
            os.kill(os.getpid(), ignored)  # dropped: had it been handled, it would be the one raised
            os.kill(os.getpid(), live)
            time.sleep(5)  # the handler raises at once; never slept through
        assert (
            str(stopped.value) == f"stopped by {signal.Signals(live).name}; anything half-written was removed"
        )
    finally:
        for each, handler in before.items():
            signal.signal(each, handler)


def test_training_started_ignoring_a_signal_trains_through_it_and_still_stops_on_the_other(
    data_dir, tmp_path
):
    """The loop records a stop signal to honour it after the step's save; one the process was
    started ignoring is not recorded: the run trains through it, and the other still stops it."""
    from pipeline.config import load_config
    from pipeline.errors import Preempted
    from pipeline.train import TrainingHooks, train

    ignored, live = signal.SIGINT, signal.SIGTERM  # as a shell's `&` starts it
    checkpoints = tmp_path / "ck"
    sets = {"data.dir": str(data_dir), "checkpoint.dir": str(checkpoints), "training.max_steps": 6}
    config = load_config(REPO / "config.yaml", sets)

    def on_step(run) -> None:
        if run.step == 2:
            os.kill(os.getpid(), ignored)  # dropped: recorded, it would stop the run after step 2
        if run.step == 4:
            os.kill(os.getpid(), live)

    before = {each: signal.getsignal(each) for each in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(ignored, signal.SIG_IGN)
        with pytest.raises(Preempted) as stopped:
            train(
                config,
                progress=False,
                hooks=TrainingHooks(on_step=on_step),
                resume_hint="python scripts/02_train.py --resume latest",
            )
        assert signal.getsignal(ignored) is signal.SIG_IGN  # left as it was, and as it is restored
    finally:
        for each, handler in before.items():
            signal.signal(each, handler)
    where = checkpoints / "step-00000004"
    assert str(stopped.value) == (
        f"stopped by {signal.Signals(live).name} after step 4; checkpoint {where} is committed. "
        "Resume with: python scripts/02_train.py --resume latest"
    )
    assert stopped.value.exit_code == 128 + live
    assert sorted(p.name for p in checkpoints.glob("step-*")) == [where.name]


def test_the_stop_handling_called_from_a_worker_thread_leaves_the_main_threads_alone():
    """A library caller that stages, publishes or trains in a worker thread: the handlers can
    only be set from the main thread, so every entry point is a no-op there (not a ValueError),
    and a block opened there does not change what a stop of the main thread says."""
    import threading

    from pipeline.errors import Stopped
    from pipeline.stops import finishing, install, stopping
    from pipeline.train import _StopSignals

    def handlers() -> dict:
        return {each: signal.getsignal(each) for each in (signal.SIGTERM, signal.SIGINT)}

    before = handlers()
    opened, release, seen = threading.Event(), threading.Event(), []

    def worker() -> None:
        try:
            install()
            finishing()
            with _StopSignals() as signals, stopping("the worker's copy was removed"):
                opened.set()
                release.wait(20)
            seen.append((signals.signum, handlers()))
        except BaseException as exc:  # noqa: BLE001 (asserted below)
            seen.append(exc)
            opened.set()

    thread = threading.Thread(target=worker, daemon=True)
    try:
        with stopping("the main copy was removed"), pytest.raises(Stopped) as stopped:
            thread.start()
            assert opened.wait(20)  # the worker's block is the one opened last
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at once; never slept through
    finally:
        release.set()
        thread.join(20)
    assert seen == [(None, before)] and handlers() == before
    assert str(stopped.value) == "stopped by SIGTERM; the main copy was removed"


@pytest.mark.parametrize("ignored", STOPS)
def test_the_training_loop_leaves_an_ignored_signal_alone_and_puts_the_other_handler_back(ignored):
    """In process, both ways round: the loop's recorder skips the signal the process was
    started ignoring, records the other, and afterwards each handler is the one it found."""
    from pipeline.train import _StopSignals

    live = signal.SIGINT if ignored == signal.SIGTERM else signal.SIGTERM

    def callers(signum, frame):  # the handler training found, to be found again after it
        raise AssertionError("the loop's recorder was not in place")

    before = {each: signal.getsignal(each) for each in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(ignored, signal.SIG_IGN)
        signal.signal(live, callers)
        with _StopSignals() as signals:
            os.kill(os.getpid(), live)
            os.kill(os.getpid(), ignored)  # after the live one: recorded, it would replace it
        after = {each: signal.getsignal(each) for each in (ignored, live)}
    finally:
        for each, handler in before.items():
            signal.signal(each, handler)
    assert (signals.signum, after) == (live, {ignored: signal.SIG_IGN, live: callers})
