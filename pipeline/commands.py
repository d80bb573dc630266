"""The command lines the pipeline prints in its hints and refusals: a script run again on the
config it was given, a run resumed as it was launched, a torchrun launch under this
interpreter, a stage rebuilt by the very command that built it. Every one repeats every flag
the user gave (a hint that drops one gives a second error when followed), in the form this
process was started in (:func:`invocation`): ``python scripts/05_stage.py ...`` from a numbered
script, ``python -m pipeline stage ...`` from the installed command. Torch-free and
import-light, so any module can name a command without the scripts' plumbing
(:mod:`pipeline.cli`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .durable import write_json_atomic
from .layout import staged_by_file
from .safe_read import read_own

if TYPE_CHECKING:
    from .config import Config

__all__ = [
    "STEPS",
    "Invocation",
    "invocation",
    "python_command",
    "record_stage_command",
    "resume_command",
    "script_command",
    "staged_command",
    "step_command",
    "torchrun_launcher",
    "with_option",
    "with_set",
]

_NUMBERED = re.compile(r"0\d_\w+\.py\Z")

# The steps as ``python -m pipeline STEP`` names them, each beside the numbered script that runs it.
STEPS = {
    "prepare": "01_prepare_data.py",
    "train": "02_train.py",
    "verify-resume": "03_verify_resume.py",
    "evaluate": "04_evaluate.py",
    "stage": "05_stage.py",
    "publish": "06_publish.py",
}
_PACKAGE_MAIN = Path(__file__).resolve().with_name("__main__.py")


@dataclass(frozen=True)
class Invocation:
    """A command line split the way a printed command repeats it."""

    program: tuple[str, ...]
    """What follows the interpreter (or torchrun): ``("scripts/02_train.py",)`` or
    ``("-m", "pipeline", "train")``."""
    script: str | None
    """The numbered script of the step it runs (``"02_train.py"``), ``None`` for another program."""
    flags: tuple[str, ...]
    """The arguments after the program: the flags as given."""

    def of(self, script: str) -> tuple[str, ...]:
        """The program that runs the numbered ``script`` in this same form: ``-m pipeline STEP``
        after the installed command, the script beside this one after a numbered script, else
        ``scripts/<script>`` (a library caller: the scripts' place in a clone)."""
        if self.program[:2] == ("-m", "pipeline"):
            return ("-m", "pipeline", next(step for step, name in STEPS.items() if name == script))
        folder = Path(self.program[0]).parent if self.script is not None else Path("scripts")
        return (str(folder / script),)


def invocation(argv: Sequence[str]) -> Invocation:
    """How ``argv`` (``sys.argv``) started this process: the installed command (``python -m
    pipeline STEP``, whose ``sys.argv[0]`` is the package's ``__main__.py``, as the console
    command's is made to be; under ``torchrun -m pipeline`` too), a numbered script, or another
    program (its flags then are every argument)."""
    first = argv[0] if argv else ""
    if len(argv) > 1 and argv[1] in STEPS and first and Path(first).resolve() == _PACKAGE_MAIN:
        return Invocation(("-m", "pipeline", argv[1]), STEPS[argv[1]], tuple(argv[2:]))
    numbered = bool(first) and _NUMBERED.match(Path(first).name) is not None
    return Invocation((first,), Path(first).name if numbered else None, tuple(argv[1:]))


# Options that choose where a run starts, or extend it (the checkpoint then records the new
# length); a resume replaces them with --resume latest.
_START_OPTIONS = ("--resume", "--init-from", "--extend-to")


def torchrun_launcher(nproc_per_node: int | str, nodes: int = 1) -> list[str]:
    """``python -m torch.distributed.run`` (torchrun) under this interpreter, the one the ranks
    run (a bare ``torchrun`` may be another environment's), for one node or ``nodes``."""
    where = (
        ["--standalone"]
        if nodes == 1
        else [f"--nnodes={nodes}", "--rdzv-backend=c10d", "--rdzv-endpoint=HOST:PORT"]
    )
    return [python_command(), "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc_per_node}"]


def resume_command(argv: list[str], launcher: list[str] | None = None) -> str:
    """The command that continues the run started by ``argv`` (``sys.argv`` of a parser
    built with ``allow_abbrev=False``, so every option is spelled out): this interpreter
    (or ``launcher``: a torchrun launch), the program as invoked (:func:`invocation`), every
    option as given (config, checkpoint folder, each ``--set``) except where the run started
    from and ``--extend-to``, then ``--resume latest``; shell-quoted."""
    invoked = invocation(argv)
    kept, rest = [], iter(invoked.flags)
    for token in rest:
        if token in _START_OPTIONS:
            next(rest, None)
        elif not token.startswith(tuple(f"{option}=" for option in _START_OPTIONS)):
            kept.append(token)
    return shlex.join([*(launcher or [python_command()]), *invoked.program, *kept, "--resume", "latest"])


def with_set(command: str, item: str) -> str:
    """``command`` (shell-quoted, as :func:`resume_command` gives it) with ``--set item``
    (``key=value``) in place of its own ``--set`` of that key, or before its ``--resume``."""
    key, tokens, kept = _set_key(item), shlex.split(command), []
    while tokens:
        token = tokens.pop(0)
        if token == "--set" and tokens and _set_key(tokens[0]) == key:
            tokens.pop(0)
        elif not (token.startswith("--set=") and _set_key(token.removeprefix("--set=")) == key):
            kept.append(token)
    at = kept.index("--resume") if "--resume" in kept else len(kept)
    return shlex.join([*kept[:at], "--set", item, *kept[at:]])


def with_option(command: str, option: str, value: str) -> str:
    """``command`` (shell-quoted) with ``option value`` at its end, in place of its own
    ``option`` (``--option v`` or ``--option=v``): one option, one value."""
    tokens, kept = shlex.split(command), []
    while tokens:
        token = tokens.pop(0)
        if token == option:
            tokens = tokens[1:]
        elif not token.startswith(f"{option}="):
            kept.append(token)
    return shlex.join([*kept, option, value])


def record_stage_command(stage: str | Path, argv: Sequence[str], manifest_sha256: str) -> None:
    """Keep, beside ``stage`` (never in it: it is published), the command that built it:
    ``argv`` (``sys.argv`` of step 05, whose parser takes no abbreviations) under this
    interpreter, in the form it was run in (:func:`invocation`), the folder it ran in, and
    the SHA-256 of the stage's ``MANIFEST.sha256``, which binds the record to this very
    stage. A record that cannot be written is left out: 06 then names the command from the
    config (:func:`staged_command`)."""
    stage = Path(os.path.abspath(stage))
    invoked = invocation(argv)
    record = {
        "command": shlex.join([python_command(), *invoked.program, *invoked.flags]),
        "cwd": os.getcwd(),
        "manifest_sha256": manifest_sha256,
    }
    try:
        write_json_atomic(stage.parent / staged_by_file(stage.name), record)
    except OSError:
        pass


# The record is a few hundred bytes; anything larger is not ours.
_MAX_RECORD_BYTES = 64 * 1024


def staged_command(stage: str | Path, manifest_sha256: str) -> str | None:
    """The command that built ``stage`` as :func:`record_stage_command` kept it, if it built
    exactly this stage (``manifest_sha256``, from the audit) and ran in this working folder
    (its paths are relative to it); else ``None``. A link, a pipe or an oversized file in its
    place is not the record."""
    stage = Path(os.path.abspath(stage))
    try:
        record = json.loads(read_own(stage.parent / staged_by_file(stage.name), _MAX_RECORD_BYTES))
    except (OSError, ValueError):
        return None
    if (
        not isinstance(record, dict)
        or record.get("manifest_sha256") != manifest_sha256
        or record.get("cwd") != os.getcwd()
        or not isinstance(record.get("command"), str)
    ):
        return None
    return record["command"]


def python_command() -> str:
    """How to name this interpreter in a printed command: ``python`` when that is what the
    shell finds first, else its path (relative when under the working folder)."""
    if shutil.which("python") == sys.executable:
        return "python"
    try:
        return (
            os.path.relpath(sys.executable)
            if Path(sys.executable).is_relative_to(Path.cwd())
            else sys.executable
        )
    except (OSError, ValueError):
        return sys.executable


# The options every step takes with one meaning: a command for another step repeats them.
_CONFIG_OPTIONS = ("--config", "--set")


def step_command(script: str) -> str:
    """The command that runs the numbered ``script``'s step, in the form this process was run in
    (:meth:`Invocation.of`: ``python -m pipeline STEP`` after the installed command, ``python
    scripts/0N_*.py`` after a numbered script), with the ``--config`` and each ``--set`` this
    invocation was given: for a refusal raised where no config is at hand (nothing trained yet,
    no stage); shell-quoted."""
    invoked = invocation(sys.argv)
    flags, kept = list(invoked.flags), []
    while flags:
        token = flags.pop(0)
        if token in _CONFIG_OPTIONS and flags:
            kept += [token, flags.pop(0)]
        elif token.startswith(tuple(f"{option}=" for option in _CONFIG_OPTIONS)):
            kept.append(token)
    return shlex.join([python_command(), *invoked.of(script), *kept])


def script_command(config: Config, script: str, *args: str, launcher: list[str] | None = None) -> str:
    """The command that runs the numbered ``script`` with ``args``, under this interpreter or
    ``launcher`` (a torchrun launch); shell-quoted, ready to paste in the folder it is printed
    in. From ``script``'s own step (a hint to run it again) it repeats every flag this
    invocation was given (``sys.argv``; the steps take no abbreviations); from another
    step, the ``--config`` and ``--set`` arguments ``config`` was given. An option of
    ``args`` replaces the given one (a ``--set`` the given ``--set`` of its key): one
    option, one value. The step is named in the form this process was run in
    (:meth:`Invocation.of`): ``-m pipeline STEP``, or the script's path as this one's."""
    invoked = invocation(sys.argv)
    given = list(invoked.flags) if invoked.script == script else list(config.command_args)
    return shlex.join([*(launcher or [python_command()]), *invoked.of(script), *_without(given, args), *args])


def _without(given: list[str], args: Sequence[str]) -> list[str]:
    """``given`` without the options that ``args`` sets again (each with its value)."""
    keys = {_set_key(value) for option, value in zip(args, args[1:]) if option == "--set"}
    options = {arg for arg in args if arg.startswith("--") and arg != "--set"}
    kept: list[str] = []
    while given:
        token = given.pop(0)
        name, equals, value = token.partition("=")
        if token == "--set" and given and _set_key(given[0]) in keys:
            given.pop(0)
        elif equals and name == "--set" and _set_key(value) in keys:
            continue
        elif token in options:
            if given and not given[0].startswith("--"):
                given.pop(0)
        elif not (equals and name in options):
            kept.append(token)
    return kept


def _set_key(item: str) -> str:
    return item.partition("=")[0].strip()
