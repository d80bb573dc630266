"""One process of a ``torchrun`` launch: its rank, the process group, and the handful of
collectives the training loop and the checkpoint protocol agree through
(:class:`LaunchWorld`, the launch's side of :class:`pipeline.world.World`).

Every collective here is small (a few integers or one float per step). Errors are agreed
on too (:meth:`World.together`): a rank that fails tells the others, so no rank is left
waiting in a collective for a peer that has already given up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
import torch.distributed as dist

# The distributed checkpoint stack (torch.distributed.checkpoint, which imports FSDP) is
# imported with this module, before the launch's process group is joined: measured with
# torch 2.13, a rank that has not imported torch.distributed.fsdp by then keeps the default
# group, gloo worker threads and all, past LaunchWorld.close
# (tests/test_distributed.py::test_close_ends_the_default_groups_gloo_threads).
import torch.distributed.checkpoint  # noqa: F401

from .. import PARENT_AT_START
from ..commands import resume_command, torchrun_launcher
from ..config import Config, launch_mode
from ..errors import ConfigError, DataError, PeerFailed, PipelineError, describe_os_error, first_line
from ..rng import capture_rng, derive_rank_rng, restore_rng
from ..world import World, launch_size

__all__ = ["LaunchWorld"]

# How long a rank whose launcher died may take to stop on its own (finish the step, save)
# before it is ended: a rank waiting in a collective for a peer that is gone never would.
ORPHAN_GRACE_S = 15.0
_ORPHAN_POLL_S = 0.25
_watching = False
# Set once the ranks agreed to stop: the rank is already on its way out with a checkpoint,
# and a SIGTERM from the watchdog after the loop restored the default handler would kill it
# before it reports the stop.
_stop_agreed = threading.Event()


def end_with_launcher(grace: float = ORPHAN_GRACE_S) -> None:
    """Stop this rank when the process that started it (the torchrun agent) dies.

    torchrun starts every rank in a session of its own, so an agent killed with SIGKILL
    takes no rank with it: they would go on training, or wait on the agent's store for
    minutes, holding their devices. A daemon thread watches the parent: once it is gone,
    the rank gets SIGTERM (it stops after its step with a checkpoint, as when torchrun
    forwards a SIGTERM, and exits 143), and ``grace`` seconds later it is ended outright
    if it is still running. Idempotent."""
    global _watching
    if _watching:
        return
    _watching = True
    parent = PARENT_AT_START  # not the parent of now: the agent may already be gone

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_ORPHAN_POLL_S)
        if not _stop_agreed.is_set():
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                # Not training yet (or no longer): the SIGTERM below ends the rank at once, unexplained.
                print(
                    f"error: the torchrun agent (pid {parent}) is gone before this rank started training; "
                    "ending it",
                    file=sys.stderr,
                    flush=True,
                )
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        print(
            f"error: the torchrun agent (pid {parent}) is gone and this rank did not stop within {grace:g} s; "
            "ending it (the last committed checkpoint is intact)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


@contextlib.contextmanager
def _peer_loss(
    what: str = "lost contact with another process of the launch",
    then: str = "the last committed checkpoint is intact: relaunch with --resume latest",
) -> Iterator[None]:
    """A collective (or the rendezvous) that fails because a peer process or the agent's
    store died is a one-line error here."""
    try:
        yield
    except RuntimeError as exc:  # torch.distributed.DistBackendError, DistNetworkError and gloo's errors
        raise PipelineError(f"{what} ({first_line(exc, limit=200)}); {then}") from None


def _one_line(error: BaseException | None) -> str:
    """What a failed rank prints for ``error`` (nothing for none, or for a quiet one)."""
    if error is None or getattr(error, "quiet", False):
        return ""
    if isinstance(error, OSError):
        return describe_os_error(error)
    return (
        str(error).replace("\n", " ")
        if isinstance(error, PipelineError)
        else f"{type(error).__name__}: {error}"
    )


@dataclass(kw_only=True, slots=True)
class LaunchWorld(World):
    """This process's place in the launch (``rank`` of ``world_size``)."""

    launched: ClassVar[bool] = True
    group: Any = None
    """The process group of this object's collectives: ``None``, the launch's default one;
    a background save's own gloo group (:meth:`own_group`), so its agreements never
    interleave with the training loop's."""
    mesh_group: Any = None
    """The group FSDP2's device mesh runs on (:meth:`wrap`): one of every rank, made at
    :meth:`start`, never the default one (see :meth:`close` for why)."""

    @classmethod
    def start(cls, config: Config) -> "LaunchWorld":
        """Join the process group torchrun set up (gloo on CPU, nccl on CUDA)."""
        mode = launch_mode(config.training.parallel, launch_size())
        if mode == "none":
            raise ConfigError(
                f"{config.source}: launched by torchrun with {os.environ['WORLD_SIZE']} processes but "
                "training.parallel is 'none': set it to 'auto', 'ddp' or 'fsdp2' "
                "(--set training.parallel=auto)"
            )
        end_with_launcher()
        local_rank = int(os.environ["LOCAL_RANK"])
        wanted = config.training.device
        cuda = wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available())
        if cuda and not torch.cuda.is_available():
            raise ConfigError(
                f"{config.source}: training.device is 'cuda' but no CUDA device is available; "
                "set it to 'cpu' or 'auto'"
            )
        if cuda:
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        # The agent's store can go away while the ranks meet (the agent killed as they start).
        with _peer_loss(
            "could not join the launch's process group",
            "its torchrun agent or another process of it is gone; nothing was trained: launch again",
        ):
            if not dist.is_initialized():
                dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
            mesh_group = dist.new_group()
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
            device=device,
            mode=mode,
            find_unused_parameters=config.training.ddp_find_unused_parameters,
            mesh_group=mesh_group,
        )

    def own_group(self) -> "LaunchWorld":
        """This rank on a new gloo process group of every rank (CPU collectives, whatever
        the training backend). Every rank must call it at the same point, in the same order."""
        return dataclasses.replace(self, group=dist.new_group(backend="gloo"))

    def leave_group(self) -> None:
        """Destroy the group :meth:`own_group` made (every rank, once its last collective is done)."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)

    def seed_rank(self, seed: int, step: int) -> None:
        """This rank's own RNG streams from ``(seed, step, rank)``
        (:func:`pipeline.rng.derive_rank_rng`)."""
        derive_rank_rng(seed, step, self.rank)

    def close(self) -> None:
        """Leave every process group and end their gloo worker threads while Python still
        runs (a worker alive at interpreter exit can abort the rank): the garbage that still
        holds a group is collected first, then the groups are destroyed. A destroyed group's
        workers stop with its last reference, so this object lets go of its mesh group too
        (an error's traceback may keep this object to the exit; the caller drops the frames
        that hold the model: :func:`pipeline.distributed.launch.joined`). FSDP2's mesh outlives
        this (torch's DTensor caches keep it), idle from the last training step on."""
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
        self.mesh_group = None

    # -- data ----------------------------------------------------------------------------
    def slice(self, indices: Sequence[int]) -> tuple[list[int], float]:
        """This rank's contiguous part of one global batch, and the factor that makes the
        mean of the ranks' scaled losses (what DDP and FSDP2 average) the global batch's
        mean loss, however unevenly the batch divides."""
        total = len(indices)
        if total < self.world_size:
            # Every rank sees the same batch size, so every rank refuses together.
            raise DataError(
                f"a batch of {total} rows cannot be split over {self.world_size} processes: raise "
                "data.batch_size, set data.drop_last, or launch fewer processes"
            )
        start, stop = (total * self.rank) // self.world_size, (total * (self.rank + 1)) // self.world_size
        return list(indices[start:stop]), (stop - start) * self.world_size / total

    def scaled_loss(self, loss: torch.Tensor, scale: float) -> torch.Tensor:
        """This rank's loss times :meth:`slice`'s factor: DDP and FSDP2 average the ranks'."""
        return loss * scale

    def global_loss(self, scaled_loss: torch.Tensor) -> float:
        """The global batch's loss, the same float on every rank."""
        value = scaled_loss.detach().to(torch.float64).reshape(1).clone()
        with _peer_loss():
            dist.all_reduce(value, group=self.group)
        return float(value) / self.world_size

    # -- agreement -----------------------------------------------------------------------
    def _max(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64, device=self._comm_device)
        with _peer_loss():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" and self.group is None else torch.device("cpu")

    def agree_signal(self, signum: int | None) -> int | None:
        """A stop signal received by any rank, known to all (each step, so all stop together)."""
        (agreed,) = self._max([signum or 0])
        if agreed:
            _stop_agreed.set()
        return agreed or None

    def agree_flags(self, flags: list[int]) -> list[int]:
        """Each flag raised on any rank, raised on all (what the callbacks asked of this step)."""
        return self._max([int(flag) for flag in flags])

    @contextlib.contextmanager
    def together(self, what: str) -> Iterator[None]:
        """Run a block on every rank; if it fails on any, it fails on all, and its message is
        printed once for the launch: the lowest rank that failed with it raises its own error,
        every other rank a quiet :class:`PeerFailed` carrying that message (for torchrun's
        report, :func:`pipeline.cli.run_main`) and its exit code. A refusal every rank
        reaches alike (a checkpoint that does not fit) is one line, not one per rank."""
        error: BaseException | None = None
        try:
            yield
        except Exception as exc:
            error = exc
        code = (
            getattr(error, "exit_code", 2 if isinstance(error, (PipelineError, OSError)) else 1)
            if error
            else 0
        )
        (agreed,) = self._max([code])
        if not agreed:
            return
        said: list[str] = []
        try:
            said = self.gather_text(_one_line(error))
        except PipelineError:  # a peer is gone: this rank says what it knows
            if error is None:
                raise
        if not said:
            raise error
        first = next((line for line in said if line), f"{what} failed on another rank (its message is above)")
        if error is None:
            raise PeerFailed(first, agreed)
        if said[self.rank] and said[self.rank] in said[: self.rank]:
            raise PeerFailed(said[self.rank], code) from None  # a lower rank says it
        raise error

    def broadcast_text(self, text: str | None) -> str:
        """Rank 0's ``text``, on every rank."""
        data = (text or "").encode("utf-8") if self.rank == 0 else b""
        (length,) = self._max([len(data)])
        buffer = torch.zeros(length, dtype=torch.uint8, device=self._comm_device)
        if self.rank == 0 and length:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        with _peer_loss():
            dist.broadcast(buffer, src=0, group=self.group)
        return bytes(buffer.cpu().tolist()).decode("utf-8")

    def gather_text(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order, on every rank. UTF-8 bytes in a tensor, not
        ``all_gather_object``: that pickles, and a record from another process is parsed here
        by the strict JSON reader like any file, never unpickled."""
        data = text.encode("utf-8")
        sizes = [torch.zeros(1, dtype=torch.int64, device=self._comm_device) for _ in range(self.world_size)]
        with _peer_loss():
            dist.all_gather(
                sizes,
                torch.tensor([len(data)], dtype=torch.int64, device=self._comm_device),
                group=self.group,
            )
        longest = max(int(size) for size in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self._comm_device)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        with _peer_loss():
            dist.all_gather(parts, mine, group=self.group)
        return [bytes(part[: int(size)].cpu().numpy()).decode("utf-8") for part, size in zip(parts, sizes)]

    def barrier(self) -> None:
        self._max([0])

    # -- model ---------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, config: Config) -> torch.nn.Module:
        """DDP or FSDP2 around the freshly built model (before the optimizer sees it)."""
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.buckets_settled = self.find_unused_parameters  # then DDP never rebuilds them
            return DistributedDataParallel(
                model,
                device_ids=[self.local_rank] if self.device.type == "cuda" else None,
                find_unused_parameters=self.find_unused_parameters,
            )
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        if config.training.amp == "fp16":
            # GradScaler's found-inf flag is a 1-element tensor; DTensor all-reduces it over the
            # mesh (so every rank skips the same steps) and warns, every step, that it did.
            warnings.filterwarnings(
                "ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning
            )
        return fully_shard(model, mesh=DeviceMesh.from_group(self.mesh_group, self.device.type))

    def settle_buckets(self, run: Any, loss: Callable[[], torch.Tensor]) -> None:
        """Make DDP rebuild its gradient buckets before this process's first step.

        Without ``find_unused_parameters``, DDP reduces the first backward of a process in
        one bucket of every parameter, then rebuilds its buckets in the order gradients
        became ready: a resumed run's first step would reduce in another order than the
        uninterrupted run's same step (other last bits from 3 processes on). One discarded
        forward and backward of the first batch (``loss``) rebuilds them in every process,
        fresh or resumed, so every step reduces alike. The RNG states and buffers it moved
        are put back, and the gradients dropped: the step that follows is the one an
        uninterrupted run takes. ``run``: the :class:`pipeline.run.TrainingRun`. Once settled,
        nothing."""
        if self.buckets_settled:
            return
        rng = capture_rng(run.generator)
        buffers = {name: buffer.detach().clone() for name, buffer in run.model.named_buffers()}
        run.optimizer.zero_grad(set_to_none=True)
        loss().backward()
        run.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, buffer in run.model.named_buffers():
                buffer.copy_(buffers[name])
        restore_rng(rng, run.generator, need_cuda=self.device.type == "cuda")
        self.buckets_settled = True

    def resume_command(self, config: Config | None = None, *, argv: Sequence[str] | None = None) -> str:
        """The launch to repeat to continue (:func:`pipeline.commands.resume_command` of
        ``argv``, by default this process's, behind torchrun with this launch's shape)."""
        nodes = self.world_size // max(self.local_world_size, 1)
        return resume_command(
            list(sys.argv if argv is None else argv),
            launcher=torchrun_launcher(self.local_world_size, nodes),
        )
