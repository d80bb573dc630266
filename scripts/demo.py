"""`make demo`: the whole pipeline, 01 -> 06, with no token and no network.

    make demo                      # what the Makefile runs
    python scripts/demo.py         # the same, with the project installed (make venv)

First a local Hub (``localhub``) starts on a free loopback port, with its own state
folder (``.localhub-demo/``, so a rehearsal Hub serving ``.localhub/`` may run beside it) and
a random token that exists only in this process and in the environment of the publish
step; if it cannot start, the demo stops before the long steps and says why. Then each
numbered script runs as its own process with this interpreter on ``config.yaml``, in order:
prepare the data, train (``--resume auto``: a rerun finishes at once), prove that resume is
exact into a new ``proof-<time>/``, evaluate (kept when the metrics already evaluate the
newest checkpoint with this data and code), stage, and ``scripts/06_publish.py`` publishes to
the local Hub, verifies, and writes a receipt; the server is stopped whatever happens. Every
file the steps write goes under ``.demo/`` (data, checkpoints, proof, metrics, stage,
receipts), so the README's commands on ``config.yaml`` start afresh after it. The demo ends
with a short summary (commit URL, files and sizes, where the receipt is). A rerun finds the
stage already published and makes no commit. The exit code is the first failing step's.

The real Hub path is the same script without ``--endpoint``:
``HF_TOKEN=hf_... python scripts/06_publish.py --repo-id you/regression-mlp``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _bootstrap import project_imports

with project_imports(until_run_main=False):
    from localhub import LocalHubProcess
    from pipeline.checkpoint import LoadMode, load_checkpoint
    from pipeline.config import Config, load_config
    from pipeline.errors import DemoFailed, PipelineError
    from pipeline.evaluate import read_metrics
    from pipeline.layout import CHECKPOINT_DIR, METRICS_FILE, MODEL_FILE, RECEIPT_DIR, STAGE_DIR
    from pipeline.provenance import code_fingerprint

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# Not .localhub/, the README's rehearsal Hub: a Hub state folder serves one server at a time.
HUB_ROOT = ROOT / ".localhub-demo"
# Everything the steps write, apart from the README's own run of config.yaml: a finished demo
# run in estados_local/ would refuse the README's first training ("checkpoints exist").
OUTPUTS = Path(".demo")
OVERRIDES = {
    "data.dir": str(OUTPUTS / "data" / "regression"),
    "checkpoint.dir": str(OUTPUTS / CHECKPOINT_DIR),
    "outputs.metrics": str(OUTPUTS / METRICS_FILE),
    "outputs.stage": str(OUTPUTS / STAGE_DIR),
}
RECEIPTS = OUTPUTS / RECEIPT_DIR
# Variables that would point a step at a real account or a real Hub.
_SCRUBBED = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "LOCALHUB_TOKEN")


@dataclass(frozen=True, slots=True)
class Step:
    script: str
    args: tuple[str, ...]
    what: str


def _env(**extra: str) -> dict[str, str]:
    """This environment without tokens or endpoints, and no telemetry. The client uploads through
    Xet, as it does to the real Hub (HF_HUB_DISABLE_XET=1 in the environment selects LFS)."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env.update({"HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"})
    if not sys.stdout.isatty():  # a log or a pipe: no progress bars, no cursor escape codes
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    env.update(extra)
    return env


def _header(number: int, total: int, text: str) -> None:
    print(f"\n==> [{number}/{total}] {text}", flush=True)


def _run(step: Step, *, env: dict[str, str] | None = None) -> None:
    """Run one script from the repo root; raise DemoFailed on a non-zero exit."""
    command = [sys.executable, "-B", str(SCRIPTS / step.script), *step.args]
    code = subprocess.call(command, cwd=ROOT, env=env or _env())
    if code != 0:
        raise DemoFailed(step.script, code)


def demo_config() -> Config:
    """config.yaml with every output under the demo's own folder."""
    return load_config(ROOT / "config.yaml", OVERRIDES)


def _steps(repo_id: str) -> list[Step]:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    sets = tuple(arg for key, value in OVERRIDES.items() for arg in ("--set", f"{key}={value}"))
    steps = [
        Step("01_prepare_data.py", sets, "prepare the data"),
        Step(
            "02_train.py",
            (*sets, "--resume", "auto"),
            "train (resumes, or finishes at once, if checkpoints exist)",
        ),
        Step(
            "03_verify_resume.py",
            (*sets, "--output", str(OUTPUTS / f"proof-{stamp}")),
            "prove that resume is exact",
        ),
        Step("04_evaluate.py", sets, "evaluate the last checkpoint"),
        Step("05_stage.py", (*sets, "--repo-id", repo_id), "stage it for the Hub"),
    ]
    # The proof script may be missing from a partial checkout; the rest still demonstrates the flow.
    available = []
    for step in steps:
        if (SCRIPTS / step.script).exists():
            available.append(step)
        else:
            print(
                f"notice: scripts/{step.script} is not in this checkout; skipping '{step.what}'", flush=True
            )
    return available


def _metrics_current(config: Config) -> bool:
    """metrics.json already evaluates the newest checkpoint, on the same data and code.

    04 stamps each evaluation with its time, and the stage carries that stamp; re-evaluating
    unchanged weights would make a rerun of the demo publish a new commit for nothing."""
    try:
        loaded = load_checkpoint("latest", config.checkpoint.dir, mode=LoadMode.VERIFY)
        folder, meta = loaded.folder, loaded.meta
        record = read_metrics(ROOT / config.outputs.metrics)
    except PipelineError:
        return False
    same = (
        record["step"] == meta["step"]
        and record["modelo_sha256"] == meta["files"][MODEL_FILE]["sha256"]
        and record["fingerprints"] == {"data": meta["fingerprints"].get("data"), "code": code_fingerprint()}
    )
    if same:
        print(
            f"{config.outputs.metrics} already evaluates {folder} with this data and code; keeping it "
            f"(delete it to evaluate again)",
            flush=True,
        )
    return same


def _newest_receipt(folder: Path, repo_id: str) -> Path | None:
    """The receipt 06 wrote or kept for ``repo_id`` (named ``<owner>--<name>-<commit>.json``)."""
    receipts = sorted(folder.glob(f"{repo_id.replace('/', '--')}-*.json"), key=lambda p: p.stat().st_mtime)
    return receipts[-1] if receipts else None


def _start_hub(token: str) -> LocalHubProcess:
    """The local Hub, started before the long steps; a failure names localhub's own reason
    (its stderr), not only that it printed no URL."""
    with tempfile.TemporaryFile(mode="w+") as errors:
        hub = LocalHubProcess(HUB_ROOT, token=token, stderr=errors)
        try:
            hub.start()
        except (RuntimeError, OSError) as exc:
            errors.seek(0)
            said = [line.strip() for line in errors.read().splitlines() if line.strip()]
            cause = said[-1] if said else str(exc)
            print(
                f"demo: the local Hub did not start: {cause} (state folder {HUB_ROOT.name}/); nothing else was "
                "run",
                file=sys.stderr,
                flush=True,
            )
            raise DemoFailed("localhub", 1) from None
    return hub


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _summary(receipt: Path | None) -> list[str]:
    """What landed, in a few lines: the receipt itself stays in its file."""
    if receipt is None:
        return ["demo: done, but 06 wrote no receipt"]
    record = json.loads(receipt.read_text(encoding="utf-8"))
    files = record.get("files", {})
    total = sum(entry.get("size") or 0 for entry in files.values())
    verified = (
        "what landed was verified"
        if record.get("verified")
        else "what landed did NOT verify (see the receipt)"
    )
    lines = [
        f"demo: done. {record.get('repo_id')} (step {record.get('step')}) is published on the local Hub, now "
        f"stopped; {verified}",
        f"  commit   {record.get('commit_url')}",
        f"  files    {len(files)}, {_size(total)} in all:",
    ]
    # One line per file at the top, one per folder (code/ holds the model's sources).
    groups: dict[str, list[int]] = {}
    for name, entry in files.items():
        top, sep, _ = name.partition("/")
        groups.setdefault(top + "/" if sep else top, []).append(entry.get("size") or 0)
    width = max((len(name) for name in groups), default=0)
    for name, sizes in sorted(groups.items()):
        count = f"  ({len(sizes)} files)" if name.endswith("/") else ""
        lines.append(f"    {name:<{width}}  {_size(sum(sizes)):>9}{count}")
    lines.append(f"  receipt  {receipt.relative_to(ROOT) if receipt.is_relative_to(ROOT) else receipt}")
    return lines


def _publish_step(repo_id: str, endpoint: str) -> Step:
    args = ("--stage", OVERRIDES["outputs.stage"], "--receipt-dir", str(RECEIPTS))
    return Step("06_publish.py", ("--repo-id", repo_id, "--endpoint", endpoint, *args), "publish")


def _publish(repo_id: str, hub: LocalHubProcess, number: int, total: int) -> Path | None:
    """Publish the stage to the running local Hub; the receipt 06 wrote."""
    _header(number, total, f"06_publish.py: publish to a local Hub as {repo_id}")
    print(f"local Hub listening on {hub.url} (state in {HUB_ROOT.name}/)", flush=True)
    receipts = ROOT / RECEIPTS
    step = _publish_step(repo_id, hub.url)
    _run(step, env=_env(HF_TOKEN=hub.token))
    return _newest_receipt(receipts, repo_id)


def main() -> int:
    os.chdir(ROOT)
    config = demo_config()
    repo_id = f"demo/{config.model.name}"
    steps = _steps(repo_id)
    total = len(steps) + 1
    hub = None
    try:
        hub = _start_hub(secrets.token_urlsafe(24))  # the token lives only here and in two child environments
        for number, step in enumerate(steps, start=1):
            _header(number, total, f"{step.script}: {step.what}")
            if step.script == "04_evaluate.py" and _metrics_current(config):
                continue
            _run(step)
        receipt = _publish(repo_id, hub, total, total)
    except DemoFailed as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        if hub is not None:
            hub.stop()
    print("\n" + "\n".join(_summary(receipt)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
