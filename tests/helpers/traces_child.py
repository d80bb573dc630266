"""``python traces_child.py CONFIG OVERRIDES_JSON KILL_AT``: train CONFIG with OVERRIDES (resuming
the latest checkpoint if any) and SIGKILL this process right after step KILL_AT, as a crash or
an out-of-memory kill would: nothing of the training's own cleanup runs."""

import json
import os
import signal
import sys

from pipeline.config import load_config
from pipeline.train import TrainingHooks, train


def main() -> None:
    config_path, overrides, kill_at = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])

    def on_step(run) -> None:
        if run.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    train(
        load_config(config_path, overrides),
        resume="auto",
        progress=False,
        hooks=TrainingHooks(on_step=on_step),
    )


if __name__ == "__main__":
    main()
