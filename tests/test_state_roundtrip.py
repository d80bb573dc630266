"""Pickle-free state round trips: optimizer, RNG, sampler and tied weights come back exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, load_model

from pipeline.checkpoint import load_model_weights, warm_start, write_safetensors
from pipeline.checkpoint.codec import join_state, split_state
from pipeline.checkpoint.weights import dedupe_shared_tensors
from pipeline.data import EpochSampler, epochs_done
from pipeline.errors import StateMismatch
from pipeline.rng import capture_rng, peek_next_draws, restore_rng, seed_everything

from support import REPO


def roundtrip(obj, tmp_path):
    """Through a real safetensors file and JSON text, as a checkpoint stores it."""
    import json

    tensors: dict[str, torch.Tensor] = {}
    tree = json.loads(json.dumps(split_state(obj, "s", tensors)))
    write_safetensors(tmp_path / "state.safetensors", tensors)
    return join_state(tree, load_file(tmp_path / "state.safetensors"))


def test_adamw_state_with_groups_round_trips_exactly(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
            {"params": [model[0].bias, model[1].weight, model[1].bias, model[2].bias], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.8, 0.95),
    )
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    back = roundtrip(saved, tmp_path)
    assert back["param_groups"] == saved["param_groups"]
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert set(back["state"]) == set(saved["state"]) and all(isinstance(k, int) for k in back["state"])
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(back["state"][index][key], value), (index, key)


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool],
)
def test_streamed_safetensors_file_reads_back_with_plain_safetensors(tmp_path, dtype):
    tensors = {
        "matrix": (torch.arange(12) % 3).to(dtype).reshape(3, 4),
        "scalar": torch.tensor(1).to(dtype),
        "empty": torch.zeros(0, 2, dtype=dtype),
        "strided": torch.ones(4, 4, dtype=dtype)[:, 1],
    }
    sha, size = write_safetensors(tmp_path / "t.safetensors", tensors, metadata={"k": "v"})
    assert size == (tmp_path / "t.safetensors").stat().st_size
    from pipeline.hashing import sha256_file

    assert sha == sha256_file(tmp_path / "t.safetensors")
    loaded = load_file(tmp_path / "t.safetensors")
    for name, tensor in tensors.items():
        assert loaded[name].dtype == dtype and torch.equal(loaded[name], tensor), name


def test_rng_restore_reproduces_every_family_and_peeking_draws_nothing():
    generator = seed_everything(7)
    random.random(), generator.random(), np.random.rand(), torch.rand(1)
    state = capture_rng(generator)
    peeked = peek_next_draws(generator)
    assert peek_next_draws(generator) == peeked, "peeking changed the live generators"
    expected = (
        random.random(),
        generator.random(),
        np.random.random_sample(),
        torch.rand(1, dtype=torch.float64),
    )
    seed_everything(99)
    restore_rng(state, generator, need_cuda=False)
    again = (
        random.random(),
        generator.random(),
        np.random.random_sample(),
        torch.rand(1, dtype=torch.float64),
    )
    assert again[:3] == expected[:3] and torch.equal(again[3], expected[3])
    assert peeked == {
        "python": expected[0],
        "numpy_generator": expected[1],
        "numpy_legacy": expected[2],
        "torch_cpu": float(expected[3]),
    }


def test_rng_state_missing_a_family_is_refused():
    generator = seed_everything(1)
    state = capture_rng(generator)
    del state["numpy_legacy"]
    with pytest.raises(StateMismatch, match="numpy_legacy"):
        restore_rng(state, generator, need_cuda=False)


def test_sampler_resumes_mid_epoch_and_reshuffles_identically(tmp_path):
    straight = EpochSampler(10, 4, np.random.Generator(np.random.PCG64(3)))
    batches = [straight.next_indices() for _ in range(7)]
    assert [len(b) for b in batches[:3]] == [4, 4, 2], "the last batch of an epoch is short without drop_last"
    epochs = [sum(batches[:3], []), sum(batches[3:6], [])]
    assert all(sorted(e) == list(range(10)) for e in epochs) and epochs[0] != epochs[1], (
        "each epoch reshuffles"
    )

    generator = np.random.Generator(np.random.PCG64(3))
    first = EpochSampler(10, 4, generator)
    head = [first.next_indices() for _ in range(2)]
    saved, generator_state = roundtrip(first.state_dict(), tmp_path), generator.bit_generator.state
    fresh_generator = np.random.Generator(np.random.PCG64(0))
    fresh_generator.bit_generator.state = generator_state
    second = EpochSampler(10, 4, fresh_generator)
    second.load_state_dict(saved)
    assert head + [second.next_indices() for _ in range(5)] == batches
    assert second.epoch == 2 and second.samples_seen == 24


def _state(**changes):
    """A saved position of a 10-row sampler two batches of 4 in, with ``changes``."""
    state = {
        "epoch": 0,
        "cursor": 8,
        "samples_seen": 8,
        "num_rows": 10,
        "permutation": np.arange(10)[::-1].copy(),
    }
    return {**state, **changes}


_NOT_PERMUTED = "checkpoint's sampler permutation is not a permutation of the 10 rows"


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"extra": 1}, "checkpoint's sampler state does not hold epoch, cursor, samples_seen, num_rows, permutation"),
        ({"num_rows": 11}, "checkpoint's sampler covers 11 rows, the data has 10"),
        ({"epoch": -1}, "checkpoint's sampler epoch is -1, expected an integer >= 0"),
        ({"cursor": True}, "checkpoint's sampler cursor is True, expected an integer >= 0"),
        ({"samples_seen": -1}, "checkpoint's sampler samples_seen is -1, expected an integer >= 0"),
        ({"permutation": np.arange(10, dtype=np.int32)}, _NOT_PERMUTED),
        ({"permutation": np.array([0, 0, 2, 3, 4, 5, 6, 7, 8, 9])}, _NOT_PERMUTED),
        ({"cursor": 11}, "checkpoint's sampler cursor 11 is past the data"),
        ({"cursor": 1, "permutation": None}, "checkpoint's sampler cursor 1 is past the data"),
    ],
    ids=["extra-key", "other-rows", "negative-epoch", "bool-cursor", "negative-seen", "int32", "repeated-row",
         "cursor-past-the-end", "cursor-without-permutation"],
)  # fmt: skip
def test_a_sampler_position_no_run_could_reach_is_refused_before_anything_is_set(changes, says):
    from pipeline.errors import DataError

    sampler = EpochSampler(10, 4, np.random.Generator(np.random.PCG64(0)))
    with pytest.raises(DataError) as caught:
        sampler.load_state_dict(_state(**changes))
    assert str(caught.value) == says
    assert (sampler.epoch, sampler.cursor, sampler.samples_seen, sampler.permutation) == (0, 0, 0, None)
    # The boundary: a cursor at the end of its epoch is a position a run reaches (the next
    # batch starts the next epoch); so is a fresh sampler's.
    sampler.load_state_dict(_state(cursor=10, samples_seen=10))
    assert (sampler.epoch, sampler.cursor, sampler.samples_seen) == (0, 10, 10)
    sampler.next_indices()
    assert (sampler.epoch, sampler.cursor, sampler.samples_seen) == (1, 4, 14)
    sampler.load_state_dict(_state(cursor=0, samples_seen=0, permutation=None))
    assert sampler.state_dict() == _state(cursor=0, samples_seen=0, permutation=None)


def test_an_epoch_sampler_counts_its_batches_and_epochs_on_both_sides_of_drop_last():
    from types import SimpleNamespace

    from pipeline.data import batches_per_epoch, epochs_done
    from pipeline.data.sampler import batch_epoch, dataset_length
    from pipeline.errors import DataError

    def generator():
        return np.random.Generator(np.random.PCG64(0))

    whole = EpochSampler(10, 5, generator(), shuffle=False, drop_last=True)  # no short batch to drop
    assert [whole.next_indices() for _ in range(3)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]
    short = EpochSampler(11, 5, generator(), shuffle=False, drop_last=True)
    assert [short.next_indices() for _ in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert (short.epoch, batches_per_epoch(short), epochs_done(short)) == (0, 2, 1.0)
    assert (short.next_indices(), short.epoch, epochs_done(short)) == ([0, 1, 2, 3, 4], 1, 1.5)
    kept = EpochSampler(11, 5, generator(), shuffle=False)
    assert [kept.next_indices() for _ in range(2)] and epochs_done(kept) == 10 / 11
    assert EpochSampler(5, 5, generator(), drop_last=True).next_indices() != []
    assert EpochSampler(4, 5, generator(), shuffle=False).next_indices() == [0, 1, 2, 3]  # kept whole
    with pytest.raises(DataError) as caught:
        EpochSampler(4, 5, generator(), drop_last=True)
    assert str(caught.value) == "batch size 5 exceeds the 4 training rows with drop_last"
    with pytest.raises(DataError) as caught:
        EpochSampler(0, 5, generator())
    assert str(caught.value) == "the training set is empty"

    class Counted:
        def __init__(self, count):
            self.count = count

        def __len__(self):
            if self.count is None:
                raise ValueError("no length yet")
            return self.count

    assert [batches_per_epoch(Counted(n)) for n in (1, 0, None)] == [1, None, None]
    assert epochs_done(SimpleNamespace(epoch=3)) == 3.0
    not_counts = (None, SimpleNamespace(epoch=-1), SimpleNamespace(epoch=1.0), SimpleNamespace(epoch=True))
    assert all(np.isnan(epochs_done(s)) for s in not_counts)
    assert [batch_epoch(SimpleNamespace(epoch=e)) for e in (2, -1, True)] == [2, 0, 0]
    assert batch_epoch(SimpleNamespace()) == 0

    class Broken:
        def __len__(self):
            raise OSError("the index is gone")

    with pytest.raises(DataError) as caught:
        dataset_length(Broken(), "train_dataset")
    assert str(caught.value) == "train_dataset.__len__() raised OSError: the index is gone"
    with pytest.raises(DataError) as caught:
        dataset_length(SimpleNamespace(num_train=True), "num_train")
    assert str(caught.value) == "num_train is True: the number of training rows must be an integer >= 0"
    assert (
        dataset_length(SimpleNamespace(num_train=0), "num_train"),
        dataset_length([1, 2], "train_dataset"),
    ) == (0, 2)


def test_a_cloned_sampler_yields_the_live_ones_batches_without_moving_it():
    from types import SimpleNamespace

    from pipeline.config import load_config
    from pipeline.data import clone_sampler, make_sampler
    from pipeline.errors import DataError

    config = load_config(REPO / "config.yaml", {"data.batch_size": 4})
    data = SimpleNamespace(num_train=10)
    generator = np.random.Generator(np.random.PCG64(5))
    live = make_sampler(data, generator, config)
    live.next_indices()
    live.next_indices()
    before = generator.bit_generator.state
    clone = clone_sampler(live, data, generator, config)
    ahead = [clone.next_indices() for _ in range(4)]  # past the epoch: the clone draws the next permutation
    assert generator.bit_generator.state == before and live.cursor == 8 and live.epoch == 0
    assert ahead == [live.next_indices() for _ in range(4)]
    with pytest.raises(DataError) as caught:
        clone_sampler(live, SimpleNamespace(train_iterable=[]), generator, config)
    assert str(caught.value) == "a stream has no sampler to copy"
    # The config's order settings reach the sampler; a task's own sampler, or a stream, has the say.
    unshuffled = load_config(REPO / "config.yaml", {"data.shuffle": False, "data.drop_last": True})
    made = make_sampler(data, generator, unshuffled)
    assert (made.num_rows, made.batch_size, made.shuffle, made.drop_last) == (10, 4, False, True)
    own = SimpleNamespace(num_train=10, make_sampler=lambda generator, config: live)
    assert make_sampler(own, generator, config) is live
    assert make_sampler(SimpleNamespace(num_train=10, train_iterable=[]), generator, config) is None


def test_sampler_saved_right_after_a_short_last_batch_is_at_the_epochs_end_and_loads(tmp_path):
    # 10 rows in batches of 4: the third batch holds the last 2 rows, and the cursor stops at the
    # data's end, not a whole batch further (a checkpoint saved there would be refused on resume).
    generator = np.random.Generator(np.random.PCG64(5))
    sampler = EpochSampler(10, 4, generator)
    epoch = [sampler.next_indices() for _ in range(3)]
    assert [len(b) for b in epoch] == [4, 4, 2]
    state = sampler.state_dict()
    assert {k: v for k, v in state.items() if k != "permutation"} == {
        "epoch": 0,
        "cursor": 10,
        "samples_seen": 10,
        "num_rows": 10,
    }
    assert state["permutation"].tolist() == sum(epoch, [])
    assert epochs_done(sampler) == 1.0

    saved, generator_state = roundtrip(state, tmp_path), generator.bit_generator.state
    fresh_generator = np.random.Generator(np.random.PCG64(0))
    fresh_generator.bit_generator.state = generator_state
    resumed = EpochSampler(10, 4, fresh_generator)
    resumed.load_state_dict(saved)
    assert (resumed.epoch, resumed.cursor, epochs_done(resumed)) == (0, 10, 1.0)
    nxt = [sampler.next_indices() for _ in range(3)]
    assert [resumed.next_indices() for _ in range(3)] == nxt
    assert sorted(sum(nxt, [])) == list(range(10))
    assert (resumed.epoch, resumed.cursor, resumed.samples_seen) == (1, 10, 20)


class TiedLM(torch.nn.Module):
    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def test_tied_weight_is_stored_once_and_loads_strictly_with_plain_safetensors(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    stored = dedupe_shared_tensors(model.state_dict())
    assert len(stored) == 1
    write_safetensors(tmp_path / "modelo.safetensors", stored, metadata={"format": "pt"})

    plain = TiedLM()
    load_model(plain, tmp_path / "modelo.safetensors", strict=True)  # no project code involved
    ours = TiedLM()
    load_model_weights(ours, load_file(tmp_path / "modelo.safetensors"))
    tokens = torch.tensor([[1, 2, 3]])
    for other in (plain, ours):
        assert torch.equal(other(tokens), model(tokens))
        assert other.head.weight.data_ptr() == other.embed.weight.data_ptr(), "the tie was broken by loading"


def test_parameters_that_are_not_contiguous_are_saved_and_restored_in_place(data_dir, tmp_path):
    """A transposed parameter and one that is every other column of a larger buffer (their Adam
    state laid out alike): each checkpoint, written in the background or not, holds the very
    values of the live parameters in their logical order; a resume puts them back, and ends
    where the uninterrupted run ends, bit for bit."""
    from pipeline.config import load_config
    from pipeline.train import TrainingHooks, train

    from support import REPO

    live: dict[int, dict[str, torch.Tensor]] = {}

    def keep(run) -> None:
        live[run.step] = {name: p.detach().clone() for name, p in run.model.named_parameters()}

    def config(folder: str, background: bool):
        return load_config(
            REPO / "config.yaml",
            {
                "data.dir": str(data_dir),
                "checkpoint.dir": str(tmp_path / folder),
                "model.factory": "layout_factories:build_model",
                "training.max_steps": 6,
                "checkpoint.every": 2,
                "checkpoint.keep_last": 3,
                "checkpoint.async": background,
            },
        )

    full = train(config("full", True), progress=False, hooks=TrainingHooks(on_step=keep))
    assert not live[6]["w1"].is_contiguous()  # clone() keeps a dense layout
    for step in (2, 4, 6):
        stored = load_file(tmp_path / "full" / f"step-{step:08d}" / "modelo.safetensors")
        assert stored.keys() == live[step].keys()
        assert all(torch.equal(stored[name], live[step][name]) for name in stored), step
    cut = train(config("cut", False), stop_at=4, progress=False)
    stored = load_file(cut.checkpoint / "modelo.safetensors")
    assert all(torch.equal(stored[name], live[4][name]) for name in stored)
    restored: dict[str, torch.Tensor] = {}

    def look(run) -> None:
        restored.update({name: p.detach().clone() for name, p in run.model.named_parameters()})

    resumed = train(config("cut", False), resume="latest", progress=False, hooks=TrainingHooks(on_start=look))
    assert all(torch.equal(restored[name], live[4][name]) for name in live[4])
    assert resumed.history["loss"] == full.history["loss"]
    final = load_file(resumed.checkpoint / "modelo.safetensors")
    assert all(torch.equal(final[name], live[6][name]) for name in final)


def test_strict_load_names_missing_and_misshapen_tensors():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(StateMismatch, match=r"missing 1 \(bias\)"):
        load_model_weights(model, {"weight": torch.zeros(2, 3)})
    with pytest.raises(StateMismatch, match=r"tensor weight is torch.float32 \(3, 3\)"):
        load_model_weights(model, {"weight": torch.zeros(3, 3), "bias": torch.zeros(2)})


def test_warm_start_reports_loaded_skipped_and_new():
    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    target = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 1))
    report = warm_start(target, source.state_dict())
    assert report["loaded"] == ["0.weight", "0.bias"]
    assert [s.split(" ")[0] for s in report["skipped"]] == ["1.weight", "1.bias"]
    assert report["new"] == ["2.weight", "2.bias"]
    assert torch.equal(target[0].weight, source[0].weight)


def test_determinism_switch_is_on_after_building_a_run():
    """configure_determinism sets the kernel switch without the compiler stack, and sets the
    compiler's flag too when torch.compile is already loaded."""
    import subprocess

    from support import PYTHON, REPO

    probe = (
        "import sys, torch\n"
        "from pipeline.config import load_config\n"
        "from pipeline.run import configure_determinism\n"
        "configure_determinism(load_config(sys.argv[1]))\n"
        "assert torch.are_deterministic_algorithms_enabled()\n"
        "assert 'torch._inductor' not in sys.modules\n"
        "import torch._inductor.config as inductor\n"
        "configure_determinism(load_config(sys.argv[1]))\n"
        "assert inductor.deterministic is True\n"
    )
    result = subprocess.run(
        [PYTHON, "-c", probe, str(REPO / "config.yaml")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


class _WarmupWithMemory:
    """A schedule factor object holding something JSON cannot store (a set)."""

    def __init__(self) -> None:
        self.seen = {0}

    def __call__(self, step: int) -> float:
        return 1.0


def unsaveable_scheduler(optimizer, config):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _WarmupWithMemory())


def test_state_that_cannot_be_saved_fails_before_the_first_step(data_dir, tmp_path):
    from pipeline.config import load_config
    from pipeline.errors import CheckpointError
    from pipeline.train import TrainingHooks, train

    from support import REPO

    config = load_config(
        REPO / "config.yaml",
        {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(tmp_path / "ckpt"),
            "scheduler.factory": "test_state_roundtrip:unsaveable_scheduler",
            "scheduler.params": {},
        },
    )
    steps = []
    with pytest.raises(
        CheckpointError, match=r"cannot be checkpointed: cannot save set at 'scheduler/lr_lambdas"
    ):
        train(config, progress=False, hooks=TrainingHooks(on_step=lambda run: steps.append(run.step)))
    assert steps == []


def test_amp_grad_scaler_state_round_trips_and_a_mismatch_is_refused(data_dir):
    from pipeline.checkpoint.state import capture_state, restore_state
    from pipeline.config import load_config
    from pipeline.errors import StateMismatch
    from pipeline.run import build_run

    from support import REPO

    config = load_config(REPO / "config.yaml", {"data.dir": str(data_dir), "training.amp": "fp16"})
    source = build_run(config, torch.device("cpu"))
    saved = {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 7,
    }
    source.scaler.load_state_dict(saved)
    model_tensors, state, tensors = capture_state(source)
    target = build_run(config, torch.device("cpu"))
    assert target.scaler.state_dict() != saved
    restore_state(target, model_tensors, state, tensors)
    assert target.scaler.state_dict() == saved
    plain = build_run(load_config(REPO / "config.yaml", {"data.dir": str(data_dir)}), torch.device("cpu"))
    with pytest.raises(StateMismatch, match="GradScaler"):
        restore_state(plain, model_tensors, state, tensors)


def test_warmup_cosine_rises_linearly_then_decays_to_the_floor_at_max_steps():
    from pipeline.config import load_config
    from pipeline.factories import warmup_cosine

    from support import REPO

    config = load_config(
        REPO / "config.yaml",
        {"training.max_steps": 12, "scheduler.params": {"warmup_steps": 4, "min_ratio": 0.1}},
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = warmup_cosine(optimizer, config)
    rates = []
    for _ in range(12):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    rates.append(optimizer.param_groups[0]["lr"])
    assert rates[:5] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])
    assert rates[8] == pytest.approx(0.2 + 1.8 * 0.5) and rates[12] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(rates[4:], rates[5:]))
