"""Where script 02's step spends time beyond the plain loop's: each piece timed alone, with
the real objects of ``throughput.py``'s run, against the plain step it adds to.

    python benchmarks/step_overhead.py [--blocks 7] [--out benchmarks/results/step_overhead.json]

One process builds 02's run (``pipeline.run.build_run`` on ``throughput.py``'s config: same
model, data, optimizer, threads and determinism) and times, per call, in blocks (the minimum
and median over ``--blocks`` blocks): every piece of 02's step path that a plain loop does not
have (the batch through the sampler's copy with per-sample seeds, ``model.train()``, the
warnings filter around the schedule, the loss as a float, the history, the progress line,
the TensorBoard event, the agreement on signals, the built-in callbacks' ``on_step_end`` (the
schedule of saves and evaluations), the contexts of the accumulation path), and the
checkpoint: the training thread's stall of an async save (buffers kept from an earlier save,
as in a run), of a sync save, the CPU time one save costs in all threads, and the async save's
copy of the state by the training thread alone against shared with a helper thread. Each is also
shown as a share of the plain step (forward, backward, clip, ``optimizer.step``,
``scheduler.step``), timed in the same process; the saves per step at ``checkpoint.every:
50``. Finally the plain step with deterministic algorithms off, to show what that switch (on
in every candidate of ``throughput.py``) costs this model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from sidebyside import loadavg  # noqa: E402
from throughput import BATCH, CLIP, SAVE_EVERY, pipeline_config  # noqa: E402

from pipeline.accumulation import _gradient_sync  # noqa: E402
from pipeline.callbacks import Control  # noqa: E402
from pipeline.checkpoint import Checkpointer, CheckpointStore, snapshot  # noqa: E402
from pipeline.data import epochs_done, load_manifest, prepare_data  # noqa: E402
from pipeline.data.seeding import isolated_rng, seed_sample  # noqa: E402
from pipeline.environment import pin_threads  # noqa: E402
from pipeline.progress import Progress  # noqa: E402
from pipeline.run import build_run, configure_determinism  # noqa: E402
from pipeline.traces import open_traces  # noqa: E402
from pipeline.train import run_provenance  # noqa: E402
from pipeline.world import World  # noqa: E402

SCHEDULE_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before"


def per_call(fn: Callable[[], Any], calls: int, blocks: int) -> dict[str, float]:
    """Seconds per call of ``fn``: the minimum and the median over ``blocks`` blocks."""
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return {"min": min(times), "median": statistics.median(times)}


def snapshot_copies(run: Any, blocks: int) -> dict[str, dict[str, float]]:
    """The async save's copy of the run's weights and optimizer state into kept buffers, by the
    training thread alone (what 02 does under 32 MiB) and shared with the helper thread (what
    it does from 32 MiB on), alternated; seconds per copy over ``blocks`` x 40 copies each."""
    groups = {
        "model": dict(run.model.state_dict()),
        "optimizer": {
            f"{index}.{key}": value
            for index, state in enumerate(run.optimizer.state.values())
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.numel() > 1
        },
    }
    times: dict[str, list[float]] = {"training thread alone": [], "shared with the helper": []}
    kept = snapshot._SHARED_FROM
    try:
        for mode in list(times) * blocks:
            snapshot._SHARED_FROM = kept if mode == "training thread alone" else 1
            buffers = snapshot.SnapshotBuffers()
            buffers.copy(groups)  # allocates: a run pays it once
            for _ in range(40):
                start = time.perf_counter()
                buffers.copy(groups)
                times[mode].append(time.perf_counter() - start)
            buffers.release()
    finally:
        snapshot._SHARED_FROM = kept
    return {
        mode: {"median": statistics.median(values), "p90": statistics.quantiles(values, n=10)[-1]}
        for mode, values in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "results" / "step_overhead.json"))
    args = parser.parse_args()
    blocks = args.blocks
    with tempfile.TemporaryDirectory(prefix="bench-step-overhead-") as tmp:
        root = Path(tmp)
        config = pipeline_config(root, 10**6, args.threads, "overhead")
        with contextlib.redirect_stdout(sys.stderr):
            prepare_data(config)
        configure_determinism(config)
        pin_threads(config)
        device = torch.device("cpu")
        world = World(device=device)
        run = build_run(config, device, world=world)
        model, optimizer, scheduler = run.model, run.optimizer, run.scheduler
        loader = torch.utils.data.DataLoader(
            run.data.train_dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
        batches = iter(loader)

        def plain_batch() -> Any:
            nonlocal batches
            try:
                return next(batches)
            except StopIteration:
                batches = iter(loader)
                return next(batches)

        def plain_step() -> None:
            loss = model(**plain_batch())["loss"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()

        for _ in range(5):  # warm-up: Adam's state, the allocator
            plain_step()
        step = per_call(plain_step, 10, blocks)

        log = open(
            root / "log.txt", "w"
        )  # a run's log file (02 writes a line per step where stderr is not a terminal)
        progress = Progress(total=10**6, initial=0, log_every=1, stream=log)
        traces = open_traces(root / "traces", run, log_every=1, say=print, data_dir=config.data.dir)
        loss = torch.tensor(5.5)
        steps = iter(range(1, 10**9))

        def history() -> None:
            run.step = next(steps)
            run.history["step"].append(run.step)
            run.history["loss"].append(float(loss))
            run.history["lr"].append(float(optimizer.param_groups[0]["lr"]))
            run.history["grad_norm"].append(float(loss))
            run.history["epoch"].append(epochs_done(run.sampler))

        def trace() -> None:
            history()
            traces.on_step_end(run, control)

        def schedule_filter() -> None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=SCHEDULE_WARNING)

        control = Control()

        def schedule() -> None:  # the callbacks build_run adds (the schedule of saves and evaluations)
            run.callbacks.on_step_end(run, control)
            control.step_done()

        def contexts() -> None:
            with _gradient_sync(model, world, True), torch.autocast("cpu", dtype=None, enabled=False):
                pass

        def seeds() -> None:
            with isolated_rng():
                for index in range(BATCH):
                    seed_sample(0, 0, index)

        pieces = {
            "batch: plain DataLoader": per_call(plain_batch, 50, blocks),
            "batch: 02's feed": per_call(run.feed.next_batch, 50, blocks),
            "  of which per-sample seeds": per_call(seeds, 50, blocks),
            "model.train()": per_call(model.train, 200, blocks),
            "warnings filter around scheduler.step": per_call(schedule_filter, 1000, blocks),
            "loss as a float + history": per_call(history, 1000, blocks),
            "progress line (log_every 1)": per_call(lambda: progress.update(7, 5.5, 1e-3), 1000, blocks),
            "TensorBoard event (+ history)": per_call(trace, 1000, blocks),
            "signal agreement": per_call(lambda: world.agree_signal(None), 1000, blocks),
            "built-in callbacks' on_step_end": per_call(schedule, 1000, blocks),
            "accumulation path contexts": per_call(contexts, 1000, blocks),
        }
        traces.close(run)
        log.close()
        for values in run.history.values():  # a run's history at the saves of the window: 100 steps
            del values[:-100]

        store = CheckpointStore(root / "checkpoints")
        store.acquire()
        try:
            provenance = run_provenance(config, load_manifest(config), device, [])
            saves: dict[str, dict[str, float]] = {}
            for mode, background in (("async", True), ("sync", False)):
                checkpointer = Checkpointer(store, provenance, background=background)
                stalls, cpu = [], []
                for index in range(blocks + 1):
                    run.step = (2 if background else 1000) + index
                    cpu_start, start = time.process_time(), time.perf_counter()
                    checkpointer.save(run)
                    stalls.append(time.perf_counter() - start)
                    checkpointer.wait()
                    cpu.append(time.process_time() - cpu_start)
                checkpointer.close()
                # The first save allocates the async buffers: a run pays it once.
                saves[mode] = {
                    "stall": statistics.median(stalls[1:]),
                    "cpu": statistics.median(cpu[1:]),
                }
        finally:
            store.release()

        copies = snapshot_copies(run, blocks)

        deterministic = []
        for switch in (False, True) * blocks:
            torch.use_deterministic_algorithms(switch)
            deterministic.append((switch, per_call(plain_step, 5, 1)["min"]))
        on = statistics.median(t for switch, t in deterministic if switch)
        off = statistics.median(t for switch, t in deterministic if not switch)

    plain = step["median"]
    print(
        f"plain step (forward, backward, clip, step, schedule): {1e3 * plain:.2f} ms (min {1e3 * step['min']:.2f})"
    )
    print(f"\n{'piece of 02 step path':<40} {'us/step, min':>13} {'median':>9} {'% of step':>10}")
    for name, value in pieces.items():
        print(
            f"{name:<40} {1e6 * value['min']:>13.1f} {1e6 * value['median']:>9.1f} {100 * value['median'] / plain:>9.2f}%"
        )
    extra = sum(
        v["median"] for k, v in pieces.items() if k != "batch: plain DataLoader" and not k.startswith("  ")
    )
    extra -= pieces["batch: plain DataLoader"]["median"]
    print(f"{'sum beyond the plain loop':<40} {'':>13} {1e6 * extra:>9.1f} {100 * extra / plain:>9.2f}%")
    print(f"\n{'checkpoint (every 50 steps)':<40} {'ms/save':>13} {'ms/step':>9} {'% of step':>10}")
    for mode, value in saves.items():
        for what in ("stall", "cpu"):
            label = f"{mode} save, {'training thread stall' if what == 'stall' else 'CPU, all threads'}"
            ms = 1e3 * value[what]
            print(
                f"{label:<40} {ms:>13.1f} {ms / SAVE_EVERY:>9.3f} {100 * value[what] / SAVE_EVERY / plain:>9.2f}%"
            )
    print(f"\n{'snapshot copy of the state (async save)':<40} {'ms, median':>13} {'p90':>9}")
    for mode, value in copies.items():
        print(f"{mode:<40} {1e3 * value['median']:>13.2f} {1e3 * value['p90']:>9.2f}")
    print(
        f"\nplain step, deterministic algorithms on / off: {1e3 * on:.2f} / {1e3 * off:.2f} ms "
        f"({on / off:.3f})"
    )
    Path(args.out).write_text(
        json.dumps(
            {
                "blocks": blocks,
                "threads": args.threads,
                "plain_step_seconds": step,
                "pieces_seconds_per_call": pieces,
                "sum_beyond_plain_seconds": extra,
                "saves_seconds": saves,
                "snapshot_copy_seconds": copies,
                "save_every": SAVE_EVERY,
                "deterministic_on_off_seconds": [on, off],
                "load_average": loadavg(),
                "torch": torch.__version__,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
