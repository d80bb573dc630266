"""The checks of the resume proof, built from the legs' checkpoints, snapshots and summaries.

Names say where and what: ``boundary.*`` (the cut checkpoint against the state right after
the resume's restore), ``final.*`` (the last checkpoints), ``after_cut.*`` (what the legs
recorded step by step after the cut), ``prefix.*`` (the fresh runs agree before the cut: the
environment is deterministic and saving draws no randomness), ``exercise.*`` (whether a
component's state at the cut differs from the freshly built one).
"""

from __future__ import annotations

from typing import Any

from ..checkpoint import component_names
from .compare import Bundle, Check, compare

__all__ = [
    "state_parts",
    "state_checks",
    "after_cut_checks",
    "boundary_checks",
    "prefix_checks",
    "exercise_check",
    "first_divergent_step",
    "control_verdict",
    "judge",
]

_HISTORY = (("loss", "losses"), ("lr", "learning_rates"), ("step", "history_steps"))


def state_parts() -> tuple[str, ...]:
    """Parts of a checkpoint's training state, each compared on its own: every component
    (:func:`pipeline.checkpoint.components`; ``data`` holds the sampler position and the task
    data's own state), and the progress."""
    return (*component_names(), "progress")


def state_checks(prefix: str, reference: Bundle, candidate: Bundle, atol: float) -> list[Check]:
    """Weights, every state part, the loss / learning-rate / step history, and the evaluations."""
    checks = [compare(f"{prefix}.model", "model", reference.model, candidate.model, atol)]
    checks += [
        compare(f"{prefix}.{part}", part, reference.component(part), candidate.component(part), atol)
        for part in state_parts()
    ]
    checks += [
        compare(f"{prefix}.{label}", "history", reference.history(key), candidate.history(key), atol)
        for key, label in _HISTORY
    ]
    checks.append(
        compare(f"{prefix}.evaluations", "history", reference.evaluations(), candidate.evaluations(), atol)
    )
    return checks


def _per_step(summary: dict[str, Any], key: str, first: int, last: int) -> dict[str, Any]:
    return {f"step {s['step']}": s[key] for s in summary["steps"] if first <= s["step"] <= last}


def after_cut_checks(
    reference: dict[str, Any], candidate: dict[str, Any], cut: int, atol: float
) -> list[Check]:
    """Batches, sampler positions and RNG next draws at every step after the cut, the RNG
    next draws at the end, and the final metric."""
    end = max(reference["step"], candidate["step"])
    checks = [
        compare(
            "after_cut.data_order",
            "data",
            _per_step(reference, "indices", cut + 1, end),
            _per_step(candidate, "indices", cut + 1, end),
            0.0,
        ),
        compare(
            "after_cut.sampler_position",
            "data",
            _per_step(reference, "sampler", cut + 1, end),
            _per_step(candidate, "sampler", cut + 1, end),
            0.0,
        ),
        compare(
            "after_cut.rng_next_draws",
            "rng",
            _per_step(reference, "rng_next_draws", cut + 1, end),
            _per_step(candidate, "rng_next_draws", cut + 1, end),
            atol,
        ),
        compare(
            "final.rng_next_draws",
            "rng",
            reference["end"]["rng_next_draws"],
            candidate["end"]["rng_next_draws"],
            atol,
        ),
        compare("final.metric", "metric", reference["end"]["metric"], candidate["end"]["metric"], atol),
    ]
    return checks


def boundary_checks(
    cut: Bundle, restored: Bundle, cut_summary: dict[str, Any], restored_summary: dict[str, Any], atol: float
) -> list[Check]:
    """The state the resume restored against the state the cut saved, and the next RNG draws."""
    return state_checks("boundary", cut, restored, atol) + [
        compare(
            "boundary.rng_next_draws",
            "rng",
            cut_summary["end"]["rng_next_draws"],
            restored_summary["start"]["rng_next_draws"],
            atol,
        ),
    ]


def prefix_checks(
    continuous: Bundle,
    cut: Bundle,
    continuous_summary: dict[str, Any],
    cut_summary: dict[str, Any],
    k: int,
    atol: float,
) -> list[Check]:
    """Before the cut both fresh runs must agree; otherwise no resume can match."""
    at_cut = next((s["rng_next_draws"] for s in continuous_summary["steps"] if s["step"] == k), None)
    return [
        compare("prefix.losses", "determinism", continuous.history("loss")[:k], cut.history("loss"), atol),
        compare(
            "prefix.learning_rates", "determinism", continuous.history("lr")[:k], cut.history("lr"), atol
        ),
        compare(
            "prefix.data_order",
            "determinism",
            _per_step(continuous_summary, "indices", 1, k),
            _per_step(cut_summary, "indices", 1, k),
            0.0,
        ),
        # The cut leg peeks after writing its checkpoint: a save that drew randomness shows here.
        compare("prefix.rng_next_draws", "determinism", at_cut, cut_summary["end"]["rng_next_draws"], atol),
    ]


def exercise_check(component: str, fresh: Bundle, cut: Bundle) -> Check:
    """Bitwise: does the state saved at the cut differ from the one every run is built with?

    If not, leaving it unrestored restores the same values and no divergence is possible.
    """
    return compare(
        f"exercise.{component}", component, fresh.component(component), cut.component(component), 0.0
    )


def first_divergent_step(
    reference: dict[str, Any], candidate: dict[str, Any], cut: int, atol: float
) -> int | None:
    """The first step after the cut whose loss differs."""
    theirs = {s["step"]: s["loss"] for s in candidate["steps"]}
    for record in reference["steps"]:
        step = record["step"]
        if step > cut and not compare("loss", "history", record["loss"], theirs.get(step), atol).passed:
            return step
    return None


# A control's results that fail the proof: an omission that changed nothing although the run
# exercises it, and a swap of the ranks' streams that left a rank its own.
_CONTROL_FAILURES = ("not detected", "not swapped")


def control_verdict(
    component: str, exercise: Check, outcome: list[Check], first_step: int | None, *, swap: bool = False
) -> dict[str, Any]:
    """Detected: some outcome check diverged. Not exercised: nothing to restore differed. The
    swap of the ranks' RNG streams (``swap``) is never that when it works, as each rank's streams
    are derived from its rank: a rank left with its own is "not swapped", which fails the proof."""
    diverged = [check for check in outcome if not check.passed]
    exercised = not exercise.passed
    if not exercised:
        result = "not swapped" if swap else "not exercised"
    else:
        result = "detected" if diverged else "not detected"
    if swap:
        why = (
            f"every rank restored streams other than its own, first differing at {exercise.first_difference} "
            f"({exercise.differing} of {exercise.compared} values)"
            if exercised
            else "a rank restored its own streams: the swap did not reach every rank"
        )
    elif exercised:
        why = (
            f"its state at the cut differs from the freshly built one at {exercise.first_difference} "
            f"({exercise.differing} of {exercise.compared} values)"
        )
    else:
        why = "its state at the cut equals the freshly built one, so leaving it out restores the same values"
    return {
        "component": component,
        "leg": f"omit-{component}",
        "result": result,
        "exercised": exercised,
        "omission_detected": bool(diverged),
        "why_exercised": why,
        "diverged_checks": {check.name: check.max_abs_diff for check in diverged},
        "first_divergent_loss_step": first_step,
    }


def judge(positive: list[Check], controls: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The verdict over the positive checks and the controls' verdicts: proven only if every
    positive check passed, no exercised control went undetected and the swap, under torchrun,
    reached every rank."""
    positive_ok = all(check.passed for check in positive)
    negative_ok = all(c["result"] not in _CONTROL_FAILURES for c in controls.values())
    by_component: dict[str, bool] = {}
    for check in positive:
        by_component[check.component] = by_component.get(check.component, True) and check.passed
    # Checks are in causal order (prefix, boundary, after the cut, final): the first name is
    # where the difference entered, e.g. the part that was restored wrongly.
    failed = list(dict.fromkeys(check.component for check in positive if not check.passed))
    failed += [
        name for name, c in controls.items() if c["result"] in _CONTROL_FAILURES and name not in failed
    ]
    return {
        "all_checks_passed": positive_ok and negative_ok,
        "positive": positive_ok,
        "negative_divergence_detected": negative_ok,
        "failed_components": failed,
        "components": {
            "positive": {name: "matched" if ok else "diverged" for name, ok in by_component.items()},
            "negative": controls,
        },
    }
