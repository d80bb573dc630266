"""Where the resume proof puts things inside its output folder (shared by the legs and the orchestrator).

OUTPUT/
    verification.json              the report
    continuous/ cut/ resume/ omit-rng/ omit-optimizer/ omit-scheduler/ omit-data/
        spec.json                  what the leg was asked to do (config included)
        log.txt                    the leg's stdout and stderr
        summary.json               what the leg recorded
        start/                     state right after build or restore (not for continuous)
        checkpoints/step-XXXXXXXX/ the leg's one checkpoint, at its last step
"""

from __future__ import annotations

__all__ = [
    "REPORT_FILE",
    "REPORT_SCHEMA",
    "SPEC_FILE",
    "LOG_FILE",
    "SUMMARY_FILE",
    "SNAPSHOT_DIR",
    "CHECKPOINTS_DIR",
    "LEG_MODULE",
]

REPORT_FILE = "verification.json"
REPORT_SCHEMA = "pipeline.resume-proof/1"
"""The report's ``schema``: which fields it has and what they mean (a stage refuses any other)."""
SPEC_FILE = "spec.json"
LOG_FILE = "log.txt"
SUMMARY_FILE = "summary.json"
SNAPSHOT_DIR = "start"
CHECKPOINTS_DIR = "checkpoints"
LEG_MODULE = "pipeline.proof.leg"
