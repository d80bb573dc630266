"""The on-disk names and default folders: a contract with existing users, kept in one
torch-free module so that light commands (audit, publish) can use them without importing
the training stack. Every other module imports these; none spells them out."""

__all__ = [
    "CHECKPOINT_DIR",
    "STAGE_DIR",
    "DATA_DIR",
    "RECEIPT_DIR",
    "MODEL_FILE",
    "STATE_FILE",
    "META_FILE",
    "MANIFEST_FILE",
    "README_FILE",
    "CURVE_FILE",
    "METRICS_FILE",
    "DATA_MANIFEST_FILE",
    "LOCK_FILE",
    "RESUME_FILE",
    "BEST_FILE",
    "SIGNATURE_FILE",
    "PUBLIC_KEY_FILE",
    "CONFIG_FILE",
    "GENERATION_CONFIG_FILE",
    "INDEX_FILE",
    "CODE_DIR",
    "HUB_MODEL_FILE",
    "TRACES_DIR",
    "TRACE_FILE",
    "TRACES_MARKER",
    "STAGED_TRACES_DIR",
    "shard_name",
    "hub_shard_name",
    "DIST_MODEL_DIR",
    "DIST_OPTIM_DIR",
    "DIST_RNG_DIR",
    "rank_rng_file",
    "step_dir_name",
    "parse_step_dir",
    "staged_by_file",
    "receipts_beside",
]

import os
import re

# Default folders (config.yaml / command-line flags may point elsewhere).
CHECKPOINT_DIR = "estados_local"
STAGE_DIR = "hub_stage"
DATA_DIR = "data"
RECEIPT_DIR = "hub_receipts"

# A checkpoint folder (step-NNNNNNNN/) and the stage.
MODEL_FILE = "modelo.safetensors"
STATE_FILE = "estado_treino.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "MANIFEST.sha256"
README_FILE = "README.md"
CURVE_FILE = "training_curve.png"
# Written by 05 --sign-key; the signature covers every other staged file (see pipeline/signing.py).
SIGNATURE_FILE = "model.sig"
PUBLIC_KEY_FILE = "signing_key.pub"
# What the Hub's own tools look for in a stage (transformers, the Hub's file viewer).
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
# The model's source files, kept under their import paths so the card's snippet can import them.
CODE_DIR = "code"
# The weights of a folder another tool wrote (05 --from-folder) keep the names save_pretrained and
# PyTorchModelHubMixin give them: the mixin's from_pretrained looks for this name only.
HUB_MODEL_FILE = "model.safetensors"

# A distributed checkpoint (torchrun): model and optimizer shards as written by
# torch.distributed.checkpoint's HuggingFaceStorageWriter (plain safetensors, one file per
# writing rank, named by torch), each rank's RNG states in its own file, and the
# rank-independent training state once, in STATE_FILE.
DIST_MODEL_DIR = "model"
DIST_OPTIM_DIR = "optim"
DIST_RNG_DIR = "rng"


def dcp_shard_name(index: int) -> str:
    """``shard-00003-model-00001-of-00001.safetensors``: the name torch's HuggingFaceStorageWriter
    gives, inside ``model/`` or ``optim/``, to the file of its writer ``index`` (rank + 1)."""
    return f"shard-{index:05d}-model-00001-of-00001.safetensors"


def rank_rng_file(rank: int) -> str:
    """``rng/rank-00003.safetensors``: rank 3's RNG states."""
    return f"{DIST_RNG_DIR}/rank-{rank:05d}.safetensors"


# TensorBoard traces: written while training into TRACES_DIR (or runs/<name>/traces/), a folder
# training rebuilds on every start and marks as its own; staged under STAGED_TRACES_DIR, where
# transformers' Trainer puts them. TensorBoard reads any file whose name holds "tfevents"; this
# one names no host, time or process.
TRACES_DIR = "traces"
TRACE_FILE = "events.out.tfevents.pipeline"
TRACES_MARKER = ".pipeline-traces"
STAGED_TRACES_DIR = "runs"

# Elsewhere.
METRICS_FILE = "metrics.json"
DATA_MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".lock"
# In checkpoint.dir while a torchrun run is stopped: the command that continues it.
RESUME_FILE = "RESUME"
# In checkpoint.dir with checkpoint.best_metric: which step is the best evaluated one.
BEST_FILE = "BEST.json"


def receipts_beside(stage: str) -> str:
    """``hub_receipts`` beside the stage folder ``stage``: a publish's receipts stay with the
    outputs of the config that staged it (``hub_receipts/`` for ``config.yaml``'s
    ``hub_stage/``, ``runs/charlm/hub_receipts/`` for ``runs/charlm/hub_stage/``), never in the
    stage, which is uploaded as it is."""
    return os.path.join(os.path.dirname(os.path.normpath(stage)), RECEIPT_DIR)


def staged_by_file(stage_name: str) -> str:
    """``.hub_stage.staged-by.json``: beside the stage ``hub_stage`` (never in it, as it is
    published), the command that built it, which 06's refusals repeat."""
    return f".{stage_name}.staged-by.json"


def shard_name(index: int, count: int) -> str:
    """``modelo-00001-of-00003.safetensors``: the weights file name, split as save_pretrained splits."""
    return f"{MODEL_FILE.removesuffix('.safetensors')}-{index:05d}-of-{count:05d}.safetensors"


def hub_shard_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors``: a shard as save_pretrained names it."""
    return f"{HUB_MODEL_FILE.removesuffix('.safetensors')}-{index:05d}-of-{count:05d}.safetensors"


# A committed checkpoint's folder: eight or more digits, so listings sort.
# [0-9], not \d (which takes any script's digits: int("٠٠٠٠٠٠١٠") is 10); \Z, not $: "step-00000010\n"
# is not ours either.
_STEP_DIR = re.compile(r"step-([0-9]{8,})\Z")


def step_dir_name(step: int) -> str:
    """``10 -> "step-00000010"``; zero-padded so listings sort, but parsed as integers."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """Inverse of :func:`step_dir_name`; ``None`` for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None
