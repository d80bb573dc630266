"""Helpers shared by the tests: run the real scripts as subprocesses and compare checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"
PYTHON = sys.executable

# The tree under test, first on every import path: this process's (imports of pipeline and
# the tests' helpers) and every subprocess's (scripts, proof legs, forkserver trainers,
# the local Hub). Otherwise the editable install of some other checkout, a worktree or a
# scratch copy made by `make mutate`, would be what runs, and its tests would prove nothing.
TREE_PATH = os.pathsep.join([str(REPO), str(HELPERS)])


def use_tree_under_test() -> None:
    """Put this tree first on ``sys.path`` and ``PYTHONPATH`` (called once by conftest)."""
    for entry in (str(HELPERS), str(REPO)):
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)
    inherited = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and p not in (str(REPO), str(HELPERS))
    ]
    os.environ["PYTHONPATH"] = os.pathsep.join([TREE_PATH, *inherited])


# The Xet client (hf_xet) waits 3 s, 6 s, ... between its retries, so a test that injects Xet
# faults would take minutes; and it reads these settings once per process, so whichever test
# first uploads through Xet in a worker would fix them for every later one. Few, short retries
# for the whole session: this process and every script it starts (a developer's own values win).
XET_FAST_RETRIES = {"HF_XET_CLIENT_RETRY_BASE_DELAY": "10ms", "HF_XET_CLIENT_RETRY_MAX_ATTEMPTS": "3"}
for _name, _value in XET_FAST_RETRIES.items():
    os.environ.setdefault(_name, _value)

# Variables that would change what a script does (a real token, a real endpoint).
_SCRUBBED_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT")
# This process's environment when the session started, before any test changed it: the zygote's.
_SESSION_ENV = dict(os.environ)


def script_env(_base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a script: this one, without tokens or endpoint, the tree under test
    first on ``PYTHONPATH``, plus ``extra``."""
    env = {k: v for k, v in (os.environ if _base is None else _base).items() if k not in _SCRUBBED_ENV}
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
    inherited = [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (str(REPO), str(HELPERS))
    ]
    env["PYTHONPATH"] = os.pathsep.join([TREE_PATH, *inherited])
    env.update(extra)
    return env


# -- running a script: ``python -B SCRIPT ARGS``, forked from tests/helpers/zygote.py when that is the same ----

# Read when torch, NumPy or their OpenMP runtime load (or at interpreter start): a script forked
# from the zygote would not see a change in them, so such a run is a real exec.
_LOAD_TIME_ENV = (
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "LD_",
    "MALLOC",
    "PYTHONHASHSEED",
    "PYTHONMALLOC",
    "PYTHONWARNINGS",
    "PYTHONFAULTHANDLER",
    "PYTHONDEVMODE",
    "MPL",
    "MATPLOTLIBRC",
)


class _Zygote:
    """This test process's fork server (tests/helpers/zygote.py), started on first use, stopped at exit."""

    started: "_Zygote | None" = None

    def __init__(self) -> None:
        import atexit
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="zygote-")
        self.socket = os.path.join(self.folder, "socket")
        self.env = script_env(_SESSION_ENV)
        self.process = subprocess.Popen(
            [PYTHON, "-B", str(HELPERS / "zygote.py"), self.socket],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        import json

        try:
            after_imports = json.loads(self.process.stdout.readline())["ready"]
        except (ValueError, KeyError, TypeError):
            raise RuntimeError("tests/helpers/zygote.py did not start") from None
        # Set by the zygote's own imports, not by us (torch sets TORCHINDUCTOR_CACHE_DIR, and does
        # the same in this process once an optimizer is built here): absent or equal is the same.
        self.set_by_imports = {k: v for k, v in after_imports.items() if k not in self.env}
        atexit.register(self.stop)

    def stop(self) -> None:
        import shutil

        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def serves(self, env: Mapping[str, str]) -> bool:
        keys = {k for k in (*env, *self.env) if k.startswith(_LOAD_TIME_ENV)}
        return all(
            env.get(k) == self.env.get(k)
            or (k in self.set_by_imports and env.get(k) in (None, self.set_by_imports[k]))
            for k in keys
        )

    @classmethod
    def get(cls) -> "_Zygote":
        if cls.started is None or cls.started.process.poll() is not None:
            cls.started = cls()  # first use, or the server died: a new one, never a silent fallback
        return cls.started

    def run(
        self, argv: list[str], cwd: Path, env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        return self.start(argv, cwd, env).wait(timeout)

    def start(self, argv: list[str], cwd: Path, env: Mapping[str, str]) -> "ScriptRun":
        import json
        import socket

        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.socket)
            request = json.dumps({"argv": argv, "cwd": str(cwd), "env": dict(env)}).encode() + b"\n"
            socket.send_fds(connection, [request], [stdin, out_write, err_write])
        finally:
            for fd in (stdin, out_write, err_write):
                os.close(fd)
        return ScriptRun(argv, connection, out_read, err_read)


class ScriptRun:
    """A script forked from the zygote and still running: its ``pid`` (to signal it, or find its
    children), and :meth:`wait` for its exit status and output. The output pipes close when the
    script and every process that inherited them (DataLoader workers) have ended."""

    def __init__(self, argv: list[str], connection, out_read: int, err_read: int) -> None:
        self.argv, self.connection, self.out_read, self.err_read = argv, connection, out_read, err_read
        self.status = b""
        while b"\n" not in self.status:  # the server answers the child's pid at once
            data = connection.recv(64)
            if not data:
                raise RuntimeError("the zygote closed the connection before starting the script")
            self.status += data
        self.pid = int(self.status.split()[0])
        self.result: subprocess.CompletedProcess | None = None

    def ended(self) -> bool:
        """Whether the script has ended (the zygote has sent its exit status), without waiting."""
        import select

        return self.result is not None or bool(select.select([self.connection], [], [], 0)[0])

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit status and output, once it and whatever holds its output pipes have ended
        (SIGKILLed past ``timeout``: ``TimeoutExpired``); the same result on a later call."""
        import io
        import selectors
        import signal
        import time

        if self.result is not None:
            return self.result

        connection, out_read, err_read = self.connection, self.out_read, self.err_read
        chunks: dict[object, list[bytes]] = {out_read: [], err_read: [], connection: [self.status]}
        selector = selectors.DefaultSelector()
        for fd in (out_read, err_read):
            selector.register(fd, selectors.EVENT_READ)
        selector.register(connection, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while selector.get_map():
                remaining = deadline - time.monotonic()
                events = selector.select(timeout=max(remaining, 0))
                if not events and remaining <= 0:
                    try:
                        os.kill(self.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    raise subprocess.TimeoutExpired([PYTHON, "-B", *self.argv], timeout)
                for key, _ in events:
                    source = key.fileobj
                    data = source.recv(65536) if source is connection else os.read(source, 65536)
                    if data:
                        chunks[source].append(data)
                    else:
                        selector.unregister(source)
        finally:
            selector.close()
            connection.close()
            os.close(out_read)
            os.close(err_read)
        pid, status = b"".join(chunks[connection]).split()

        def text(fd: int) -> str:  # as subprocess.run(text=True): locale encoding, universal newlines
            return io.TextIOWrapper(io.BytesIO(b"".join(chunks[fd]))).read()

        self.result = subprocess.CompletedProcess(
            [PYTHON, "-B", *self.argv], int(status), text(out_read), text(err_read)
        )
        return self.result


def run_python(
    argv: list[str], *, cwd: Path, env: Mapping[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -B *argv`` (a script and its arguments) with stdout and stderr captured as text;
    never raises on a non-zero exit. Forked from the zygote unless ``env`` differs from it in
    what the preloaded modules read at load time; then a real exec."""
    zygote = _Zygote.get()
    if zygote.serves(env):
        return zygote.run([str(a) for a in argv], cwd, env, timeout)
    return subprocess.run(
        [PYTHON, "-B", *map(str, argv)],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_script(
    name: str, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``scripts/<name>`` with the test interpreter; never raises on a non-zero exit."""
    return run_python(
        [str(REPO / "scripts" / name), *args], cwd=cwd, env=env or script_env(), timeout=timeout
    )


def start_script(name: str, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> ScriptRun:
    """Start ``scripts/<name>`` forked from the zygote and return at once (see :class:`ScriptRun`);
    ``env`` must be one the zygote serves (no load-time variables of its own)."""
    env = env or script_env()
    zygote = _Zygote.get()
    assert zygote.serves(env), "start_script needs an environment the zygote serves"
    return zygote.start([str(REPO / "scripts" / name), *map(str, args)], cwd, env)


def start_python(script: Path, cwd: Path, env: dict[str, str] | None = None) -> ScriptRun:
    """Start ``python -B script`` forked from the zygote and return at once (see :class:`ScriptRun`):
    a helper process that must run beside this one (a peer of an in-process rank); ``env`` as for
    :func:`start_script`."""
    env = env or script_env()
    zygote = _Zygote.get()
    assert zygote.serves(env), "start_python needs an environment the zygote serves"
    return zygote.start([str(script)], cwd, env)


def children(pid: int) -> list[int]:
    """The pids of the processes whose parent is ``pid`` (Linux /proc), e.g. a trainer's workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue  # ended meanwhile
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def data_args(data_dir: Path) -> list[str]:
    return ["--set", f"data.dir={data_dir}"]


def prepare_data(data_dir: Path, *extra: str) -> None:
    result = run_script("01_prepare_data.py", *data_args(data_dir), *extra)
    assert result.returncode == 0, result.stderr


def train(
    data_dir: Path, checkpoint_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return run_script(
        "02_train.py",
        *data_args(data_dir),
        "--checkpoint-dir",
        str(checkpoint_dir),
        "--quiet",
        *args,
        env=env,
    )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, a NaN where the other has one included (the history marks what was not measured,
    a gradient norm at a step that was not logged, with NaN; ``torch.equal`` holds NaN != NaN)."""
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() or a.shape != b.shape:
        return False
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def assert_checkpoints_bitwise_equal(a: Path, b: Path) -> None:
    """Every tensor of both safetensors files equal in name, dtype, shape and bits."""
    for name in ("modelo.safetensors", "estado_treino.safetensors"):
        left, right = load_file(a / name), load_file(b / name)
        assert left.keys() == right.keys(), (
            f"{name}: tensor names differ: {sorted(left.keys() ^ right.keys())}"
        )
        differing = [
            k for k in left if left[k].dtype != right[k].dtype or not _same_values(left[k], right[k])
        ]
        assert not differing, f"{name}: tensors differ: {differing[:5]}"


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single ``error: ...`` line of a refused run; fails on a traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def train_until_killed(config_path: str, overrides: dict, started) -> None:
    """Child-process body for the SIGKILL test: resume (or start) and train, setting
    ``started`` once the first step has run so the parent kills a training process."""
    from pipeline.config import load_config
    from pipeline.train import TrainingHooks
    from pipeline.train import train as train_in_process

    config = load_config(config_path, overrides)
    train_in_process(
        config, resume="auto", progress=False, hooks=TrainingHooks(on_step=lambda run: started.set())
    )


def verify_checkpoint(folder: Path) -> dict:
    """Verify every file of a checkpoint folder (no tensors built) and return its meta.json."""
    from pipeline.checkpoint import LoadMode, load_checkpoint

    return load_checkpoint(folder, mode=LoadMode.VERIFY).meta


def save_parts(training_state: dict | None = None) -> dict:
    """The records ``CheckpointStore.save`` writes beside the tensors, empty but for
    ``training_state``: what a test that saves a checkpoint without a trainer passes. A fresh
    dict each call, so a test may change it."""
    return {
        "created": "now",
        "config": {},
        "fingerprints": {},
        "versions": {},
        "device": "cpu",
        "model": {},
        "environment": {},
        "lineage": [],
        "training_state": {} if training_state is None else training_state,
    }


def read_meta_json(folder: Path) -> dict:
    """A checkpoint folder's ``meta.json``, as written (nothing checked)."""
    import json

    return json.loads((folder / "meta.json").read_text(encoding="utf-8"))


def write_sealed(folder: Path, meta: dict) -> None:
    """Write ``meta`` as the folder's ``meta.json`` with its seal recomputed, in the exact
    layout the pipeline writes: what a forger, or a careless edit, does, so that only the
    change to the record is what a test then sees refused or accepted."""
    from pipeline.checkpoint.meta import meta_sha256
    from pipeline.durable import json_bytes

    meta = {key: value for key, value in meta.items() if key != "meta_sha256"}
    meta["meta_sha256"] = meta_sha256(meta)
    (folder / "meta.json").write_bytes(json_bytes(meta))


def reseal(folder: Path, edit: Callable[[dict], object]) -> None:
    """Apply ``edit`` to the folder's ``meta.json`` record in place, then :func:`write_sealed` it."""
    meta = read_meta_json(folder)
    edit(meta)
    write_sealed(folder, meta)


def first_python_block(card: str) -> str:
    """The code of the first ```python block of a model card (the loading snippet)."""
    import re

    match = re.search(r"^(`{3,})python\n(.*?)\n\1$", card, re.MULTILINE | re.DOTALL)
    assert match, "the card has no python block"
    return match.group(2)


# Prepended to code run "as a Hub user": this project's package and examples cannot be imported
# (no editable-install finder, no repository on the path), which the code asserts before it runs.
_WITHOUT_PROJECT = """import importlib.util, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "") + repr(f)]
sys.path[:] = [p for p in sys.path if p not in ("", {repo!r})]
assert importlib.util.find_spec("pipeline") is None and importlib.util.find_spec("examples") is None
"""


def run_as_hub_user(code: str, folder: Path, endpoint: str, token: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (``-I``) in the empty ``folder``, with a private HF_HOME,
    the Hub at ``endpoint``, and neither ``pipeline`` nor ``examples`` importable."""
    folder.mkdir(parents=True, exist_ok=True)
    assert not any(folder.iterdir()), "the folder must start empty"
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV and k != "PYTHONPATH"}
    env.update(
        {
            "HF_ENDPOINT": endpoint,
            "HF_TOKEN": token,
            "HF_HOME": str(folder.parent / f"{folder.name}-hf_home"),
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "OMP_NUM_THREADS": "1",
        }
    )
    script = _WITHOUT_PROJECT.format(repo=str(REPO)) + code
    return subprocess.run(
        [PYTHON, "-I", "-c", script], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )


def publish_stage(
    stage: Path, endpoint: str, repo_id: str, token: str, *args: str
) -> subprocess.CompletedProcess:
    """scripts/06_publish.py on ``stage`` to the Hub at ``endpoint``; receipts beside the stage."""
    env = script_env(HF_TOKEN=token, HF_HOME=str(stage.parent / "hf_home_publish"))
    return run_script(
        "06_publish.py",
        "--repo-id",
        repo_id,
        "--endpoint",
        endpoint,
        "--stage",
        str(stage),
        "--receipt-dir",
        str(stage.parent / "receipts"),
        *args,
        cwd=stage.parent,
        env=env,
    )


def a_socket(path: Path) -> None:
    """A socket file at ``path``, bound by its short name (AF_UNIX takes at most 107 bytes)."""
    import socket

    here = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path.name)
    finally:
        os.chdir(here)
