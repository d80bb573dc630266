"""Script 05: build the Hub stage from the last verified checkpoint, then audit it.

``build`` assembles and swaps the stage into place (one :class:`StageBuild` per build);
``weights`` brings the checkpoint's weights in, one tensor in memory at a time;
``hf_export`` writes the files the Hub's tools need; ``code_export`` collects the model's
code and ``hub_loader`` is the loader shipped with it; ``card`` writes the model card;
``redact`` and ``proof_report`` keep machine paths and foreign proofs out. The stage's
manifest and audit (``pipeline.audit``), the leak scan (``pipeline.leaks``) and signing
(``pipeline.signing``) are shared with the publish side, which imports no torch.
"""

from .build import StageBuild, StageResult, build_stage
from .weights import find_nonfinite

__all__ = ["StageBuild", "StageResult", "build_stage", "find_nonfinite"]
