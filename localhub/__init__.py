"""localhub: a loopback-only double of the Hugging Face Hub HTTP API for tests and rehearsals.

It speaks what the real `huggingface_hub` client uses for create_repo, create_commit (over Xet, the
client's default when hf_xet is installed, or over the legacy LFS path with HF_HUB_DISABLE_XET=1),
repo/model info, refs, commits, tree, paths-info, file_exists, hf_hub_download, snapshot_download
and whoami. The Xet side (``xet/``: token endpoints, a CAS that verifies xorbs and shards, file
reconstruction, global dedup) needs the ``localhub`` extra (blake3, lz4). State persists under ``root``.

    from localhub import LocalHub
    with LocalHub(tmp_path, token="secret") as hub:
        api = HfApi(endpoint=hub.url, token="secret")

CLI: ``python -m localhub --root DIR [--port N] [--host 127.0.0.1] [--token T]``
(prefer ``LOCALHUB_TOKEN`` in the environment over ``--token``).
"""

from .cli import main
from .faults import Faults
from .hub import LocalHub, check_loopback
from .process import LocalHubProcess, admin_request
from .store import HubError, Store

__all__ = [
    "Faults",
    "HubError",
    "LocalHub",
    "LocalHubProcess",
    "Store",
    "admin_request",
    "check_loopback",
    "main",
]
