"""transformers' Trainer save, with and without ``SealedCheckpoints``. A benchmark, not a test.

    python benchmarks/trainer_seal.py [--sizes 0.1,0.5] [--reps 5] [--saves 3] [--out FILE]

For each ``--sizes`` value (GB of checkpoint: a GPT-2 whose weights are a third of it, the
AdamW state the rest), one process builds the model once; each repetition trains ``--saves``
steps with a save at every step, once per candidate in rotated order, into a fresh folder
beside the repository (same disk; the previous one deleted and the deletion synced, untimed):

- ``trainer``: the Trainer's own save;
- ``trainer + SealedCheckpoints``: the same, and the callback's seal;
- ``seal``: the part of the latter spent in the callback (timed around it in the same run);
- ``hash alone``: the SHA-256 of every file of the newest checkpoint of that run, as the seal
  hashes them (the files still in the page cache), right after the run, writing nothing.

A save is timed from the ``on_step_end`` that asks for it to the last ``on_save`` callback
(so it includes the seal when the callback is there); the median over the saves of a
repetition is that repetition's figure. Reported per size: medians [min-max] over the
repetitions, the ratio with/without the callback, and the seal against hashing alone
(target: at most 1.1, i.e. the callback costs no more than its hashing).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
import transformers  # noqa: E402
from sidebyside import loadavg, ratio, rotated, summary, target_table  # noqa: E402

from pipeline.integrations.seal import _hash_files, _listing  # noqa: E402
from pipeline.integrations.transformers import SealedCheckpoints  # noqa: E402
from pipeline.safe_read import HandedFolder  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
CANDIDATES = ("trainer", "trainer + SealedCheckpoints")


class _Clock(transformers.TrainerCallback):
    """Save intervals: from the on_step_end that asks for a save to this callback's on_save.
    ``since``: another clock whose on_save starts the interval instead (around a callback)."""

    def __init__(self, since: "_Clock | None" = None) -> None:
        self.since = since
        self.started = self.ended = 0.0
        self.seconds: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self.started = time.perf_counter()
        return control

    def on_save(self, args, state, control, **kwargs):
        self.ended = time.perf_counter()
        self.seconds.append(self.ended - (self.since.ended if self.since else self.started))
        return control


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> dict:
        ids = torch.arange(32) % 1024
        return {"input_ids": ids, "labels": ids}


def _model(gigabytes: float) -> transformers.GPT2LMHeadModel:
    """A GPT-2 whose weights (fp32) plus AdamW's two moments make about ``gigabytes``."""
    params = gigabytes * 1e9 / 12
    width = 512
    layers = max(1, round((params - 1024 * width) / (12 * width * width)))
    config = transformers.GPT2Config(n_layer=layers, n_head=8, n_embd=width, vocab_size=1024, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _drop(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.sync()


def _run(model, folder: Path, saves: int, sealed: bool) -> tuple[list[float], list[float]]:
    """The save times of one run, and the seal's part of each (empty without the callback)."""
    before, clock = _Clock(), None
    args = transformers.TrainingArguments(
        output_dir=str(folder),
        max_steps=saves,
        save_steps=1,
        per_device_train_batch_size=1,
        report_to=[],
        use_cpu=True,
        logging_steps=10**6,
        disable_tqdm=True,
    )
    clock = _Clock(since=before) if sealed else before
    callbacks = [before, SealedCheckpoints(), clock] if sealed else [before]
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its summary
        transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks).train()
    if not sealed:
        return before.seconds, []
    return [a + b for a, b in zip(before.seconds, clock.seconds)], clock.seconds


def _hash_alone(folder: Path) -> float:
    """The seal's hashing of the newest checkpoint, alone (what SealedCheckpoints adds at least)."""
    checkpoint = max(folder.glob("checkpoint-*"), key=lambda p: int(p.name.rpartition("-")[2]))
    start = time.perf_counter()
    with HandedFolder(checkpoint) as handed:
        _hash_files(handed, _listing(handed))
    return time.perf_counter() - start


def measure(gigabytes: float, reps: int, saves: int, parent: Path) -> dict:
    model = _model(gigabytes)
    runs: dict[str, list[float]] = {name: [] for name in (*CANDIDATES, "seal", "hash alone")}
    loads, size = [], 0
    for rep in range(reps):
        loads.append(loadavg())
        for name in rotated(CANDIDATES, rep):
            folder = parent / f"{name.split()[-1]}-{rep}"
            seconds, seal = _run(model, folder, saves, sealed=name != "trainer")
            runs[name].append(statistics.median(seconds))
            if seal:
                runs["seal"].append(statistics.median(seal))
                runs["hash alone"].append(_hash_alone(folder))
                newest = max(folder.glob("checkpoint-*"), key=lambda p: int(p.name.rpartition("-")[2]))
                size = sum(
                    p.stat().st_size for p in newest.rglob("*") if p.is_file() and p.name != "meta.json"
                )
            _drop(folder)
    return {
        "checkpoint_bytes": size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "loadavg": loads,
        **{name: summary(values) for name, values in runs.items()},
        "_raw": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="0.1,0.5", help="checkpoint sizes in GB, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--saves", type=int, default=3, help="saves per run (their median is one figure)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "trainer_seal.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    parent = Path(tempfile.mkdtemp(prefix=".trainer-seal-bench-", dir=REPO.parent))
    results, ratios = {}, []
    try:
        for text in args.sizes.split(","):
            measured = measure(float(text), args.reps, args.saves, parent)
            raw = measured.pop("_raw")
            results[text] = measured
            with_seal, without = raw["trainer + SealedCheckpoints"], raw["trainer"]
            ratios.append(
                ratio("save with / without SealedCheckpoints", f"{text} GB", with_seal, without, None)
            )
            ratios.append(ratio("seal / hashing alone", f"{text} GB", raw["seal"], raw["hash alone"], 1.1))
            print(
                f"{text} GB ({measured['checkpoint_bytes'] / 1e9:.2f} GB written per save, "
                f"{measured['parameters']:,} parameters), load {min(measured['loadavg']):.1f}-"
                f"{max(measured['loadavg']):.1f}"
            )
            print("| candidate | median s | [min-max] |\n| --- | ---: | --- |")
            for name in (*CANDIDATES, "seal", "hash alone"):
                entry = measured[name]
                print(f"| {name} | {entry['median']:.3f} | [{entry['min']:.3f}-{entry['max']:.3f}] |")
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    for r in ratios:
        paired = f"{r.median_of_ratios:.3f}" if r.median_of_ratios is not None else "-"
        print(f"{r.label} ({r.scope}): {r.of_medians:.3f} of medians, {paired} median of ratios")
    print(target_table(ratios))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"sizes": results, "ratios": [r.to_dict() for r in ratios], "torch": torch.__version__}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
