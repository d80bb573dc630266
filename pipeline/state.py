"""Capture and restore the complete training state, and check a checkpoint fits this run.

Components (each can be left out on restore, which is how the resume proof shows every
one of them matters): ``optimizer``, ``scheduler``, ``data`` (sampler position and the
task data's own state), ``rng`` (Python, NumPy Generator and legacy, torch CPU and CUDA),
``scaler`` (AMP). Model weights and progress (step, history) are always restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open

from .config import RESUME_IRRELEVANT_KEYS, Config, config_from_dict
from .errors import CheckpointError, ConfigError, ConfigMismatch, StateMismatch
from .rng import capture_rng, restore_rng
from .run import TrainingRun
from .serialization import dedupe_shared_tensors, join_state, split_state
from .store import MODEL_FILE, STATE_FILE

__all__ = [
    "OMITTABLE",
    "capture_state",
    "check_capturable",
    "restore_state",
    "load_model_weights",
    "warm_start",
    "check_resume_compatible",
    "read_tensors",
    "model_summary",
]

OMITTABLE = ("rng", "optimizer", "scheduler", "data", "scaler")
_HISTORY = ("step", "loss", "lr")


def capture_state(run: TrainingRun) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """Return (model tensors, JSON state, state tensors). Tensors are the live ones: write
    them before the next step, or copy them (the async checkpointer does)."""
    model_tensors = dedupe_shared_tensors(run.model.state_dict())
    tensors: dict[str, torch.Tensor] = {}
    task_state = getattr(run.data, "state_dict", None)
    state = {
        "optimizer": split_state(run.optimizer.state_dict(), "optimizer", tensors),
        "scheduler": split_state(run.scheduler.state_dict(), "scheduler", tensors),
        "data": {
            "sampler": split_state(run.sampler.state_dict(), "data/sampler", tensors),
            "task": split_state(task_state(), "data/task", tensors) if task_state else None,
        },
        "rng": split_state(capture_rng(run.generator), "rng", tensors),
        "scaler": split_state(run.scaler.state_dict(), "scaler", tensors) if run.scaler is not None else None,
        "progress": {"step": run.step},
    }
    for key in _HISTORY:
        dtype = torch.int64 if key == "step" else torch.float64
        tensors[f"history/{key}"] = torch.tensor(run.history[key], dtype=dtype)
    return model_tensors, state, tensors


def check_capturable(run: TrainingRun) -> None:
    """Walk the state once before the first step, so state that cannot be saved without
    pickle (a scheduler holding a callable object, say) fails now, not at the first save
    hours later."""
    try:
        capture_state(run)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"this run's state cannot be checkpointed: {exc}") from None


def restore_state(run: TrainingRun, model_tensors: Mapping[str, torch.Tensor], state: dict[str, Any],
                  tensors: Mapping[str, torch.Tensor], *, omit: Iterable[str] = ()) -> None:
    """Load weights, optimizer, scheduler, data position and scaler, then RNG states last."""
    omit = frozenset(omit)
    unknown = omit - set(OMITTABLE)
    assert not unknown, f"unknown components to omit: {unknown}"
    try:
        load_model_weights(run.model, model_tensors)
        if "optimizer" not in omit:
            run.optimizer.load_state_dict(join_state(state["optimizer"], tensors))
        if "scheduler" not in omit:
            run.scheduler.load_state_dict(join_state(state["scheduler"], tensors))
        if "data" not in omit:
            run.sampler.load_state_dict(join_state(state["data"]["sampler"], tensors))
            if state["data"]["task"] is not None:
                run.data.load_state_dict(join_state(state["data"]["task"], tensors))
        if "scaler" not in omit and (state["scaler"] is None) != (run.scaler is None):
            raise StateMismatch("the checkpoint and this run disagree on AMP GradScaler use (training.amp)")
        if "scaler" not in omit and run.scaler is not None:
            run.scaler.load_state_dict(join_state(state["scaler"], tensors))
        run.step = int(state["progress"]["step"])
        run.history = {key: tensors[f"history/{key}"].tolist() for key in _HISTORY}
        if "rng" not in omit:
            restore_rng(join_state(state["rng"], tensors), run.generator, need_cuda=run.device.type == "cuda")
    except KeyError as exc:
        raise StateMismatch(f"{STATE_FILE} lacks {exc.args[0]!r}: the checkpoint does not fit this code") from None
    except (ValueError, RuntimeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateMismatch(f"saved training state does not fit the objects built from the config: {first_line}") \
            from None


def load_model_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, source: str = MODEL_FILE) -> None:
    """Strict load: the same names (tied weights stored once), shapes and dtypes, or an error naming them."""
    expected = dedupe_shared_tensors(model.state_dict())
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} ({', '.join(unexpected[:3])}"
                         f"{', ...' if len(unexpected) > 3 else ''})")
        raise StateMismatch(f"{source} does not fit the configured model: {'; '.join(parts)}")
    for name, current in expected.items():
        saved = tensors[name]
        if saved.shape != current.shape or saved.dtype != current.dtype:
            raise StateMismatch(f"{source}: tensor {name} is {saved.dtype} {tuple(saved.shape)}, the model expects "
                                f"{current.dtype} {tuple(current.shape)}")
    full = dict(tensors)
    # Tied aliases point at the kept tensor so a strict load_state_dict accepts them.
    state_dict = model.state_dict()
    for name in state_dict:
        if name not in full:
            kept = next(k for k in expected if state_dict[k].data_ptr() == state_dict[name].data_ptr())
            full[name] = full[kept]
    model.load_state_dict(full, strict=True)


def warm_start(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Shape-tolerant weight copy for ``--init-from``: report loaded / skipped / new names."""
    own = dedupe_shared_tensors(model.state_dict())
    report: dict[str, list[str]] = {"loaded": [], "skipped": [], "new": []}
    with torch.no_grad():
        for name, target in own.items():
            source = tensors.get(name)
            if source is None:
                report["new"].append(name)
            elif source.shape != target.shape:
                report["skipped"].append(f"{name} (shape {tuple(source.shape)} vs {tuple(target.shape)})")
            else:
                target.copy_(source.to(dtype=target.dtype, device=target.device))
                report["loaded"].append(name)
    report["skipped"] += [f"{name} (not in the model)" for name in sorted(set(tensors) - set(own))]
    return report


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, memory-mapped (no pickle, no code execution)."""
    tensors = {}
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        for name in handle.keys():
            tensors[name] = handle.get_tensor(name)
    return tensors


def model_summary(model: torch.nn.Module) -> dict[str, Any]:
    """Names, dtypes and shapes of the stored weights, recorded in meta.json."""
    stored = dedupe_shared_tensors(model.state_dict())
    full = model.state_dict()
    return {
        "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for name, t in sorted(stored.items())},
        "tied": sorted(name for name in full if name not in stored),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def _compared_keys(flat: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in flat.items()
            if key not in RESUME_IRRELEVANT_KEYS and key.split(".")[0] not in RESUME_IRRELEVANT_KEYS}


def check_resume_compatible(meta: dict[str, Any], config: Config, data_fingerprint: str) -> None:
    """Refuse a checkpoint from a different model, optimizer, schedule, data or training setup."""
    try:
        saved_config = config_from_dict(meta["config"], source="checkpoint meta.json")
    except ConfigError as exc:
        raise ConfigMismatch(f"the checkpoint's config is not valid for this version: {exc}") from None
    saved, current = _compared_keys(saved_config.flat()), _compared_keys(config.flat())
    differing = sorted(key for key in saved.keys() | current.keys() if saved.get(key) != current.get(key))
    if differing:
        key = differing[0]
        more = f" (and {len(differing) - 1} more: {', '.join(differing[1:4])})" if len(differing) > 1 else ""
        raise ConfigMismatch(f"config differs from the checkpoint at {key}: checkpoint has {saved.get(key)!r}, "
                             f"{config.source} has {current.get(key)!r}{more}. Resume with the checkpoint's config, "
                             "or start a new run in another --checkpoint-dir")
    if meta["fingerprints"].get("data") != data_fingerprint:
        raise ConfigMismatch(f"the prepared data differs from the data the checkpoint was trained on "
                             f"(fingerprint {data_fingerprint[:12]} vs {str(meta['fingerprints'].get('data'))[:12]}): "
                             "restore the original data folder")
