"""transformers' Trainer with sealed checkpoints (the optional extra ``transformers``)::

    from pipeline.integrations.transformers import SealedCheckpoints, verified_checkpoint

    trainer = Trainer(..., args=TrainingArguments(output_dir="out", save_steps=500, save_total_limit=2),
                      callbacks=[SealedCheckpoints()])
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
from .seal import check_seal, seal_checkpoint, verified_checkpoint

__all__ = ["SealedCheckpoints", "check_seal", "seal_checkpoint", "verified_checkpoint"]


class SealedCheckpoints(TrainerCallback):
    """Seal every ``checkpoint-N`` folder the Trainer saves, right after it saved it.

    Its cost is hashing what the Trainer just wrote (still in the page cache) and writing
    one small file. Under several processes every rank waits until all of them are done
    writing, then the process that saves (``args.should_save``) seals. A folder that cannot
    be sealed (a disk error, a ``meta.json`` that is not a seal) is named on stderr and left
    unsealed, which :func:`verified_checkpoint` skips: training goes on."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank's files of this checkpoint are written
        if args.should_save:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            try:
                seal_checkpoint(folder, step=state.global_step)
            except (PipelineError, OSError) as exc:
                print(
                    f"SealedCheckpoints: {folder} was not sealed ({exc}); verified_checkpoint will skip it",
                    file=sys.stderr,
                    flush=True,
                )
        return control
