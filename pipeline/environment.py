"""What, besides the saved state, changes the numbers a run computes on this machine.

Two threads split a matmul's sums differently from one, so the thread count is as much
part of a bitwise resume as the weights. A run pins its intra-op thread count at the
start (``training.threads``) and every checkpoint records :func:`current_environment`;
a resume first restores the recorded thread counts, then compares every item and refuses
with one line naming the first that differs, unless the user accepts the change
(``--allow-environment-change``), which the checkpoint then records.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .config import Config
from .errors import SEALED_BUT_UNFIT, EnvironmentMismatch, MachineLimit
from .limits import check_counts

__all__ = ["ENVIRONMENT_ITEMS", "pin_threads", "current_environment", "reproduce_environment"]

ENVIRONMENT_ITEMS = (
    "intra_op_threads",
    "inter_op_threads",
    "deterministic_algorithms",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "device_type",
    "torch",
    "numpy",
)


def pin_threads(config: Config) -> None:
    """A fresh run uses exactly ``training.threads`` intra-op threads, whatever
    ``OMP_NUM_THREADS`` or the core count say; a count this machine cannot honour, with
    ``data.num_workers``, is refused first (:func:`pipeline.limits.check_counts`)."""
    check_counts(config.training.threads, config.data.num_workers)
    torch.set_num_threads(config.training.threads)


def current_environment(device: torch.device) -> dict[str, Any]:
    return {
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "device_type": device.type,
        "torch": torch.__version__,
        "numpy": np.__version__,
    }


def reproduce_environment(
    recorded: Any, device: torch.device, *, allow_change: bool, step: int
) -> list[dict[str, Any]]:
    """Restore the recorded thread counts, then compare every item with this process.

    Returns the changes (``[]`` when bitwise); raises :class:`EnvironmentMismatch` naming the
    first one unless ``allow_change``. ``recorded`` comes from a verified ``meta.json``.
    """
    if (
        not isinstance(recorded, dict)
        or set(recorded) != {*ENVIRONMENT_ITEMS, "changes"}
        or not isinstance(recorded["changes"], list)
    ):
        raise EnvironmentMismatch(f"the checkpoint's environment record is malformed: {SEALED_BUT_UNFIT}")
    for item, setter in (
        ("intra_op_threads", torch.set_num_threads),
        ("inter_op_threads", torch.set_num_interop_threads),
    ):
        wanted = recorded[item]
        getter = torch.get_num_threads if item == "intra_op_threads" else torch.get_num_interop_threads
        if type(wanted) is int and wanted >= 1 and getter() != wanted:
            try:
                check_counts(wanted, key=f"the checkpoint's {item}")
            except MachineLimit as refused:
                if allow_change:
                    continue  # the change is recorded below, like any other
                raise EnvironmentMismatch(
                    f"{refused}; or pass --allow-environment-change to resume with this process's "
                    f"{getter()} (the resume is then not bitwise exact, and meta.json records it)"
                ) from None
            try:
                setter(wanted)
            except RuntimeError:  # inter-op threads are fixed once parallel work started
                pass
    now = current_environment(device)
    changes = [
        {"item": item, "recorded": recorded[item], "now": now[item], "step": step}
        for item in ENVIRONMENT_ITEMS
        if now[item] != recorded[item]
    ]
    if changes and not allow_change:
        first = changes[0]
        more = f" (and {', '.join(c['item'] for c in changes[1:])})" if len(changes) > 1 else ""
        raise EnvironmentMismatch(
            f"this process cannot reproduce the checkpoint's {first['item']} "
            f"({first['recorded']!r} recorded, {first['now']!r} here){more}, so the resume "
            "would not be bitwise exact: resume where it matches, or pass "
            "--allow-environment-change to continue anyway (recorded in meta.json)"
        )
    return changes
