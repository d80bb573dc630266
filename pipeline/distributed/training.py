"""``train`` under torchrun: one process per rank, DDP or FSDP2 around the model,
distributed checkpoints (``pipeline.checkpoint.distributed``). The run itself is
:func:`pipeline.train.train`'s, the same in one process and in a launch; this joins the
launch around it."""

from __future__ import annotations

import signal
import threading
from typing import Any

from ..checkpoint import DistributedCheckpointer  # noqa: F401  (see below)
from ..config import Config, launch_mode
from ..errors import PipelineError
from ..train import TrainResult, train
from .world import World

# The distributed checkpoint stack (torch.distributed.checkpoint, which imports FSDP) is
# imported here, before the launch's process group is joined: measured with torch 2.13, a
# rank that has not imported torch.distributed.fsdp by then keeps the default group, gloo
# worker threads and all, past World.close
# (tests/test_distributed.py::test_close_ends_the_default_groups_gloo_threads).

__all__ = ["train_distributed"]


def train_distributed(config: Config, *, world: World | None = None, **options: Any) -> TrainResult:
    """Train as one rank of a torchrun launch (``training.parallel``: auto, ddp or fsdp2).

    ``options``: as for :func:`pipeline.train.train` (``resume``, ``init_from``, ``extend_to``,
    ``reshard``, ``stop_at``, ``hooks``...). ``world``: a process group the caller started (and
    will close) to run several trainings in one launch; by default one is joined and left
    here. Every rank returns the same result.
    """
    if world is not None:
        if world.mode != launch_mode(config.training.parallel, world.world_size):
            raise PipelineError(
                f"the launch runs {world.mode}, the config asks for {config.training.parallel}"
            )
        return train(config, world=world, **options)
    world = World.start(config)
    try:
        return train(config, world=world, **options)
    except BaseException:
        _outlast_the_agent()
        raise
    finally:
        world.close()


def _outlast_the_agent() -> None:
    """This rank ends with an error or a stop its caller reports, as every rank of the launch
    does (they agreed). torchrun SIGTERMs the ranks still running as soon as one exits: the
    rank that prints the launch's one line (the others stay quiet) must not be ended before
    it does, so SIGTERM is ignored from here on; exiting takes moments, and the agent sends
    SIGKILL if it ever does not."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
