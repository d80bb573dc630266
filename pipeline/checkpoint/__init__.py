"""The checkpoint concept in one package.

========================  ==========================================================
``codec``                 nested state <-> (JSON tree, tensor table), no pickle
``tensorfile``            THE safetensors reader and writer (hash while writing;
                          map once, hash and view while reading)
``store``                 one ``estados_local/``: lock, list, resolve "latest or path",
                          atomic save, prune
``load``                  verification and load in one pass: :func:`load_checkpoint`
``shards``                a distributed checkpoint's launch record and shard coverage
``state``                 capture / restore a training run's full state
``weights``               tied-weight dedupe, strict load, warm start, model summary
``compat``                may this checkpoint resume this config?
``checkpointer``          sync or background saves of a live run (``snapshot``: buffers)
========================  ==========================================================

Other packages import from here, not from the submodules.
"""

from .checkpointer import Checkpointer
from .compat import check_resume_compatible, continued_config
from .load import WEIGHTS_ONLY, LoadedCheckpoint, checkpoint_meta, load_checkpoint, pinned_checkpoint
from .state import OMITTABLE, capture_state, check_capturable, restore_state
from .store import CheckpointStore, SavedCheckpoint, is_distributed, parse_step_dir, resolve, step_dir_name
from .tensorfile import read_tensors, write_safetensors
from .weights import check_derived_buffers, load_model_weights, warm_start

__all__ = [
    "Checkpointer",
    "CheckpointStore",
    "LoadedCheckpoint",
    "OMITTABLE",
    "SavedCheckpoint",
    "capture_state",
    "check_capturable",
    "check_derived_buffers",
    "check_resume_compatible",
    "checkpoint_meta",
    "continued_config",
    "is_distributed",
    "load_checkpoint",
    "load_model_weights",
    "parse_step_dir",
    "pinned_checkpoint",
    "read_tensors",
    "resolve",
    "restore_state",
    "step_dir_name",
    "warm_start",
    "WEIGHTS_ONLY",
    "write_safetensors",
]
