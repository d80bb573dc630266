"""A task that leaves the machine no room for one more thread or process, as another program
might right after a run checked its counts (tests/test_machine_limits.py): once built (after
the check), its data (``build_crowded_data``) or its model (``build_crowded_model``, only where
``CROWD_THE_MACHINE`` is set, so that a run without a limit trains it plainly) starts idle
threads until the next one cannot start. Run it only under a limit on processes."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from pipeline.tasks.regression import build_data, build_model

_HELD: list[tuple[threading.Thread, threading.Event]] = []


def crowd() -> None:
    """Idle threads until the next cannot start, then ``CROWD_LEAVE`` of them (default 0) end."""
    while True:
        done = threading.Event()
        thread = threading.Thread(target=done.wait, daemon=True)
        try:
            thread.start()
        except RuntimeError:  # can't start new thread: the room is used up
            break
        _HELD.append((thread, done))
    for thread, done in [_HELD.pop() for _ in range(int(os.environ.get("CROWD_LEAVE", "0")))]:
        done.set()
        thread.join()


def build_crowded_data(config: Any, data_dir: Path) -> Any:
    data = build_data(config, data_dir)
    crowd()
    return data


def build_crowded_model(config: Any) -> Any:
    model = build_model(config)
    if os.environ.get("CROWD_THE_MACHINE"):
        crowd()
    return model
