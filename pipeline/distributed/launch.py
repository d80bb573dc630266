"""The world a run trains in, joined around it: the caller's, a torchrun launch's (joined
here and left after), or this process alone. :func:`pipeline.train.train` trains in it, the
same in one process and on each rank."""

from __future__ import annotations

import contextlib
import signal
import threading
import traceback
from typing import Iterator

from ..config import Config, launch_mode
from ..errors import PipelineError
from ..world import World, joins_launch

__all__ = ["joined"]


@contextlib.contextmanager
def joined(config: Config, world: World | None = None) -> Iterator[World]:
    """The world ``config``'s run trains in (``training.parallel``: auto, ddp or fsdp2 under
    torchrun; none, or auto in a plain process).

    ``world``: one the caller started (and will close) to run several trainings in one
    launch, checked against the config. By default, a process torchrun launched joins the
    launch's process group here and leaves it after; any other trains alone."""
    if world is not None:
        if world.launched and world.mode != launch_mode(config.training.parallel, world.world_size):
            raise PipelineError(
                f"the launch runs {world.mode}, the config asks for {config.training.parallel}"
            )
        yield world
        return
    if not joins_launch(config):
        yield World.alone(config)
        return
    from .world import LaunchWorld  # torch.distributed.checkpoint with it: only for a launch

    launch = LaunchWorld.start(config)
    try:
        yield launch
    except BaseException as exc:
        _outlast_the_agent()
        _release_frames(exc)
        raise
    finally:
        launch.close()


def _release_frames(error: BaseException) -> None:
    """Drop the locals of the frames ``error`` (and every error chained to it) unwound. They
    hold the run's DDP model and its reducer, so the launch's process groups: alive past
    :meth:`~pipeline.distributed.world.LaunchWorld.close`, their gloo worker threads would
    still run when the interpreter finalizes, which can abort the rank (SIGABRT) after it
    printed its one line. The frames' files and lines stay, for a traceback."""
    pending, seen = [error], set()
    while pending:
        chained = pending.pop()
        if chained is None or id(chained) in seen:
            continue
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        pending += [chained.__cause__, chained.__context__]


def _outlast_the_agent() -> None:
    """This rank ends with an error or a stop its caller reports, as every rank of the launch
    does (they agreed). torchrun SIGTERMs the ranks still running as soon as one exits: the
    rank that prints the launch's one line (the others stay quiet) must not be ended before
    it does, so SIGTERM is ignored from here on; exiting takes moments, and the agent sends
    SIGKILL if it ever does not."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
