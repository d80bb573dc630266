"""Reusable CPU copies of a run's tensors, so a background thread can write a consistent
state while training moves on.

One buffer per tensor name, kept from save to save: after the first save a snapshot is a
plain memory copy with no allocation (fresh pages would be faulted in on every save, which
costs more than the copy itself), shared by the calling thread and a helper thread from
32 MiB on (:class:`_TwoHands`). A buffer is reallocated only when its tensor's shape or dtype
changes, and dropped when the name disappears, so the buffers never hold more than one
copy of the state.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator, Mapping

import numpy as np
import torch

__all__ = ["SnapshotBuffers"]


class SnapshotBuffers:
    """Named, persistent CPU buffers, filled by :meth:`copy`.

    Keys are ``(group, name)``, so the same tensor name in two files never shares a buffer.
    Buffers are pinned when the source lives on a GPU, so the device-to-host copy runs at
    full bus speed.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._hands = _TwoHands()

    def copy(self, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Copy every tensor into its buffer; return ``{group: {name: buffer}}``.

        The result stays valid until the next :meth:`copy` or :meth:`release`; the caller
        must not start another copy while a writer still reads the previous one.
        """
        snapshot: dict[str, dict[str, torch.Tensor]] = {}
        from_gpu = False
        pieces: list[tuple[np.ndarray, np.ndarray]] = []
        with torch.no_grad():
            for group, tensors in groups.items():
                snapshot[group] = {}
                for name, source in tensors.items():
                    buffer = self._buffer_for((group, name), source)
                    from_gpu |= source.device.type == "cuda"
                    if _plain_cpu(source):
                        target, origin = _as_bytes(buffer), _as_bytes(source)
                        pieces += [
                            (target[start : start + _PIECE], origin[start : start + _PIECE])
                            for start in range(0, len(origin), _PIECE)
                        ]
                    else:
                        buffer.copy_(source, non_blocking=buffer.is_pinned())
                    snapshot[group][name] = buffer
        self._hands.copy(pieces)
        wanted = {(group, name) for group, tensors in snapshot.items() for name in tensors}
        for stale in set(self._buffers) - wanted:
            del self._buffers[stale]
        if from_gpu:
            # Wait here for the device-to-host copies (milliseconds) rather than hand the
            # writer buffers that are still being filled.
            torch.cuda.synchronize()
        return snapshot

    def release(self) -> None:
        """Free every buffer (the run is over)."""
        self._buffers.clear()
        self._hands.stop()

    def _buffer_for(self, key: tuple[str, str], source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pin = source.device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
        return buffer


# Bytes per piece of a snapshot copy: small enough that the threads share the work evenly and
# the calling thread never waits long for the helper's last piece.
_PIECE = 4 * 1024 * 1024
# Snapshots from this size on are shared with the helper thread (see :class:`_TwoHands`).
_SHARED_FROM = 32 * 1024 * 1024


def _plain_cpu(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.numel() > 0
    )


class _TwoHands:
    """Plain memory copies, split into pieces that the calling thread and one helper thread
    take in turn until none is left: on an idle second core a snapshot takes about half a
    memcpy. Only the calling thread is sure to run, so it waits at the end for the piece the
    helper holds (one piece, at most), never for a helper that did not get a core.

    That wait is for a thread the host may have descheduled mid-piece: on a busy host it
    lasts until the helper runs again, milliseconds whatever the piece. A snapshot under
    ``_SHARED_FROM`` bytes is therefore copied by the calling thread alone: there, half a
    memcpy saves less than that wait can cost (10 MB on a 2-vCPU VM with no idle core: 2.8
    against 3.0 ms, and in another run 3.8 against 8.3 ms, alone against shared, medians;
    benchmarks/README.md, throughput), and a small run keeps one thread fewer.

    One memcpy per piece (``np.copyto``, which releases the GIL), not ``Tensor.copy_``:
    that splits each tensor over OpenMP threads, and on a busy host every split waits for a
    descheduled thread (9 tensors of 1 MB took 68 ms that way against 0.9 ms by memcpy)."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._helper: threading.Thread | None = None
        self._pieces: Iterator[tuple[np.ndarray, np.ndarray]] = iter(())
        self._lock = threading.Condition()
        self._held = 0  # pieces being copied by the helper
        self._error: BaseException | None = None

    def copy(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        shared = len(pieces) > 1 and sum(target.nbytes for target, _ in pieces) >= _SHARED_FROM
        if shared and self._helper is None:
            helper = threading.Thread(target=self._serve, name="snapshot-copy", daemon=True)
            helper.start()  # kept only once started: stop() joins it
            self._helper = helper
        with self._lock:
            self._pieces = iter(pieces)
        if shared:
            self._work.put(True)
        while (piece := self._take(helper=False)) is not None:
            np.copyto(*piece)
        with self._lock:
            while self._held:
                self._lock.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _take(self, *, helper: bool) -> tuple[np.ndarray, np.ndarray] | None:
        with self._lock:
            piece = next(self._pieces, None)
            if helper and piece is not None:
                self._held += 1
            return piece

    def _serve(self) -> None:
        while self._work.get():
            while (piece := self._take(helper=True)) is not None:
                try:
                    np.copyto(*piece)
                except BaseException as exc:  # raised by copy(), in the calling thread
                    self._error = exc
                finally:
                    with self._lock:
                        self._held -= 1
                        self._lock.notify_all()

    def stop(self) -> None:
        if self._helper is not None:
            self._work.put(False)
            self._helper.join()
            self._helper = None


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()
