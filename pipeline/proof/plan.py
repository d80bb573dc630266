"""The resume proof's plan: how many steps, where to cut, and the legs with their exact commands."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import components, step_dir_name
from ..config import Config
from ..data import STREAM, describe_inputs, load_task_data, make_sampler
from ..errors import ConfigError
from ..provenance import PACKAGE_ROOT
from .layout import CHECKPOINTS_DIR, LEG_MODULE, SPEC_FILE

__all__ = [
    "DEFAULT_STEPS",
    "controls",
    "Plan",
    "Leg",
    "plan_cut",
    "make_legs",
    "phases",
    "pack",
    "leg_spec",
    "process_command",
    "leg_env",
]

DEFAULT_STEPS = 10


@dataclass(frozen=True, slots=True)
class Plan:
    steps: int
    cut: int
    reason: str
    epochs: list[int] | None  # epoch of the sampler after steps 1..N (index 0 unused), if it has one
    data: dict[str, Any] | None = None  # the inputs proved (pipeline.data.describe_inputs)

    def to_dict(self) -> dict[str, Any]:
        first_new = None
        if self.epochs is not None:
            first_new = next(
                (s for s in range(self.cut + 1, self.steps + 1) if self.epochs[s] != self.epochs[self.cut]),
                None,
            )
        return {
            "steps": self.steps,
            "cut": self.cut,
            "reason": self.reason,
            "epoch_at_cut": None if self.epochs is None else self.epochs[self.cut],
            "first_step_of_a_new_epoch_after_cut": first_new,
        }


@dataclass(frozen=True, slots=True)
class Leg:
    name: str
    stop_at: int
    resume: bool  # from the cut leg's checkpoint
    omit: tuple[str, ...] = ()
    snapshot: bool = True  # save the state right after build/restore

    def folder(self, output: Path) -> Path:
        return output / self.name


def plan_cut(config: Config, steps: int | None, cut: int | None) -> Plan:
    """Validate N and K; by default cut inside an epoch, with an epoch boundary still to come.

    Mid-epoch means the saved sampler holds a half-used permutation; a later boundary
    means the resumed run must also draw the next permutation from restored RNG state.
    """
    max_steps = config.training.max_steps
    n = steps if steps is not None else min(DEFAULT_STEPS, max_steps)
    if n < 2:
        raise ConfigError(f"--steps must be >= 2 so that there is a step to cut at (got {n})")
    if n > max_steps:
        raise ConfigError(
            f"--steps {n} exceeds training.max_steps {max_steps}: the proof trains the configured "
            "run, so lower --steps or raise it with --set training.max_steps=..."
        )
    data = load_task_data(config)
    inputs = describe_inputs(data, config)
    epochs = _sampler_epochs(data, config, n)
    if cut is not None:
        if not 1 <= cut < n:
            raise ConfigError(f"--cut must be between 1 and N-1 = {n - 1} (got {cut})")
        return Plan(n, cut, "given with --cut" + _where(epochs, cut, n), epochs, inputs)
    if epochs is None:
        why = (
            "a stream has no epochs"
            if inputs["mode"] == STREAM
            else "the sampler's state has no integer 'epoch'"
        )
        return Plan(n, n // 2, f"{why}; cut at the middle", None, inputs)
    inside = [k for k in range(1, n) if epochs[k + 1] == epochs[k]]
    with_boundary = [k for k in inside if epochs[n] != epochs[k]]
    if with_boundary:
        k = max(with_boundary)
        return Plan(
            n,
            k,
            "the last step inside an epoch with a new epoch still to come" + _where(epochs, k, n),
            epochs,
            inputs,
        )
    if inside:
        # No boundary reachable: cut near the middle, leaving steps on both sides.
        k = max((k for k in inside if k <= n // 2), default=min(inside))
        return Plan(
            n,
            k,
            "a step inside an epoch near the middle (no new epoch starts by step N)" + _where(epochs, k, n),
            epochs,
            inputs,
        )
    return Plan(n, n // 2, "every step is a whole epoch; cut at the middle", epochs, inputs)


def _where(epochs: list[int] | None, k: int, n: int) -> str:
    if epochs is None:
        return ""
    inside = "inside" if epochs[k + 1] == epochs[k] else "at the end of"
    text = f": step {k} is {inside} epoch {epochs[k]}"
    following = next((s for s in range(k + 1, n + 1) if epochs[s] != epochs[k]), None)
    return text + (f"; epoch {epochs[following]} starts at step {following}" if following else "")


def _sampler_epochs(data: Any, config: Config, n: int) -> list[int] | None:
    """Dry-run the configured sampler for N optimizer steps (no model, a throwaway
    generator): each step draws ``training.grad_accum_steps`` batches, as training does."""
    generator = np.random.Generator(np.random.PCG64(config.training.seed))
    sampler = make_sampler(data, generator, config)
    if sampler is None:  # a stream
        return None
    epochs: list[int] = [0]
    for _ in range(n):
        for _ in range(config.training.grad_accum_steps):
            sampler.next_indices()
        state = sampler.state_dict()
        epoch = state.get("epoch") if isinstance(state, dict) else None
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool):
            return None
        epochs.append(int(epoch))
    return epochs


def controls(config: Config) -> tuple[str, ...]:
    """The saved components a negative control leaves unrestored, in report order: each of
    the training state's (:func:`pipeline.checkpoint.components`) a run of ``config`` has."""
    return tuple(component.name for component in components() if component.proved(config))


def make_legs(plan: Plan, config: Config) -> list[Leg]:
    """continuous, cut, resume, then one resume per omitted component."""
    return [
        Leg("continuous", plan.steps, resume=False, snapshot=False),
        Leg("cut", plan.cut, resume=False),
        Leg("resume", plan.steps, resume=True),
        *(Leg(f"omit-{name}", plan.steps, resume=True, omit=(name,)) for name in controls(config)),
    ]


def phases(legs: list[Leg]) -> list[list[Leg]]:
    """The cut and the continuous run are independent; every resume needs the cut's checkpoint."""
    return [legs[:2], legs[2:]]


def pack(phase: list[Leg], processes: int) -> list[list[Leg]]:
    """``phase``'s legs dealt in order into at most ``processes`` processes, each running its
    legs one after the other. Each process's first leg starts in a fresh interpreter, so the
    resume (first of its phase) always does: exactly a user's relaunch. A later leg in the
    same process builds a new model, optimizer, scheduler, sampler and data generator and
    re-seeds every RNG family (``build_run``), so what the process ran before reaches none of
    its numbers; the torchrun proof shares its launch between controls the same way."""
    count = max(1, min(processes, len(phase)))
    return [phase[i::count] for i in range(count)]


def leg_spec(leg: Leg, plan: Plan, config: Config, output: Path) -> dict[str, Any]:
    """What the leg process runs: the full config with checkpoints inside the leg's folder.

    ``checkpoint.every = N`` saves only at the leg's last step, so the continuous leg is an
    uninterrupted reference; these keys are resume-irrelevant, nothing computed changes.
    """
    raw = config.to_dict()
    raw["checkpoint"] = {
        **raw["checkpoint"],
        "dir": str(leg.folder(output).resolve() / CHECKPOINTS_DIR),
        "every": plan.steps,
        "keep_last": 1,
    }
    raw["outputs"] = {**raw["outputs"], "traces": str(leg.folder(output).resolve() / "traces")}
    cut_folder = output.resolve() / "cut" / CHECKPOINTS_DIR / step_dir_name(plan.cut)
    return {
        "leg": leg.name,
        "config": raw,
        "resume": str(cut_folder) if leg.resume else None,
        "stop_at": leg.stop_at,
        "omit": list(leg.omit),
        "snapshot": leg.snapshot,
    }


def process_command(legs: list[Leg], output: Path) -> list[str]:
    """Same interpreter, same flags that matter (-B), a fresh process running ``legs`` in order."""
    flags = ["-B"] if sys.flags.dont_write_bytecode else []
    return [sys.executable, *flags, "-m", LEG_MODULE, *(str(leg.folder(output) / SPEC_FILE) for leg in legs)]


def leg_env() -> dict[str, str]:
    """The caller's environment, with this package first on the path so every leg runs the
    very sources the report fingerprints."""
    env = dict(os.environ)
    root = str(PACKAGE_ROOT.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
    return env
