"""Turn a live training run into a committed checkpoint (capture, then atomic store write).

Synchronous mode writes while training waits. Background mode (``checkpoint.async``)
copies the state into reused CPU buffers, returns to training, and lets one worker thread
write, hash, fsync and commit through the same :meth:`CheckpointStore.save`, so the files,
their hashes and the crash-safety protocol are identical in both modes. At most one save is
in flight: the next one, and :meth:`Checkpointer.close`, first wait for it to commit and
raise its error, if any, in the training thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

import torch

from ..durable import utc_now
from ..run import TrainingRun
from .best import BestRule
from .snapshot import SnapshotBuffers
from .state import capture_state
from .store import CheckpointStore, SavedCheckpoint
from .weights import model_summary

__all__ = ["Checkpointer", "PendingSave"]


class PendingSave:
    """A checkpoint being written in the background; ``path`` is where it will commit."""

    def __init__(self, step: int, path: Path) -> None:
        self.step = step
        self.path = path
        self._future: Future[SavedCheckpoint] = Future()
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> SavedCheckpoint:
        """Wait for the commit; raise the background write's exception here if it failed."""
        try:
            return self._future.result()
        finally:
            if self._thread is not None:
                self._thread.join()


class OneSaveInFlight:
    """At most one background save (``_in_flight``) and the snapshot buffers it copies into:
    what the single-process and the distributed checkpointers share."""

    _in_flight: PendingSave | None
    snapshot: SnapshotBuffers

    def wait(self) -> SavedCheckpoint | None:
        """Block until the save in flight commits; raise its error here. ``None`` if idle."""
        pending, self._in_flight = self._in_flight, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then free the snapshot buffers
        and whatever else :meth:`_release` frees."""
        try:
            self.wait()
        finally:
            self.snapshot.release()
            self._release()

    def _release(self) -> None:
        """Nothing else to free here; the distributed checkpointer leaves its own group."""


class Checkpointer(OneSaveInFlight):
    """Saves a run into a locked :class:`CheckpointStore`.

    ``provenance`` holds what is the same for every save of the run: ``config``,
    ``fingerprints``, ``versions`` and ``device``. With ``background=True``, :meth:`save`
    returns a :class:`PendingSave` once the state is copied; call :meth:`close` before the
    store's lock is released.
    """

    def __init__(
        self, store: CheckpointStore, provenance: dict[str, Any], *, background: bool = False
    ) -> None:
        self.store = store
        self.provenance = provenance
        self.background = background
        self.last_saved_step: int | None = None
        """Step of the newest committed save (in background mode, once its write finished)."""
        self.snapshot = SnapshotBuffers()
        self._in_flight: PendingSave | None = None

    def save(self, run: TrainingRun) -> SavedCheckpoint | PendingSave:
        # One save in flight: the snapshot buffers are reused, so the previous write must
        # be done with them, and its failure must stop training before more work is lost.
        self.wait()
        self.store.best = BestRule.of(
            run.evaluations, run.config.checkpoint.best_metric, run.config.checkpoint.best_mode
        )
        model_tensors, state, state_tensors = capture_state(run)
        meta = {
            **self.provenance,
            "created": utc_now(),
            "model": model_summary(run.model, run.fresh_buffers),
            "training_state": state,
        }
        if not self.background:
            saved = self.store.save(run.step, model_tensors, state_tensors, meta)
            self.last_saved_step = saved.step
            return saved
        copies = self.snapshot.copy({"model": model_tensors, "state": state_tensors})
        # Not copied: the training state's tree and the model summary were built for this
        # save (split_state shares no container with the live objects), and the provenance
        # is this checkpointer's own; training changes none of it.
        return self._start(run.step, copies["model"], copies["state"], meta)

    def _start(
        self,
        step: int,
        model_tensors: Mapping[str, torch.Tensor],
        state_tensors: Mapping[str, torch.Tensor],
        meta: dict[str, Any],
    ) -> PendingSave:
        pending = PendingSave(step, self.store.path_for(step))
        # Not a daemon: if the interpreter exits without close(), it still waits for the
        # commit instead of killing the write halfway (which would only leave a temp folder).
        thread = threading.Thread(
            target=self._write,
            args=(pending, model_tensors, state_tensors, meta),
            name=f"checkpoint-step-{step}",
            daemon=False,
        )
        pending._thread = thread
        # In flight only once it runs: a thread that cannot start (the machine out of threads)
        # raises here, and close() must not then wait for ever on a save that never began.
        thread.start()
        self._in_flight = pending
        return pending

    def _write(
        self,
        pending: PendingSave,
        model_tensors: Mapping[str, torch.Tensor],
        state_tensors: Mapping[str, torch.Tensor],
        meta: dict[str, Any],
    ) -> None:
        try:
            saved = self.store.save(pending.step, model_tensors, state_tensors, meta)
        except BaseException as exc:  # re-raised in the training thread by PendingSave.result
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised by the background save of step {pending.step})")
            pending._future.set_exception(exc)
            return
        self.last_saved_step = saved.step
        pending._future.set_result(saved)
