"""The checkpoint concept in one package.

========================  ==========================================================
``codec``                 nested state <-> (JSON tree, tensor table), no pickle
``tensorfile``            THE safetensors reader and writer (hash while writing;
                          map once, hash and view while reading)
``meta``                  THE ``meta.json``: fields, build, seal, read, check
``store``                 one ``estados_local/``: lock, list, resolve "latest", "best" or
                          a path, atomic save, prune
``best``                  the best evaluated step (``checkpoint.best_metric``) and its mark
``evaluations``           a run's evaluations in its training state, checked on load
``load``                  verification and load in one pass: :func:`load_checkpoint`
``shards``                a distributed checkpoint's launch record, shard coverage, and
                          its full tensors one at a time (``ConsolidatedTensors``)
``components``            THE table of the training state's components (rng, optimizer,
                          scheduler, data, scaler, any registered one)
``state``                 capture / restore a training run's full state
``weights``               tied-weight dedupe, THE fit check (``check_weights_fit``),
                          strict load, warm start, model summary
``compat``                may this checkpoint resume this config?
``private_copy``          its weights from a verified private copy, one tensor at a time
``checkpointer``          sync or background saves of a live run (``snapshot``: buffers)
``distributed``           the commit protocol across torchrun ranks (save through DCP)
``dist_restore``          a distributed checkpoint restored through DCP, or a single-
                          process one onto the ranks (``--reshard``)
``verified_dcp``          that restore's reads: each rank's chunks hashed in its memory
========================  ==========================================================

Other packages import from here, not from the submodules (a test checks it). The names of
``distributed`` and ``dist_restore`` load on first use, so a single-process run never imports
``torch.distributed.checkpoint``.
"""

from typing import Any

from ..lazy import lazy_names
from ..world import World
from .best import best_record, read_best
from .checkpointer import Checkpointer, OneSaveInFlight
from .codec import join_state, split_state
from .compat import check_resume_compatible, continued_config
from .components import Component, component_names, components, register_component, unregister_component
from .evaluations import evaluations_from
from .load import LoadedCheckpoint, LoadMode, checkpoint_meta, load_checkpoint, pinned_checkpoint
from .meta import is_distributed, read_meta
from .private_copy import CheckpointWeights, open_weights
from .shards import ConsolidatedTensors
from .state import capture_state, check_capturable, restore_state
from .store import CheckpointStore, SavedCheckpoint, parse_step_dir, resolve, step_dir_name
from .tensorfile import (
    PUBLISHED_METADATA,
    MappedTensors,
    check_tensor_name,
    read_tensors,
    write_safetensors,
    write_safetensors_streamed,
)
from .validate import history_lists
from .weights import (
    check_derived_buffers,
    check_weights_fit,
    dedupe_shared_tensors,
    load_model_weights,
    model_summary,
    stored_layout,
    warm_start,
)

# Loaded on first use, from their module (module docstring).
_DISTRIBUTED = {
    "DistributedCheckpointer": ".distributed",
    "live_components": ".dist_restore",
    "read_full_state": ".dist_restore",
    "read_rank_rng": ".dist_restore",
    "restore_distributed": ".dist_restore",
    "restore_from_single": ".dist_restore",
}

__all__ = [
    *_DISTRIBUTED,
    "Checkpointer",
    "best_record",
    "read_best",
    "evaluations_from",
    "history_lists",
    "CheckpointStore",
    "CheckpointWeights",
    "ConsolidatedTensors",
    "MappedTensors",
    "LoadedCheckpoint",
    "Component",
    "SavedCheckpoint",
    "capture_state",
    "component_names",
    "components",
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
    "open_checkpointer",
    "open_weights",
    "parse_step_dir",
    "pinned_checkpoint",
    "read_meta",
    "read_tensors",
    "register_component",
    "unregister_component",
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


__getattr__ = lazy_names(__name__, _DISTRIBUTED)


def open_checkpointer(
    store: CheckpointStore,
    world: World,
    provenance: dict[str, Any],
    model_summary: dict,
    *,
    resharded_from: int | None = None,
    background: bool = False,
) -> "Checkpointer | OneSaveInFlight":
    """The checkpointer of a run in ``world``: a :class:`Checkpointer` in one process, a
    :class:`~pipeline.checkpoint.distributed.DistributedCheckpointer` on each rank of a
    launch (``model_summary``: the plain model's, taken before it was wrapped;
    ``resharded_from``: the world size the run last came from). Both ``save``, ``wait`` and
    ``close`` alike."""
    if not world.launched:
        return Checkpointer(store, provenance, background=background)
    return __getattr__("DistributedCheckpointer")(  # torch.distributed.checkpoint: only for a launch
        store, world, provenance, model_summary, resharded_from=resharded_from, background=background
    )
