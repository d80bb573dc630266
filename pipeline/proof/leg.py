"""Legs of the resume proof, one after the other in this process (internal; started by scripts/03).

    python -B -m pipeline.proof.leg RUN/resume/spec.json [RUN/omit-rng/spec.json ...]

By default every leg has a process of its own; with fewer processes than legs
(``--jobs``) one runs several, the first in its fresh interpreter (see
:func:`pipeline.proof.plan.pack` for why the later ones are unaffected by it). Each leg
writes its output to its own ``log.txt``: the first leg's is the process's standard output,
opened by scripts/03; a later leg moves both streams to its own as it starts.

The spec names the full config, where to resume from, where to stop and which components
to leave unrestored (the negative controls). This is the only entry point that passes
:class:`pipeline.train.TrainingHooks` (``skip_restore``, ``on_start``, ``on_step``) to
:func:`pipeline.train.train`; the public 02 script cannot.

The leg only observes the run: it records, per step, the loss, learning rate, batch
indices, the sampler's position and the next draw of every RNG family (drawn from
copies), snapshots the state right after build/restore, and at the end peeks the RNGs
again and evaluates the model. It writes ``summary.json`` beside the spec.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..checkpoint import capture_state, write_safetensors
from ..cli import run_main
from ..config import config_from_dict
from ..durable import write_json_atomic
from ..errors import InternalError
from ..evaluate import check_metrics
from ..layout import MODEL_FILE, STATE_FILE
from ..rng import peek_next_draws
from ..run import TrainingRun
from ..train import TrainingHooks, train
from .compare import SNAPSHOT_STATE
from .layout import LOG_FILE, SNAPSHOT_DIR, SUMMARY_FILE

__all__ = ["LegRecorder", "run_leg", "main"]


class LegRecorder:
    """:class:`~pipeline.train.TrainingHooks` callbacks that record the run without disturbing it."""

    def __init__(self, folder: Path, *, snapshot: bool) -> None:
        self.folder = folder
        self.snapshot = snapshot
        self.run: TrainingRun | None = None
        self.start: dict[str, Any] = {}
        self.steps: list[dict[str, Any]] = []
        self._indices: list[Any] | None = None
        self._indices_recorded = False

    def on_start(self, run: TrainingRun) -> None:
        self.run = run
        self._watch_sampler(run)
        self.start = {
            "step": run.step,
            "rng_next_draws": peek_next_draws(run.generator),
            "sampler": _position(run),
        }
        if self.snapshot:
            _write_snapshot(run, self.folder / SNAPSHOT_DIR)

    def on_step(self, run: TrainingRun) -> None:
        self.steps.append(
            {
                "step": run.step,
                "loss": run.history["loss"][-1],
                "lr": run.history["lr"][-1],
                "indices": self._indices if self._indices_recorded else None,
                "sampler": _position(run),
                "rng_next_draws": peek_next_draws(run.generator),
            }
        )

    def _watch_sampler(self, run: TrainingRun) -> None:
        # Wrap the instance's next_indices to see each batch's rows; the rows returned
        # are the sampler's own, untouched. A sampler that refuses attributes stays unwatched
        # (and a stream, which has none).
        if run.sampler is None:
            return
        original = run.sampler.next_indices

        def next_indices():
            indices = original()
            self._indices = _plain(indices)
            return indices

        try:
            run.sampler.next_indices = next_indices
            self._indices_recorded = True
        except AttributeError:
            self._indices_recorded = False

    def finish(self, step: int, checkpoint: Path | None, resumed_from: int | None) -> dict[str, Any]:
        run = self.run
        if run is None:
            raise InternalError("train() never called on_start")
        # Peek before evaluating: evaluation is the user's code and may draw.
        end_draws = peek_next_draws(run.generator)
        metric = check_metrics(
            run.data.evaluate(run.model, run.device), "evaluate()"
        )  # several sets flattened
        return {
            "step": step,
            "resumed_from": resumed_from,
            "device": str(run.device),
            "checkpoint": str(checkpoint) if checkpoint is not None else None,
            "start": self.start,
            "steps": self.steps,
            "end": {"rng_next_draws": end_draws, "metric": metric, "sampler": _position(run)},
        }


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _scalars(state: Any) -> dict[str, Any]:
    """The sampler's scalar fields (epoch, cursor, samples seen): its position, readable."""
    if not isinstance(state, dict):
        return {}
    return {str(k): _plain(v) for k, v in state.items() if isinstance(_plain(v), (bool, int, float, str))}


def _position(run: TrainingRun) -> dict[str, Any]:
    """Where the data is: the sampler's scalars (epoch, cursor, samples seen), or a stream's
    pass and samples consumed (this process's)."""
    if run.sampler is not None:
        return _scalars(run.sampler.state_dict())
    own = run.feed.state_dict()["ranks"][0]
    return {"pass": own["pass"], "consumed": own["consumed"]}


def _write_snapshot(run: TrainingRun, folder: Path) -> None:
    """The state exactly as a checkpoint would capture it now, in the checkpoint's file formats."""
    model_tensors, state, state_tensors = capture_state(run)
    folder.mkdir()
    write_safetensors(folder / MODEL_FILE, model_tensors)
    write_safetensors(folder / STATE_FILE, state_tensors)
    write_json_atomic(folder / SNAPSHOT_STATE, state, allow_nan=True)  # as a checkpoint's meta.json


def run_leg(spec_path: Path) -> dict[str, Any]:
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    folder = spec_path.parent
    config = config_from_dict(spec["config"], source=str(spec_path))
    recorder = LegRecorder(folder, snapshot=spec["snapshot"])
    hooks = TrainingHooks(
        skip_restore=tuple(spec["omit"]), on_start=recorder.on_start, on_step=recorder.on_step
    )
    result = train(config, resume=spec["resume"], stop_at=spec["stop_at"], progress=False, hooks=hooks)
    summary = {
        "leg": spec["leg"],
        "omit": spec["omit"],
        **recorder.finish(result.step, result.checkpoint, result.resumed_from),
    }
    write_json_atomic(folder / SUMMARY_FILE, summary, allow_nan=True)  # a diverged control may record NaN
    return summary


def _log_to(path: Path) -> None:
    """Send this process's stdout and stderr (file descriptors too) to a new ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.dup2(descriptor, 1)
        os.dup2(descriptor, 2)
    finally:
        os.close(descriptor)


def main() -> int:
    specs = [Path(arg) for arg in sys.argv[1:]]
    if not specs:
        print(
            "usage: python -m pipeline.proof.leg SPEC.json [SPEC.json ...] (internal to "
            "scripts/03_verify_resume.py)",
            file=sys.stderr,
        )
        return 2
    for index, spec in enumerate(specs):
        if index:
            _log_to(spec.parent / LOG_FILE)
        run_leg(spec)
    return 0


if __name__ == "__main__":
    run_main(main)
