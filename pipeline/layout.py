"""The on-disk names: a contract with existing users, kept in one torch-free module so that
light commands (audit, publish) can use them without importing the training stack."""

__all__ = ["CHECKPOINT_DIR", "STAGE_DIR", "MODEL_FILE", "STATE_FILE", "META_FILE", "MANIFEST_FILE", "README_FILE"]

CHECKPOINT_DIR = "estados_local"
STAGE_DIR = "hub_stage"
MODEL_FILE = "modelo.safetensors"
STATE_FILE = "estado_treino.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "MANIFEST.sha256"
README_FILE = "README.md"
