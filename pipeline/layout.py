"""The on-disk names and default folders: a contract with existing users, kept in one
torch-free module so that light commands (audit, publish) can use them without importing
the training stack. Every other module imports these; none spells them out."""

__all__ = [
    "CHECKPOINT_DIR", "STAGE_DIR", "DATA_DIR", "RECEIPT_DIR", "MODEL_FILE", "STATE_FILE", "META_FILE",
    "MANIFEST_FILE", "README_FILE", "CURVE_FILE", "METRICS_FILE", "DATA_MANIFEST_FILE", "LOCK_FILE",
    "SIGNATURE_FILE", "PUBLIC_KEY_FILE",
]

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

# Elsewhere.
METRICS_FILE = "metrics.json"
DATA_MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".lock"
