"""Script 05: build the Hub stage from the last verified checkpoint, then audit it.

``build`` assembles and swaps the stage into place (one :class:`StageBuild` per build),
writing the publishable record (``record``) and every file (``files``: hashed as written,
the manifest, the folder replaced only if 05 built it); ``weights`` brings the checkpoint's
weights in, one tensor in memory at a time; ``hf_export`` writes the files the Hub's tools
need; ``hub_loader`` is the loader shipped with the model's code (collected by
``pipeline.sources``, which training fingerprints too); ``card`` writes the model card,
of parts a folder's card shares (``card_parts``), its recipe one fact at a time (``recipe``);
``redact`` and ``proof_report`` keep machine paths and foreign proofs out; ``from_folder``,
``folder_source`` and ``folder_card`` stage a folder another tool wrote. The stage's manifest
and audit (``pipeline.audit``), the leak scan (``pipeline.leaks``) and signing
(``pipeline.signing``) are shared with the publish side, which imports no torch.
"""

from __future__ import annotations

from ..lazy import lazy_names

# name -> the module that defines it. Lazy, so that importing a submodule does not import
# the whole stage.
_NAMES = {
    "StageBuild": ".build",
    "StageResult": ".build",
    "build_stage": ".build",
    "find_nonfinite": ".weights",
}

__all__ = list(_NAMES)


__getattr__ = lazy_names(__name__, _NAMES)
