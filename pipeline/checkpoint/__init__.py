"""The checkpoint concept in one package.

========================  ==========================================================
``codec``                 nested state <-> (JSON tree, tensor table), no pickle
``tensorfile``            THE safetensors reader and writer (hash while writing;
                          map once, hash and view while reading)
``meta``                  THE ``meta.json``: fields, build, seal, read, check
``store``                 one ``estados_local/``: lock, list, resolve "latest or path",
                          atomic save, prune
``load``                  verification and load in one pass: :func:`load_checkpoint`
``shards``                a distributed checkpoint's launch record, shard coverage, and
                          its full tensors one at a time (``ConsolidatedTensors``)
``state``                 capture / restore a training run's full state
``weights``               tied-weight dedupe, THE fit check (``check_weights_fit``),
                          strict load, warm start, model summary
``compat``                may this checkpoint resume this config?
``private_copy``          its weights from a verified private copy, one tensor at a time
``checkpointer``          sync or background saves of a live run (``snapshot``: buffers)
``distributed``           the commit protocol across torchrun ranks; restore via DCP
========================  ==========================================================

Other packages import from here, not from the submodules (a test checks it). The names of
``distributed`` load on first use, so a single-process run never imports
``torch.distributed.checkpoint``.
"""

import importlib
from typing import Any

from .checkpointer import Checkpointer
from .codec import join_state, split_state
from .compat import check_resume_compatible, continued_config
from .load import LoadedCheckpoint, LoadMode, checkpoint_meta, load_checkpoint, pinned_checkpoint
from .meta import is_distributed, read_meta
from .private_copy import CheckpointWeights, open_weights
from .shards import ConsolidatedTensors
from .state import OMITTABLE, capture_state, check_capturable, restore_state
from .store import CheckpointStore, SavedCheckpoint, parse_step_dir, resolve, step_dir_name
from .tensorfile import (
    PUBLISHED_METADATA,
    MappedTensors,
    check_tensor_name,
    read_tensors,
    write_safetensors,
    write_safetensors_streamed,
)
from .weights import (
    check_derived_buffers,
    check_weights_fit,
    dedupe_shared_tensors,
    load_model_weights,
    model_summary,
    stored_layout,
    warm_start,
)

_DISTRIBUTED = (
    "DistributedCheckpointer",
    "live_components",
    "read_full_state",
    "read_rank_rng",
    "restore_distributed",
    "restore_from_single",
)

__all__ = [
    *_DISTRIBUTED,
    "Checkpointer",
    "CheckpointStore",
    "CheckpointWeights",
    "ConsolidatedTensors",
    "MappedTensors",
    "LoadedCheckpoint",
    "OMITTABLE",
    "SavedCheckpoint",
    "capture_state",
    "check_capturable",
    "check_derived_buffers",
    "check_tensor_name",
    "check_weights_fit",
    "check_resume_compatible",
    "dedupe_shared_tensors",
    "checkpoint_meta",
    "continued_config",
    "is_distributed",
    "join_state",
    "load_checkpoint",
    "load_model_weights",
    "model_summary",
    "open_weights",
    "parse_step_dir",
    "pinned_checkpoint",
    "read_meta",
    "read_tensors",
    "resolve",
    "restore_state",
    "split_state",
    "step_dir_name",
    "stored_layout",
    "warm_start",
    "LoadMode",
    "PUBLISHED_METADATA",
    "write_safetensors",
    "write_safetensors_streamed",
]


def __getattr__(name: str) -> Any:
    if name not in _DISTRIBUTED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".distributed", __name__), name)
    globals()[name] = value
    return value
