"""Exact-resume training on atomic, hashed local checkpoints, published to the Hub once.

The public API, one name per step of the pipeline (the numbered scripts call these)::

    from pipeline import load_config, prepare_data, train, verify_resume, evaluate_checkpoint, write_metrics
    from pipeline import build_stage, publish, Publication, load_checkpoint, load_model_weights, build_model

    config = load_config("config.yaml")
    prepare_data(config)                                   # 01: data/ + manifest.json
    train(config, resume="auto")                           # 02: estados_local/step-…/
    loaded = load_checkpoint("latest", config.checkpoint.dir)   # verified, memory-mapped
    write_metrics(evaluate_checkpoint(config), config)     # 04: metrics.json
    build_stage(config)                                    # 05: hub_stage/
    publish(Publication(repo_id="you/model"))              # 06: one commit

Names are imported on first use (module ``__getattr__``), so ``import pipeline`` and the
publish path stay free of torch and matplotlib. Errors are in :mod:`pipeline.errors`,
on-disk names in :mod:`pipeline.layout`.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# The process that started this one, read as early as can be: every script and every
# ``python -m pipeline...`` imports this package first. Under torchrun that is the agent,
# which the watchdog of pipeline.distributed.world watches even if it died while this
# rank was still importing torch.
PARENT_AT_START = os.getppid()

# public name -> module that defines it
_API = {
    "load_config": "pipeline.config",
    "config_from_dict": "pipeline.config",
    "Config": "pipeline.config",
    "prepare_data": "pipeline.data",
    "train": "pipeline.train",
    "TrainingHooks": "pipeline.train",
    "verify_resume": "pipeline.proof",
    "evaluate_checkpoint": "pipeline.evaluate",
    "write_metrics": "pipeline.evaluate",
    "build_stage": "pipeline.stage",
    "audit_stage": "pipeline.audit",
    "publish": "pipeline.publishing",
    "Publication": "pipeline.publishing",
    "load_checkpoint": "pipeline.checkpoint",
    "load_model_weights": "pipeline.checkpoint",
    "build_model": "pipeline.run",
}

__all__ = ["__version__", *_API]


# Written out here, not through pipeline.lazy as the subpackages are: model code imports
# pipeline.params, which runs this file, and what model code imports is published with it.
def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
