"""The processes a run trains in, as the loop, the start and the checkpoints see them.

A run trains in one :class:`World`: this process alone (this class: rank 0 of 1, every
agreement the process's own answer), or one rank of a torchrun launch
(:class:`pipeline.distributed.world.LaunchWorld`, the same operations over the launch's
process group). The trainer, the start and the checkpointers ask the world, never whether
there is one: one path for both.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch

from .commands import script_command
from .config import Config, launch_mode
from .errors import ConfigError

__all__ = ["World", "launched_by_torchrun", "launch_size", "joins_launch", "resolve_device"]

# What torchrun (and any launcher following its convention) sets for every worker.
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _LAUNCH_ENV)


def launch_size() -> int | None:
    """The number of processes of the torchrun launch this process belongs to (else None)."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else None


def joins_launch(config: Config) -> bool:
    """Whether this process trains as one rank of a torchrun launch: it was launched by
    torchrun, unless the launch is one process that runs ``training.parallel`` none (what
    ``auto`` is there), which trains as a plain process."""
    size = launch_size()
    return size is not None and (size > 1 or launch_mode(config.training.parallel, size) != "none")


def resolve_device(config: Config) -> torch.device:
    wanted = config.training.device
    if wanted == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{config.source}: training.device is 'cuda' but no CUDA device is available; "
            "set it to 'cpu' or 'auto'"
        )
    return torch.device(wanted)


@dataclass(kw_only=True, slots=True)
class World:
    """A run in this process alone: rank 0 of 1, on ``device``. Each operation is what the
    launch's (:class:`pipeline.distributed.world.LaunchWorld`) comes to for one process that
    needs no one's agreement, so the same code serves both."""

    launched: ClassVar[bool] = False
    """Whether this is one rank of a torchrun launch (process groups, DCP checkpoints)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    mode: str = "none"
    """``training.parallel`` as run: none here; ddp or fsdp2 in a launch."""
    find_unused_parameters: bool = False
    """DDP's ``find_unused_parameters`` (``training.ddp_find_unused_parameters``)."""
    buckets_settled: bool = True
    """False from :meth:`wrap` of a DDP model that will rebuild its gradient buckets until
    :meth:`settle_buckets` made it do so."""

    @classmethod
    def alone(cls, config: Config) -> "World":
        """This process, on the device ``training.device`` names."""
        return cls(device=resolve_device(config))

    # -- data ----------------------------------------------------------------------------
    def slice(self, indices: Sequence[int]) -> tuple[list[int], float]:
        """This process's part of one global batch (all of it) and its loss factor."""
        return list(indices), 1.0

    def scaled_loss(self, loss: torch.Tensor, scale: float) -> torch.Tensor:
        """The loss this process backpropagates (``scale``: :meth:`slice`'s factor)."""
        return loss

    def global_loss(self, scaled_loss: torch.Tensor) -> float:
        """The global batch's loss, the same float on every rank."""
        return float(scaled_loss.detach())

    # -- agreement -----------------------------------------------------------------------
    def agree_signal(self, signum: int | None) -> int | None:
        """A stop signal received by any rank, known to all (each step, so all stop together)."""
        return signum

    def agree_flags(self, flags: list[int]) -> list[int]:
        """Each flag raised on any rank, raised on all (what the callbacks asked of this step)."""
        return [int(flag) for flag in flags]

    @contextlib.contextmanager
    def together(self, what: str) -> Iterator[None]:
        """Run a block on every rank; if it fails on any, it fails on all (one rank: as is)."""
        yield

    def broadcast_text(self, text: str | None) -> str:
        """Rank 0's ``text``, on every rank."""
        return text or ""

    def gather_text(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order, on every rank."""
        return [text]

    def barrier(self) -> None:
        """Wait for every rank."""

    def own_group(self) -> "World":
        """This rank on a process group of its own (a background save's): one process needs none."""
        return self

    def leave_group(self) -> None:
        """Destroy the group :meth:`own_group` made."""

    def close(self) -> None:
        """Leave the launch's process groups."""

    def seed_rank(self, seed: int, step: int) -> None:
        """Seed this rank's own RNG streams where a launch derives them (a fresh run, a
        resume at another world size). One process's streams are the run's: seeded by
        :func:`pipeline.rng.seed_everything`, nothing to derive."""

    def describe(self) -> dict[str, Any]:
        """What meta.json records about the launch that wrote a checkpoint."""
        return {
            "mode": self.mode,
            "world_size": self.world_size,
            "ddp_find_unused_parameters": self.find_unused_parameters,
        }

    # -- model ---------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, config: Config) -> torch.nn.Module:
        """DDP or FSDP2 around the freshly built model in a launch; one process trains it as built."""
        return model

    def settle_buckets(self, run: Any, loss: Callable[[], torch.Tensor]) -> None:
        """Make DDP rebuild its gradient buckets before the first step, once (one process has none)."""

    def resume_command(self, config: Config) -> str:
        """The command that continues ``config``'s run: script 02 with ``--resume latest``."""
        return script_command(config, "02_train.py", "--resume", "latest")
