"""Training progress: a tqdm bar on a terminal, plain log lines otherwise (CI, files, pipes); a
callback of the loop, first to hear each step."""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["Progress", "quiet_hub_progress_unless_terminal"]


def quiet_hub_progress_unless_terminal() -> None:
    """huggingface_hub draws its upload and download bars with cursor escape codes; in a log
    file or a pipe they are noise. Turned off (its public switch) unless stderr is a terminal."""
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


class Progress:
    def __init__(
        self,
        *,
        total: int,
        initial: int,
        log_every: int = 1,
        stream: TextIO | None = None,
        enabled: bool = True,
    ) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.log_every = log_every
        self.enabled = enabled
        self._bar = None
        if enabled and self.stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", file=self.stream, dynamic_ncols=True)

    def on_step_end(self, run: Any, control: Any) -> None:
        """The loop's callback event (:mod:`pipeline.callbacks`): the step just trained."""
        self.update(run.step, run.history["loss"][-1], run.history["lr"][-1])

    def update(self, step: int, loss: float, lr: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4g}", lr=f"{lr:.3g}", refresh=False)
        elif step % self.log_every == 0 or step == self.total:
            print(f"step {step}/{self.total}  loss {loss:.6g}  lr {lr:.6g}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
