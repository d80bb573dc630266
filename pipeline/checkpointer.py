"""Turn a live training run into a committed checkpoint (capture, then atomic store write)."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from .run import TrainingRun
from .state import capture_state, model_summary
from .store import CheckpointStore, SavedCheckpoint

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves a run into a locked :class:`CheckpointStore`.

    ``provenance`` holds what is the same for every save of the run: ``config``,
    ``fingerprints``, ``versions`` and ``device``.
    """

    def __init__(self, store: CheckpointStore, provenance: dict[str, Any]) -> None:
        self.store = store
        self.provenance = provenance
        self.last_saved_step: int | None = None

    def save(self, run: TrainingRun) -> SavedCheckpoint:
        model_tensors, state, state_tensors = capture_state(run)
        meta = {
            **self.provenance,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "model": model_summary(run.model),
            "training_state": state,
        }
        saved = self.store.save(run.step, model_tensors, state_tensors, meta)
        self.last_saved_step = run.step
        return saved

    def close(self) -> None:
        """Wait for any save in flight (none in synchronous mode)."""
