"""One World for every run: a process alone is rank 0 of 1 whose agreements are its own
answers, so the trainer, the start and the checkpointers take one path; a launch the caller
joined must run the mode its config asks for."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pipeline.config import launch_mode, load_config
from pipeline.distributed.launch import joined
from pipeline.distributed.world import LaunchWorld
from pipeline.errors import PipelineError
from pipeline.run import build_run
from pipeline.world import World, joins_launch

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
        assert world.broadcast_text(None) == ""
        assert world.own_group() is world
        with pytest.raises(KeyError):
            with world.together("a step"):
                raise KeyError("as raised")


def test_a_process_with_only_some_launch_variables_trains_alone(monkeypatch):
    """A cluster may set RANK or LOCAL_RANK for its own reasons: only torchrun's three together
    make a launch, and without WORLD_SIZE there would be no size to join with."""
    from pipeline.world import launch_size, launched_by_torchrun

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
        assert not launched_by_torchrun() and launch_size() is None
        assert not joins_launch(load_config(CONFIG, {"training.parallel": "ddp"}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_by_torchrun() and launch_size() == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_training_device_cuda_without_cuda_is_refused_in_one_line_naming_the_fix():
    from pipeline.errors import ConfigError
    from pipeline.world import resolve_device

    config = load_config(CONFIG, {"training.device": "cuda"})
    line = f"{config.source}: training.device is 'cuda' but no CUDA device is available; set it to 'cpu' or 'auto'"
    with pytest.raises(ConfigError) as refused:
        resolve_device(config)
    assert str(refused.value) == line
    assert resolve_device(load_config(CONFIG, {"training.device": "auto"})) == torch.device("cpu")
    assert resolve_device(load_config(CONFIG, {"training.device": "cpu"})) == torch.device("cpu")


def test_a_launch_refuses_a_config_it_cannot_run_before_joining_its_process_group(monkeypatch):
    """A rank of a 2-process launch whose config runs training.parallel none, or asks for
    CUDA on a machine without it, is refused in one line naming the key and its fix, before
    it waits for its peers in the process group."""
    import pipeline.distributed.world as launch_world
    from pipeline.errors import ConfigError

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_world, "_watching", True)  # no launcher watchdog in the test process
    config = load_config(CONFIG, {"training.parallel": "none"})
    with pytest.raises(ConfigError) as refused:
        LaunchWorld.start(config)
    assert str(refused.value) == (
        f"{config.source}: launched by torchrun with 2 processes but training.parallel is 'none': set it "
        "to 'auto', 'ddp' or 'fsdp2' (--set training.parallel=auto)"
    )
    if not torch.cuda.is_available():
        config = load_config(CONFIG, {"training.parallel": "ddp", "training.device": "cuda"})
        with pytest.raises(ConfigError) as refused:
            LaunchWorld.start(config)
        assert str(refused.value) == (
            f"{config.source}: training.device is 'cuda' but no CUDA device is available; "
            "set it to 'cpu' or 'auto'"
        )
    assert not torch.distributed.is_initialized()


def test_a_one_process_launch_joins_as_a_launch_only_when_the_config_names_ddp_or_fsdp2(monkeypatch):
    """torchrun --nproc-per-node 1: ``auto`` (and ``none``) train as a plain process, ``ddp`` and
    ``fsdp2`` as a launch of one (the mode asked for, its checkpoints distributed ones); two
    processes always join the launch (``none`` is then refused when it starts)."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    joins = {mode: joins_launch(load_config(CONFIG, {"training.parallel": mode})) for mode in PARALLEL}
    assert joins == {"auto": False, "none": False, "ddp": True, "fsdp2": True}
    assert [launch_mode(mode, 1) for mode in PARALLEL] == ["none", "none", "ddp", "fsdp2"]
    assert [launch_mode(mode, None) for mode in PARALLEL] == ["none", "none", "ddp", "fsdp2"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert all(joins_launch(load_config(CONFIG, {"training.parallel": mode})) for mode in PARALLEL)
    assert [launch_mode(mode, 2) for mode in PARALLEL] == ["ddp", "none", "ddp", "fsdp2"]


PARALLEL = ("auto", "none", "ddp", "fsdp2")


def test_a_launch_given_to_train_must_run_the_mode_its_config_asks_for():
    launch = LaunchWorld(
        rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), mode="fsdp2"
    )
    with pytest.raises(PipelineError, match="the launch runs fsdp2, the config asks for ddp"):
        with joined(load_config(CONFIG, {"training.parallel": "ddp"}), launch):
            pass
    with joined(load_config(CONFIG, {"training.parallel": "fsdp2"}), launch) as world:
        assert world is launch


def test_a_run_built_for_a_rank_of_a_launch_reads_that_ranks_part_of_each_batch(data_dir):
    """The feed reads for the run's world (no process group needed to slice a batch): rank R
    of two gets its contiguous half of the global batch one process trains on."""
    config = load_config(CONFIG, {"data.dir": str(data_dir), "data.num_workers": 0, "training.device": "cpu"})
    cpu = torch.device("cpu")
    alone = build_run(config, cpu)
    with contextlib.closing(alone.feed):
        (whole, _), scale = alone.feed.next_batch()
    assert scale == 1.0
    total = len(whole)
    for rank in range(2):
        launch = LaunchWorld(
            rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=cpu, mode="ddp"
        )
        run = build_run(config, cpu, world=launch)
        with contextlib.closing(run.feed):
            (part, _), _ = run.feed.next_batch()
        assert torch.equal(part, whole[(total * rank) // 2 : (total * (rank + 1)) // 2]), rank


def test_ddps_bucket_settling_pass_puts_back_the_buffers_and_rng_its_forward_moved(tmp_path):
    """One process of DDP on gloo, in-process, around a model with BatchNorm: the discarded
    forward and backward that settles DDP's buckets moves the running statistics and draws
    from the RNG; both are put back (docs/distributed.md), so the first real step counts its
    batch once, as an uninterrupted run's does, and no gradient is left behind."""
    from types import SimpleNamespace

    import numpy as np
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        launch = LaunchWorld(
            rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), mode="ddp"
        )
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        ddp = launch.wrap(model, None)
        assert not launch.buckets_settled
        run = SimpleNamespace(
            model=ddp, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1), generator=np.random.default_rng(0)
        )
        before = {name: buffer.clone() for name, buffer in ddp.named_buffers()}
        draw = torch.get_rng_state()
        launch.settle_buckets(run, lambda: ddp(torch.randn(8, 3) + 5.0).pow(2).mean())
        assert launch.buckets_settled
        assert all(torch.equal(buffer, before[name]) for name, buffer in ddp.named_buffers()), dict(
            ddp.named_buffers()
        )
        assert torch.equal(torch.get_rng_state(), draw)
        assert all(p.grad is None for p in ddp.parameters())
    finally:
        dist.destroy_process_group()


def test_a_run_started_from_python_prints_a_resume_command_that_continues_it(data_dir, tmp_path, capsys):
    """``train()`` called from Python (no script's argv to repeat) that stops on a refusal
    prints the script 02 command to go on with; pasted, it resumes the run and finishes it."""
    import shlex

    from pipeline.checkpoint import CheckpointStore
    from pipeline.entry.train import main as train_script
    from pipeline.errors import ConfigError
    from pipeline.train import train

    overrides = {
        "data.dir": str(data_dir),
        "checkpoint.dir": str(tmp_path / "ck"),
        "training.max_steps": 2,
        "training.eval_every": 1,
        "checkpoint.best_metric": "rmsee",
    }
    with pytest.raises(ConfigError) as refused:
        train(load_config(CONFIG, overrides), progress=False)
    command = shlex.split(str(refused.value).partition("; step 1 is committed: resume with ")[2])
    # Not beside this process's own program (pytest's): script 02 in its place in a clone.
    assert command[1] == "scripts/02_train.py" and command[-2:] == ["--resume", "latest"], command
    assert train_script(command[2:]) == 0, capsys.readouterr().err
    assert "trained to step 2/2" in capsys.readouterr().out
    assert CheckpointStore(tmp_path / "ck").committed_steps() == [2]


def test_a_rank_of_a_two_node_launch_reads_its_nodes_process_count_and_names_that_launch_to_resume(
    monkeypatch, tmp_path
):
    """Rank 0 of a launch of 2 nodes of 1 process each, with the variables torchrun's agents
    set (its peer: a second process that only joins the groups), knows its node runs 1 of the
    2 processes (``LOCAL_WORLD_SIZE``, not ``WORLD_SIZE``) and names a 2-node launch of 1
    process a node to resume; a launcher that does not say the node's count gets the
    launch's (one node)."""
    import shlex

    import torch.distributed as dist

    import pipeline.distributed.world as launch_world
    from pipeline.commands import python_command

    from support import script_env, start_python

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's
    launch = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    peer = tmp_path / "peer.py"
    peer.write_text(
        "import os\n"
        "import torch.distributed as dist\n"
        "os.environ['TORCHELASTIC_USE_AGENT_STORE'] = 'True'  # a load-time name: the fork server's has none\n"
        "dist.init_process_group('gloo')\n"
        "dist.new_group(), dist.new_group()  # each start's mesh group\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    other = start_python(peer, tmp_path, script_env(RANK="1", **launch))
    for name, value in {**launch, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_world, "_watching", True)  # no launcher watchdog in the test process
    config = load_config(
        CONFIG,
        {"training.parallel": "ddp", "training.device": "auto", "training.ddp_find_unused_parameters": True},
    )
    argv = ["scripts/02_train.py", "--set", "training.parallel=ddp"]
    try:
        two_nodes = LaunchWorld.start(config)
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        one_node = LaunchWorld.start(config)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        ended = other.wait(60)
    assert ended.returncode == 0, ended.stderr
    cpu = torch.device("cpu")
    fields = dict(rank=0, world_size=2, local_rank=0, device=cpu, mode="ddp", find_unused_parameters=True)
    assert two_nodes == LaunchWorld(local_world_size=1, mesh_group=two_nodes.mesh_group, **fields)
    assert one_node == LaunchWorld(local_world_size=2, mesh_group=one_node.mesh_group, **fields)
    assert two_nodes.describe() == {"mode": "ddp", "world_size": 2, "ddp_find_unused_parameters": True}
    torchrun = shlex.join([python_command(), "-m", "torch.distributed.run"])
    assert two_nodes.resume_command(argv=argv) == torchrun + (
        " --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --nproc-per-node=1"
        " scripts/02_train.py --set training.parallel=ddp --resume latest"
    )
    assert one_node.resume_command(argv=argv) == torchrun + (
        " --standalone --nproc-per-node=2 scripts/02_train.py --set training.parallel=ddp --resume latest"
    )


def _gloo_threads() -> set[str]:
    """The ids of this process's gloo worker and transport threads."""
    from pathlib import Path

    tasks = Path("/proc/self/task")
    return {
        task.name
        for task in tasks.iterdir()
        if (task / "comm").read_text().strip() in ("pt_gloo_runloop", "gloo_tcp_loop")
    }


def test_a_rank_that_fails_ends_its_groups_threads_although_the_error_is_still_held(
    data_dir, monkeypatch, tmp_path
):
    """A refusal on a rank of a launch (here the only one, DDP on gloo) leaves no gloo thread
    running once :func:`joined` is left, while the error that ended the run is still held (as
    a script's exit holds it to the end): a worker alive when the interpreter finalizes can
    abort the rank after its one line was printed (SIGABRT for exit 2). The error's frames
    held the DDP model's group, the launch object its mesh group."""
    import torch.distributed as dist

    from pipeline.errors import StateMismatch
    from pipeline.train import train

    from support import reseal

    config, _agents = _a_launch_of_one(data_dir, monkeypatch, tmp_path)
    before = _gloo_threads()
    with _a_failing_rank():
        train(config, stop_at=2, progress=False)
        reseal(tmp_path / "ck" / "step-00000002", lambda meta: meta["training_state"].update(optimizer={}))
        with pytest.raises(StateMismatch) as refused:
            train(config, resume="latest", progress=False)
        assert not dist.is_initialized()
        assert _gloo_threads() == before, refused.value


def _a_launch_of_one(data_dir, monkeypatch, tmp_path):
    """The environment torchrun gives the only rank of a launch, and the config of a DDP run
    in it; the agent's store, which the caller keeps while the rank runs."""
    import torch.distributed as dist

    import pipeline.distributed.world as launch_world

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "1", "RANK": "0"}
    for name, value in {**launch, "LOCAL_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_world, "_watching", True)  # no launcher watchdog in the test process
    config = load_config(
        CONFIG,
        {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path / "ck"), "training.parallel": "ddp"},
    )
    return config, store


@contextlib.contextmanager
def _a_failing_rank():
    """The test process back as it was after a rank failed in it: SIGTERM handled again (a
    failed rank ignores it from then on), no process group left behind."""
    import signal

    import torch.distributed as dist

    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        if dist.is_initialized():
            dist.destroy_process_group()


class _FailsAtStep1:
    def on_step_end(self, run, control):
        if run.step == 1:
            raise ValueError("no further")


def test_a_rank_whose_error_holds_the_run_only_through_another_or_is_no_exception_ends_its_groups_threads(
    data_dir, monkeypatch, tmp_path
):
    """Two errors a rank can end with that hold the run otherwise: a callback's failure is
    raised anew once the checkpointer closed, so the frames that hold the DDP model are its
    context's; a KeyboardInterrupt is no Exception. Neither leaves a gloo thread running once
    :func:`joined` is left, and what --debug prints for the callback's failure still names the
    file and line that raised it."""
    import traceback

    import torch.distributed as dist

    from pipeline.errors import CallbackFailed
    from pipeline.train import TrainingHooks, train

    config, _agents = _a_launch_of_one(data_dir, monkeypatch, tmp_path)
    before = _gloo_threads()
    failing = TrainingHooks(on_start=lambda run: run.callbacks.add("failing", _FailsAtStep1(), user=True))
    with _a_failing_rank():
        with pytest.raises(CallbackFailed) as refused:
            train(config, progress=False, hooks=failing)
        assert not dist.is_initialized() and _gloo_threads() == before
    assert str(refused.value) == (
        "training.callbacks failing on_step_end() failed: ValueError: no further (fix the callback; "
        "--debug prints the traceback); no checkpoint was committed yet: fix it and run the same "
        "command again"
    )
    raised = traceback.extract_tb(refused.value.__cause__.__traceback__)[-1]  # what --debug prints last
    assert (raised.filename, raised.name, raised.line) == (
        __file__,
        "on_step_end",
        'raise ValueError("no further")',
    )

    def interrupted(run) -> None:
        raise KeyboardInterrupt("at step 1")

    with _a_failing_rank():
        with pytest.raises(KeyboardInterrupt) as stopped:  # held, as the error of a script's exit is
            train(config, progress=False, hooks=TrainingHooks(on_step=interrupted))
        assert not dist.is_initialized() and _gloo_threads() == before
    assert stopped.value.args == ("at step 1",)
