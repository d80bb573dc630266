"""Hub repo ids: one rule for script 05 (the card's snippets download from the repo) and
script 06 (the commit goes there). Torch-free: the publish side uses it."""

from __future__ import annotations

import re

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .errors import RepoIdError

__all__ = ["hub_repo_id"]

# A model repo's page, as a browser's address bar or the Hub's "copy" button gives it.
_REPO_PAGE = re.compile(r"^https?://(?:www\.)?(?:huggingface\.co|hf\.co)/(?P<id>[^/?#\s]+(?:/[^/?#\s]+)?)/?$")


def hub_repo_id(text: str, *, namespace_required: bool = False) -> str:
    """``text`` as a Hub model repo id, ``namespace/name`` or ``name``, checked by the Hub
    client's own rule; the address of a repo's page (``https://huggingface.co/ns/name``)
    gives its id. ``namespace_required``: a bare ``name`` is refused (a card that downloads
    ``name`` would get the Hub's repo of that name, not the publisher's)."""
    page = _REPO_PAGE.match(text)
    repo_id = page.group("id") if page is not None else text
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise RepoIdError(
            f"--repo-id {text!r} is not a valid Hub repo id: use 'namespace/name' (letters, digits, '-', "
            "'_', '.'; no spaces, no '..', no trailing '/')"
        ) from None
    if namespace_required and "/" not in repo_id:
        raise RepoIdError(
            f"--repo-id {text!r} names no namespace: use 'namespace/name' (your user or organization), "
            "since the card's snippets download from exactly that id"
        )
    return repo_id
