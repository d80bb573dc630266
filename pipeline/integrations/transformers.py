"""transformers' Trainer with sealed checkpoints (the optional extra ``transformers``)::

    from pipeline.integrations.transformers import SealedCheckpoints, verified_checkpoint

    trainer = Trainer(..., args=TrainingArguments(output_dir="out", save_steps=500),
                      callbacks=[SealedCheckpoints(keep_last=2)])
    trainer.train(resume_from_checkpoint=verified_checkpoint("out"))

The Trainer writes ``checkpoint-N`` in place and marks nothing when it is done, so after a
crash its newest folder may be incomplete (and ``resume_from_checkpoint=True`` takes it).
:class:`SealedCheckpoints` seals each folder right after the Trainer saved it
(:func:`~pipeline.integrations.seal.seal_checkpoint`); :func:`verified_checkpoint` returns
the newest whose seal verifies. docs/other-trainers.md says what this does and does not
guarantee.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import PipelineError
from .seal import check_seal, prune_checkpoints, seal_checkpoint, verified_checkpoint

__all__ = ["SealedCheckpoints", "check_seal", "prune_checkpoints", "seal_checkpoint", "verified_checkpoint"]


class SealedCheckpoints(TrainerCallback):
    """Seal every ``checkpoint-N`` folder the Trainer saves, right after it saved it; with
    ``keep_last``, then delete the sealed checkpoints beyond the ``keep_last`` newest (the
    Trainer's best model kept), in place of the Trainer's ``save_total_limit``.

    Its cost is hashing what the Trainer just wrote (still in the page cache) and writing
    one small file. Under several processes every rank waits until all of them are done
    writing, then the process that saves (``args.should_save``) seals. A folder that cannot
    be sealed (a disk error, a ``meta.json`` that is not a seal) is named on stderr and left
    unsealed, which :func:`verified_checkpoint` skips, and nothing is pruned: training goes on.

    Why not ``save_total_limit``: the Trainer deletes old checkpoints before this callback
    runs, choosing them by modification time; a crash among those deletions leaves a
    half-deleted folder that later looks newest, and a run killed again can be left with no
    sealed checkpoint at all (seen in the kill tests). ``keep_last`` deletes only once the new
    checkpoint is sealed and its files fsynced (so ``keep_last=1`` survives a power cut too),
    by step, each folder renamed away before it is removed."""

    def __init__(self, keep_last: int | None = None) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        self.keep_last = keep_last

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if args.should_save and args.save_total_limit:
            print(
                f"SealedCheckpoints: save_total_limit={args.save_total_limit} lets the Trainer delete old "
                "checkpoints before the new one is sealed; prefer save_total_limit=None and "
                f"SealedCheckpoints(keep_last={args.save_total_limit})",
                file=sys.stderr,
                flush=True,
            )
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank's files of this checkpoint are written
        if args.should_save:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            doing = "sealed"
            try:
                seal_checkpoint(folder, step=state.global_step)
                doing = "pruned after it"
                if self.keep_last is not None:
                    prune_checkpoints(folder, self.keep_last, protect=state.best_model_checkpoint)
            except (PipelineError, OSError) as exc:
                print(
                    f"SealedCheckpoints: {folder} was not {doing} ({exc}); verified_checkpoint skips an unsealed one",
                    file=sys.stderr,
                    flush=True,
                )
        return control
