"""Restore a distributed run: a distributed checkpoint into a built run, verified as it is
read, or a single-process checkpoint onto the ranks of a launch (``--reshard``); and the
readers of a distributed checkpoint's RNG files and whole state (the resume proof's).

The format and the commit protocol that wrote it: :mod:`.distributed`. How each rank
verifies what it reads: :mod:`.verified_dcp`.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..durable import json_loads_strict
from ..errors import SEALED_BUT_UNFIT, CheckpointError, PipelineError, SchemaMismatch, StateMismatch
from ..layout import DIST_MODEL_DIR, DIST_OPTIM_DIR, STATE_FILE, dcp_shard_name, rank_rng_file
from ..rng import derive_rank_rng, restore_rng
from ..run import TrainingRun
from ..world import World
from .codec import join_state, split_state
from .components import components
from .distributed import _FLAT, _RNG_KEY, _model_state, _optimizer_state
from .load import LoadedCheckpoint, load_checkpoint
from .shards import consolidate, shard_tensors, tensor_specs
from .state import checked_omit, restore_components
from .tensorfile import map_file, parse_header, read_tensors, tensors_from_map
from .validate import validated_state
from .verified_dcp import SealedReads
from .weights import check_derived_buffers

__all__ = [
    "restore_distributed",
    "restore_from_single",
    "live_components",
    "read_full_state",
    "read_rank_rng",
]


def live_components(run: TrainingRun) -> dict[str, Any]:
    """This rank's live state of each saved component besides the model (copies): what
    the resume proof compares to see whether a control changed what was restored. The
    optimizer's as this rank holds it (its shard, flattened as DCP saves it)."""
    _, optimizer, _ = _optimizer_state(run)
    live = {c.name: copy.deepcopy(c.live(run)) for c in components() if c.name != "optimizer"}
    live["optimizer"] = {
        name: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
        for name, t in optimizer.items()
    }
    return live


def read_rank_rng(path: Path, data: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON tree, tensors) of one rank's RNG file, through the strict parser; ``data``: its
    bytes, read and verified already (:class:`~.verified_dcp.SealedReads`)."""
    tensors = read_tensors(path) if data is None else tensors_from_map(path, data)
    header, _ = parse_header(map_file(path) if data is None else data)
    try:
        return json_loads_strict(header["__metadata__"][_RNG_KEY].encode("utf-8")), tensors
    except (KeyError, TypeError, ValueError):
        raise StateMismatch(f"{path} holds no readable RNG record: {SEALED_BUT_UNFIT}") from None


def read_full_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """A distributed checkpoint, verified (hashes, headers, coverage), as one whole:
    ``(model tensors, JSON training state, its tensor table)`` with the optimizer state
    consolidated and every rank's RNG states under ``rng/rank-R`` (what the resume proof
    compares)."""
    loaded = load_checkpoint(folder)
    meta = loaded.meta
    maps = {name: map_file(folder / name) for name in meta["files"] if name.startswith(f"{DIST_OPTIM_DIR}/")}
    expected = meta["tensors"][DIST_OPTIM_DIR]
    tensors = {
        **loaded.state_tensors,
        **consolidate(shard_tensors(folder, DIST_OPTIM_DIR, expected, maps), expected),
    }
    rng = {}
    for rank in range(meta["parallel"]["world_size"]):
        tree, rank_tensors = read_rank_rng(folder / rank_rng_file(rank))
        rng[f"rank-{rank}"] = split_state(join_state(tree, rank_tensors), f"rng/rank-{rank}", tensors)
    return loaded.model_tensors, {**meta["training_state"], "rng": rng}, tensors


def _dcp_load(
    template: dict[str, torch.Tensor], reads: SealedReads, part: str, what: str, world: World
) -> None:
    folder, expected = reads.folder / part, reads.meta["tensors"][part]
    if tensor_specs(template) != expected:
        odd = sorted(set(template) ^ set(expected)) or sorted(
            n for n in template if tensor_specs({n: template[n]})[n] != expected[n]
        )
        raise StateMismatch(
            f"{folder}: the checkpoint's {what} tensors differ from this run's at {odd[0]}: "
            "it does not fit the model or optimizer built from the config"
        )
    try:
        with warnings.catch_warnings():
            # One process reading every shard (a run moved to one process) is what no_dist means.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(template, storage_reader=reads.reader(part), no_dist=not world.launched)
    except CheckpointException as failed:
        # DCP gathered every rank's failure, so every rank raises the same (lowest) rank's.
        error = failed.failures[min(failed.failures)][0]
        if isinstance(error, (PipelineError, OSError)):
            raise error from None
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise StateMismatch(f"{folder}: saved training state does not fit this run: {first}") from None


def restore_distributed(
    run: TrainingRun,
    world: World,
    folder: Path,
    meta: dict[str, Any],
    *,
    omit: Iterable[str] = (),
    swap_rng: bool = False,
) -> None:
    """Load a distributed checkpoint, verified as it is read (every rank read its sealed
    meta.json), into a built run: wrapped, one rank of a launch (``world``), or a plain one
    process (a run moved to one process with ``--reshard``). Each rank
    reads the files it uses into its own memory and hashes them there
    (:class:`~.verified_dcp.SealedReads`); the ranks agree that every one matched its seal
    before any state is set. Model and optimizer come through DCP, which redistributes
    them for another world size or ``training.parallel`` (DCP loads into the run's own
    tensors, so a refusal after it ends the run, and nothing on disk changes); then the
    JSON state, validated with the single-process rules
    (:func:`~pipeline.checkpoint.validate.validated_state`) and derived buffers checked
    before any of it is set, and this rank's RNGs last: re-derived from ``(seed, step,
    rank)`` when the world size changed, as the per-rank streams have no counterpart then.
    Whether the launch may differ is decided before (:mod:`pipeline.start`).

    ``omit`` and ``swap_rng``: the resume proof's negative controls
    (:class:`pipeline.train.TrainingHooks`). An omitted component keeps what the fresh
    build gave it (the RNGs: the streams a fresh run derives at step 0)."""
    omit = checked_omit(omit)
    rank, world_size = world.rank, world.world_size
    # DCP loads in place, so templates: the optimizer's first (torch builds its state with a
    # zero-gradient, zero-lr step, which must not touch weights loaded after it).
    reads = SealedReads(folder, meta)
    resharded = meta["parallel"]["world_size"] != world_size
    if not resharded:
        # This rank's own files, read from the disk while torch builds the templates and
        # DCP plans (a reshard's reads are known only from the plan).
        own = dcp_shard_name(rank + 1)
        reads.prefetch(
            [f"{DIST_OPTIM_DIR}/{own}", f"{DIST_MODEL_DIR}/{own}", rank_rng_file(rank), STATE_FILE]
        )
    _, optimizer, _ = _optimizer_state(run)
    if "optimizer" not in omit:
        _dcp_load(optimizer, reads, DIST_OPTIM_DIR, "optimizer", world)
    model = _model_state(run, meta["tensors"][DIST_MODEL_DIR])
    # DCP loads into the model's own tensors: the derived buffers into copies, so that the
    # check below compares the saved values with the ones this code built.
    derived = meta["model"]["derived_buffers"]
    if isinstance(derived, list):  # else refused by the check below
        model.update(
            {name: model[name].clone() for name in derived if isinstance(name, str) and name in model}
        )
    _dcp_load(model, reads, DIST_MODEL_DIR, "model", world)
    # The data order is global (one Generator on every rank), so a reshard carries rank 0's
    # over; the per-rank streams have no counterpart at another world size. The swap control
    # rotates them so that no rank, at any world size, keeps its own.
    source = 0 if resharded else ((rank + 1) % world_size if swap_rng else rank)
    rng_data, shared_data = reads.read(rank_rng_file(source)), reads.read(STATE_FILE)
    rng_tree, rng_tensors, shared = None, {}, {}
    try:
        if rng_data is not None and shared_data is not None:
            rng_tree, rng_tensors = read_rank_rng(folder / rank_rng_file(source), rng_data)
            shared = tensors_from_map(folder / STATE_FILE, shared_data)
    except (SchemaMismatch, StateMismatch) as unfit:
        reads.refuse(unfit)
    reads.agree(world)  # one collective: every file any rank used matched its seal
    state = {**meta["training_state"], "rng": rng_tree}
    _, _, live = _optimizer_state(run)
    joined = validated_state(
        run, state, {**shared, **optimizer, **rng_tensors}, step=meta["step"], optimizer=live
    )
    check_derived_buffers(
        getattr(run.model, "module", run.model),
        model,
        derived,
        source=str(folder / DIST_MODEL_DIR),
    )
    with _fits(folder):
        set_model_state_dict(run.model, model, options=StateDictOptions(strict=False))
        if "optimizer" not in omit:
            _set_optimizer(run, joined["optimizer"], _FLAT)
        _restore_rest(run, joined, omit, rank, resharded)


def restore_from_single(
    run: TrainingRun, world: World, loaded: LoadedCheckpoint, *, omit: Iterable[str] = ()
) -> None:
    """Continue a single-process checkpoint on this rank of a launch (``--reshard``).

    ``loaded``: the checkpoint, verified and read whole on this rank; its weights are
    already in the model (:func:`pipeline.start` loads them into the plain model before
    DDP or FSDP2 wraps it). The optimizer state, in torch's form, is validated like a
    single-process resume, named by parameter and set through torch's full-state loader
    (which shards it for FSDP2); sampler, scheduler, scaler, step and history carry over;
    each rank's RNG streams are derived from ``(seed, step, rank)``, the data order's
    Generator continues."""
    omit = checked_omit(omit)
    tensors = loaded.state_tensors
    joined = validated_state(run, loaded.meta["training_state"], tensors, step=loaded.meta["step"])
    with _fits(loaded.folder):
        if "optimizer" not in omit:
            plain = getattr(run.model, "module", run.model)
            names = {id(p): name for name, p in plain.named_parameters()}
            order = [names[id(p)] for group in run.optimizer.param_groups for p in group["params"]]
            saved = joined["optimizer"]
            by_name = {
                "state": {order[index]: value for index, value in saved["state"].items()},
                "param_groups": [
                    {**group, "params": [order[i] for i in group["params"]]}
                    for group in saved["param_groups"]
                ],
            }
            _set_optimizer(run, by_name, StateDictOptions(full_state_dict=True))
        _restore_rest(run, joined, omit, world.rank, True)


def _set_optimizer(run: TrainingRun, state: dict[str, Any], options: StateDictOptions) -> None:
    """Load a validated optimizer state through torch's loader, then give every group's
    hyperparameters the types the freshly built optimizer has: torch's full-state path
    flattens and rebuilds the state, handing back lists where the optimizer holds tuples
    (AdamW's ``betas``). Left as lists, the next checkpoint would record lists, which no
    resume of this code accepts (:mod:`~pipeline.checkpoint.validate`)."""
    built = [
        {key: value for key, value in group.items() if key != "params"}
        for group in run.optimizer.param_groups
    ]
    set_optimizer_state_dict(run.model, run.optimizer, state, options=options)
    for group, fresh in zip(run.optimizer.param_groups, built, strict=True):
        for key, value in fresh.items():
            if key in group:
                group[key] = _typed_like(group[key], value)


def _typed_like(loaded: Any, built: Any) -> Any:
    """``loaded`` with the tuples of ``built`` (the same values, nested alike)."""
    if isinstance(built, tuple) and isinstance(loaded, (list, tuple)) and len(loaded) == len(built):
        return tuple(_typed_like(item, like) for item, like in zip(loaded, built))
    return loaded


def _restore_rest(
    run: TrainingRun,
    joined: dict[str, Any],
    omit: frozenset[str],
    rank: int,
    resharded: bool,
) -> None:
    """The components the ranks share, step, history, and this rank's RNGs last (see
    :func:`restore_distributed`)."""
    restore_components(run, joined, omit, shared_only=True)
    run.step = joined["step"]
    run.history = joined["history"]
    run.evaluations = joined["evaluations"]
    if "rng" in omit:
        derive_rank_rng(run.config.training.seed, 0, rank)
    elif not resharded:
        restore_rng(joined["rng"], run.generator, need_cuda=run.device.type == "cuda")
    else:
        run.generator.bit_generator.state = joined["rng"]["numpy_generator"]
        derive_rank_rng(run.config.training.seed, run.step, rank)


@contextlib.contextmanager
def _fits(folder: Path) -> Iterator[None]:
    """torch's loaders' own refusals as one line naming the checkpoint."""
    try:
        yield
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateMismatch(f"{folder}: saved training state does not fit this run: {first}") from None
