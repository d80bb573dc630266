"""Resume compatibility: may this checkpoint continue this run?"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import RESUME_IRRELEVANT_KEYS, Config, config_from_dict
from ..errors import ConfigError, ConfigMismatch

__all__ = ["LAUNCH_KEYS", "check_resume_compatible", "continued_config"]


# How the run is launched: compared as a launch (process count included) before the config,
# by pipeline.start, and changed only with --reshard.
LAUNCH_KEYS = frozenset({"training.parallel", "training.ddp_find_unused_parameters"})


def _compared_keys(flat: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value
        for key, value in flat.items()
        if key not in LAUNCH_KEYS
        and key not in RESUME_IRRELEVANT_KEYS
        and key.split(".")[0] not in RESUME_IRRELEVANT_KEYS
    }


def _saved_config(meta: dict[str, Any]) -> Config:
    try:
        return config_from_dict(meta["config"], source="checkpoint meta.json")
    except ConfigError as exc:
        raise ConfigMismatch(f"the checkpoint's config is not valid for this version: {exc}") from None


def _with_max_steps(config: Config, max_steps: int) -> Config:
    return dataclasses.replace(config, training=dataclasses.replace(config.training, max_steps=max_steps))


def continued_config(
    meta: dict[str, Any], config: Config, data_fingerprint: str, *, extend_to: int | None
) -> tuple[Config, list[dict]]:
    """The config a resume continues with, and the run's lineage (``meta.json`` ``lineage``),
    after :func:`check_resume_compatible`.

    Once a run was extended, its length is recorded state: ``config``'s ``training.max_steps``
    may be any length the run has had (the config file usually keeps the first one), and the
    run continues to the checkpoint's. A config whose length is ``training.epochs`` (max_steps
    not given) continues to the checkpoint's length, its epochs compared like every key.
    ``extend_to`` raises it further: it must exceed the checkpoint's step and max_steps, and
    adds an entry to the lineage; ``config``'s length is then not compared, since the
    extension names the length. Every other key is compared.
    """
    recorded, step, lineage = _saved_config(meta).training.max_steps, meta["step"], list(meta["lineage"])
    lengths = [entry["from_max_steps"] for entry in lineage] + [recorded]
    # A plain resume refuses another length rather than ignore it. With --extend-to the
    # config's length is replaced either way (the schedule keeps the lineage's first), so
    # asking for it again, say the --max-steps a run was started with, would guard nothing.
    # A length in training.epochs was counted when the run started: its epochs are compared.
    given = config.training.max_steps
    if extend_to is None and given is not None and given not in lengths:
        history = f" (extended from {lengths[0]})" if lineage else ""
        raise ConfigMismatch(
            f"training.max_steps is {config.training.max_steps}, but the checkpoint's run is "
            f"{recorded} steps{history}: resume it at its length with --max-steps {recorded}, or train "
            f"it further with --extend-to N (N > {max(recorded, step)})"
        )
    config = _with_max_steps(config, recorded)
    check_resume_compatible(meta, config, data_fingerprint)
    if extend_to is None:
        return config, lineage
    if extend_to <= step or extend_to <= recorded:
        raise ConfigError(
            f"--extend-to {extend_to} must exceed the checkpoint's step {step} and its max_steps {recorded}"
        )
    lineage.append({"from_max_steps": recorded, "at_step": step, "to_max_steps": extend_to})
    return _with_max_steps(config, extend_to), lineage


def check_resume_compatible(meta: dict[str, Any], config: Config, data_fingerprint: str) -> None:
    """Refuse a checkpoint from a different model, optimizer, schedule, data or training
    setup (the launch, :data:`LAUNCH_KEYS`, is not compared here)."""
    saved_config = _saved_config(meta)
    saved, current = _compared_keys(saved_config.flat()), _compared_keys(config.flat())
    differing = sorted(key for key in saved.keys() | current.keys() if saved.get(key) != current.get(key))
    if differing:
        key = differing[0]
        more = f" (and {len(differing) - 1} more: {', '.join(differing[1:4])})" if len(differing) > 1 else ""
        raise ConfigMismatch(
            f"config differs from the checkpoint at {key}: checkpoint has {saved.get(key)!r}, "
            f"{config.source} has {current.get(key)!r}{more}. Resume with the checkpoint's config, "
            "or start a new run in another --checkpoint-dir"
        )
    if meta["fingerprints"].get("data") != data_fingerprint:
        raise ConfigMismatch(
            f"the prepared data differs from the data the checkpoint was trained on "
            f"(fingerprint {data_fingerprint[:12]} vs {str(meta['fingerprints'].get('data'))[:12]}): "
            "restore the original data folder"
        )
