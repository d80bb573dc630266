"""One World for every run: a process alone is rank 0 of 1 whose agreements are its own
answers, so the trainer, the start and the checkpointers take one path; a launch the caller
joined must run the mode its config asks for."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import load_config
from pipeline.distributed.launch import joined
from pipeline.distributed.world import LaunchWorld
from pipeline.errors import PipelineError
from pipeline.world import World

from support import REPO

CONFIG = REPO / "config.yaml"


def test_a_process_alone_is_rank_0_of_1_and_agrees_with_itself(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with joined(load_config(CONFIG, {"training.device": "cpu"})) as world:
        assert type(world) is World and not world.launched
        assert (world.rank, world.world_size, world.mode, world.device) == (0, 1, "none", torch.device("cpu"))
        assert world.slice([3, 1, 2]) == ([3, 1, 2], 1.0)
        loss = torch.tensor(0.25, dtype=torch.float64)
        assert world.scaled_loss(loss, 1.0) is loss and world.global_loss(loss) == 0.25
        assert world.agree_signal(15) == 15 and world.agree_signal(None) is None
        assert world.broadcast_text("x") == "x" and world.gather_text("y") == ["y"]
        assert world.own_group() is world
        with pytest.raises(KeyError):
            with world.together("a step"):
                raise KeyError("as raised")


def test_a_launch_given_to_train_must_run_the_mode_its_config_asks_for():
    launch = LaunchWorld(
        rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), mode="fsdp2"
    )
    with pytest.raises(PipelineError, match="the launch runs fsdp2, the config asks for ddp"):
        with joined(load_config(CONFIG, {"training.parallel": "ddp"}), launch):
            pass
    with joined(load_config(CONFIG, {"training.parallel": "fsdp2"}), launch) as world:
        assert world is launch
