"""The resume proof behind scripts/03_verify_resume.py.

A continuous run, the same run cut at step K, a resume from that checkpoint, and one
resume per saved component that deliberately leaves it unrestored, each in its own
process; then every weight, state tensor, loss, learning rate, batch and next RNG draw is
compared with a measured difference. See the README, section "Resume proof".

Modules: :mod:`.plan` (N, K, legs, commands), :mod:`.leg` (the internal per-leg entry
point), :mod:`.compare` (measured comparisons), :mod:`.checks` (which comparisons),
:mod:`.protocol` (orchestration and report), :mod:`.layout` (file names).
"""

from .distributed import verify_resume_distributed
from .layout import REPORT_SCHEMA
from .plan import DEFAULT_STEPS, controls, plan_cut
from .protocol import describe, summary_line, verify_resume

__all__ = [
    "controls",
    "DEFAULT_STEPS",
    "REPORT_SCHEMA",
    "plan_cut",
    "verify_resume",
    "summary_line",
    "describe",
    "verify_resume_distributed",
]
