"""The installed command: ``python -m pipeline STEP`` and the ``pipeline`` console command run the
steps of scripts/01..06 from any folder, with every relative path the working folder's, and the
commands they print name the form they were run in."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.commands import (
    STEPS,
    Invocation,
    invocation,
    python_command,
    record_stage_command,
    resume_command,
    script_command,
)
from pipeline.config import Config

from support import PYTHON, REPO, one_line_error, script_env

CONFIG = REPO / "config.yaml"
MAIN = REPO / "pipeline" / "__main__.py"


def command(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -B -m pipeline *args`` in ``cwd``: a real start, as a user's shell makes it."""
    return subprocess.run(
        [PYTHON, "-B", "-m", "pipeline", *args],
        cwd=cwd,
        env=env or script_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_command_lists_its_steps_shows_a_steps_flags_and_refuses_an_unknown_step_in_one_line(tmp_path):
    listed = command("--help", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("usage: python -m pipeline STEP [flags]\n"), listed.stdout
    for step in STEPS:
        assert f"\n  {step} " in listed.stdout, listed.stdout
    assert "Prepare the training data and record its SHA-256 fingerprint." in listed.stdout
    flags = command("train", "--help", cwd=tmp_path)
    assert flags.returncode == 0, flags.stderr
    assert flags.stdout.startswith("usage: python -m pipeline train [-h] [--config CONFIG]"), flags.stdout
    assert "--resume latest|auto|PATH" in flags.stdout and "--extend-to N" in flags.stdout
    # Its examples in the form it was run in, a torchrun launch with torchrun's -m.
    assert "    python -m pipeline train --resume latest " in flags.stdout, flags.stdout
    assert "-nproc-per-node 2 -m pipeline train " in flags.stdout and "scripts/" not in flags.stdout
    # A dashed step runs its module (pipeline/entry/verify_resume.py), listed with its summary.
    assert "\n  verify-resume  Prove that resuming from a checkpoint" in listed.stdout, listed.stdout
    proof = command("verify-resume", "--help", cwd=tmp_path)
    assert proof.returncode == 0, proof.stderr
    assert proof.stdout.startswith("usage: python -m pipeline verify-resume [-h]"), proof.stdout
    for wrong in (["trian", "--config", "x.yaml"], []):
        refused = command(*wrong, cwd=tmp_path)
        assert refused.returncode == 2 and refused.stdout == ""
        line = one_line_error(refused)
        assert "python -m pipeline STEP, where STEP is one of prepare, train, verify-resume" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy  # five real starts that import torch
def test_the_steps_run_from_an_empty_folder_into_its_folders_and_print_this_form(tmp_path):
    """Nothing of the clone in the working folder: --config names the repository's config by its
    absolute path, so every output lands in the working folder under the default names."""
    work = tmp_path / "work"
    work.mkdir()
    env = script_env()
    where = subprocess.run(
        [PYTHON, "-c", "import pipeline; print(pipeline.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert Path(where.stdout.strip()) == REPO / "pipeline" / "__init__.py", where  # this tree, not an install
    given = ("--config", str(CONFIG))
    # Unprepared data: the fix printed is the prepare step in this form, and runs as printed.
    line = one_line_error(command("train", *given, "--quiet", cwd=work))
    printed = shlex.split(line.split("run ", 1)[1].removesuffix(" first"))
    assert printed[1:] == ["-m", "pipeline", "prepare", *given], line
    prepared = subprocess.run(printed, cwd=work, env=env, capture_output=True, text=True)
    assert prepared.returncode == 0, prepared.stderr
    assert (work / "data" / "regression" / "manifest.json").is_file()
    trained = command("train", *given, "--quiet", cwd=work)
    assert trained.returncode == 0, trained.stderr
    assert "checkpoint estados_local/step-00000010" in trained.stdout, trained.stdout
    evaluated = command("evaluate", *given, cwd=work)
    assert evaluated.returncode == 0 and "wrote metrics.json" in evaluated.stdout, evaluated.stderr
    staged = command("stage", *given, "--repo-id", "me/first", cwd=work)
    assert staged.returncode == 0, staged.stderr
    assert "into hub_stage/ (with metrics)" in staged.stdout, staged.stdout
    assert (work / "hub_stage" / "MANIFEST.sha256").is_file()
    recorded = json.loads((work / ".hub_stage.staged-by.json").read_text())["command"]
    assert shlex.split(recorded)[1:] == ["-m", "pipeline", "stage", *given, "--repo-id", "me/first"], recorded
    # 06 refuses another repo before any request: its fix is that stage command, in this form.
    line = one_line_error(
        command(
            "publish",
            *given,
            "--repo-id",
            "me/second",
            "--dry-run",
            "--endpoint",
            "http://127.0.0.1:9",
            cwd=work,
        )
    )
    restage = line.split("restage with ", 1)[1].split(", or pass --force-repo-id")[0]
    assert shlex.split(restage)[1:] == ["-m", "pipeline", "stage", *given, "--repo-id", "me/second"], line
    assert sorted(p.name for p in work.iterdir() if not p.name.startswith(".")) == [
        "data", "estados_local", "hub_stage", "metrics.json", "traces"
    ]  # fmt: skip


def test_printed_commands_name_the_form_the_step_was_run_in(monkeypatch, tmp_path):
    """``sys.argv`` of ``python -m pipeline train ...`` (and of ``torchrun -m pipeline train ...``)
    starts with the package's ``__main__.py``: every printed command names ``-m pipeline STEP``."""
    config = Config(command_args=("--config", "mine.yaml"))
    argv = [str(MAIN), "train", "--config", "mine.yaml", "--stop-at", "5", "--resume=auto"]
    assert invocation(argv) == Invocation(
        ("-m", "pipeline", "train"),
        "02_train.py",
        ("--config", "mine.yaml", "--stop-at", "5", "--resume=auto"),
    )
    resume = shlex.split(resume_command(argv))
    assert resume[1:] == [
        "-m",
        "pipeline",
        "train",
        "--config",
        "mine.yaml",
        "--stop-at",
        "5",
        "--resume",
        "latest",
    ]
    launch = shlex.split(resume_command(argv, launcher=["torchrun", "--nproc-per-node=2"]))
    assert launch == ["torchrun", "--nproc-per-node=2", *resume[1:]]
    monkeypatch.setattr("sys.argv", argv)
    again = shlex.split(script_command(config, "02_train.py", "--resume", "7"))
    assert again[1:] == [
        "-m",
        "pipeline",
        "train",
        "--config",
        "mine.yaml",
        "--stop-at",
        "5",
        "--resume",
        "7",
    ]
    other = shlex.split(script_command(config, "01_prepare_data.py"))
    assert other[1:] == ["-m", "pipeline", "prepare", "--config", "mine.yaml"]
    monkeypatch.chdir(tmp_path)
    record_stage_command(tmp_path / "hub_stage", [str(MAIN), "stage", "--repo-id", "me/m"], "0" * 64)
    recorded = json.loads((tmp_path / ".hub_stage.staged-by.json").read_text())["command"]
    assert shlex.split(recorded)[1:] == ["-m", "pipeline", "stage", "--repo-id", "me/m"]
    # The same step as a numbered script: its path, as the scripts always printed it.
    assert shlex.split(resume_command(["scripts/02_train.py", "--stop-at", "5"]))[1:] == [
        "scripts/02_train.py", "--stop-at", "5", "--resume", "latest"
    ]  # fmt: skip
    # The package's __main__.py reached by another spelling of its path is still the installed command.
    detour = str(MAIN.parent / ".." / MAIN.parent.name / MAIN.name)
    assert invocation([detour, "train", "--quiet"]) == Invocation(
        ("-m", "pipeline", "train"), "02_train.py", ("--quiet",)
    )
    # A step's name after another program (python some_tool.py train) is that program's argument.
    assert invocation(["tool.py", "train"]) == Invocation(("tool.py",), None, ("train",))
    # A numbered name ends where it seems to: a final line break makes it another program.
    assert invocation(["tools/09_mine.py", "x"]) == Invocation(("tools/09_mine.py",), "09_mine.py", ("x",))
    assert invocation(["tools/09_mine.py\n", "x"]) == Invocation(("tools/09_mine.py\n",), None, ("x",))


def test_refusals_that_point_at_another_step_name_it_in_the_form_the_step_was_run_in(monkeypatch, tmp_path):
    """``python -m pipeline evaluate`` from an empty folder before any training, ``publish`` before
    any stage, a damaged data manifest: the step each refusal names is the one this form runs
    (``-m pipeline train``), never a ``scripts/02_train.py`` that folder does not hold, with the
    config's options it was given, so that it runs as printed."""
    from pipeline.audit import audit_stage
    from pipeline.checkpoint import resolve
    from pipeline.config import load_config
    from pipeline.data import load_manifest
    from pipeline.errors import DataError, NoCheckpoint, StageAuditError

    monkeypatch.chdir(tmp_path)
    config = load_config(CONFIG, {"data.dir": "data"})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{")
    (tmp_path / "bare_stage").mkdir()
    given = ["--config", str(CONFIG), "--set=training.seed=3", "--set", "card.license=mit"]
    for argv, named in (
        ([str(MAIN), "evaluate", "--checkpoint", "latest", *given], "-m pipeline {step}"),
        (["scripts/04_evaluate.py", "--checkpoint", "latest", *given], "scripts/{script}"),
    ):
        monkeypatch.setattr("sys.argv", argv)
        with pytest.raises(NoCheckpoint) as refused:
            resolve("latest", tmp_path / "estados_local", committed=True)
        # The config's options repeated (every step takes them), not 04's own --checkpoint.
        train = f"{python_command()} {named.format(step='train', script='02_train.py')} {shlex.join(given)}"
        assert f"/: train first with {train}, or pass --checkpoint PATH" in str(refused.value)
        stage = f"{python_command()} {named.format(step='stage', script='05_stage.py')} {shlex.join(given)}"
        with pytest.raises(StageAuditError) as missing:
            audit_stage(tmp_path / "hub_stage")
        assert str(missing.value) == f"{tmp_path / 'hub_stage'} is not a stage folder: run {stage}"
        with pytest.raises(StageAuditError) as bare:
            audit_stage(tmp_path / "bare_stage")
        assert str(bare.value).endswith(f"is not a stage built by {stage}")
        prepare = named.format(step="prepare", script="01_prepare_data.py")
        with pytest.raises(DataError) as damaged:
            load_manifest(config)
        assert str(damaged.value).startswith(
            f"data/manifest.json is damaged: move data/ aside (nothing in it is deleted) and rerun "
            f"{python_command()} {prepare} --config {CONFIG} --set data.dir=data"
        ), damaged.value


def test_the_console_command_is_declared_and_runs_the_steps_in_the_python_m_form(tmp_path):
    """pyproject.toml's ``pipeline`` console command, installed from this tree by pip (offline, no
    dependencies: this environment has them) into a folder of its own, run from an empty one."""
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts == {"pipeline": "pipeline.entry.dispatch:console"}
    source, target, work = tmp_path / "source", tmp_path / "site", tmp_path / "work"
    for name in ("pipeline", "localhub"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    installed = subprocess.run(
        [PYTHON, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    work.mkdir()
    env = {**script_env(), "PYTHONPATH": str(target)}  # the installed copy, not this tree

    def console(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(target / "bin" / "pipeline"), *args], cwd=work, env=env, capture_output=True, text=True
        )

    listed = console("--help")
    assert listed.returncode == 0 and listed.stdout.startswith("usage: pipeline STEP [flags]\n"), listed
    line = one_line_error(console("train", "--config", str(CONFIG)))
    printed = shlex.split(line.split("run ", 1)[1].removesuffix(" first"))
    assert printed[1:] == ["-m", "pipeline", "prepare", "--config", str(CONFIG)], line
    assert list(work.iterdir()) == []


def test_a_library_this_python_cannot_import_is_one_line(tmp_path):
    """A Python without the project's libraries (-S: no site-packages), the package on its path:
    the step's imports fail (yaml, torch), and so do 06's after its flags are read."""
    bare = {**script_env(), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [PYTHON, "-S", "-m", "pipeline", "train", "--help"],
        cwd=tmp_path,
        env=bare,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stdout == ""
    line = one_line_error(result)
    assert line.startswith(f"error: this Python ({PYTHON}) cannot import ") and "pip install -e ." in line, (
        line
    )
    # 06 reads its flags with yaml alone; its Hub client is imported afterwards (run_main's line).
    import yaml

    libraries = tmp_path / "only-yaml"
    libraries.mkdir()
    (libraries / "yaml").symlink_to(Path(yaml.__file__).parent)
    with_yaml = {**bare, "PYTHONPATH": f"{REPO}:{libraries}"}
    result = subprocess.run(
        [PYTHON, "-S", "-m", "pipeline", "publish", "--repo-id", "me/m", "--stage", "s", "--dry-run"],
        cwd=tmp_path,
        env=with_yaml,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert one_line_error(result).startswith(f"error: this Python ({PYTHON}) cannot import "), result.stderr
