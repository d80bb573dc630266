"""Script 05: build the Hub stage from the last verified checkpoint, then audit it.

``build`` assembles and swaps the stage into place; ``hf_export`` plans the weights and the
files the Hub's tools need; ``code_export`` collects the model's code; ``card`` writes the
model card; ``redact`` and ``proof_report`` keep machine paths and foreign proofs out.
The stage's manifest and audit (``pipeline.audit``), the leak scan (``pipeline.leaks``) and
signing (``pipeline.signing``) are shared with the publish side, which imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["StageResult", "build_stage", "find_nonfinite"]


def __getattr__(name: str) -> Any:
    # Lazy, so that training can read ``code_export`` (the model's code closure, which its
    # checkpoints fingerprint) without importing the stage's Hub-side dependencies.
    if name not in __all__:
        raise AttributeError(f"module 'pipeline.stage' has no attribute {name!r}")
    value = getattr(importlib.import_module(".build", __name__), name)
    globals()[name] = value
    return value
