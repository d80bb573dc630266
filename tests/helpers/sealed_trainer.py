"""A real transformers Trainer with SealedCheckpoints, SIGKILLed at random instants of its saves.

    python -B tests/helpers/sealed_trainer.py REPORT.json --reference DIR
    python -B tests/helpers/sealed_trainer.py REPORT.json --kills N --seed S --kill-dir DIR

``--reference``: one uninterrupted run (6 steps, save_steps 2, ``SealedCheckpoints(keep_last=2)``)
that also times its saves. ``--kills``: training in DIR with a save at every step and
``SealedCheckpoints(keep_last=2)`` (or, with ``--trainer-limit N``, the Trainer's own
``save_total_limit=N`` instead), resumed each time from ``verified_checkpoint(DIR)`` and
killed by SIGKILL at a random instant of its first or second save (a delay drawn over the save's measured length,
seal included), N times. After each kill this process judges every checkpoint folder
independently of the seal: complete when it holds every file a Trainer save writes and a
seal, the safetensors readable tensor by tensor, every torch.save archive's CRCs intact (read
as zip archives, never unpickled), ``trainer_state.json`` at the folder's step. What
``verified_checkpoint`` returns must be the newest complete folder (it raises only when there
is none), and the next run must resume right after it. transformers is imported once here;
every run is a forked child. The report (JSON) lists every kill; the test asserts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import select
import signal
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from pipeline.integrations.transformers import SealedCheckpoints, verified_checkpoint

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TRAINER_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
    "training_args.bin",
    "meta.json",
}
ARCHIVES = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin")
_WAIT = 120.0  # seconds a child may take to reach a save before it counts as hung


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> dict:
        ids = (torch.arange(16) * (index % 7 + 1)) % 64
        return {"input_ids": ids, "labels": ids}


class _Notify(TrainerCallback):
    """Tells the parent through a pipe when a save starts (``s<step>``) and when it is sealed (``d``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            os.write(self.fd, f"s{state.global_step}\n".encode())
        return control

    def on_save(self, args, state, control, **kwargs):
        os.write(self.fd, b"d\n")
        return control


def _trainer(output: Path, *, max_steps: int, save_steps: int, limit: int | None, callbacks: list) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    args = TrainingArguments(
        output_dir=str(output),
        max_steps=max_steps,
        save_steps=save_steps,
        save_total_limit=limit,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        logging_steps=10**6,
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=_Data(), callbacks=callbacks)


def _train_in_child(output: Path, max_steps: int, save_steps: int, limit: int | None, fd: int | None) -> int:
    """Fork a child that trains (resuming from the verified checkpoint); its pid. ``limit``:
    the Trainer's save_total_limit, else SealedCheckpoints(keep_last=2) prunes."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        sealed = SealedCheckpoints() if limit else SealedCheckpoints(keep_last=2)
        callbacks = [sealed] + ([_Notify(fd)] if fd is not None else [])
        trainer = _trainer(
            output, max_steps=max_steps, save_steps=save_steps, limit=limit, callbacks=callbacks
        )
        trainer.train(resume_from_checkpoint=verified_checkpoint(output))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported by the exit status, the parent says what
        print(f"child failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        os._exit(code)


def _lines(fd: int, buffer: bytearray, deadline: float):
    """The pipe's lines as they come; ends at EOF or the deadline."""
    while time.monotonic() < deadline:
        while b"\n" in buffer:
            line, _, rest = bytes(buffer).partition(b"\n")
            buffer[:] = rest
            yield line.decode()
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return
        data = os.read(fd, 4096)
        if not data:
            return
        buffer += data


def _complete(folder: Path) -> list[str]:
    """What makes ``folder`` not a complete, sealed Trainer save, judged without reading the seal."""
    problems = []
    # A stale temporary of an earlier, killed save of the same step may stay beside them
    # (safetensors writes .tmpXXXXXX, then renames): sealed as found, and harmless.
    missing = TRAINER_FILES - {p.name for p in folder.iterdir()}
    if missing:
        return [f"{sorted(missing)} missing"]
    try:
        with safe_open(str(folder / "model.safetensors"), "np") as weights:
            for name in weights.keys():
                weights.get_tensor(name)
    except Exception as exc:  # noqa: BLE001 - any failure to read is the finding
        problems.append(f"model.safetensors unreadable: {exc}")
    for name in ARCHIVES:
        try:
            with zipfile.ZipFile(folder / name) as archive:
                bad = archive.testzip()
            if bad is not None:
                problems.append(f"{name}: member {bad} fails its CRC")
        except (zipfile.BadZipFile, OSError) as exc:
            problems.append(f"{name} is not a complete archive: {exc}")
    try:
        step = json.loads((folder / "trainer_state.json").read_text())["global_step"]
        if f"checkpoint-{step}" != folder.name:
            problems.append(f"trainer_state.json is at step {step}")
    except (ValueError, KeyError) as exc:
        problems.append(f"trainer_state.json unreadable: {exc}")
    return problems


def reference(output: Path) -> dict:
    read, write = os.pipe()
    pid = _train_in_child(output, 6, 2, None, write)
    os.close(write)
    times, started = [], None
    for line in _lines(read, bytearray(), time.monotonic() + _WAIT):
        if line.startswith("s"):
            started = time.monotonic()
        elif line == "d" and started is not None:
            times.append(time.monotonic() - started)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return {"exit": os.waitstatus_to_exitcode(status), "save_seconds": times}


def kills(output: Path, count: int, seed: int, window: float, limit: int | None) -> list[dict]:
    rng = random.Random(seed)
    report = []
    expected_start = 1  # the step of the first save of the next run
    for number in range(count):
        read, write = os.pipe()
        pid = _train_in_child(output, 10**6, 1, limit, write)
        os.close(write)
        # The first run is killed in its second save or later, so one sealed checkpoint exists.
        wanted = rng.randint(2, 3) if number == 0 else rng.randint(1, 2)
        delay = rng.uniform(0.0, window)
        entry: dict = {"delay": delay, "problems": []}
        saves = []
        for line in _lines(read, bytearray(), time.monotonic() + _WAIT):
            if line.startswith("s"):
                saves.append(int(line[1:]))
                if len(saves) == wanted:
                    time.sleep(delay)
                    break
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(read)
        entry["saves"] = saves
        if len(saves) < wanted:
            entry["problems"].append(f"the run ended before its save {wanted} (status {status})")
        elif saves[0] != expected_start:
            entry["problems"].append(
                f"resumed at step {saves[0]}, the verified checkpoint is {expected_start - 1}"
            )
        messages = io.StringIO()
        with contextlib.redirect_stderr(messages):
            try:
                found = verified_checkpoint(output)
            except Exception as exc:  # noqa: BLE001 - recorded as the finding
                found = None
                entry["problems"].append(f"verified_checkpoint raised: {exc}")
        entry["skipped"] = [line for line in messages.getvalue().splitlines() if "skipping" in line]
        entry["returned"] = found.name if found is not None else None
        judged = {p.name: _complete(p) for p in output.iterdir() if p.name.startswith("checkpoint-")}
        entry["pruning_left"] = sorted(p.name for p in output.iterdir() if p.name.startswith(".pruned-"))
        complete = sorted(
            (name for name, why in judged.items() if not why), key=lambda n: int(n.split("-")[1])
        )
        newest = complete[-1] if complete else None
        if entry["returned"] != newest:
            entry["problems"].append(
                f"verified_checkpoint gave {entry['returned']}, the newest complete save is {newest}: {judged}"
            )
        if found is not None:
            expected_start = int(found.name.rpartition("-")[2]) + 1
        entry["folders"] = sorted(judged)
        report.append(entry)
    return report


def _warm_up() -> None:
    """What the first save of every process would pay, paid once here before forking: the
    weight-conversion tables save_pretrained compiles (about 0.5 s); and the garbage collector
    told to leave these objects alone (Trainer runs gc.collect at start)."""
    with tempfile.TemporaryDirectory() as folder:
        _trainer(Path(folder), max_steps=1, save_steps=1, limit=None, callbacks=[]).save_model(folder)
    gc.freeze()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report", type=Path)
    parser.add_argument("--reference", type=Path)
    parser.add_argument("--kills", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-dir", type=Path)
    parser.add_argument(
        "--trainer-limit", type=int, help="the Trainer's save_total_limit instead of keep_last=2"
    )
    args = parser.parse_args()
    result: dict = {"seed": args.seed}
    _warm_up()
    if args.reference is not None:
        result["reference"] = reference(args.reference)
    if args.kills:
        seconds = result.get("reference", {}).get("save_seconds") or [0.05]
        # Over the whole save: the Trainer's files, the rotation, the hashing, the seal.
        result["window"] = 1.3 * statistics.median(seconds)
        start = time.monotonic()
        result["kills"] = kills(args.kill_dir, args.kills, args.seed, result["window"], args.trainer_limit)
        result["kill_seconds"] = time.monotonic() - start
    args.report.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
