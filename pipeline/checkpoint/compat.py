"""Resume compatibility: may this checkpoint continue this run?"""

from __future__ import annotations

from typing import Any

from ..config import RESUME_IRRELEVANT_KEYS, Config, config_from_dict
from ..errors import ConfigError, ConfigMismatch

__all__ = ["check_resume_compatible"]


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
